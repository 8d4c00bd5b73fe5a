"""Every environment variable anychip reads, in one place.

Environment variables exist only where vLLM's process model forces them (the plugin runs inside engine
processes that `anychip serve` or a plain `vllm serve` start) or where a user needs an override without a flag.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from anychip.kernels.policy import KernelPolicy

#: What anychip sets for the vLLM engines it starts (bench, eval, tests; a user's own value wins): the engine core
#: in-process, so a decode step pays no inter-process round trip (twice the decode speed on a 2-core CPU).
VLLM_STARTUP: dict[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: The same for the CPU engines (serve's profile, every vLLM system of `bench latency --device cpu`; a user's own
#: value wins). vLLM 0.32's CPU engines save their compiled forward ahead of time but cannot load it back (stock
#: Inductor's compiled function lacks the `finalize_loading` vLLM's loader calls), so with AOT compilation on every
#: start compiles again; off, vLLM's own compile cache serves a warm start: 37-50 s down to 13 s for the default
#: W4A8 model, 52 s to 14 s for its BF16 source (docs/benchmarks.md).
VLLM_CPU_STARTUP: dict[str, str] = {"VLLM_USE_AOT_COMPILE": "0"}


def vllm_startup(device: str) -> dict[str, str]:
    """What anychip sets for a vLLM engine it starts on `device` ("cpu" or "cuda"): VLLM_STARTUP, and on the CPU
    VLLM_CPU_STARTUP too."""
    return {**VLLM_STARTUP, **(VLLM_CPU_STARTUP if device == "cpu" else {})}
#: The compile caches a vLLM engine reads and fills at start (Inductor's, Triton's, vLLM's own compile cache under
#: its cache root): `anychip bench latency` gives every system empty ones of its own, so that no engine starts on
#: kernels an earlier system or run compiled. A variable the user set is left alone (then caches are shared).
COMPILE_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT")
#: vLLM's compilation config for the CPU engines anychip starts (serve, bench; a user's own flag wins): one Inductor
#: graph for the whole forward instead of one piece between every two attention calls. Splitting only serves
#: piecewise CUDA graphs, which a CPU has none of; each piece costs a Python call through vLLM's piecewise backend
#: and Inductor's wrapper, about a quarter of a SmolLM2-135M decode step on 2 cores (docs/kernels-cpu.md).
VLLM_CPU_COMPILATION: dict[str, list] = {"splitting_ops": []}

#: Where prepared models are cached (the directory that holds `smollm2-135m-instruct/...`).
ANYCHIP_CACHE = "ANYCHIP_CACHE"
#: Path of the coverage report that the vLLM plugin writes (set by `anychip serve --coverage`).
ANYCHIP_COVERAGE = "ANYCHIP_COVERAGE"
#: "1" allows the torch reference route for linears that no fast kernel can serve; counted in the report.
ANYCHIP_ALLOW_FALLBACK = "ANYCHIP_ALLOW_FALLBACK"
#: Forces one kernel route by id (`anychip routes` lists them): "cpu.avx512_vnni", "cpu.avx2", "cpu.portable",
#: "cuda.triton", "reference", ...; the short names "avx2", "portable", ... are accepted too.
ANYCHIP_KERNEL_ISA = "ANYCHIP_KERNEL_ISA"
#: How the output head is served: "bf16" (default, the checkpoint's BF16 tensor) or "int8" (quantized per channel
#: at load; not the checkpoint's numerics; `anychip serve --head int8` sets it for plain `vllm serve` engines too).
ANYCHIP_HEAD = "ANYCHIP_HEAD"
#: Where the compiled C++ extension is cached (default: ~/.cache/anychip/torch_extensions).
ANYCHIP_BUILD_DIR = "ANYCHIP_BUILD_DIR"
#: GPU GEMM tuning: "load" (default: shapes that neither the shipped table nor the disk cache
#: (ANYCHIP_GPU_TUNING_DIR) knows are timed once at load and cached) or "off" (never time: default configs).
ANYCHIP_GPU_TUNE = "ANYCHIP_GPU_TUNE"
#: Where the GPU tuning results are cached (default: ~/.cache/anychip/gpu_tuning); a folder that cannot be written
#: only costs the timing again at the next start.
ANYCHIP_GPU_TUNING_DIR = "ANYCHIP_GPU_TUNING_DIR"
#: Threads that compile the Triton kernels of each loaded GPU linear in the background (kernels/gpu/precompile.py);
#: default min(8, CPUs), 0: off (every kernel compiles at its first launch).
ANYCHIP_GPU_PRECOMPILE = "ANYCHIP_GPU_PRECOMPILE"
#: "0" disables strict mode in the plugin (same as ANYCHIP_ALLOW_FALLBACK=1).
ANYCHIP_STRICT = "ANYCHIP_STRICT"
#: "1" lets the plugin run under a vLLM version it was not tested with (a warning; `vllm_tested: false` in coverage).
ANYCHIP_ALLOW_UNTESTED_VLLM = "ANYCHIP_ALLOW_UNTESTED_VLLM"
#: Folder of *.jsonl multiple-choice tasks for `anychip eval` when --data is not given.
ANYCHIP_EVALDATA = "ANYCHIP_EVALDATA"
#: The key `anychip serve` requires on /v1 routes when --api-key is not given (passed to vLLM as VLLM_API_KEY).
ANYCHIP_API_KEY = "ANYCHIP_API_KEY"
#: "0" keeps vLLM's RMSNorm kernels apart from the W4A8 linears after them (vllm_plugin/fusion.py; default: fused
#: where the route computes the norm itself).
ANYCHIP_FUSE_NORM = "ANYCHIP_FUSE_NORM"
#: "0" leaves vLLM's CPU attention to vLLM's Python ops; by default the plugin calls the same vLLM kernels from C++
#: (anychip::cpu_attention) for a W4A8 model on vLLM's CPU backend (vllm_plugin/cpu_attention.py).
ANYCHIP_CPU_ATTENTION = "ANYCHIP_CPU_ATTENTION"
#: The prefill attention kernel for steps of fresh prompts (csrc/attention_prefill_x86.h) on the C++ attention path:
#: "0" off (vLLM's kernels for every step), "1" on wherever it runs (AVX2 + FMA); default: on where vLLM's CPU
#: attention is its AVX2 build (x86 without AVX512).
ANYCHIP_ATTN_PREFILL = "ANYCHIP_ATTN_PREFILL"
#: "1" moves SiluAndMul into the down projection's kernels wherever the route computes it, "0" nowhere; default
#: (unset): where the route does so by default (Route.fuse_silu_by_default: the C++ x86 routes, not the GPU's).
ANYCHIP_FUSE_SILU = "ANYCHIP_FUSE_SILU"
#: "0" keeps the registry from picking route cpu.amx_int8 (AMX-INT8 prefill tiles, csrc/w4a8_amx.h) on CPUs that
#: have it: cpu.avx512_vnni serves instead (default: on, same bits; forcing the route still takes it).
ANYCHIP_CPU_AMX = "ANYCHIP_CPU_AMX"
#: "0" launches the GPU route's Triton kernels through Triton's JIT at every call (kernels/gpu/direct.py; default:
#: the compiled kernels directly).
ANYCHIP_DIRECT_LAUNCH = "ANYCHIP_DIRECT_LAUNCH"
#: "0" launches the GPU route's batch-one GEMVs as plain launches (default: programmatic dependent launches on
#: Hopper and newer, kernels/gpu/launch.py).
ANYCHIP_GPU_PDL = "ANYCHIP_GPU_PDL"
#: "1": load-time GPU tuning also times the Gluon GEMM (sm_90) beside the Triton prefill tiles (default off).
ANYCHIP_GPU_WGMMA = "ANYCHIP_GPU_WGMMA"
#: The anychip commit a benchmark report records for a tree without its own .git (a `git archive` export).
ANYCHIP_SOURCE_COMMIT = "ANYCHIP_SOURCE_COMMIT"
#: "0" leaves vLLM's CUDA graph sizes alone for anychip-served models (default: prefill steps up to the step budget
#: also replay graphs, anychip/cuda_graphs.py).
ANYCHIP_GPU_PREFILL_GRAPHS = "ANYCHIP_GPU_PREFILL_GRAPHS"


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use 1 or 0")


def cache_dir() -> Path:
    """Model cache: $ANYCHIP_CACHE, else ~/.cache/anychip/models."""
    value = os.environ.get(ANYCHIP_CACHE)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "anychip" / "models"


def build_dir() -> Path:
    value = os.environ.get(ANYCHIP_BUILD_DIR)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "anychip" / "torch_extensions"


def tuning_dir() -> Path:
    value = os.environ.get(ANYCHIP_GPU_TUNING_DIR)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "anychip" / "gpu_tuning"


def coverage_path() -> Path | None:
    value = os.environ.get(ANYCHIP_COVERAGE)
    return Path(value) if value else None


def fallback_allowed() -> bool:
    allow, strict = _flag(ANYCHIP_ALLOW_FALLBACK, False), _flag(ANYCHIP_STRICT, True)
    if allow and strict and os.environ.get(ANYCHIP_STRICT, "") != "":  # both said, and they disagree
        raise ValueError(f"{ANYCHIP_STRICT}={os.environ[ANYCHIP_STRICT]!r} and {ANYCHIP_ALLOW_FALLBACK}="
                         f"{os.environ[ANYCHIP_ALLOW_FALLBACK]!r} contradict each other: unset one")
    return allow or not strict


def forced_isa() -> str | None:
    """The route ANYCHIP_KERNEL_ISA forces (spaces around it dropped), None when unset or blank."""
    return os.environ.get(ANYCHIP_KERNEL_ISA, "").strip() or None


def allow_untested_vllm() -> bool:
    return _flag(ANYCHIP_ALLOW_UNTESTED_VLLM, False)


def fuse_norm() -> bool:
    return _flag(ANYCHIP_FUSE_NORM, True)


def cpu_attention() -> bool:
    return _flag(ANYCHIP_CPU_ATTENTION, True)


def attn_prefill() -> bool | None:
    """ANYCHIP_ATTN_PREFILL: True (on), False (off), None (unset or "auto": the plugin decides by the CPU)."""
    raw = os.environ.get(ANYCHIP_ATTN_PREFILL, "").strip().lower()
    if raw in ("", "auto"):
        return None
    return _flag(ANYCHIP_ATTN_PREFILL, False)


def fuse_silu() -> bool | None:
    """ANYCHIP_FUSE_SILU: True (on), False (off), None (unset: each route's default)."""
    if not os.environ.get(ANYCHIP_FUSE_SILU, "").strip():
        return None
    return _flag(ANYCHIP_FUSE_SILU, False)


def gpu_prefill_graphs() -> bool:
    return _flag(ANYCHIP_GPU_PREFILL_GRAPHS, True)


def precompile_threads() -> int:
    value = os.environ.get(ANYCHIP_GPU_PRECOMPILE, "").strip()
    if not value:
        return min(8, os.cpu_count() or 1)
    if not value.isdigit():
        raise ValueError(f"{ANYCHIP_GPU_PRECOMPILE}={value!r}: a number of threads (0: off)")
    return int(value)


def kernel_policy(allow_fallback: bool | None = None) -> KernelPolicy:
    """The kernel policy from the environment (ANYCHIP_KERNEL_ISA, ANYCHIP_ALLOW_FALLBACK / ANYCHIP_STRICT,
    ANYCHIP_BUILD_DIR, ANYCHIP_HEAD, ANYCHIP_GPU_TUNE, ANYCHIP_GPU_TUNING_DIR, ANYCHIP_GPU_PRECOMPILE,
    ANYCHIP_DIRECT_LAUNCH, ANYCHIP_GPU_PDL, ANYCHIP_GPU_WGMMA, ANYCHIP_CPU_AMX); `allow_fallback` overrides the
    environment's answer (a CLI flag)."""
    return KernelPolicy(route=forced_isa(), build_dir=build_dir(), head=os.environ.get(ANYCHIP_HEAD) or "bf16",
                        gpu_tuning=os.environ.get(ANYCHIP_GPU_TUNE) or "load", tuning_dir=tuning_dir(),
                        gpu_precompile=precompile_threads(), gpu_direct_launch=_flag(ANYCHIP_DIRECT_LAUNCH, True),
                        gpu_pdl=_flag(ANYCHIP_GPU_PDL, True), gpu_wgmma=_flag(ANYCHIP_GPU_WGMMA, False),
                        cpu_amx=_flag(ANYCHIP_CPU_AMX, True),
                        allow_fallback=fallback_allowed() if allow_fallback is None else allow_fallback)


@contextmanager
def patched_environ(values: dict[str, str], override: bool = True) -> Iterator[None]:
    """Set `values` in os.environ for the block (override=False keeps what the user already set), then restore
    every touched variable exactly, unset ones included."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if override or k not in os.environ:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
