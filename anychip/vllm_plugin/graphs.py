"""CUDA graphs for prefill steps of anychip-served models (anychip/cuda_graphs.py says why and which sizes).

Installed on vLLM's platform as fusion.py's pass is: after the platform finishes an engine's config, a model this
plugin's quantization config serves on an NVIDIA GPU, with piecewise graphs for mixed steps and vLLM's default
capture sizes, captures four more sizes an octave up to max_num_batched_tokens. Sizes someone chose (a list, or a
largest size other than vLLM's default for the engine's max_num_seqs: --cudagraph-capture-sizes,
--max-cudagraph-capture-size, a --compilation-config, `anychip serve`'s profile, `anychip bench`) stay as they are;
ANYCHIP_GPU_PREFILL_GRAPHS=0 keeps vLLM's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from anychip import cuda_graphs, envs

log = logging.getLogger("anychip")

_installed = False


def extend(vllm_config: Any, serves: Callable[[Any], bool]) -> bool:
    """Give `vllm_config` the prefill capture sizes where the rules above allow; returns whether it did."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    cc = vllm_config.compilation_config
    if not envs.gpu_prefill_graphs() or not current_platform.is_cuda() or not serves(vllm_config):
        return False
    if cc.cudagraph_mode.mixed_mode() != CUDAGraphMode.PIECEWISE or cc.compile_sizes:
        return False
    sched = vllm_config.scheduler_config
    budget = int(sched.max_num_batched_tokens)
    default_max = cuda_graphs.vllm_default_max(int(sched.max_num_seqs), budget,
                                               int(getattr(vllm_config, "num_speculative_tokens", 0) or 0))
    sizes = cuda_graphs.extended(list(cc.cudagraph_capture_sizes or []), int(cc.max_cudagraph_capture_size or 0),
                                 budget, default_max)
    if sizes is None:
        return False
    added = [s for s in sizes if s > cc.max_cudagraph_capture_size]
    cc.cudagraph_capture_sizes = sizes
    cc.max_cudagraph_capture_size = sizes[-1]
    log.info("anychip: CUDA graphs also for prefill steps of up to %d tokens, sizes %s "
             "(ANYCHIP_GPU_PREFILL_GRAPHS=0: vLLM's sizes only)", budget, ", ".join(map(str, added)))
    return True


def install(serves: Callable[[Any], bool]) -> bool:
    """Have vLLM's platform call `extend` on every engine config it finishes (once a process); False where this
    vLLM has no platform to hook. serves(vllm_config): whether anychip's quantization config serves the model."""
    global _installed
    if _installed:
        return True
    from anychip.vllm_plugin import compat

    def on_config(vllm_config: Any) -> None:
        try:
            extend(vllm_config, serves)
        except Exception as exc:  # an optimization: never the reason an engine does not start
            log.warning("anychip: prefill CUDA graphs left out (%s: %s); vLLM's capture sizes stay",
                        type(exc).__name__, exc)

    _installed = compat.install_config_hook(on_config)
    return _installed
