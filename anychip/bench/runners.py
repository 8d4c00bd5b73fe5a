"""One system, one process: `python -m anychip.bench.runners SPEC.json OUT.json`.

`anychip bench latency` starts this module once per system so that engines share neither memory nor threads. It
builds the engine (vLLM's offline `LLM`, or llama.cpp through llama-cpp-python), then runs the llama-bench loop
that both engines share (`measure`): a probe, a warm-up, and `reps` repetitions of one prefill of `pp` random
tokens and `tg` single-token decode steps, each on an empty KV cache (prefix caching off, fresh random ids);
with `batch`, then `batch` requests of `pp` random tokens generating `tg` each, all submitted at once (vLLM only).
It records raw seconds only; `anychip.bench.metrics` turns them into rates.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from anychip import envs
from anychip.bench.gpu_clocks import ClockSampler
from anychip.bench.metrics import plan_within_budget
from anychip.checkpoint.model_dir import ModelDir

Engine = Literal["vllm", "llama.cpp"]


@dataclass
class RunSpec:
    """What one runner process measures.

    system: row name in the report ("anychip-w4a8", "vllm-bf16", ...).
    env: environment the parent set for this system (recorded, already applied when the child starts).
    budget_s: wall-time budget for probe + warm-up + repetitions; pp, tg and reps shrink to fit (recorded).
    device: "cpu" or "cuda", where the engine runs (vLLM picks it from its build; recorded).
    batch: requests in the batched run (0: none); batch_reps: its timed repetitions.
    graph_tokens: the largest step vLLM captures as a CUDA graph (None: vLLM's choice; GPU engines only).
    """

    system: str
    engine: Engine
    model: str
    pp: int
    tg: int
    reps: int
    threads: int
    eager: bool = False
    budget_s: float = 600.0
    seed: int = 0
    dtype: str = "bfloat16"
    device: str = "cpu"
    batch: int = 0
    batch_reps: int = 3
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    graph_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("pp", "tg", "reps", "threads", "batch_reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.graph_tokens is not None and (self.graph_tokens < 1 or self.device != "cuda"):
            raise ValueError(f"--graph-tokens {self.graph_tokens}: a positive number of tokens, for --device cuda")
        if self.batch < 0:
            raise ValueError(f"--batch must be 0 (off) or a number of requests, got {self.batch}")
        if self.batch and self.engine != "vllm":
            raise ValueError(f"--batch: {self.system} runs one sequence at a time (llama-cpp-python); leave it out")


class Timed(Protocol):
    """An engine under test: each call starts on an empty KV cache and returns wall seconds."""

    vocab_size: int

    def prefill(self, ids: list[int]) -> float: ...

    def decode(self, first: int, steps: int) -> float: ...

    def settings(self) -> dict[str, Any]: ...


class VllmTimed:
    """vLLM's offline API. prefill: one request of len(ids) tokens, max_tokens=1 (the whole prompt in one
    scheduler step: max_num_batched_tokens >= pp). decode: a one-token prompt and `steps` generated tokens with
    ignore_eos, i.e. `steps` forward passes of one token each, the first of them the one-token prefill."""

    def __init__(self, spec: RunSpec, max_len: int):
        seqs = max(1, spec.batch)
        for name, value in envs.vllm_startup(spec.device).items():  # the child process owns its environment
            os.environ.setdefault(name, value)
        from anychip.vllm_plugin import offline  # vLLM's public offline API only

        self._offline = offline
        cfg = ModelDir.open(spec.model).config
        self.vocab_size = int(cfg["vocab_size"])
        kv_bytes = _kv_cache_bytes(cfg, max_len) * seqs
        self._kwargs: dict[str, Any] = dict(
            model=spec.model,
            dtype=spec.dtype,
            skip_tokenizer_init=True,
            max_model_len=max_len,
            # batched: vLLM's GPU default step size, so 64 prompts prefill in a few steps
            max_num_batched_tokens=max(max_len, 8192 if spec.batch else 256),
            max_num_seqs=seqs,
            enable_prefix_caching=False,
            enforce_eager=spec.eager,
            distributed_executor_backend="uni",
            kv_cache_memory_bytes=kv_bytes,
            seed=spec.seed,
        )
        if spec.device == "cpu" and not spec.eager:  # every vLLM system on the CPU: the same engine settings
            self._kwargs["compilation_config"] = {k: list(v) for k, v in envs.VLLM_CPU_COMPILATION.items()}
        if spec.graph_tokens and not spec.eager:  # every vLLM system on the GPU: the same capture sizes
            self._kwargs["compilation_config"] = {"max_cudagraph_capture_size": spec.graph_tokens}
        self.llm = offline.make_llm(**self._kwargs)

    def _run(self, prompts: list[list[int]], max_tokens: int) -> float:
        sp = self._offline.sampling_params(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                           temperature=0.0, detokenize=False)
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        got = sorted({len(o.outputs[0].token_ids) for o in out})
        if len(out) != len(prompts) or got != [max_tokens]:
            raise RuntimeError(f"vLLM generated {got} tokens for {len(out)} of {len(prompts)} requests, expected "
                               f"{max_tokens} each")
        return dt

    def prefill(self, ids: list[int]) -> float:
        return self._run([ids], 1)

    def decode(self, first: int, steps: int) -> float:
        return self._run([[first]], steps)

    def batch(self, prompts: list[list[int]], steps: int) -> float:
        return self._run(prompts, steps)

    def settings(self) -> dict[str, Any]:
        import torch

        return {
            "executor": "uni (VLLM_ENABLE_V1_MULTIPROCESSING=" + os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
            + ")",
            "compile_mode": self._offline.compile_mode(self.llm, self._kwargs["enforce_eager"]),
            "cuda_graph_max_tokens": self._offline.cuda_graph_tokens(self.llm),
            "dtype": self._kwargs["dtype"],
            "torch_threads": torch.get_num_threads(),
            "max_num_batched_tokens": self._kwargs["max_num_batched_tokens"],
            "kv_cache_bytes": self._kwargs["kv_cache_memory_bytes"],
            "prefix_caching": False,
            "compilation_config": self._kwargs.get("compilation_config"),
            "versions": {"vllm": self._offline.version(), "torch": torch.__version__},
        }


class LlamaCppTimed:
    """llama.cpp through llama-cpp-python's `Llama.eval` (one `llama_decode` per n_batch slice), llama-bench's
    defaults n_batch=2048, n_ubatch=512. prefill: eval of all ids on a reset context. decode: `steps` evals of
    one token each on a reset context, feeding random ids as llama-bench does (no sampling)."""

    def __init__(self, spec: RunSpec, max_len: int):
        from llama_cpp import Llama

        self._threads, self._model = spec.threads, spec.model
        self.llm = Llama(model_path=spec.model, n_ctx=max_len, n_batch=2048, n_ubatch=512, n_threads=spec.threads,
                         n_threads_batch=spec.threads, seed=spec.seed, logits_all=False, verbose=False)
        self.vocab_size = int(self.llm.n_vocab())
        self._rng = np.random.default_rng(spec.seed + 1)

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()  # n_tokens = 0: eval() then drops every KV cell from position 0 on
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0

    def decode(self, first: int, steps: int) -> float:
        self.llm.reset()
        tokens = [first] + self._rng.integers(0, self.vocab_size, steps - 1).tolist()
        t0 = time.perf_counter()
        for tok in tokens:
            self.llm.eval([tok])
        return time.perf_counter() - t0

    def settings(self) -> dict[str, Any]:
        import llama_cpp

        return {"executor": "llama.cpp (llama-cpp-python Llama.eval)", "compile_mode": "n/a",
                "dtype": f"{Path(self._model).name} (GGUF)", "threads": self._threads, "n_batch": self.llm.n_batch,
                "n_ubatch": int(self.llm.context_params.n_ubatch),
                "versions": {"llama_cpp_python": llama_cpp.__version__}}


def _kv_cache_bytes(cfg: dict[str, Any], max_len: int) -> int:
    """KV cache for one sequence of max_len tokens in BF16, doubled, at least 256 MiB (block rounding)."""
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    per_token = 2 * int(cfg["num_hidden_layers"]) * int(cfg.get("num_key_value_heads", heads)) * head_dim * 2
    return max(256 << 20, 2 * per_token * max_len)


def measure(engine: Timed, spec: RunSpec, probe: tuple[int, int] = (32, 4)) -> dict[str, Any]:
    """The llama-bench loop: probe (sizes the run to the budget), warm-up, then spec.reps timed repetitions."""
    rng = np.random.default_rng(spec.seed)

    def ids(n: int) -> list[int]:
        return rng.integers(0, engine.vocab_size, n).tolist()

    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()
    pp_probe, tg_probe = min(spec.pp, probe[0]), min(spec.tg, probe[1])
    engine.prefill(ids(pp_probe)), engine.decode(ids(1)[0], tg_probe)  # first calls pay one-off costs
    # best of two: a burst of other work during one probe should not shrink the whole run
    s_pp = min(engine.prefill(ids(pp_probe)) for _ in range(2)) / pp_probe
    s_tg = min(engine.decode(ids(1)[0], tg_probe) for _ in range(2)) / tg_probe
    spent = time.perf_counter() - t_start
    plan = plan_within_budget(spec.pp, spec.tg, spec.reps, s_pp, s_tg, spec.budget_s - spent)
    engine.prefill(ids(plan.pp)), engine.decode(ids(1)[0], plan.tg)  # warm-up at the measured sizes
    timings, cpu_s, reason, windows = [], 0.0, plan.reason, []
    sampler = ClockSampler.for_device(spec.device)
    with sampler if sampler is not None else contextlib.nullcontext():
        for rep in range(plan.reps):
            cpu0 = _process_cpu_s()
            t0 = time.monotonic()
            pp_s = engine.prefill(ids(plan.pp))
            t1 = time.monotonic()
            timings.append([pp_s, engine.decode(ids(1)[0], plan.tg)])
            windows.append((t0, t1, time.monotonic()))
            cpu_s += _process_cpu_s() - cpu0
            if rep + 1 < plan.reps and time.perf_counter() - t_start > 1.5 * spec.budget_s:
                # the machine got slower than the probe said (other work): stop rather than run for hours
                reason = (f"{reason + '; ' if reason else ''}stopped after {rep + 1} of {plan.reps} repetitions: "
                          f"1.5x the {spec.budget_s:.0f} s budget spent")
                break
    # the median SM clock (MHz) during each repetition's prefill and decode; None where no reading arrived
    clocks = None if sampler is None else [[sampler.median_between(a, b), sampler.median_between(b, c)]
                                           for a, b, c in windows]
    # CPU seconds this process got per wall second per thread: well below 1 means other work took the cores
    cpu_share = cpu_s / (sum(map(sum, timings)) * spec.threads)
    batched: dict[str, Any] = {}
    if spec.batch:  # at the requested sizes: the budget plan sizes the batch-one loop only
        def prompts() -> list[list[int]]:
            return [ids(spec.pp) for _ in range(spec.batch)]

        engine.batch(prompts(), spec.tg)  # warm-up
        batched = {"batch": spec.batch, "batch_pp": spec.pp, "batch_tg": spec.tg,
                   "batch_timings": [engine.batch(prompts(), spec.tg) for _ in range(spec.batch_reps)]}
    return {"pp": plan.pp, "tg": plan.tg, "reps": len(timings), "reduced": reason, "timings": timings, **batched,
            "probe_s_per_token": {"pp": s_pp, "tg": s_tg}, "loadavg": [load_before, os.getloadavg()[0]],
            "cpu_share": cpu_share, "gpu_sm_clock_mhz": clocks}


def _process_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def run(spec: RunSpec) -> dict[str, Any]:
    max_len = (spec.pp + spec.tg if spec.batch else max(spec.pp, spec.tg)) + 16
    t0 = time.perf_counter()
    engine: Timed = (VllmTimed if spec.engine == "vllm" else LlamaCppTimed)(spec, max_len)
    start_s = time.perf_counter() - t0
    result = measure(engine, spec)
    settings = engine.settings()
    settings.setdefault("threads", spec.threads)
    settings["env"] = spec.env
    settings["seed"] = spec.seed
    settings["python"] = platform.python_version()
    settings["device"] = spec.device
    return {"ok": True, "engine_start_s": start_s, "settings": settings, "peak_rss_mib": peak_rss_mib(), **result}


def peak_rss_mib(status: Path = Path("/proc/self/status")) -> float:
    """This process's peak resident memory, MiB: Linux's VmHWM, which belongs to the process's own address space.
    getrusage's ru_maxrss is not that: Linux carries it across fork and exec, so a runner started by a bench
    process that had grown larger reported the bench process's peak. Elsewhere ru_maxrss (KiB on Linux, bytes on
    macOS) is what there is."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = RunSpec(**json.loads(spec_path.read_text()))
    try:
        result = run(spec)
    except Exception as exc:  # the parent reports it as this system's row
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out_path.write_text(json.dumps({"spec": asdict(spec), **result}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
