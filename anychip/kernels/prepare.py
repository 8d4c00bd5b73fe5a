"""Offline half of a W4A8 linear: pick the route once and convert the checkpoint tensors to its layout.

The runtime half is `w4a8_linear`, one call of the `anychip::w4a8_linear` op (ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anychip import envs
from anychip.checkpoint.pack import PACK_FACTOR, unpack_int4
from anychip.kernels import dispatch, ops  # noqa: F401  (ops registers torch.ops.anychip.*)
from anychip.kernels.dispatch import GROUP_SIZES, NoKernelRoute

ROWS = 16  # output rows per weight block of the C++ layout


@dataclass(frozen=True)
class Route:
    """Which implementation serves a linear: kernel "w4a8_cpu" | "kleidiai" | "triton" | "reference", isa as in
    dispatch."""

    kernel: str
    isa: str
    group_size: int
    device: str = "cpu"

    @property
    def name(self) -> str:
        return f"anychip.{self.device}.w4a8.{self.isa}"

    @property
    def is_fallback(self) -> bool:
        return self.kernel == "reference"


@dataclass
class PreparedW4A8:
    """A linear's weights in its route's layout.

    w4a8_cpu:  weight (ceil(N/16), K/8, 64) uint8, scales (ceil(N/16), K/G, 16) fp32 (see csrc/w4a8_cpu.cpp).
    kleidiai:  weight the opaque blob of aten._dyn_quant_pack_4bit_weight, scales empty.
    triton:    weight (N, K/2) int8, scales (K/G, N) (see gpu/prepare.py).
    reference: weight (N, K) int8, scales (N, K/G) fp32.
    """

    weight: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    group_size: int
    route: Route


def prepare_w4a8(
    wq: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    *,
    packed: bool,
    isa: str | None = None,
    allow_fallback: bool | None = None,
) -> PreparedW4A8:
    """Convert one linear's checkpoint tensors for its kernel.

    wq: (N, K/8) int32 pack-quantized words (packed=True) or (N, K) int8 in [-8, 7] (packed=False).
    scales: (N, K/G), any float dtype.  isa: force a route (default: $ANYCHIP_KERNEL_ISA, else the best).
    allow_fallback: when no fast route can serve, use the torch reference instead of raising (default:
    $ANYCHIP_ALLOW_FALLBACK=1 or $ANYCHIP_STRICT=0).
    """
    if allow_fallback is None:
        allow_fallback = envs.fallback_allowed()
    if wq.is_cuda:  # NVIDIA GPUs: the Triton route (kernels/gpu), or the torch reference there as a fallback
        from anychip.kernels.gpu.prepare import prepare_cuda

        return prepare_cuda(wq, scales, group_size, packed=packed, isa=isa, allow_fallback=allow_fallback)
    q = _int8_weights(wq, packed)
    n, k = q.shape
    if scales.dim() != 2 or scales.shape[0] != n or not scales.is_floating_point():
        raise NoKernelRoute(f"scales must be a float (N={n}, K/G) tensor, got {scales.dtype} {tuple(scales.shape)}")
    if group_size <= 0 or k % group_size:
        raise NoKernelRoute(
            f"K={k} is not divisible by group size {group_size}: quantize with a group size from {GROUP_SIZES} "
            f"that divides K"
        )
    if scales.shape[1] != k // group_size:
        raise NoKernelRoute(f"scales have {scales.shape[1]} groups, K={k} / G={group_size} needs {k // group_size}")
    try:
        if group_size not in GROUP_SIZES:
            raise NoKernelRoute(
                f"group size {group_size} has no fast kernel: re-quantize with one of {GROUP_SIZES}"
                + ("" if allow_fallback else f" or allow the slow reference ({envs.ANYCHIP_ALLOW_FALLBACK}=1)")
            )
        chosen = dispatch.select_isa(isa, k, group_size)
    except NoKernelRoute:
        if not allow_fallback:
            raise
        chosen = "reference"
    if chosen == "reference" and not (allow_fallback or (isa or envs.forced_isa()) == "reference"):
        raise NoKernelRoute(f"the reference route is a fallback: pass allow_fallback=True or set "
                            f"{envs.ANYCHIP_ALLOW_FALLBACK}=1")
    impl = dispatch.implementation(chosen)
    route = Route(kernel=impl.kernel, isa=chosen, group_size=group_size, device=impl.device)
    if route.kernel == "w4a8_cpu":
        weight, sw = blocked_layout(q, scales)
    elif route.kernel == "kleidiai":
        weight, sw = _kleidiai_layout(q, scales, group_size), torch.empty(0)
    else:
        weight, sw = q, scales.float().contiguous()
    return PreparedW4A8(weight=weight, scales=sw, n=n, k=k, group_size=group_size, route=route)


def w4a8_linear(
    x: torch.Tensor, prepared: PreparedW4A8, bias: torch.Tensor | None = None, layer_id: int = -1
) -> torch.Tensor:
    """x (..., K) bf16/fp16/fp32 -> (..., N) in x's dtype."""
    p = prepared
    return torch.ops.anychip.w4a8_linear(x, p.weight, p.scales, bias, p.n, p.k, p.group_size, p.route.isa, layer_id)


def _int8_weights(wq: torch.Tensor, packed: bool) -> torch.Tensor:
    """(N, K) int8 in [-8, 7] from either checkpoint format."""
    if packed:
        if wq.dtype != torch.int32 or wq.dim() != 2:
            raise NoKernelRoute(
                f"packed=True wants (N, K/{PACK_FACTOR}) int32 words (pack-quantized), got {wq.dtype} "
                f"{tuple(wq.shape)}: pass packed=False for int-quantized int8 weights"
            )
        return unpack_int4(wq.cpu())
    if wq.dtype != torch.int8 or wq.dim() != 2:
        raise NoKernelRoute(
            f"packed=False wants (N, K) int8 (int-quantized), got {wq.dtype} {tuple(wq.shape)}: pass packed=True "
            "for pack-quantized int32 words"
        )
    q = wq.cpu().contiguous()
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise NoKernelRoute("int-quantized weights hold values outside [-8, 7]: this is not an INT4 checkpoint")
    return q


def blocked_layout(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) int8, (N, K/G) -> weight (NB, K/8, 64) uint8, scales (NB, K/G, 16) fp32, NB = ceil(N/16).

    Byte r*4+j of chunk c holds w[r, 8c+j] + 8 in its low nibble and w[r, 8c+4+j] + 8 in its high nibble; padded
    rows are zero weights with zero scales."""
    n, k = q.shape
    if k % 8:
        raise NoKernelRoute(f"K={k} is not a multiple of 8: the CPU kernels read 8 input channels per vector")
    nb = -(-n // ROWS)
    pad = nb * ROWS - n
    u = torch.nn.functional.pad(q, (0, 0, 0, pad)).to(torch.int16).add_(8).to(torch.uint8)
    u = u.view(nb, ROWS, k // 8, 2, 4)  # [block, row, chunk, lo/hi, j]
    byte = u[:, :, :, 0, :] | (u[:, :, :, 1, :] << 4)  # (NB, 16, K/8, 4)
    weight = byte.permute(0, 2, 1, 3).reshape(nb, k // 8, 64).contiguous()
    s = torch.nn.functional.pad(scales.float(), (0, 0, 0, pad))
    sw = s.view(nb, ROWS, -1).permute(0, 2, 1).contiguous()
    return weight, sw


def _kleidiai_layout(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = q.shape
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(n, k // 2, 2)
    nibbles = (u[..., 0] | (u[..., 1] << 4)).contiguous()  # (N, K/2), even k in the low nibble
    return torch.ops.aten._dyn_quant_pack_4bit_weight(nibbles, scales.to(torch.bfloat16), None, group_size, k, n)
