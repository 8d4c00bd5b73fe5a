"""Pure-torch oracles for the W4A8 ops. Every implementation is tested against these.

W4A8: symmetric INT4 weights with one scale per group of G input channels, dynamic symmetric per-token INT8
activations:  y[m, n] = sx[m] * sum_g sw[n, g] * sum_{k in g} xq[m, k] * wq[n, k]  (+ bias[n]),
with the inner sum exact in INT32.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric INT8.  x: (M, K) bf16/fp16/fp32 -> xq (M, K) int8, sx (M, 1) fp32.

    scale = amax / 127 (computed in fp32), q = round_half_even(x / scale) clamped to [-127, 127]; an all-zero
    row gets scale 0 and q = 0; a row holding NaN or inf gets scale NaN and q = 0, so that each of its outputs is
    NaN (every kernel route does the same: none turns such a row into finite outputs).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_activations_ref wants (M, K), got {tuple(x.shape)}")
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    sx = amax / INT8_MAX
    sx = torch.where(torch.isfinite(sx), sx, torch.full_like(sx, float("nan")))
    safe = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.round(xf / safe).clamp_(-INT8_MAX, INT8_MAX)
    xq = torch.where(sx > 0, xq, torch.zeros_like(xq)).to(torch.int8)  # zero and non-finite rows: q = 0
    return xq, sx


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's RMSNorm as its IR ops (`rms_norm`, `fused_add_rms_norm`) define it: h = x (+ residual) in fp32,
    y = ((h * rsqrt(mean(h^2) + eps)) as weight's dtype) * weight, in x's dtype; returns (y, h in x's dtype when
    a residual was given, else None)."""
    h = x.float()
    if residual is not None:
        h = h + residual.float()
    y = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = (y.to(weight.dtype) * weight).to(x.dtype)
    return y, None if residual is None else h.to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """vLLM's SiluAndMul as its native forward computes it: silu(x[..., :d]) * x[..., d:], d = x.shape[-1] // 2,
    silu in fp32 rounded to x's dtype, the product rounded again."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d].float()).to(x.dtype) * x[..., d:]


def group_dot_ref(xq: torch.Tensor, wq: torch.Tensor, group_size: int) -> torch.Tensor:
    """The exact integer part: (M, K) int8 x (N, K) int8 -> (M, N, K // G) int32 per-group dot products."""
    m, k = xq.shape
    n, k2 = wq.shape
    if k != k2:
        raise ValueError(f"K mismatch: activations have {k}, weights {k2}")
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group size {group_size}")
    g = k // group_size
    xg = xq.to(torch.int64).view(m, 1, g, group_size)
    wg = wq.to(torch.int64).view(1, n, g, group_size)
    return (xg * wg).sum(dim=3).to(torch.int32)


def w4a8_linear_ref(
    xq: torch.Tensor,
    sx: torch.Tensor,
    wq: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """xq (M, K) int8, sx (M, 1) fp32, wq (N, K) int8 in [-8, 7], sw (N, K // G) -> (M, N) out_dtype."""
    n, groups = sw.shape
    group_size = wq.shape[1] // groups
    acc = group_dot_ref(xq, wq, group_size).to(torch.float64)  # (M, N, G)
    y = (acc * sw.double().unsqueeze(0)).sum(dim=2) * sx.double()
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype)


def w4a8_linear_dynamic_ref(
    x: torch.Tensor,
    wq: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x per token, then the W4A8 linear; output in x's dtype. x may have leading batch dims."""
    lead = x.shape[:-1]
    xq, sx = quantize_activations_ref(x.reshape(-1, x.shape[-1]))
    y = w4a8_linear_ref(xq, sx, wq, sw, bias, out_dtype=x.dtype)
    return y.reshape(*lead, wq.shape[0])


def dequantize_weight_ref(wq: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K) int8, (N, K // G) -> (N, K) dense weights."""
    n, groups = sw.shape
    g = wq.shape[1] // groups
    return (wq.float().view(n, groups, g) * sw.float().unsqueeze(2)).reshape(n, -1).to(dtype)


# ---- the output head (logits = x @ W^T), served by kernels/routes/head.py ----


def head_bf16_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """BF16 head: x (..., K), weight (N, K) bf16 -> (..., N) in x's dtype; products and sums in fp32 (here in
    fp64, the higher precision the kernels are compared against)."""
    y = x.double() @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def quantize_head_int8_ref(weight: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel symmetric INT8: weight (N, K) -> wq (N, K) int8 in [-127, 127], sw (N,) fp32
    (amax / 127; an all-zero row gets scale 0). `rows` output channels at a time: rows are independent, so the
    result is the same, and the fp32 temporaries stay a few MB instead of several times the head (a 128k x 2048
    head made 2.6 GB of them at load)."""
    n = weight.shape[0]
    wq = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    sw = torch.empty(n, dtype=torch.float32, device=weight.device)
    for r0 in range(0, n, rows):
        wf = weight[r0:r0 + rows].float()
        s = wf.abs().amax(dim=1) / INT8_MAX
        safe = torch.where(s > 0, s, torch.ones_like(s))
        wq[r0:r0 + rows] = torch.round(wf / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX)
        sw[r0:r0 + rows] = s
    return wq, sw


def head_int8_ref(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """INT8 head: x quantized per token (quantize_activations_ref), exact INT32 dots, then
    float(dot) * (sx * sw) + bias in fp32 -> (..., N) in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, sx = quantize_activations_ref(x.reshape(-1, k))
    dots = (xq.to(torch.int64) @ wq.to(torch.int64).t()).to(torch.int32)
    y = dots.float() * (sx * sw.float()[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, wq.shape[0])
