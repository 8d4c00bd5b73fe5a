"""The coverage report: proof of which route served every quantized linear, in prefill and in decode.

This module owns the schema, the atomic writer and `anychip coverage check`; it imports no vLLM. The vLLM plugin
fills a `Coverage` while the engine runs (anychip/vllm_plugin/coverage_recorder.py).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anychip import __version__
from anychip.errors import AnychipError
from anychip.formats import GROUP_SIZES

SCHEMA_VERSION = 1
PHASES = ("prefill", "decode")
REFERENCE_KERNEL = "reference"


@dataclass
class LayerRoute:
    """How one vLLM linear (dotted prefix, e.g. model.layers.3.self_attn.qkv_proj) is served."""

    name: str
    route: str  # the route id, e.g. "cpu.avx512_vnni" or "reference"; "vllm.<Scheme>" for vLLM's own
    kernel: str
    isa: str
    group_size: int
    n: int
    k: int
    checkpoint_format: str
    fallback: bool = False
    reason: str | None = None  # why a fallback was taken
    bit_exact: bool | None = None  # whether the route computes the checkpoint's numerics exactly (None: unknown)
    quantized: bool = True  # False: a linear the checkpoint leaves in BF16 (vLLM's unquantized GEMM serves it)
    ignored: bool = False  # unquantized because the checkpoint's `ignore` names it
    calls: Counter = field(default_factory=Counter)  # phase -> calls
    tokens: Counter = field(default_factory=Counter)  # phase -> tokens
    fused: tuple[str, ...] = ()  # what vLLM computes ahead of it that ran inside its kernels (vllm_plugin/fusion.py)

    def to_json(self) -> dict[str, Any]:
        return {
            "route": self.route,
            "kernel": self.kernel,
            "isa": self.isa,
            "group_size": self.group_size,
            "n": self.n,
            "k": self.k,
            "checkpoint_format": self.checkpoint_format,
            "fallback": self.fallback,
            "reason": self.reason,
            "bit_exact": self.bit_exact,
            "quantized": self.quantized,
            "ignored": self.ignored,
            "calls": dict(self.calls),
            "tokens": dict(self.tokens),
            "fused": list(self.fused),
        }


class Coverage:
    """Thread-safe accumulator; `snapshot()` is the JSON document."""

    def __init__(self, strict: bool, fallback_allowed: bool, platform_info: dict[str, Any]) -> None:
        self.strict = strict
        self.fallback_allowed = fallback_allowed
        self.platform = platform_info
        self.vllm_version: str | None = None
        self.vllm_tested: bool | None = None
        self.tensor_parallel: dict[str, int] = {"rank": 0, "world_size": 1}
        self.model: str | None = None
        self.attention_backend: str | None = None
        # on vLLM's CPU backend: how many attention layers call vLLM's kernels from anychip's C++ op, how many keep
        # vLLM's Python ops, and whether Inductor writes the compiled forward's wrapper in C++
        self.attention_calls: dict[str, Any] | None = None
        self.head_route: dict[str, Any] | None = None
        self.refused: str | None = None  # why the engine stopped while its model was built or loaded
        self.layers: list[LayerRoute] = []
        self.phases: dict[str, Counter] = {}
        self._lock = threading.Lock()
        self.dirty = True

    def add_layer(self, route: LayerRoute) -> int:
        with self._lock:
            self.layers.append(route)
            self.dirty = True
            return len(self.layers) - 1

    def record(self, layer_id: int, phase: str, tokens: int, forward_tokens: int | None) -> None:
        """One linear call. `forward_tokens` is set on the first linear of a forward pass, to count passes."""
        with self._lock:
            layer = self.layers[layer_id]
            layer.calls[phase] += 1
            layer.tokens[phase] += tokens
            if forward_tokens is not None:
                counts = self.phases.setdefault(phase, Counter())
                counts["forward_passes"] += 1
                counts["tokens"] += forward_tokens
            self.dirty = True

    def route_stats(self) -> dict[str, Any]:
        quantized = [layer for layer in self.layers if layer.quantized]
        by_group = Counter(layer.group_size for layer in quantized if not layer.fallback)
        stats: dict[str, Any] = {f"prepared_g{g}_linears": by_group.get(g, 0) for g in GROUP_SIZES}
        for g, count in by_group.items():
            stats[f"prepared_g{g}_linears"] = count
        stats["prepared_linears"] = sum(by_group.values())
        stats["fallback_linears"] = sum(1 for layer in quantized if layer.fallback)
        stats["by_route"] = dict(Counter(layer.route for layer in quantized))
        stats["unquantized_linears"] = len(self.layers) - len(quantized)
        return stats

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            self.dirty = False
            return {
                "schema_version": SCHEMA_VERSION,
                "anychip_version": __version__,
                "vllm_version": self.vllm_version,
                "vllm_tested": self.vllm_tested,
                "tensor_parallel": dict(self.tensor_parallel),
                "model": self.model,
                "platform": self.platform,
                "strict": self.strict,
                "fallback_allowed": self.fallback_allowed,
                "refused": self.refused,
                "phases": {p: {"forward_passes": c["forward_passes"], "tokens": c["tokens"]}
                           for p, c in self.phases.items()},
                "attention_backend": self.attention_backend,
                "attention_calls": self.attention_calls,
                "route_stats": self.route_stats(),
                "head_route": self.head_route,
                "gpu_gemm_configs": self.gpu_gemm_configs(),
                "layers": {layer.name: layer.to_json() for layer in self.layers},
            }

    def gpu_gemm_configs(self) -> dict[str, dict[str, str]] | None:
        """For the cuda.triton route: which GEMM serves each linear shape ("N:K:G") at each M bucket in this
        process, the Triton tiles ("gemm"), the batch-one GEMV ("gemv") or the Gluon GEMM ("wgmma"), with its
        config; None where no layer takes the route."""
        if not any(layer.route == "cuda.triton" for layer in self.layers):
            return None
        from anychip.kernels.gpu import launch

        out: dict[str, dict[str, str]] = {}
        for (bucket, n, kk, g, _device), cfg in sorted(launch.tuned().items(), key=str):
            out.setdefault(f"{n}:{kk}:{g}", {})[str(bucket)] = f"{launch.config_kind(cfg)} {cfg}"
        return out


def write_atomic(path: Path, document: dict[str, Any]) -> None:
    """Write JSON so that a reader never sees a half-written file (temp file + rename in the same folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def rank_path(path: Path, rank: int) -> Path:
    """Where tensor-parallel rank `rank` writes its report when the user asked for `path`."""
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def write_rank_index(path: Path, world_size: int) -> None:
    """The report at `path` for a tensor-parallel engine: which file holds each rank's report."""
    write_atomic(path, {"schema_version": SCHEMA_VERSION, "anychip_version": __version__,
                        "tensor_parallel": {"world_size": world_size},
                        "ranks": {str(r): rank_path(Path(path), r).name for r in range(world_size)}})


def platform_summary() -> dict[str, Any]:
    from anychip.profile import detect_cpu

    cpu = detect_cpu()
    return {"machine": platform.machine(), "system": platform.system(), "cpu": cpu.model,
            "cpu_features": list(cpu.features), "physical_cores": cpu.physical_cores, "profile": cpu.profile_name}


def check(document: dict[str, Any], expect_linears: int | None = None, group_size: int | None = None,
          allow_fallback: bool = False) -> list[str]:
    """Reasons the report does not prove strict W4A8 coverage; empty when it does."""
    problems: list[str] = []
    required = ("schema_version", "anychip_version", "vllm_version", "platform", "strict", "fallback_allowed",
                "phases", "attention_backend", "route_stats", "head_route", "layers")
    for key in required:
        if key not in document:
            problems.append(f"missing field {key!r}")
    if problems:
        return problems
    for key in ("phases", "route_stats", "layers"):
        if not isinstance(document[key], dict):
            problems.append(f"field {key!r} is {type(document[key]).__name__}, not an object")
    if isinstance(document["layers"], dict) and not all(isinstance(v, dict) for v in document["layers"].values()):
        problems.append("field 'layers' holds entries that are not objects")
    if isinstance(document["phases"], dict) and not all(isinstance(v, dict) for v in document["phases"].values()):
        problems.append("field 'phases' holds entries that are not objects")
    if isinstance(document["layers"], dict):
        bad = [f"{name}.{key}" for name, layer in document["layers"].items() if isinstance(layer, dict)
               for key in ("calls", "tokens") if not isinstance(layer.get(key, {}), dict)
               or not all(isinstance(v, int) for v in layer.get(key, {}).values())]
        if bad:
            problems.append(f"layers' call counts are not objects of whole numbers, e.g. {bad[0]}")
    if not isinstance(document["head_route"], (dict, type(None))):
        problems.append(f"field 'head_route' is {type(document['head_route']).__name__}, not an object")
    if problems:
        return problems
    if document.get("refused") is not None:  # the recorder writes null or the refusal's message
        return [f"the engine refused to start: {document['refused'] or '(no reason given)'}"]
    if document["schema_version"] != SCHEMA_VERSION:
        problems.append(f"schema_version {document['schema_version']} != {SCHEMA_VERSION}")
    if not allow_fallback:
        if document["strict"] is not True:
            problems.append("strict is not true (the engine ran with fallback permitted)")
        if document["fallback_allowed"] is not False:
            problems.append("fallback_allowed is not false")
    head = document.get("head_route") or {}
    pooling = head.get("head") == UNUSED_HEAD  # embeddings only: every request is one prefill, none decodes
    for phase in ("prefill",) if pooling else PHASES:
        if not (document["phases"].get(phase) or {}).get("forward_passes"):
            problems.append(f"phase {phase!r} was never observed (send at least one request "
                            + ("that generates two or more tokens before checking)" if phase == "decode" else
                               "before checking)"))
    stats = document["route_stats"]
    layers: dict[str, dict[str, Any]] = document["layers"]
    unquantized = {name: layer for name, layer in layers.items() if layer.get("quantized") is False}
    layers = {name: layer for name, layer in layers.items() if name not in unquantized}
    if not layers:
        problems.append("no quantized linear was prepared: is this a W4A8 checkpoint served with anychip?")
    stray = [name for name, layer in unquantized.items() if not layer.get("ignored")]
    if stray:
        problems.append(f"{len(stray)} linears run unquantized on vLLM's BF16 GEMM without the checkpoint's ignore "
                        f"list naming them, e.g. {stray[0]} ({unquantized[stray[0]].get('reason')}): quantize them "
                        "(anychip quantize) or add them to quantization_config.ignore")
    problems += _route_problems(layers, stats, head, allow_fallback)
    if expect_linears is not None and len(layers) != expect_linears:
        merged = sum(1 for name in layers if name.endswith(("qkv_proj", "gate_up_proj")))
        hint = (" (the report counts the linears vLLM runs: its qkv_proj and gate_up_proj each stand for several of "
                "the checkpoint's, which `anychip verify` and `anychip routes` count one by one)"
                if merged and expect_linears > len(layers) else "")
        problems.append(f"{len(layers)} quantized linears in the report, expected {expect_linears}{hint}")
    if group_size is not None:
        wrong = [name for name, layer in layers.items() if layer.get("group_size") != group_size]
        if wrong:
            problems.append(f"{len(wrong)} linears are not G{group_size}, e.g. {wrong[0]} is "
                            f"G{layers[wrong[0]].get('group_size')}")
        for g in GROUP_SIZES:
            if g != group_size and stats.get(f"prepared_g{g}_linears", 0):
                problems.append(f"prepared_g{g}_linears={stats[f'prepared_g{g}_linears']}, expected 0")
    for name, layer in layers.items():
        if str(layer.get("route", "")).startswith("vllm."):
            continue  # served by vLLM's own scheme (fallback allowed): its calls are not observed
        calls, tokens = layer.get("calls") or {}, layer.get("tokens") or {}
        for phase in PHASES:
            passes = (document["phases"].get(phase) or {}).get("forward_passes") or 0
            if passes and not calls.get(phase):
                problems.append(f"{name} was not called in {phase}")
                break
            if calls.get(phase, 0) < passes:  # every forward pass calls every linear
                problems.append(f"{name} was called {calls.get(phase, 0)} times in {phase}, which ran {passes} "
                                "forward passes")
                break
            if tokens.get(phase, 0) < calls.get(phase, 0):
                problems.append(f"{name} took {tokens.get(phase, 0)} tokens in {calls[phase]} {phase} calls")
                break
    if not head.get("route") and not pooling:
        problems.append("head_route names no route for the output head")
    return problems


def _route_problems(layers: dict[str, dict[str, Any]], stats: dict[str, Any], head: dict[str, Any],
                    allow_fallback: bool) -> list[str]:
    """The quantized layers' routes: known ids, none on the reference or vLLM's own schemes unless fallback is
    allowed (marked or not), and route_stats as the layers add up (a hand-edited report passed on its stats)."""
    from anychip.kernels import routes

    problems: list[str] = []
    known = set(routes.route_ids())
    unknown = [name for name, layer in layers.items() if not isinstance(layer.get("route"), str)
               or (layer["route"] not in known and not layer["route"].startswith("vllm."))]
    if unknown:
        problems.append(f"{len(unknown)} linears name no known route, e.g. {unknown[0]} "
                        f"({layers[unknown[0]].get('route')!r}; routes: {', '.join(sorted(known))})")
    fallback = [name for name, layer in layers.items() if layer.get("fallback")]
    if stats.get("fallback_linears", 0) != len(fallback):
        problems.append(f"route_stats.fallback_linears={stats.get('fallback_linears')} but {len(fallback)} layers "
                        "are marked fallback")
    slow = [name for name, layer in layers.items() if layer.get("fallback")
            or layer.get("route") == routes.REFERENCE.id or str(layer.get("route", "")).startswith("vllm.")]
    if slow and not allow_fallback:
        problems.append(f"{len(slow)} linears ran on the reference route or vLLM's own scheme, e.g. {slow[0]} "
                        f"({layers[slow[0]].get('route')}: {layers[slow[0]].get('reason')})")
    fast = [layer for name, layer in layers.items() if not layer.get("fallback")]
    if stats.get("prepared_linears") != len(fast):
        problems.append(f"route_stats.prepared_linears={stats.get('prepared_linears')} but {len(fast)} quantized "
                        "linears are not marked fallback")
    by_route = dict(Counter(str(layer.get("route")) for layer in layers.values()))
    if stats.get("by_route") != by_route:
        problems.append(f"route_stats.by_route={stats.get('by_route')} but the layers add up to {by_route}")
    from anychip.kernels.routes.head import HEAD_ROUTES

    head_id = head.get("route")
    if head_id and (not isinstance(head_id, str) or (head_id not in {r.id for r in HEAD_ROUTES}
                                                      and not head_id.startswith("vllm."))):
        problems.append(f"head_route names no known route ({head_id!r}; anychip's head routes: "
                        f"{', '.join(r.id for r in HEAD_ROUTES)}, or one of vLLM's, vllm.*)")
    if not allow_fallback and str(head.get("route") or "").startswith(routes.REFERENCE.id):
        problems.append(f"the output head ran on {head['route']}, the reference, in a strict report")
    return problems


def check_ranks(index: dict[str, Any], folder: Path, expect_linears: int | None = None,
                group_size: int | None = None, allow_fallback: bool = False) -> tuple[list[str], list[dict[str, Any]]]:
    """A tensor-parallel index (`ranks`: rank -> file beside it): every rank's report checked, and the ranks
    consistent with each other. Returns (problems, the rank documents read)."""
    problems: list[str] = []
    docs: list[dict[str, Any]] = []
    world = (index.get("tensor_parallel") or {}).get("world_size")
    ranks = index.get("ranks") or {}
    if not isinstance(world, int) or sorted(ranks) != [str(r) for r in range(world)]:
        return [f"ranks {sorted(ranks)} do not match tensor_parallel.world_size={world}"], docs
    for rank in range(world):
        path = folder / ranks[str(rank)]
        if not path.is_file():
            problems.append(f"rank {rank}: {path} does not exist (did that rank start?)")
            continue
        try:
            doc = read_report(path)
        except CoverageReportError as exc:
            problems.append(f"rank {rank}: {exc}")
            continue
        docs.append(doc)
        problems += [f"rank {rank}: {p}" for p in check(doc, expect_linears, group_size, allow_fallback)]
        tp = doc.get("tensor_parallel") or {}
        if tp.get("rank") != rank or tp.get("world_size") != world:
            problems.append(f"rank {rank}: {path.name} says it is rank {tp.get('rank')} of {tp.get('world_size')}")
    names = [set(doc.get("layers") or {}) for doc in docs]
    if names and any(n != names[0] for n in names):
        problems.append("the ranks prepared different linears: " + "; ".join(
            f"rank {r}: {len(n)}" for r, n in enumerate(names)))
    return problems, docs


#: head_route["head"] of an engine whose output head computes nothing (a pooling runner loads none).
UNUSED_HEAD = "unused"


class CoverageReportError(AnychipError, ValueError):
    """A file given as a coverage report is not one."""


def read_report(path: Path) -> dict[str, Any]:
    """A coverage report (or a tensor-parallel index) as a dict; CoverageReportError when the file is not one."""
    if path.is_dir():
        raise CoverageReportError(f"{path} is a folder; pass the report's JSON file (the --coverage path)")
    try:
        document = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CoverageReportError(f"{path} is not a coverage report: not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise CoverageReportError(f"{path} is not a coverage report: JSON {type(document).__name__}, not an object")
    return document


def cmd_check(args) -> int:
    path = Path(args.path)
    if not path.exists():
        print(f"anychip coverage check: {path} does not exist (serve with `anychip serve --coverage {path}` "
              "or set ANYCHIP_COVERAGE for a plain vllm serve)")
        return 2
    document = read_report(path)
    if "ranks" in document:
        problems, docs = check_ranks(document, path.parent, args.expect_linears, args.group_size,
                                     args.allow_fallback)
    else:
        problems, docs = check(document, args.expect_linears, args.group_size, args.allow_fallback), [document]
    if problems:
        print(f"coverage check FAILED for {path}:")
        for p in problems:
            print(f"  - {p}")
        return 1
    stats = docs[0].get("route_stats", {})
    routes = sorted({r for doc in docs for r in doc["route_stats"].get("by_route", {})})
    ranks = f" on each of {len(docs)} tensor-parallel ranks" if len(docs) > 1 else ""
    fallback = stats.get("fallback_linears") or 0
    linears = (stats.get("prepared_linears") or 0) + fallback
    as_fallback = f" ({fallback} as fallback)" if fallback else ""
    print(f"coverage check PASSED for {path}: {linears} linears{ranks} on {', '.join(routes)}{as_fallback}; "
          f"phases {', '.join(sorted(docs[0]['phases']))}; "
          f"head {docs[0]['head_route'].get('route') or docs[0]['head_route'].get('head')}")
    return 0
