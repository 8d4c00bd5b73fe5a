"""`anychip eval MODEL`: multiple-choice accuracy and perplexity, optionally beside the BF16 source model.

Each model runs in a fresh process (spawned), one after the other, so the second starts with the first's memory
returned and with no vLLM state left behind.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from anychip.checkpoint.model_dir import ModelDir, ModelDirError
from anychip.eval.requests import PairEncoder, pair_sequence, plan_requests, rolling_windows
from anychip.eval.scoring import TaskScore, compare, perplexity, score_task
from anychip.eval.tasks import (PERPLEXITY, EvalDataError, data_source, load_task, load_text, resolve_data_dir,
                                select_tasks)

ENGINES: tuple[str, ...] = ("vllm", "torch")


@dataclass(frozen=True)
class EvalSettings:
    """How a model is evaluated.

    limit: first N items of each task (None: all).
    window, stride: perplexity windows of `window` tokens every `stride` tokens (each token scored once, with at
        least window - stride tokens of context after the first window).
    max_len: the engine's context length; longer requests are left-truncated as lm-eval does.
    engine: "vllm" (the serving path) or "torch" (transformers; W4A8 on the torch reference arithmetic).
    device: torch device for engine="torch".
    """

    limit: int | None = None
    window: int = 1024
    stride: int = 512
    max_len: int = 2048
    engine: str = "vllm"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise EvalDataError(f"--limit {self.limit}: must be at least 1")
        if not 0 < self.stride <= self.window <= self.max_len:
            raise ValueError(f"need 0 < stride ({self.stride}) <= window ({self.window}) <= max_len ({self.max_len})")
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r}: use one of {ENGINES}")


@dataclass
class ModelResult:
    """One model's per-item outcomes and perplexity sums (picklable: it crosses the process boundary)."""

    model: str
    tasks: dict[str, TaskScore] = field(default_factory=dict)
    ppl: dict[str, Any] | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    logliks: dict[str, list[list[float]]] = field(default_factory=dict)  # per task, per item, per choice


def bf16_source(model_dir: Path) -> Path:
    """The BF16 directory a W4A8 checkpoint was quantized from (recorded by `anychip quantize`)."""
    try:
        return ModelDir.open(model_dir).bf16_source()
    except ModelDirError as exc:
        raise ModelDirError(f"--compare-bf16: {exc}") from None


def make_engine(model_dir: Path, settings: EvalSettings):
    if settings.engine == "vllm":
        from anychip.eval.engines import VllmEngine

        return VllmEngine(model_dir, max_len=settings.max_len)
    from anychip.eval.engines import TorchEngine

    return TorchEngine.from_dir(model_dir, device=settings.device, max_len=settings.max_len)


def evaluate_model(model_dir: Path, task_files: list[Path], text: str | None, settings: EvalSettings) -> ModelResult:
    """Score every task (and the perplexity text, if given) with one engine on `model_dir`, in this process."""
    from anychip.eval.engines import vllm_environment

    with vllm_environment():
        engine = make_engine(model_dir, settings)
        try:
            return evaluate_engine(engine, str(model_dir), task_files, text, settings)
        finally:
            engine.close()


def evaluate_engine(engine, label: str, task_files: list[Path], text: str | None,
                    settings: EvalSettings) -> ModelResult:
    """Score every task (and the perplexity text) with an engine that is already running."""
    result = ModelResult(model=label)
    short = Path(label).name
    for path in task_files:
        t0 = time.perf_counter()
        task = load_task(path, settings.limit)
        plan = plan_requests(task.items, PairEncoder(engine.encode, engine.prefix_id))
        seqs, n_cont = zip(*(pair_sequence(p, settings.max_len) for p in plan.pairs))
        lps = engine.token_logprobs(seqs, desc=f"{short} {task.name}")
        pair_ll = [sum(lp[-n:]) for lp, n in zip(lps, n_cont)]
        result.logliks[task.name] = plan.gather(pair_ll)
        result.tasks[task.name] = score_task(result.logliks[task.name], [it.lengths for it in task.items],
                                             [it.label for it in task.items])
        result.seconds[task.name] = time.perf_counter() - t0
    if text is not None:
        t0 = time.perf_counter()
        result.ppl = _perplexity(engine, text, settings, short)
        result.seconds[PERPLEXITY] = time.perf_counter() - t0
    return result


def _perplexity(engine, text: str, settings: EvalSettings, label: str) -> dict[str, Any]:
    tokens = engine.encode(text)
    windows = rolling_windows(len(tokens), settings.window, settings.stride)
    lps = engine.token_logprobs([tokens[w.start:w.end] for w in windows], desc=f"{label} {PERPLEXITY}")
    nll = -sum(sum(lp[-w.n_scored:]) for lp, w in zip(lps, windows))
    scored = sum(w.n_scored for w in windows)
    return {"ppl": perplexity(-nll, scored), "nll_per_token": nll / scored, "tokens": scored, "windows": len(windows)}


def evaluate_isolated(model_dir: Path, task_files: list[Path], text: str | None,
                      settings: EvalSettings) -> ModelResult:
    """evaluate_model in a fresh spawned process; its memory and engine state go when it returns."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(evaluate_model, model_dir, task_files, text, settings).result()


def build_report(results: dict[str, ModelResult], settings: EvalSettings, extra: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: per task, each model's summary and (with two models) the W4A8 - BF16 delta."""
    tasks: dict[str, Any] = {}
    names = list(next(iter(results.values())).tasks)
    for name in names:
        entry: dict[str, Any] = {label: r.tasks[name].summary() for label, r in results.items()}
        if "w4a8" in results and "bf16" in results:
            entry["delta"] = compare(results["w4a8"].tasks[name], results["bf16"].tasks[name])
        tasks[name] = entry
    if all(r.ppl is not None for r in results.values()):
        entry = {label: r.ppl for label, r in results.items()}
        if "w4a8" in results and "bf16" in results:
            ratio = results["w4a8"].ppl["ppl"] / results["bf16"].ppl["ppl"]  # type: ignore[index]
            entry["delta"] = {"ppl_ratio": ratio, "ppl_increase_pct": 100.0 * (ratio - 1.0)}
        tasks[PERPLEXITY] = entry
    return {
        "models": {label: r.model for label, r in results.items()},
        "settings": asdict(settings),
        **extra,
        "ci": "delta = W4A8 - BF16 in accuracy units; acc*_ci95: paired per-item differences, normal "
              "approximation (mean +- 1.96 * sd(ddof=1) / sqrt(n))",
        "tasks": tasks,
        "seconds": {label: r.seconds for label, r in results.items()},
    }


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table of the report (accuracies in percent)."""
    lines = [f"{'task':<18} {'model':<6} {'acc':>7} {'acc_norm':>9} {'n':>6}   delta acc_norm [95% CI]"]
    for name, entry in report["tasks"].items():
        for label in ("bf16", "w4a8"):
            if label not in entry:
                continue
            m = entry[label]
            if name == PERPLEXITY:
                lines.append(f"{name:<18} {label:<6} ppl {m['ppl']:.4f} over {m['tokens']} tokens")
                continue
            lines.append(f"{name:<18} {label:<6} {100 * m['acc']:7.2f} {100 * m['acc_norm']:9.2f} {m['n']:>6}")
        d = entry.get("delta")
        if d and name == PERPLEXITY:
            lines.append(f"{'':<18} delta  ppl {d['ppl_increase_pct']:+.2f}%")
        elif d:
            lo, hi = d["acc_norm_ci95"]
            lines.append(f"{'':<18} delta  {100 * d['acc']:+7.2f} {100 * d['acc_norm']:+9.2f}"
                         f"          [{_pct(lo)}, {_pct(hi)}]")
    return "\n".join(lines)


def _pct(x: float) -> str:
    return "nan" if math.isnan(x) else f"{100 * x:+.2f}"


def models_to_evaluate(model: Path, compare_bf16: bool) -> dict[str, Path]:
    """{"w4a8" or "bf16": model}, and with compare_bf16 {"bf16": the source it was quantized from} too."""
    models = {"bf16" if ModelDir.open(model).kind == "bf16" else "w4a8": model}
    if compare_bf16:
        models["bf16"] = bf16_source(model)
    return models


def run_eval(model: Path, task_names: list[str] | None, data: str | None, settings: EvalSettings,
             compare_bf16: bool, text_path: str | None) -> dict[str, Any]:
    """Resolve data, evaluate the model (and its BF16 source), return the report."""
    needs_data = task_names is None or any(n != PERPLEXITY for n in task_names)
    data_dir = resolve_data_dir(data) if needs_data else None
    task_files, want_ppl = select_tasks(task_names, data_dir)
    text_file, text = load_text(text_path) if want_ppl else (None, None)
    models = models_to_evaluate(model, compare_bf16)
    results = {label: evaluate_isolated(path, task_files, text, settings) for label, path in models.items()}
    extra = {"data": data_source(data_dir, task_files), "text": str(text_file) if text_file else None}
    return build_report(results, settings, extra)


def cmd_eval(args: argparse.Namespace) -> int:
    settings = EvalSettings(limit=args.limit)
    report = run_eval(Path(args.model), args.tasks, args.data, settings, args.compare_bf16, args.text)
    report["command"] = "anychip " + " ".join(getattr(args, "argv", None) or sys.argv[1:])
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
