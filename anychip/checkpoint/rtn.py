"""Round-to-nearest symmetric INT4 per-group weight quantization, the default `WeightQuantizer`.

scale = amax / 7 per group of G input channels (stored BF16); q = round(w / scale) clamped to [-8, 7], computed
with the BF16-rounded scale so that q * scale is exactly what a reader dequantizes. An all-zero group gets
q = 0 and scale 1: any positive scale dequantizes its zeros exactly, and the contract wants every scale > 0.
"""

from __future__ import annotations

import torch

from anychip.errors import AnychipError

INT4_MAX = 7
INT4_MIN = -8


def group_scales(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, K) float -> (N, K // G) bf16 symmetric scales amax / 7 (1 for an all-zero group)."""
    n, k = w.shape
    amax = w.float().view(n, k // group_size, group_size).abs().amax(dim=2)
    scales = (amax / INT4_MAX).to(torch.bfloat16)
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def quantize_with_scales(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(N, K) float with (N, K // G) scales -> (N, K) int8 in [-8, 7]; a zero or NaN scale gives q = 0, a
    negative one the codes of -w (scales.search_scales' signed search)."""
    n, k = w.shape
    groups = scales.shape[1]
    s = scales.float().unsqueeze(2)  # (N, K // G, 1)
    usable = s.abs() > 0  # not zero, not NaN
    safe = torch.where(usable, s, torch.ones_like(s))
    q = torch.round(w.float().view(n, groups, k // groups) / safe).clamp_(INT4_MIN, INT4_MAX)
    q = torch.where(usable, q, torch.zeros_like(q))
    return q.to(torch.int8).view(n, k)


def rtn_quantize(w: torch.Tensor, group_size: int, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight -> (wq (N, K) int8 in [-8, 7], scales (N, K // G) bf16)."""
    if w.dim() != 2 or w.shape[1] % group_size:
        raise ValueError(f"{name}: rtn_quantize wants (N, K) with K divisible by {group_size}, got {tuple(w.shape)}")
    if not torch.isfinite(w).all():  # before the scales: a NaN group's scale would read as zero and become 1
        raise AnychipError(f"{name}: weights contain inf or nan; the BF16 source is damaged, re-create it")
    scales = group_scales(w, group_size)  # finite: amax / 7 of finite weights
    return quantize_with_scales(w, scales), scales
