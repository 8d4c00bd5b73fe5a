"""The Triton route's weight layout (pure torch, on any device: the tensors stay where they are).

    weight  (N, K/2) int8: byte b of row n holds w[n, 2b] in its low nibble and w[n, 2b+1] in its high nibble,
            as two's-complement int4 (the checkpoint's offset-8 nibble XOR 8). Rows stay K-contiguous, which is
            the operand order INT8 tensor-core dots want (K-major A and B), and a pack-quantized checkpoint
            converts with one XOR: its int32 words viewed as little-endian bytes are already this byte order.
    scales  (K/G, N): one row per group so a tile's scales are one contiguous load; bf16/fp16 scales are kept as
            they are (lossless, half the bytes of fp32), any other float dtype becomes fp32.
"""

from __future__ import annotations

import torch

from anychip.kernels.routes.base import CheckpointWeights, NoKernelRoute

# 0x88888888 as a signed int32: flips every nibble's top bit, offset-8 -> two's complement
_FLIP_NIBBLES = -0x77777778
_KEPT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_layout(weights: CheckpointWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint tensors -> (weight (N, K/2) int8, scales (K/G, N)) for the Triton kernels."""
    if weights.packed:
        weight = (weights.wq.contiguous() ^ _FLIP_NIBBLES).view(torch.int8)  # (N, K/2)
    else:
        weight = pack_nibbles(weights.int8())
    scales = weights.scales
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
