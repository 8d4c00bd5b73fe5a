"""Offline half of a W4A8 linear: pick its route once and convert the checkpoint tensors to that route's layout.

The runtime half is `w4a8_linear`, one call of the `anychip::w4a8_linear` op (ops.py), which hands the call to
the route the weights were prepared for.
"""

from __future__ import annotations

import torch

from anychip.kernels import (
    ops,  # registers torch.ops.anychip.*
    routes,
)
from anychip.kernels.policy import KernelPolicy
from anychip.kernels.routes.base import CheckpointWeights, PreparedW4A8

DEFAULT_POLICY = KernelPolicy()


def prepare_w4a8(
    wq: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    *,
    packed: bool,
    route: str | None = None,
    policy: KernelPolicy = DEFAULT_POLICY,
) -> PreparedW4A8:
    """Convert one linear's checkpoint tensors for the route that serves it.

    wq: (N, K/8) int32 pack-quantized words (packed=True) or (N, K) int8 in [-8, 7] (packed=False);
    scales: (N, K/G), any float dtype. The device of `wq` picks the device's routes. route: force one route id
    (overrides policy.route). policy: forced route, fallback permission, extension build folder.
    """
    weights = CheckpointWeights(wq, scales, group_size, packed=packed)
    policy = policy.forcing(route)
    chosen = routes.select(weights.problem, policy)
    weight, sw = chosen.prepare(weights, policy)
    return PreparedW4A8(weight=weight, scales=sw, n=weights.n, k=weights.k, group_size=group_size, route=chosen)


def w4a8_linear(
    x: torch.Tensor, prepared: PreparedW4A8, bias: torch.Tensor | None = None,
    layer_id: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """x (..., K) bf16/fp16/fp32 -> (..., N) in x's dtype. layer_id: the coverage layer this call counts for
    (ops.layer_tensor, or an int, made into one per call: in a compiled or hot loop pass the tensor); None: none."""
    p = prepared
    if isinstance(layer_id, int):
        layer_id = ops.layer_tensor(layer_id)
    return torch.ops.anychip.w4a8_linear(x, p.weight, p.scales, bias, p.n, p.k, p.group_size, p.route.code, layer_id)
