"""torch's KleidiAI op on aarch64 (aten._dyn_quant_matmul_4bit): also what stock vLLM runs on Arm.

Not bit-exact with the reference: KleidiAI quantizes activations per token *asymmetrically* and rounds the
weight scales to BF16, so it matches the checkpoint's numerics only within a tolerance. It is taken only when
forced (ANYCHIP_KERNEL_ISA=arm.kleidiai) or when no bit-exact route can serve.

Layout: weight is the opaque blob of aten._dyn_quant_pack_4bit_weight; scales are empty.
"""

from __future__ import annotations

import torch

from anychip.kernels import machine
from anychip.kernels.policy import KernelPolicy
from anychip.kernels.routes.base import CheckpointWeights, LinearProblem, NoKernelRoute, Route


class ArmKleidiAI(Route):
    id = "arm.kleidiai"
    code = 64
    aliases = ("kleidiai",)
    device = "cpu"
    kernel = "kleidiai"
    bit_exact = False
    summary = "torch aten._dyn_quant_matmul_4bit (KleidiAI; asymmetric per-token activations, BF16 scales)"

    def unavailable(self) -> str | None:
        if not machine.is_arm():
            return "not an aarch64 CPU"
        kleidiai = getattr(torch.backends, "kleidiai", None)
        if kleidiai is None or not kleidiai.is_available() or not hasattr(torch.ops.aten, "_dyn_quant_matmul_4bit"):
            return "this torch build has no KleidiAI (torch.backends.kleidiai.is_available() is False)"
        if "asimddp" not in machine.cpu_flags():
            return "this CPU lacks the dot-product extension (asimddp)"
        return None

    def rejects(self, problem: LinearProblem) -> str | None:
        if why := super().rejects(problem):
            return why
        if problem.group_size % 32 or problem.k % problem.group_size:
            return (f"KleidiAI needs a group size that is a multiple of 32 dividing K (K={problem.k}, "
                    f"G={problem.group_size}): force ANYCHIP_KERNEL_ISA=arm.dotprod (bit-exact) instead")
        return None

    def prepare(self, weights: CheckpointWeights, policy: KernelPolicy) -> tuple[torch.Tensor, torch.Tensor]:
        q, n, k = weights.int8().cpu(), weights.n, weights.k
        u = (q.to(torch.int16) + 8).to(torch.uint8).view(n, k // 2, 2)
        nibbles = (u[..., 0] | (u[..., 1] << 4)).contiguous()  # (N, K/2), even k in the low nibble
        blob = torch.ops.aten._dyn_quant_pack_4bit_weight(
            nibbles, weights.scales.to(torch.bfloat16), None, weights.group_size, k, n)
        return blob, torch.empty(0)

    def linear(self, x, weight, scales, bias, n, k, group_size):
        y = torch.ops.aten._dyn_quant_matmul_4bit(x.float(), weight, group_size, k, n)
        return (y if bias is None else y + bias.float()).to(x.dtype)

    def linear_q(self, xq, sx, weight, scales, bias, n, k, group_size, out_dtype):
        raise NoKernelRoute(f"{self.id} quantizes its activations itself: call w4a8_linear, not w4a8_linear_q")

    def group_dots(self, xq, weight, scales, n, k, group_size):
        raise NoKernelRoute(f"{self.id} exposes no integer group sums (KleidiAI computes them inside)")
