"""Offline half of the GPU route: pick the route for CUDA tensors and convert them to the Triton layout.

    weight  (N, K/2) int8: byte b of row n holds w[n, 2b] in its low nibble and w[n, 2b+1] in its high nibble,
            as two's-complement int4 (the checkpoint's offset-8 nibble XOR 8). Rows stay K-contiguous, which is
            the operand order INT8 tensor-core dots want (K-major A and B), and a pack-quantized checkpoint
            converts with one XOR: its int32 words viewed as little-endian bytes are already this byte order.
    scales  (K/G, N): one row per group so a tile's scales are one contiguous load; bf16/fp16 scales are kept as
            they are (lossless, half the bytes of fp32), any other float dtype becomes fp32.
The layout functions are pure torch on any device (the tensors stay where they are).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from anychip import envs
from anychip.checkpoint.pack import PACK_FACTOR, unpack_int4
from anychip.kernels.dispatch import GROUP_SIZES, NoKernelRoute
from anychip.kernels.gpu import unavailable_reason

if TYPE_CHECKING:
    from anychip.kernels.prepare import PreparedW4A8

TRITON_ISA = "triton"
# 0x88888888 as a signed int32: flips every nibble's top bit, offset-8 -> two's complement
_FLIP_NIBBLES = -0x77777778
_KEPT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def prepare_cuda(
    wq: torch.Tensor, scales: torch.Tensor, group_size: int, *, packed: bool, isa: str | None,
    allow_fallback: bool,
) -> PreparedW4A8:
    """prepare_w4a8 for CUDA tensors: the Triton route, or the torch reference on the GPU as a fallback."""
    from anychip.kernels.prepare import PreparedW4A8, Route

    n, k = _checkpoint_shape(wq, packed)
    _check_scales(n, k, scales, group_size)
    forced = isa or envs.forced_isa()
    if forced not in (None, TRITON_ISA, "reference"):
        raise NoKernelRoute(f"kernel ISA {forced!r} is a CPU route but the weights are on {wq.device}: set "
                            f"{envs.ANYCHIP_KERNEL_ISA}={TRITON_ISA} (or unset it), or prepare CPU tensors")
    why = unavailable_reason(wq.device)
    if why is None and group_size not in GROUP_SIZES:
        why = f"group size {group_size} has no Triton kernel: re-quantize with one of {GROUP_SIZES}"
    if forced != "reference" and why is None:
        weight, sw = triton_layout(wq, scales, group_size, packed=packed)
        route = Route(kernel="triton", isa=TRITON_ISA, group_size=group_size, device="cuda")
        return PreparedW4A8(weight=weight, scales=sw, n=n, k=k, group_size=group_size, route=route)
    if forced == TRITON_ISA or (forced is None and not allow_fallback):
        raise NoKernelRoute(f"{why}" + ("" if forced else f"; or allow the slow reference "
                                                         f"({envs.ANYCHIP_ALLOW_FALLBACK}=1)"))
    q = unpack_int4(wq) if packed else _checked_int8(wq)
    route = Route(kernel="reference", isa="reference", group_size=group_size, device="cuda")
    return PreparedW4A8(weight=q.contiguous(), scales=scales.float().contiguous(), n=n, k=k,
                        group_size=group_size, route=route)


def triton_layout(
    wq: torch.Tensor, scales: torch.Tensor, group_size: int, *, packed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint tensors -> (weight (N, K/2) int8, scales (K/G, N)) for the Triton kernels.

    wq: (N, K/8) int32 pack-quantized words (packed=True) or (N, K) int8 in [-8, 7] (packed=False);
    scales: (N, K/G) float."""
    n, k = _checkpoint_shape(wq, packed)
    _check_scales(n, k, scales, group_size)
    if packed:
        weight = (wq.contiguous() ^ _FLIP_NIBBLES).view(torch.int8)  # (N, K/2)
    else:
        weight = pack_nibbles(_checked_int8(wq))
    dtype = scales.dtype if scales.dtype in _KEPT_SCALE_DTYPES else torch.float32
    return weight, scales.to(dtype).t().contiguous()  # (K/G, N)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 in [-8, 7] -> (N, K/2) int8, even k in the low nibble, two's complement."""
    if q.shape[1] % 2:
        raise NoKernelRoute(f"K={q.shape[1]} is odd: INT4 weights pack two per byte")
    u = q.to(torch.int16) & 0xF
    return (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8).view(torch.int8).contiguous()


def unpack_nibbles(weight: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: (N, K/2) int8 -> (N, K) int8 in [-8, 7] (tests and debugging)."""
    b = weight.to(torch.int16)
    lo = ((b & 0xF) ^ 8) - 8
    hi = (((b >> 4) & 0xF) ^ 8) - 8
    return torch.stack((lo, hi), dim=2).reshape(weight.shape[0], -1).to(torch.int8)


def _checkpoint_shape(wq: torch.Tensor, packed: bool) -> tuple[int, int]:
    if packed:
        if wq.dtype != torch.int32 or wq.dim() != 2:
            raise NoKernelRoute(
                f"packed=True wants (N, K/{PACK_FACTOR}) int32 words (pack-quantized), got {wq.dtype} "
                f"{tuple(wq.shape)}: pass packed=False for int-quantized int8 weights")
        return wq.shape[0], wq.shape[1] * PACK_FACTOR
    if wq.dtype != torch.int8 or wq.dim() != 2:
        raise NoKernelRoute(
            f"packed=False wants (N, K) int8 (int-quantized), got {wq.dtype} {tuple(wq.shape)}: pass "
            "packed=True for pack-quantized int32 words")
    return wq.shape[0], wq.shape[1]


def _check_scales(n: int, k: int, scales: torch.Tensor, group_size: int) -> None:
    if group_size <= 0 or k % group_size:
        raise NoKernelRoute(f"K={k} is not divisible by group size {group_size}: quantize with a group size from "
                            f"{GROUP_SIZES} that divides K")
    if scales.dim() != 2 or tuple(scales.shape) != (n, k // group_size) or not scales.is_floating_point():
        raise NoKernelRoute(f"scales must be a float (N={n}, K/G={k // group_size}) tensor, got {scales.dtype} "
                            f"{tuple(scales.shape)}")


def _checked_int8(q: torch.Tensor) -> torch.Tensor:
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise NoKernelRoute("int-quantized weights hold values outside [-8, 7]: this is not an INT4 checkpoint")
    return q
