"""The torch oracle as a route (reference.py): every device, every group size; a fallback, never a default.

Layout: weight (N, K) int8, scales (N, K/G) fp32, on the weights' device.
"""

from __future__ import annotations

import torch

from anychip.kernels.policy import KernelPolicy
from anychip.kernels.reference import group_dot_ref, quantize_activations_ref, w4a8_linear_ref
from anychip.kernels.routes.base import CheckpointWeights, LinearProblem, Route


class Reference(Route):
    id = "reference"
    code = 66
    device = "any"
    kernel = "reference"
    bit_exact = True
    fallback_only = True
    summary = "torch oracle (kernels/reference.py), slow: fallback only"

    def rejects(self, problem: LinearProblem) -> str | None:
        return None  # any group size that divides K (CheckpointWeights checks that)

    @property
    def isa(self) -> str:
        return "reference"

    def prepare(self, weights: CheckpointWeights, policy: KernelPolicy) -> tuple[torch.Tensor, torch.Tensor]:
        return weights.int8(), weights.scales.float().contiguous()

    def linear(self, x, weight, scales, bias, n, k, group_size):
        xq, sx = quantize_activations_ref(x)
        return w4a8_linear_ref(xq, sx, weight, scales, bias, out_dtype=x.dtype)

    def linear_q(self, xq, sx, weight, scales, bias, n, k, group_size, out_dtype):
        return w4a8_linear_ref(xq, sx, weight, scales, bias, out_dtype=out_dtype)

    def group_dots(self, xq, weight, scales, n, k, group_size):
        return group_dot_ref(xq, weight, group_size)
