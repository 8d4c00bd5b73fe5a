"""NVIDIA GPUs: Triton kernels with INT8 tensor-core dots on INT4 weights unpacked in registers, and at one token a
GEMV with the activation quantization fused (kernels/gpu).

Layout (gpu/layout.py): weight (N, K/2) int8 two's-complement nibbles, scales (K/G, N). Triton is imported on
the first call, never at import time.
"""

from __future__ import annotations

import torch

from anychip.kernels import gpu, hooks
from anychip.kernels.policy import KernelPolicy
from anychip.kernels.routes.base import CheckpointWeights, LinearProblem, Route


def _launch():
    from anychip.kernels.gpu import launch

    return launch


class CudaTriton(Route):
    id = "cuda.triton"
    code = 65
    aliases = ("triton",)
    device = "cuda"
    kernel = "triton"
    bit_exact = True
    summary = "Triton INT8 tensor-core dots, INT4 unpacked in registers, split-K for decode; dp4a GEMV at batch one"
    #: The GEMM launch bumps the coverage counter itself (hooks.DeviceCounter): counts survive CUDA-graph replay.
    counts_on_device = True
    fuses_norm = True
    fuses_silu_mul = True

    def unavailable(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        return gpu.unavailable_reason(torch.device("cuda"))

    def rejects(self, problem: LinearProblem) -> str | None:
        if why := super().rejects(problem):
            return why
        return f"K={problem.k} is odd (INT4 weights pack two per byte)" if problem.k % 2 else None

    def prepare(self, weights: CheckpointWeights, policy: KernelPolicy) -> tuple[torch.Tensor, torch.Tensor]:
        from anychip.kernels.gpu import direct, launch, tuning
        from anychip.kernels.gpu.layout import triton_layout

        direct.set_enabled(policy.gpu_direct_launch)
        launch.set_pdl(policy.gpu_pdl)
        weight, scales = triton_layout(weights)
        # every M bucket's config known now, at load: no request waits for the tuner
        tuning.tune_linear(weight, scales, weights.n, weights.k, weights.group_size, policy.gpu_tuning,
                           policy.tuning_dir, policy.gpu_precompile, wgmma=policy.gpu_wgmma)
        return weight, scales

    def linear(self, x, weight, scales, bias, n, k, group_size):
        counter = hooks.take_device_counter(x.device)
        return _launch().w4a8_linear(x, weight, scales, bias, n, k, group_size, counter=counter)

    def linear_q(self, xq, sx, weight, scales, bias, n, k, group_size, out_dtype):
        counter = hooks.take_device_counter(xq.device)
        return _launch().w4a8_linear_q(xq, sx, weight, scales, bias, n, k, group_size, out_dtype, counter=counter)

    def linear_norm(self, x, norm_weight, eps, residual, residual_out, weight, scales, bias, n, k, group_size):
        launch = _launch()
        counter = hooks.take_device_counter(x.device)
        norm = launch.Norm(norm_weight, eps, residual, residual_out)
        return launch.w4a8_linear_pre(x, norm, weight, scales, bias, n, k, group_size, counter=counter)

    def linear_silu_mul(self, x, weight, scales, bias, n, k, group_size):
        launch = _launch()
        counter = hooks.take_device_counter(x.device)
        return launch.w4a8_linear_pre(x, launch.SiluMul(), weight, scales, bias, n, k, group_size, counter=counter)

    def group_dots(self, xq, weight, scales, n, k, group_size):
        return _launch().group_dots(xq, weight, n, k, group_size)
