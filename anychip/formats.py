"""The W4A8 formats anychip reads and writes, declared once: group sizes, checkpoint formats, INT4 packing.

The lowest module of the package (imports nothing of anychip): the checkpoint room, the kernels and the plugin
all take these facts from here.

Pack-quantized INT4: eight signed 4-bit values a little-endian int32 word, each stored with offset +8 (so -8..7 becomes 0..15),
the lowest K index in the lowest bits. Identical to compressed_tensors' pack_to_int32(num_bits=4).
"""

from __future__ import annotations

import torch

#: Input channels per weight scale that the kernels serve and `quantize` writes.
GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
#: compressed-tensors formats of the INT4 weights: int32 words of 8 nibbles, or one int8 per weight.
FORMATS: tuple[str, ...] = ("pack-quantized", "int-quantized")
PACK_FACTOR = 8  # int4 values per int32 word
#: The group scales the contract allows: normal (a subnormal scale is a zeroed group wherever the hardware flushes
#: denormals, and a damaged one anyway) and small enough that the group's weights, up to 8 s, stay finite.
SCALE_MIN = torch.finfo(torch.float32).tiny  # 2^-126, also BF16's smallest normal
SCALE_MAX = torch.finfo(torch.float32).max / 8  # just under 2^125
_SHIFTS = torch.arange(PACK_FACTOR, dtype=torch.int32) * 4


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 in [-8, 7] -> (N, K // 8) int32."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"pack_int4 wants a 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if k % PACK_FACTOR:
        raise ValueError(f"K={k} is not a multiple of {PACK_FACTOR}: int4 packing needs whole int32 words")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("pack_int4: values outside the int4 range [-8, 7]")
    u = (q.to(torch.int32) + 8).view(n, k // PACK_FACTOR, PACK_FACTOR)
    return (u << _SHIFTS.to(q.device)).sum(dim=2, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """(N, K // 8) int32 -> (N, K) int8 in [-8, 7]."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"unpack_int4 wants a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    n, words = packed.shape
    u = (packed.unsqueeze(2) >> _SHIFTS.to(packed.device)) & 0xF
    q = (u - 8).to(torch.int8).reshape(n, words * PACK_FACTOR)
    if k is not None:
        if k > words * PACK_FACTOR:
            raise ValueError(f"unpack_int4: K={k} exceeds the {words * PACK_FACTOR} values stored")
        q = q[:, :k]
    return q


def bad_scales(scales: torch.Tensor) -> torch.Tensor:
    """True where a float scale (any dtype) breaks the contract's rule: not in [SCALE_MIN, SCALE_MAX], NaN included."""
    f = scales.float()
    return ~((f >= SCALE_MIN) & (f <= SCALE_MAX))
