"""vLLM's public offline API (`LLM`, `SamplingParams`) for anychip's own runners: `anychip bench` and
`anychip eval` start engines through this module, so vLLM's names stay in this room."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import vllm
from vllm import LLM, SamplingParams

from anychip.checkpoint.io import is_mistral_format
from anychip.kernels.machine import request_amx_tiles


def make_llm(**kwargs: Any) -> LLM:
    """vllm.LLM(**kwargs); the anychip plugin joins through vLLM's entry point unless VLLM_PLUGINS leaves it out.
    The AMX tile state is requested here too, so that stock vLLM peers (without the plugin) run as they would in
    a process where oneDNN asked for it, instead of stopping with SIGILL (machine.request_amx_tiles). A model folder
    also in Mistral's own format is read the Hugging Face way unless the caller says otherwise."""
    request_amx_tiles()
    model = kwargs.get("model")
    if model is not None and is_mistral_format(Path(model)):
        # a repo in Mistral's own format too: read the Hugging Face way, as its W4A8 copy (HF format only) is, so
        # that a comparison of the two compares weights, not two config and tokenizer paths
        for key, value in (("config_format", "hf"), ("load_format", "safetensors"), ("tokenizer_mode", "hf")):
            kwargs.setdefault(key, value)
    return LLM(**kwargs)


def sampling_params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**kwargs)


def version() -> str:
    return vllm.__version__


def compile_mode(llm: LLM, eager: bool) -> str:
    """How the engine runs the model: "eager" or "compiled (<mode>, <backend>[, C++ wrapper])"; the C++ wrapper as
    the engine's config says, which an engine in this process shares (cpu_attention.note_attention_layer)."""
    if eager:
        return "eager"
    cc = llm.llm_engine.vllm_config.compilation_config
    wrapper = ", C++ wrapper" if cc.inductor_compile_config.get("cpp_wrapper") else ""
    return f"compiled ({cc.mode.name}, {cc.backend}{wrapper})"


def cuda_graph_tokens(llm: LLM) -> int:
    """The largest step, in tokens, the engine replays as a CUDA graph (0: none, e.g. on a CPU or eager); a larger
    step, such as a long prefill, launches its kernels one by one from the host."""
    cc = llm.llm_engine.vllm_config.compilation_config
    if cc.cudagraph_mode.name == "NONE":
        return 0
    return int(cc.max_cudagraph_capture_size or 0)
