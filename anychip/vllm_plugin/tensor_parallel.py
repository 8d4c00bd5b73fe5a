"""Row-parallel W4A8 linears keep the checkpoint's numerics: one per-token INT8 scale over the whole input.

A row-parallel shard sees K / tp of a token's input channels. Quantizing each shard with its own amax would give
every rank a different per-token scale, which is not the checkpoint's declared numerics (dynamic per-token
symmetric INT8 over K). So the ranks agree on the token's amax first (an all-reduce MAX of one fp32 a token, in
the tensor-parallel group) and quantize their shard with that scale: the INT8 values and the scale are then the
ones the unsharded linear computes, bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from anychip.kernels.reference import INT8_MAX
from anychip.vllm_plugin import compat

_LIB = torch.library.Library("anychip", "FRAGMENT")  # process lifetime, like every torch op registry
_LIB.define("tp_token_amax(Tensor x) -> Tensor")


def _tp_token_amax(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # (M, 1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=compat.tp_device_group())
    return amax


for _device in ("CPU", "CUDA"):
    _LIB.impl("tp_token_amax", _tp_token_amax, _device)


@torch.library.register_fake("anychip::tp_token_amax", lib=_LIB)
def _tp_token_amax_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def quantize_over_ranks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K/tp) shard -> xq (M, K/tp) int8, sx (M, 1) fp32 with the scale of the whole (M, K) input; the same
    arithmetic as kernels.reference.quantize_activations_ref."""
    sx = torch.ops.anychip.tp_token_amax(x) / INT8_MAX
    safe = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.round(x.float() / safe).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return xq, sx
