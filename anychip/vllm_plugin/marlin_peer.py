"""vLLM's Marlin GEMM as a peer for the GPU kernel benchmark (anychip/bench/kernels_gpu.py).

The bench's INT4 weights are repacked and called the way vLLM 0.26's `MarlinLinearKernel` serves a GPTQ linear
(symmetric uint4b8, grouped, no act-order): `gptq_marlin_repack` on GPTQ-packed words, `marlin_permute_scales`,
vLLM's workspace and empty g_idx / zero points, then `apply_gptq_marlin_linear` per call. Two peers:
  w4a16   BF16 activations (vLLM's default)
  w4a8    INT8 activations (a server started with VLLM_MARLIN_INPUT_DTYPE=int8): per call, per-token INT8
          quantization (vLLM's Triton `per_token_quant_int8`) and then the INT8 x INT4 Marlin GEMM; the group scales
          become int16 steps of max(scale) / 4096 and the per-token scales carry that factor
          (`marlin_act_int8_process_scales`)
Only the benchmark uses this, so it sits apart from compat.py (the serving plugin's vLLM names). It is written
against vLLM 0.26's signatures and gives a reason instead of guessing for any other release.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MARLIN_VLLM = "0.26."  # the release whose marlin_gemm / apply_gptq_marlin_linear signatures this file uses
_OPS = ("marlin_gemm", "gptq_marlin_repack")


def vllm_version() -> str | None:
    try:
        import vllm
    except Exception:  # a broken install can raise anything on import
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def unavailable_reason() -> str | None:
    """Why the Marlin peers cannot run here (one line), or None when they can."""
    try:
        import vllm
    except Exception as exc:  # as above: the reason is the message, never a crash
        return f"vLLM is not importable ({type(exc).__name__}: {exc})"
    version = str(getattr(vllm, "__version__", "unknown"))
    if not version.startswith(MARLIN_VLLM):
        return f"vLLM {version} is installed; the Marlin peer is written against vLLM {MARLIN_VLLM}x's signatures"
    if not torch.cuda.is_available():
        return "no CUDA device (Marlin runs on NVIDIA GPUs)"
    try:
        import vllm._custom_ops  # loads vLLM's compiled ops
        from vllm.model_executor.layers.quantization.utils import marlin_utils
        from vllm.scalar_type import scalar_types
    except Exception as exc:  # e.g. vllm._C built for another torch
        return f"vLLM's Marlin modules are not importable ({type(exc).__name__}: {exc})"
    missing = [op for op in _OPS if not hasattr(torch.ops._C, op)]
    if missing:
        return f"vLLM's compiled ops have no {', '.join(missing)} (a vLLM build without Marlin)"
    if scalar_types.uint4b8 not in marlin_utils.query_marlin_supported_quant_types(has_zp=False):
        return f"Marlin serves no uint4b8 weights on compute capability {torch.cuda.get_device_capability()}"
    return None


def gptq_pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 in [-8, 7] -> (K // 8, N) int32, GPTQ's layout: nibble i of word r holds row 8r + i, as q + 8."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"K={k} is not a multiple of 8: GPTQ packs 8 nibbles per int32 along K")
    u = (q.to(torch.int64) + 8).t().reshape(k // 8, 8, n)
    shifts = 4 * torch.arange(8, device=q.device, dtype=torch.int64).view(1, 8, 1)
    words = (u << shifts).sum(dim=1)  # in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def make_marlin(q: torch.Tensor, scales: torch.Tensor, group_size: int,
                int8_activations: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """Marlin weights for q (N, K) int8 in [-8, 7] with scales (N, K // G) bf16 (w = q * scale), on a CUDA device.
    Returns x (M, K) bf16 -> (M, N) bf16, the call vLLM makes when it serves that linear (no bias)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import marlin_utils as mu
    from vllm.scalar_type import scalar_types

    n, k = q.shape
    if scales.shape != (n, k // group_size) or k % group_size:
        raise ValueError(f"scales {tuple(scales.shape)} do not fit weights (N={n}, K={k}) with group size "
                         f"{group_size}: want (N, K // G) and K a multiple of G")
    if group_size not in mu.MARLIN_SUPPORTED_GROUP_SIZES:
        raise ValueError(f"Marlin supports group sizes {mu.MARLIN_SUPPORTED_GROUP_SIZES}, not {group_size}")
    fits, why = mu.check_marlin_supports_shape(n, k, k, group_size)
    if not fits:  # vLLM would zero-pad such a layer; the peer times unpadded shapes only
        raise ValueError(f"Marlin peer, K={k} N={n}: {why}")
    if int8_activations and k == group_size:
        raise ValueError(f"K={k} is one group: vLLM 0.26's INT8-activation Marlin path sets its global scale only "
                         "with several groups per row")
    wtype = scalar_types.uint4b8
    empty = mu.marlin_make_empty_g_idx(q.device)  # no act-order: empty g_idx, sort indices and zero points
    weight = ops.gptq_marlin_repack(gptq_pack(q), empty, k, n, wtype.size_bits, int8_activations)
    marlin_scales = mu.marlin_permute_scales(scales.t().contiguous(), k, n, group_size, int8_activations)
    global_scale = None
    if int8_activations:
        marlin_scales, global_scale = mu.marlin_act_int8_process_scales(marlin_scales)
    workspace = mu.marlin_make_workspace_new(q.device)
    input_dtype = torch.int8 if int8_activations else None

    def call(x: torch.Tensor) -> torch.Tensor:
        return mu.apply_gptq_marlin_linear(
            input=x, weight=weight, weight_scale=marlin_scales, weight_zp=empty, g_idx=empty,
            g_idx_sort_indices=empty, workspace=workspace, wtype=wtype, output_size_per_partition=n,
            input_size_per_partition=k, is_k_full=True, input_global_scale=global_scale, bias=None,
            input_dtype=input_dtype)

    return call
