"""One system, one process: `python -m anychip.bench.runners SPEC.json OUT.json`.

`anychip bench latency` starts this module once per system so that engines share neither memory nor threads. It
builds the engine (vLLM's offline `LLM`, or llama.cpp through llama-cpp-python), then runs the llama-bench loop
that both engines share (`measure`): a probe, a warm-up, and `reps` repetitions of one prefill of `pp` random
tokens and `tg` single-token decode steps, each on an empty KV cache (prefix caching off, fresh random ids);
with `batch`, then `batch` requests of `pp` random tokens generating `tg` each, all submitted at once (vLLM only).
It records raw seconds only; `anychip.bench.metrics` turns them into rates.

With `--control FD_IN,FD_OUT` (`anychip bench latency --interleave`) the runner starts its engine, probes and warms
up, then times one repetition each time the bench asks, so that the bench can alternate the systems' repetitions
while every engine stays loaded.
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
from typing import IO, Any, Literal, Protocol

import numpy as np

from anychip import envs
from anychip.bench.gpu_clocks import ClockSampler
from anychip.bench.metrics import plan_within_budget
from anychip.checkpoint.model_dir import ModelDir
from anychip.errors import AnychipError

Engine = Literal["vllm", "llama.cpp"]


class BenchArgumentError(AnychipError, ValueError):
    """A bench flag out of range, named as the user typed it."""


def require_at_least_one(**counts: int) -> None:
    """BenchArgumentError naming the first flag (its keyword, underscores as dashes) whose count is below 1."""
    for name, value in counts.items():
        if value < 1:
            raise BenchArgumentError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def context_needed(pp: int, tg: int, batch: int) -> int:
    """The engines' max_model_len: a prefill of pp tokens and a decode of tg (both in one sequence when batched)."""
    return (pp + tg if batch else max(pp, tg)) + 16


@dataclass
class RunSpec:
    """What one runner process measures.

    system: row name in the report ("anychip-w4a8", "vllm-bf16", ...).
    env: environment the parent set for this system (recorded, already applied when the child starts).
    budget_s: wall-time budget for probe + warm-up + repetitions; pp, tg and reps shrink to fit (recorded).
    device: "cpu" or "cuda", where the engine runs (vLLM picks it from its build; recorded).
    batch: requests in the batched run (0: none); batch_reps: its timed repetitions.
    graph_tokens: vLLM's dense CUDA graph sizes reach this step (None: vLLM's default); past it, prefill steps up
    to the step budget are captured at four sizes an octave (cuda_graphs.capture_sizes; GPU engines only).
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
        require_at_least_one(pp=self.pp, tg=self.tg, reps=self.reps, threads=self.threads,
                             batch_reps=self.batch_reps)
        if self.graph_tokens is not None and (self.graph_tokens < 1 or self.device != "cuda"):
            raise BenchArgumentError(f"--graph-tokens {self.graph_tokens}: a positive number of tokens, for "
                                     "--device cuda")
        if self.batch < 0:
            raise BenchArgumentError(f"--batch must be 0 (off) or a number of requests, got {self.batch}")
        if self.batch and self.engine != "vllm":
            raise BenchArgumentError(f"--batch: {self.system} runs one sequence at a time (llama-cpp-python); "
                                     "leave it out")


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
        if spec.device == "cuda" and not spec.eager:  # every vLLM system on the GPU: the same capture sizes,
            # vLLM's dense ones (to --graph-tokens, else its default: twice max_num_seqs, at most 512), then the
            # prefill sizes anychip's plugin adds (cuda_graphs.py), which a stock engine would not
            from anychip import cuda_graphs

            budget = self._kwargs["max_num_batched_tokens"]
            dense = spec.graph_tokens or cuda_graphs.vllm_default_max(seqs, budget)
            self._kwargs["compilation_config"] = {"cudagraph_capture_sizes": cuda_graphs.capture_sizes(budget, dense)}
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


class Repetitions:
    """The llama-bench loop of one engine, in steps: made, it probes (sizing the run to the budget) and warms up;
    `rep()` times one repetition of a prefill of pp random tokens and tg decode steps; `finish()` runs the batched
    part, if any, and returns what `measure` returns. `measure` calls them in a row; `anychip bench latency
    --interleave` calls `rep()` of every system in turn (`serve_control`)."""

    def __init__(self, engine: Timed, spec: RunSpec, probe: tuple[int, int] = (32, 4)) -> None:
        self.engine, self.spec = engine, spec
        self.rng = np.random.default_rng(spec.seed)
        self.load_before = os.getloadavg()[0]
        t_start = time.perf_counter()
        pp_probe, tg_probe = min(spec.pp, probe[0]), min(spec.tg, probe[1])
        engine.prefill(self.ids(pp_probe)), engine.decode(self.ids(1)[0], tg_probe)  # first calls pay one-offs
        # best of two: a burst of other work during one probe should not shrink the whole run
        self.s_pp = min(engine.prefill(self.ids(pp_probe)) for _ in range(2)) / pp_probe
        self.s_tg = min(engine.decode(self.ids(1)[0], tg_probe) for _ in range(2)) / tg_probe
        self.plan = plan_within_budget(spec.pp, spec.tg, spec.reps, self.s_pp, self.s_tg,
                                       spec.budget_s - (time.perf_counter() - t_start))
        engine.prefill(self.ids(self.plan.pp)), engine.decode(self.ids(1)[0], self.plan.tg)  # warm-up, those sizes
        # the seconds this engine has run so far: probe, warm-up, then its repetitions (not other systems' turns)
        self.spent_s = time.perf_counter() - t_start
        self.timings: list[list[float]] = []
        self.windows: list[tuple[float, float, float]] = []
        self.cpu_s = 0.0
        self.reason = self.plan.reason
        self._stopped = False
        self._stack = contextlib.ExitStack()
        self.sampler = ClockSampler.for_device(spec.device)
        if self.sampler is not None:
            self._stack.enter_context(self.sampler)

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(0, self.engine.vocab_size, n).tolist()

    @property
    def remaining(self) -> int:
        return 0 if self._stopped else self.plan.reps - len(self.timings)

    def rep(self) -> list[float]:
        """One timed repetition: [prefill seconds, decode seconds]."""
        if not self.remaining:
            raise RuntimeError("no repetition left")
        cpu0 = _process_cpu_s()
        t0 = time.monotonic()
        pp_s = self.engine.prefill(self.ids(self.plan.pp))
        t1 = time.monotonic()
        timing = [pp_s, self.engine.decode(self.ids(1)[0], self.plan.tg)]
        t2 = time.monotonic()
        self.timings.append(timing)
        self.windows.append((t0, t1, t2))
        self.cpu_s += _process_cpu_s() - cpu0
        self.spent_s += t2 - t0
        if self.remaining and self.spent_s > 1.5 * self.spec.budget_s:
            # the machine got slower than the probe said (other work): stop rather than run for hours
            self.reason = (f"{self.reason + '; ' if self.reason else ''}stopped after {len(self.timings)} of "
                           f"{self.plan.reps} repetitions: 1.5x the {self.spec.budget_s:.0f} s budget spent")
            self._stopped = True
        return timing

    def finish(self) -> dict[str, Any]:
        self._stack.close()
        spec, timings = self.spec, self.timings
        # the median SM clock (MHz) during each repetition's prefill and decode; None where no reading arrived
        clocks = None if self.sampler is None else [
            [self.sampler.median_between(a, b), self.sampler.median_between(b, c)] for a, b, c in self.windows]
        # CPU seconds this process got per wall second per thread: well below 1 means other work took the cores
        cpu_share = self.cpu_s / (sum(map(sum, timings)) * spec.threads) if timings else None
        batched: dict[str, Any] = {}
        if spec.batch:  # at the requested sizes: the budget plan sizes the batch-one loop only
            def prompts() -> list[list[int]]:
                return [self.ids(spec.pp) for _ in range(spec.batch)]

            self.engine.batch(prompts(), spec.tg)  # warm-up
            batched = {"batch": spec.batch, "batch_pp": spec.pp, "batch_tg": spec.tg,
                       "batch_timings": [self.engine.batch(prompts(), spec.tg) for _ in range(spec.batch_reps)]}
        return {"pp": self.plan.pp, "tg": self.plan.tg, "reps": len(timings), "reduced": self.reason,
                "timings": timings, **batched, "probe_s_per_token": {"pp": self.s_pp, "tg": self.s_tg},
                "loadavg": [self.load_before, os.getloadavg()[0]], "cpu_share": cpu_share,
                "gpu_sm_clock_mhz": clocks,
                # when each repetition ran (CLOCK_MONOTONIC, the same clock in every process of the machine)
                "rep_windows": [[round(a, 4), round(c, 4)] for a, _, c in self.windows]}


def measure(engine: Timed, spec: RunSpec, probe: tuple[int, int] = (32, 4)) -> dict[str, Any]:
    """The llama-bench loop: probe (sizes the run to the budget), warm-up, then spec.reps timed repetitions."""
    reps = Repetitions(engine, spec, probe)
    while reps.remaining:
        reps.rep()
    return reps.finish()


def _process_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Control:
    """The line-delimited JSON channel between `anychip bench latency --interleave` and a runner: two pipes, one
    each way. recv() is None when the other side has closed its end."""

    def __init__(self, reader: IO[str], writer: IO[str]) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    def from_fds(cls, fd_in: int, fd_out: int) -> Control:
        return cls(os.fdopen(fd_in, "r", buffering=1), os.fdopen(fd_out, "w", buffering=1))

    def fileno(self) -> int:
        """The reading end's descriptor (for select)."""
        return self._reader.fileno()

    def send(self, message: dict[str, Any]) -> None:
        self._writer.write(json.dumps(message) + "\n")
        self._writer.flush()

    def recv(self) -> dict[str, Any] | None:
        line = self._reader.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        for stream in (self._reader, self._writer):
            with contextlib.suppress(OSError):
                stream.close()


def serve_control(reps: Repetitions, control: Control) -> None:
    """Answer the bench's requests until it says finish (or goes away): "rep" times one repetition ({"timing":
    [prefill s, decode s], "remaining": n}), or says {"done": true} when this engine has none left."""
    control.send({"ready": True, "reps": reps.plan.reps, "pp": reps.plan.pp, "tg": reps.plan.tg})
    while (message := control.recv()) is not None and message.get("cmd") != "finish":
        if message.get("cmd") != "rep":
            raise ValueError(f"unknown request from the bench: {message}")
        if reps.remaining:
            control.send({"timing": reps.rep(), "remaining": reps.remaining})
        else:
            control.send({"done": True})


def run(spec: RunSpec, control: Control | None = None) -> dict[str, Any]:
    """Start the engine and measure it; with `control`, one repetition at a time when the bench asks."""
    max_len = context_needed(spec.pp, spec.tg, spec.batch)
    t0 = time.perf_counter()
    engine: Timed = (VllmTimed if spec.engine == "vllm" else LlamaCppTimed)(spec, max_len)
    start_s = time.perf_counter() - t0
    if control is None:
        result = measure(engine, spec)
    else:
        reps = Repetitions(engine, spec)
        serve_control(reps, control)
        result = reps.finish()
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
    """SPEC.json OUT.json [--control FD_IN,FD_OUT]: the result goes to OUT.json; with --control the repetitions
    run when the bench asks for them over those two pipe descriptors (`anychip bench latency --interleave`)."""
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    control = None
    if len(argv) > 2:
        if len(argv) != 4 or argv[2] != "--control":
            raise SystemExit(f"usage: SPEC.json OUT.json [--control FD_IN,FD_OUT], got {argv}")
        fd_in, fd_out = (int(fd) for fd in argv[3].split(","))
        control = Control.from_fds(fd_in, fd_out)
    spec = RunSpec(**json.loads(spec_path.read_text()))
    try:
        result = run(spec, control)
    except Exception as exc:  # the parent reports it as this system's row
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out_path.write_text(json.dumps({"spec": asdict(spec), **result}, indent=1))
    if control is not None:
        control.close()  # after the result is written: the bench reads it once this side has gone
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
