"""vLLM's CPU attention called from C++: the same kernels without the Python around each call.

On vLLM's CPU backend every decoder layer's attention is two Python custom ops (`vllm::unified_kv_cache_update`,
`vllm::unified_attention_with_output`): each looks up the forward context, the layer and its cache, views and
chunks the cache, then calls one C++ kernel (`_C::cpu_attn_reshape_and_cache`, `_C::cpu_attention_with_kv_cache`).
At one token that Python is about four times the kernels' time (docs/kernels-cpu.md: 1.4 ms a step of 60 such
calls around 0.3 ms of kernels for SmolLM2-135M on 2 cores), and a Python op also keeps Inductor's wrapper code
in Python.

For a W4A8 model served by this plugin on vLLM's CPU backend, each eligible `Attention` layer instead calls
`anychip::cpu_attention` (csrc/attention_cpu.cpp), which makes the same two kernel calls with the same arguments:
the layer's cache and constants are registered with it once, the step's attention metadata once a forward, from a
hook on vLLM's forward context. Same kernels, same arguments: the same bits (tests/test_cpu_attention.py compares
logprobs with the path on and off). A layer the C++ op does not cover (another backend or attention type, KV
sharing, quantized queries, an FP8 cache, a subclass of Attention) keeps vLLM's path, as does every layer under
speculative decoding or KV transfer. `ANYCHIP_CPU_ATTENTION=0` turns it off.

One exception to "the same kernels": on an x86 without AVX512 (vLLM's CPU attention is then its generic AVX2
build), a step of 32 rows or more and at least 6 for each sequence (prompts, chunks of them, prefix-cache hits)
attends with anychip's own prefill kernel (csrc/attention_prefill_x86.h, PREFILL_KERNEL in the coverage report's
`attention_calls`), after the keys and values went into the cache as before; steps with decode rows keep vLLM's
kernels, and so do steps with cached context where vLLM's attention is not its `vec` build (whose paged cache
layout the kernel reads; `attention_calls["vllm_isa"]` names the builds in use). `ANYCHIP_ATTN_PREFILL` overrides
the choice (`prefill_kernel_choice`).

With every attention layer of the model on this path, the compiled forward calls no Python op, so Inductor can
write its wrapper code in C++ (`cpp_wrapper`, built apart from the kernels: CPP_WRAPPER): the plugin sets it in the
engine's inductor options while vLLM builds the model (`note_attention_layer`, before vLLM hands the options to
torch.compile), unless the user set `cpp_wrapper` either way. With vLLM's own attention ops in the graph Inductor
refuses it (their layer-name argument is a Python object).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from anychip import envs
from anychip.errors import AnychipError
from anychip.vllm_plugin import compat

log = logging.getLogger(__name__)

UNSET, NO_METADATA, READY = 0, 1, 2  # attention_cpu.cpp's State
BACKEND_IMPL = "CPUAttentionBackendImpl"


class _Registry:
    """The layers whose attention runs through anychip::cpu_attention, by id (their index here), for the process;
    held weakly, so the registry keeps no model's modules alive (a registered KV cache stays held, here and by the C++
    op, until that layer is registered again)."""

    def __init__(self) -> None:
        self.layers: list[weakref.ref] = []  # Attention modules
        self.names: list[str] = []
        self.caches: list[Any] = []  # the kv_cache tensor each was registered with (None: not yet)
        self.groups: list[int] | None = None  # layer id -> metadata group, as last sent (-1: not in this pass)

    def add(self, layer: Any) -> int:
        self.layers.append(weakref.ref(layer))
        self.names.append(layer.layer_name)
        self.caches.append(None)
        self.groups = None
        return len(self.layers) - 1


_registry = _Registry()
_hooked = False  # the forward-context hook
_model_hook = False  # the CPU model runner's load hook: without it no layer is adopted, so no C++ wrapper either


def install(serves: Callable[[Any], bool]) -> bool:
    """Have vLLM's CPU model runners hand every model they load to `adopt` where `serves(vllm_config)` (the plugin
    serves its quantization config); once a process, from the plugin's registration. False where this process's
    platform is not vLLM's CPU one."""
    global _model_hook

    def on_model(model: torch.nn.Module, vllm_config: Any) -> None:
        if serves(vllm_config):
            from anychip.vllm_plugin import recorder
            from anychip.vllm_plugin.scheme import check_float_weights

            check_float_weights(model)
            recorder.note_model(model, vllm_config)
            adopt(model, vllm_config)

    _model_hook = compat.install_cpu_model_hook(on_model)
    return _model_hook


def ineligible(layer: Any, vllm_config: Any) -> str | None:
    """Why `layer` keeps vLLM's attention path, or None when anychip::cpu_attention computes what it would."""
    from vllm.v1.attention.backend import AttentionType

    if type(layer) is not compat.Attention:
        return f"{type(layer).__name__} is not vLLM's plain Attention"
    if type(layer.impl).__name__ != BACKEND_IMPL:
        return f"backend {type(layer.impl).__name__}"
    if layer.attn_type != AttentionType.DECODER:
        return f"attention type {layer.attn_type}"
    if getattr(layer, "kv_sharing_target_layer_name", None) is not None:
        return "shares another layer's KV cache"
    if getattr(layer, "query_quant", None) is not None or getattr(layer, "use_direct_call", False):
        return "quantized queries or direct calls"
    if getattr(layer.attn_backend, "forward_includes_kv_cache_update", False):
        return "its backend updates the cache inside the forward"
    if layer.kv_cache_dtype != "auto":
        return f"KV cache dtype {layer.kv_cache_dtype}"
    if vllm_config.speculative_config is not None or vllm_config.kv_transfer_config is not None:
        return "speculative decoding or KV transfer"
    return None


def adopt(model: torch.nn.Module, vllm_config: Any) -> int:
    """Route every eligible attention layer of `model` through anychip::cpu_attention; returns how many. Call after
    the model is built, before it is compiled."""
    if not envs.cpu_attention() or not _schemas_match():
        return 0
    from anychip.kernels import cpu_ext

    cpu_ext.load()  # registers torch.ops.anychip.cpu_attention
    reasons: dict[str, int] = {}
    done = 0
    for module in model.modules():
        if not hasattr(module, "impl") or not hasattr(module, "layer_name"):
            continue
        why = ineligible(module, vllm_config)
        if why is not None:
            reasons[why] = reasons.get(why, 0) + 1
            continue
        module.register_buffer("_anychip_attn_id", torch.tensor([_registry.add(module)], dtype=torch.int64),
                               persistent=False)
        module.__class__ = _subclass(type(module))
        done += 1
    if done:
        _hook_forward_context()
        log.info("anychip: %d attention layers call vLLM's CPU attention kernels from C++", done)
    from anychip.vllm_plugin.recorder import get_recorder

    prefill, why = prefill_kernel_choice() if done else (False, "no layer on the C++ path")
    torch.ops.anychip.attn_set_prefill_kernel(prefill)
    get_recorder().coverage.attention_calls = {
        "from_cpp": done, "python": sum(reasons.values()),
        "cpp_wrapper": bool(vllm_config.compilation_config.inductor_compile_config.get("cpp_wrapper", False)),
        "prefill_kernel": PREFILL_KERNEL if prefill else None, "prefill_kernel_why": why}
    if prefill:
        log.info("anychip: steps of fresh prompts attend with %s (%s)", PREFILL_KERNEL, why)
    for why, n in reasons.items():
        log.info("anychip: %d attention layers keep vLLM's attention path (%s)", n, why)
    return done


#: The coverage report's name for anychip's prefill attention kernel (csrc/attention_prefill_x86.h).
PREFILL_KERNEL = "cpu.attn_prefill_avx2"


def prefill_kernel_choice(flags: frozenset[str] | None = None, arch: str | None = None) -> tuple[bool, str]:
    """Whether steps whose sequences are all fresh prompts attend with anychip's prefill kernel instead of vLLM's,
    and why. By default only where vLLM's CPU attention is its AVX2 build (x86 without AVX512): there its generic
    kernels took about a quarter of a 512-token prefill (docs/kernels-cpu.md); with AVX512 or AMX vLLM's are kept."""
    import platform

    from anychip.kernels import machine

    flags = machine.cpu_flags() if flags is None else flags
    arch = platform.machine() if arch is None else arch
    choice = envs.attn_prefill()
    if choice is False:
        return False, f"{envs.ANYCHIP_ATTN_PREFILL}=0"
    if arch not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= flags:
        return False, "the kernel needs x86 with AVX2 and FMA"
    if choice is True:
        return True, f"{envs.ANYCHIP_ATTN_PREFILL}=1"
    if "avx512f" in flags:
        return False, "AVX512: vLLM's own attention kernels"
    return True, "AVX2 without AVX512, where vLLM's attention kernels are its generic ones"


#: The inductor options the plugin sets. The wrapper is built apart from Inductor's C++ kernels, at -O1: on the
#: 2-vCPU Xeon (default model, empty caches) engine start 76 s against 112 s for one -O3 build of both (60 s
#: without the C++ wrapper), decode 6% slower than that build (docs/kernels-cpu.md). A user who sets cpp_wrapper
#: gets exactly what they set.
CPP_WRAPPER = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
_wrapper_choice: dict[int, bool | None] = {}  # id(compilation config) -> all attention layers eligible so far


class AttentionShapeError(AnychipError, ValueError):
    """vLLM's CPU attention does not take this model's attention shape."""


def check_head_size(layer: Any, prefix: str) -> None:
    """vLLM's CPU attention accepts a head size its kernels do not take while the engine starts, then fails at the
    first forward ("Unsupported CPU attention configuration: head_dim=40", seen in a probe) after the whole start-up:
    refuse while the model is built, naming the sizes it takes. Not a checkpoint problem: the same model serves on
    a GPU."""
    from vllm.platforms import current_platform

    backend = getattr(layer, "attn_backend", None)
    if not current_platform.is_cpu() or backend is None or not hasattr(backend, "supports_head_size"):
        return
    if not backend.supports_head_size(int(layer.head_size)):
        raise AttentionShapeError(
            f"layer {prefix}: head dim {layer.head_size} is not one that vLLM's CPU attention ({backend.get_name()}) "
            f"takes ({', '.join(str(s) for s in backend.get_supported_head_sizes())}): the engine would fail at its "
            "first forward. This is vLLM's CPU limit, not the checkpoint's: serve the model on a GPU, or choose a "
            "model whose head dim is one of those.")


def note_attention_layer(layer: Any) -> None:
    """Called for each attention layer while vLLM builds the model (AnychipW4A8Config.get_quant_method, once the
    layer's backend is set): Inductor's C++ wrapper is asked for exactly while every layer so far is eligible."""
    from vllm.config import get_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.platforms import current_platform

    if not envs.cpu_attention() or not current_platform.is_cpu() or not _model_hook:
        return
    vllm_config = get_current_vllm_config()
    compilation = vllm_config.compilation_config
    if compilation.mode in (None, CompilationMode.NONE) or compilation.backend not in ("", "inductor"):
        return
    options = compilation.inductor_compile_config
    key = id(compilation)
    if key not in _wrapper_choice:
        _wrapper_choice[key] = None if "cpp_wrapper" in options else True  # None: the user's own choice stands
    if _wrapper_choice[key] is None:
        return
    eligible = bool(_wrapper_choice[key]) and ineligible(layer, vllm_config) is None and _schemas_match()
    _wrapper_choice[key] = eligible
    for option, value in CPP_WRAPPER.items():
        if eligible:
            options[option] = value
        else:
            options.pop(option, None)


_SCHEMAS = {
    "cpu_attention_with_kv_cache": "_C::cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor "
    "value_cache, Tensor(a3!) output, Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, Tensor? "
    "alibi_slopes, SymInt sliding_window_size, Tensor block_table, float softcap, Tensor scheduler_metadata, Tensor? "
    "s_aux, Tensor? dynamic_causal, float k_scale=1., float v_scale=1., str kv_cache_dtype=\"auto\") -> ()",
    "cpu_attn_reshape_and_cache": "_C::cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a2!) key_cache, "
    "Tensor(a3!) value_cache, Tensor slot_mapping, str isa, float k_scale=1., float v_scale=1., str "
    "kv_cache_dtype=\"auto\") -> ()",
}


@functools.cache
def _schemas_match() -> bool:
    """Whether vLLM's two CPU attention kernels take exactly the arguments the C++ op passes (once a process: the
    model build asks at every attention layer)."""
    for name, expected in _SCHEMAS.items():
        try:
            schema = str(getattr(torch.ops._C, name).default._schema)
        except (AttributeError, RuntimeError):
            log.info("anychip: vLLM has no _C::%s: its CPU attention stays in Python", name)
            return False
        if schema != expected:
            log.info("anychip: vLLM's _C::%s takes other arguments (%s): its CPU attention stays in Python", name,
                     schema)
            return False
    return True


_subclasses: dict[type, type] = {}


def _subclass(cls: type) -> type:
    """cls with a forward that calls anychip::cpu_attention where vLLM's calls its two Python ops."""
    sub = _subclasses.get(cls)
    if sub is None:
        sub = _subclasses[cls] = type(cls.__name__, (cls,), {"forward": _forward, "__module__": cls.__module__})
    return sub


def _forward(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             output_shape: torch.Size | None = None, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    # vLLM's Attention.forward (0.32) with its two custom-op calls replaced by one
    if output_dtype is None:
        output_dtype = query.dtype
    if output_shape is None:
        output_shape = torch.Size((query.shape[0], self.num_heads * self.head_size_v))
    output = torch.empty(output_shape, dtype=output_dtype, device=query.device)
    hidden_size = output_shape[-1]
    query = query.view(-1, self.num_heads, self.head_size)
    out = output.view(-1, self.num_heads, self.head_size_v)
    key = key.view(-1, self.num_kv_heads, self.head_size) if key is not None else None
    value = value.view(-1, self.num_kv_heads, self.head_size_v) if value is not None else None
    torch.ops.anychip.cpu_attention(query, key, value, out, self._anychip_attn_id)
    return output.view(-1, hidden_size)


def _hook_forward_context() -> None:
    """Wrap vLLM's override_forward_context (every set_forward_context goes through it) so that the C++ op holds
    the metadata of the forward pass that runs, and knows when none does."""
    global _hooked
    if _hooked:
        return
    import vllm.forward_context as fc

    original = fc.override_forward_context

    @contextlib.contextmanager
    def override_forward_context(forward_context: Any) -> Iterator[None]:
        with original(forward_context):
            previous = _publish(forward_context)
            try:
                yield
            finally:
                torch.ops.anychip.attn_set_state(UNSET)
                if previous != UNSET:
                    _publish(fc._forward_context)

    fc.override_forward_context = override_forward_context
    _hooked = True


def _publish(ctx: Any) -> int:
    """Hand `ctx`'s attention metadata to the C++ op; returns the op's previous state."""
    ops = torch.ops.anychip
    if ctx is None:
        return ops.attn_set_state(UNSET)
    metadata = ctx.attn_metadata
    if metadata is None:
        return ops.attn_set_state(NO_METADATA)
    if not isinstance(metadata, dict):
        raise RuntimeError(f"anychip: attention metadata of type {type(metadata).__name__} (speculative decoding?) "
                           "is not what anychip::cpu_attention reads; set ANYCHIP_CPU_ATTENTION=0")
    slots = ctx.slot_mapping if isinstance(ctx.slot_mapping, dict) else {}
    reg = _registry
    keys: dict[tuple[int, int], int] = {}
    groups: list[int] = []
    for i, (ref, name) in enumerate(zip(reg.layers, reg.names)):
        layer, md = ref(), metadata.get(name)
        if layer is None or md is None:  # gone, or a layer of another model in this process: not in this pass
            reg.caches[i] = None
            groups.append(-1)
            continue
        slot = slots.get(name)
        key = (id(md), id(slot))
        g = keys.get(key)
        if g is None:
            g = keys[key] = len(keys)
            if md.scheduler_metadata is None:
                raise RuntimeError(f"anychip: {name}: vLLM built no CPU attention scheduler metadata for this step")
            ops.attn_set_group(g, md.num_actual_tokens, md.causal, md.query_start_loc, md.seq_lens, md.block_table,
                               md.scheduler_metadata, md.dynamic_causal, slot)
        groups.append(g)
        if layer.kv_cache is not reg.caches[i]:
            _register(i, layer)
    if groups != reg.groups:
        ops.attn_set_layer_groups(groups)
        reg.groups = groups
    return ops.attn_set_state(READY)


def _register(i: int, layer: Any) -> None:
    impl = layer.impl
    sinks = impl.sinks
    if sinks is not None and sinks.dtype not in (torch.bfloat16, torch.float32):
        sinks = impl.sinks = sinks.to(torch.float32)  # as vLLM's forward does, once
    torch.ops.anychip.attn_register_layer(
        i, layer.kv_cache, float(impl.scale), impl.alibi_slopes, int(impl.sliding_window),
        float(impl.logits_soft_cap), sinks, float(layer._k_scale_float), float(layer._v_scale_float),
        str(layer.isa), str(impl.kv_cache_dtype))
    _registry.caches[i] = layer.kv_cache
    from anychip.vllm_plugin.recorder import get_recorder

    calls = get_recorder().coverage.attention_calls
    if calls is not None:  # vLLM's attention builds in use: the prefill kernel reads the `vec` build's cache only
        calls["vllm_isa"] = sorted(set(calls.get("vllm_isa", [])) | {str(layer.isa)})
