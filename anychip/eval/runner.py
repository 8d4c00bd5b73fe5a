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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from anychip.checkpoint.model_dir import ModelDir, ModelDirError
from anychip.envs import ANYCHIP_HEAD, patched_environ
from anychip.errors import AnychipError
from anychip.eval.requests import PairEncoder, pair_sequence, plan_requests, rolling_windows
from anychip.eval.scoring import TaskScore, compare, perplexity, score_task
from anychip.eval.tasks import (PERPLEXITY, EvalDataError, Task, data_source, load_task, load_text, resolve_data_dir,
                                select_tasks)

ENGINES: tuple[str, ...] = ("vllm", "torch", "llama.cpp")
#: Label prefix of llama.cpp peers in the report ("llama.cpp-Q4_0") and the suffix of the INT8-head variant.
LLAMA_CPP = "llama.cpp"
HEAD_INT8 = "+head-int8"


@dataclass(frozen=True)
class EvalSettings:
    """How a model is evaluated.

    limit: first N items of each task (None: all).
    window, stride: perplexity windows of `window` tokens every `stride` tokens (each token scored once, with at
        least window - stride tokens of context after the first window).
    max_len: the engine's context length; longer requests are left-truncated as lm-eval does.
    engine: "vllm" (the serving path) or "torch" (transformers; W4A8 on the torch reference arithmetic); a
        Target's own engine wins (llama.cpp peers).
    device: torch device for engine="torch".
    threads: CPU threads of the llama.cpp engine (None: every CPU this process may use).
    jobs: models evaluated at a time, each in its own process (results do not depend on it).
    """

    limit: int | None = None
    window: int = 1024
    stride: int = 512
    max_len: int = 2048
    engine: str = "vllm"
    device: str = "cpu"
    threads: int | None = None
    jobs: int = 1

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise EvalDataError(f"--limit {self.limit}: must be at least 1")
        if not 0 < self.stride <= self.window <= self.max_len:
            raise ValueError(f"need 0 < stride ({self.stride}) <= window ({self.window}) <= max_len ({self.max_len})")
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r}: use one of {ENGINES}")
        if self.threads is not None and self.threads < 1:
            raise EvalDataError(f"--threads {self.threads}: must be at least 1")
        if self.jobs < 1:
            raise EvalDataError(f"--jobs {self.jobs}: must be at least 1")


@dataclass
class ModelResult:
    """One model's per-item outcomes and perplexity sums (picklable: it crosses the process boundary)."""

    model: str
    tasks: dict[str, TaskScore] = field(default_factory=dict)
    ppl: dict[str, Any] | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    logliks: dict[str, list[list[float]]] = field(default_factory=dict)  # per task, per item, per choice


@dataclass(frozen=True)
class Target:
    """One model of a report: its label, what the engine loads and how.

    path: a model directory, or a GGUF file for engine="llama.cpp".
    engine: None takes EvalSettings.engine.
    env: variables set while the engine starts and runs (ANYCHIP_HEAD=int8 for the INT8-head variant).
    tokenizer: the Hugging Face tokenizer directory (llama.cpp: the BF16 source the GGUF was made from).
    baseline: the label this one's delta is taken against ("" for none).
    """

    label: str
    path: Path
    engine: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    tokenizer: Path | None = None
    baseline: str = ""


def as_target(model: Path | Target) -> Target:
    """A model directory as the Target of its own name (a Target as it is)."""
    return model if isinstance(model, Target) else Target(Path(model).name, Path(model))


def given_bf16(compare_bf16: bool | Path) -> Path | None:
    """The BF16 source's folder --bf16 named (compare_bf16 is then that path), None to use the recorded one."""
    return compare_bf16 if isinstance(compare_bf16, Path) else None


def bf16_source(model_dir: Path, given: Path | None = None) -> Path:
    """The BF16 directory a W4A8 checkpoint was quantized from (recorded by `anychip quantize`, or `given`: --bf16)."""
    try:
        return ModelDir.open(model_dir).bf16_source(given)
    except ModelDirError as exc:
        msg = str(exc)
        raise ModelDirError(msg if msg.startswith("--bf16") else
                            f"{'--bf16' if given is not None else '--compare-bf16'}: {msg}") from None


def make_engine(target: Target, settings: EvalSettings):
    engine = target.engine or settings.engine
    if engine == "vllm":
        from anychip.eval.engines import VllmEngine

        return VllmEngine(target.path, max_len=settings.max_len)
    if engine == LLAMA_CPP:
        from anychip.eval.llama_cpp_engine import LlamaCppEngine

        return LlamaCppEngine(target.path, target.tokenizer or target.path.parent, max_len=settings.max_len,
                              threads=settings.threads)
    from anychip.eval.engines import TorchEngine

    return TorchEngine.from_dir(target.path, device=settings.device, max_len=settings.max_len)


def evaluate_model(model: Path | Target, task_files: list[Path], text: str | None,
                   settings: EvalSettings) -> ModelResult:
    """Score every task (and the perplexity text, if given) with one engine on `model`, in this process."""
    from anychip.eval.engines import vllm_environment

    target = as_target(model)
    with vllm_environment(), patched_environ(dict(target.env)):
        engine = make_engine(target, settings)
        try:
            return evaluate_engine(engine, str(target.path), task_files, text, settings)
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
        try:
            plan = plan_requests(task.items, PairEncoder(engine.encode, engine.prefix_id))
            seqs, n_cont = zip(*(pair_sequence(p, settings.max_len) for p in plan.pairs))
        except EvalDataError as exc:
            raise EvalDataError(f"{path}: {exc}") from None
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
    if len(tokens) < 2:
        raise EvalDataError(f"{label}: the perplexity text encodes to {len(tokens)} token(s) with this model's "
                            "tokenizer: give a text it can read (--text FILE)")
    windows = rolling_windows(len(tokens), settings.window, settings.stride)
    lps = engine.token_logprobs([tokens[w.start:w.end] for w in windows], desc=f"{label} {PERPLEXITY}")
    nll = -sum(sum(lp[-w.n_scored:]) for lp, w in zip(lps, windows))
    scored = sum(w.n_scored for w in windows)
    return {"ppl": perplexity(-nll, scored), "nll_per_token": nll / scored, "tokens": scored, "windows": len(windows)}


def evaluate_isolated(model: Path | Target, task_files: list[Path], text: str | None,
                      settings: EvalSettings) -> ModelResult:
    """evaluate_model in a fresh spawned process; its memory and engine state go when it returns."""
    result = evaluate_all([model], task_files, text, settings)[0]
    if isinstance(result, ModelProcessDied):
        raise result
    return result


class ModelProcessDied(AnychipError):
    """A model's evaluation process ended without a result (killed by a signal: a crashing engine)."""


def evaluate_all(models: list[Path | Target], task_files: list[Path], text: str | None,
                 settings: EvalSettings, evaluate=None) -> list[ModelResult | ModelProcessDied]:
    """evaluate_model (or `evaluate`, a picklable function of the same arguments) for each model,
    `settings.jobs` at a time, each in a fresh spawned process of its own (its memory and engine state go when it
    returns); results in the order of `models`. A process that dies without a result (an engine that crashes)
    costs only its own model: its place holds the ModelProcessDied that says how it ended. An exception raised
    inside a model's process is raised here."""
    with ThreadPoolExecutor(max_workers=settings.jobs) as pool:
        futures = [pool.submit(_in_own_process, evaluate or evaluate_model, m, task_files, text, settings)
                   for m in models]
        return [f.result() for f in futures]


def _in_own_process(evaluate, model: Path | Target, task_files: list[Path], text: str | None,
                    settings: EvalSettings) -> ModelResult | ModelProcessDied:
    from anychip.bench.peers import exit_reason

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, evaluate, model, task_files, text, settings))
    proc.start()
    send.close()  # the child holds the only writer: its death reads here as EOF
    try:
        ok, value = receive.recv()
    except EOFError:
        proc.join()
        target = as_target(model)
        engine = target.engine or settings.engine
        return ModelProcessDied(f"{target.label}: its evaluation process {exit_reason(proc.exitcode or 0, engine)} "
                                "before it returned a result")
    finally:
        receive.close()
    proc.join()
    if not ok:
        raise value
    return value


def _child(send, evaluate, model, task_files, text, settings) -> None:
    try:
        send.send((True, evaluate(model, task_files, text, settings)))
    except BaseException as exc:  # noqa: BLE001 -- carried to the parent, which raises it
        try:
            send.send((False, exc))
        except Exception:  # noqa: BLE001 -- an exception that does not pickle
            send.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
    finally:
        send.close()


def report_pairs(labels: list[str], baselines: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(model, base) pairs the report gives deltas for: W4A8 - BF16, each Target's own baseline, and W4A8 -
    each llama.cpp peer (the peer quantizes the same BF16 weights)."""
    pairs = [("w4a8", "bf16")] if "w4a8" in labels and "bf16" in labels else []
    pairs += [(label, base) for label, base in (baselines or {}).items() if base and base in labels]
    if "w4a8" in labels:
        pairs += [("w4a8", label) for label in labels if label.startswith(LLAMA_CPP)]
    return list(dict.fromkeys(pairs))


def _ppl_delta(model: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    ratio = model["ppl"] / base["ppl"]
    return {"ppl_ratio": ratio, "ppl_increase_pct": 100.0 * (ratio - 1.0)}


def build_report(results: dict[str, ModelResult], settings: EvalSettings, extra: dict[str, Any],
                 baselines: dict[str, str] | None = None) -> dict[str, Any]:
    """The JSON report: per task, each model's summary and the deltas of report_pairs ("delta": W4A8 - BF16;
    "deltas": {"A - B": ...} for every pair); per task and model, the items' 0/1 outcomes as strings (to pair
    them with another report's)."""
    pairs = report_pairs(list(results), baselines)
    tasks: dict[str, Any] = {}
    items: dict[str, Any] = {}
    names = list(next(iter(results.values())).tasks)
    for name in names:
        entry: dict[str, Any] = {label: r.tasks[name].summary() for label, r in results.items()}
        deltas = {f"{a} - {b}": {**compare(results[a].tasks[name], results[b].tasks[name]),
                                 "mean_abs_loglik_diff": _mean_abs_diff(results[a].logliks.get(name),
                                                                        results[b].logliks.get(name))}
                  for a, b in pairs}
        if ("w4a8", "bf16") in pairs:
            entry["delta"] = deltas["w4a8 - bf16"]
        if deltas:
            entry["deltas"] = deltas
        tasks[name] = entry
        items[name] = {label: {"acc": _bits(r.tasks[name].acc_items), "acc_norm": _bits(r.tasks[name].acc_norm_items)}
                       for label, r in results.items()}
    if all(r.ppl is not None for r in results.values()):
        entry = {label: r.ppl for label, r in results.items()}
        deltas = {f"{a} - {b}": _ppl_delta(results[a].ppl, results[b].ppl) for a, b in pairs}  # type: ignore[arg-type]
        if ("w4a8", "bf16") in pairs:
            entry["delta"] = deltas["w4a8 - bf16"]
        if deltas:
            entry["deltas"] = deltas
        tasks[PERPLEXITY] = entry
    return {
        "models": {label: r.model for label, r in results.items()},
        "settings": asdict(settings),
        **extra,
        "ci": "delta = A - B in accuracy units (W4A8 - BF16 unless named); acc*_ci95: paired per-item differences, "
              "normal approximation (mean +- 1.96 * sd(ddof=1) / sqrt(n))",
        "tasks": tasks,
        "items": items,
        "seconds": {label: r.seconds for label, r in results.items()},
    }


def _mean_abs_diff(a: list[list[float]] | None, b: list[list[float]] | None) -> float | None:
    """Mean |loglik difference| over every choice of every item (nats): how far apart two engines score."""
    if not a or not b:
        return None
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(diffs) / len(diffs) if diffs else None


def _bits(outcomes: tuple[float, ...]) -> str:
    return "".join("1" if x else "0" for x in outcomes)


_NOT_MODELS = ("delta", "deltas")


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table of the report (accuracies in percent)."""
    labels = list(report["models"])
    w = max(6, *(len(label) for label in labels))
    t = max([18, *(len(name) for name in report["tasks"])])  # the task column fits the longest name
    lines = [f"{'task':<{t}} {'model':<{w}} {'acc':>7} {'acc_norm':>9} {'n':>6}   delta's paired 95% CI: acc, "
             "acc_norm"]
    for name, entry in report["tasks"].items():
        for label in [x for x in entry if x not in _NOT_MODELS]:
            m = entry[label]
            if name == PERPLEXITY:
                lines.append(f"{name:<{t}} {label:<{w}} ppl {m['ppl']:.4f} over {m['tokens']} tokens")
                continue
            lines.append(f"{name:<{t}} {label:<{w}} {100 * m['acc']:7.2f} {100 * m['acc_norm']:9.2f} {m['n']:>6}")
        deltas = entry.get("deltas") or ({"w4a8 - bf16": entry["delta"]} if "delta" in entry else {})
        for pair, d in deltas.items():
            if name == PERPLEXITY:
                lines.append(f"{'':<{t}} {'delta':<{w}} ppl {d['ppl_increase_pct']:+.2f}%  ({pair})")
                continue
            cis = "  ".join(f"[{_pct(lo)}, {_pct(hi)}]" for lo, hi in (d.get("acc_ci95", (math.nan,) * 2),
                                                                         d["acc_norm_ci95"]))
            flat = (" (no item scored differently: a CI of zero width)"
                    if d.get("acc_discordant") == 0 and d.get("acc_norm_discordant") == 0 else "")
            lines.append(f"{'':<{t}} {'delta':<{w}} {100 * d['acc']:+7.2f} {100 * d['acc_norm']:+9.2f}"
                         f"          {cis}  ({pair}){flat}")
    lines += [f"not evaluated: {reason}" for reason in report.get("failed", {}).values()]
    return "\n".join(lines)


def _pct(x: float) -> str:
    return "nan" if math.isnan(x) else f"{100 * x:+.2f}"


def models_to_evaluate(model: Path, compare_bf16: bool | Path) -> dict[str, Path]:
    """{"w4a8", "bf16" or another quant_method: model}, and with compare_bf16 {"bf16": the source it was quantized
    from} too (compare_bf16 a path: the source is there, --bf16)."""
    md = ModelDir.open(model)
    label = ("w4a8" if md.made_by_anychip else {"bf16": "bf16", "w4a8": "w4a8", "synthetic": "w4a8"}.get(md.kind)
             or md.quant_method or "quantized")
    models = {label: model}  # a model quantized some other way is labelled by its quant_method, not as W4A8
    if compare_bf16:
        models["bf16"] = bf16_source(model, given_bf16(compare_bf16))
    return models


def targets_to_evaluate(model: Path, compare_bf16: bool | Path, head_int8: bool = False,
                        llama_cpp: list[str] | None = None) -> list[Target]:
    """The report's models: `model` (and its BF16 source), `model` with the INT8 head (ANYCHIP_HEAD=int8), and
    llama.cpp GGUFs of the BF16 source in each file type of `llama_cpp` (made once with llama.cpp's quantizer)."""
    targets = [Target(label, path) for label, path in models_to_evaluate(model, compare_bf16).items()]
    own = targets[0].label
    if head_int8:
        targets.append(Target(own + HEAD_INT8, model, env=((ANYCHIP_HEAD, "int8"),), baseline=own))
    if llama_cpp:
        from anychip.eval.llama_cpp_engine import gguf_for

        bf16 = model if own == "bf16" else bf16_source(model, given_bf16(compare_bf16))
        for ftype in llama_cpp:
            targets.append(Target(f"{LLAMA_CPP}-{ftype}", gguf_for(bf16, ftype), engine=LLAMA_CPP, tokenizer=bf16,
                                  baseline="bf16"))
    return targets


def model_context(model_dir: Path) -> int | None:
    """The longest sequence a model directory's config.json allows (max_position_embeddings), None if unsaid."""
    try:
        value = ModelDir.open(model_dir).config.get("max_position_embeddings")
    except ModelDirError:
        return None
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 2 else None


def fit_context(settings: EvalSettings, model_dirs: list[Path]) -> EvalSettings:
    """`settings` with max_len below the shortest context of `model_dirs` (vLLM refuses a longer max_model_len, and
    scores a sequence as a prompt plus one generated token: max_len + 1 positions), and the perplexity window and
    stride shrunk to fit (stride at most half the window, as by default); the report's settings record what was
    used, the same for every model of a report."""
    contexts = [c for c in map(model_context, model_dirs) if c is not None]
    if not contexts or min(contexts) > settings.max_len:
        return settings
    ctx = min(contexts)
    max_len = ctx - 1
    window = min(settings.window, max_len)
    stride = min(settings.stride, max(1, window // 2))
    print(f"anychip eval: the model's context is {ctx} tokens: sequences are cut to {max_len}, perplexity windows "
          f"of {window} tokens with stride {stride}", file=sys.stderr)
    return replace(settings, max_len=max_len, window=window, stride=stride)


def check_choices_fit(tasks: list[Task], max_len: int, tokenizer_dir: Path) -> None:
    """A choice longer than the window (requests.pair_sequence refuses it) named before any engine starts. Only
    choices of at least max_len - 4 UTF-8 bytes can be that long (a token covers at least one byte; the margin
    takes a context's trailing spaces, moved into the choice, and a merged boundary token), so only those are
    tokenized, with the model's own tokenizer; one that transformers cannot load leaves the check to the engine."""
    long = [(task, item, ctx, cont) for task in tasks for item in task.items for ctx, cont in item.requests()
            if len(cont.encode()) + len(ctx) - len(ctx.rstrip()) + 4 >= max_len]
    if not long:
        return
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except Exception:  # noqa: BLE001 -- the engine's own tokenizer checks it later
        return
    encoder = PairEncoder(lambda text: tokenizer.encode(text, add_special_tokens=False), prefix_id=0)
    for task, item, ctx, cont in long:
        n = len(encoder(ctx, cont)[1])
        if n >= max_len:
            raise EvalDataError(f"{task.path}: item {item.id}: a choice of {n} tokens does not fit the model's "
                                f"{max_len}-token window: shorten it (a choice is scored whole; only its context is "
                                "cut from the left)")


def verify_model(model: Path, mode: str) -> None:
    """Verify a W4A8 model before scoring it (checkpoint.verify.verify_before_use), saying so."""
    from anychip.checkpoint.verify import verify_before_use

    said = verify_before_use(model, mode, "eval")
    if said:  # on stderr, as the engine's log: stdout holds the results table alone
        print(said, file=sys.stderr, flush=True)


def run_eval(model: Path, task_names: list[str] | None, data: str | None, settings: EvalSettings,
             compare_bf16: bool | Path, text_path: str | None, head_int8: bool = False,
             llama_cpp: list[str] | None = None, verify: str = "full") -> dict[str, Any]:
    """Resolve data, evaluate the model (its BF16 source, its INT8-head variant, llama.cpp peers), return the
    report."""
    needs_data = task_names is None or any(n != PERPLEXITY for n in task_names)
    data_dir = resolve_data_dir(data) if needs_data else None
    task_files, want_ppl = select_tasks(task_names, data_dir)
    tasks = [load_task(path, settings.limit) for path in task_files]  # bad data named before any engine starts
    text_file, text = load_text(text_path) if want_ppl else (None, None)
    verify_model(model, verify)  # after the data (named first), before any engine
    targets = targets_to_evaluate(model, compare_bf16, head_int8, llama_cpp)
    settings = fit_context(settings, [t.path for t in targets if t.path.is_dir()])
    check_choices_fit(tasks, settings.max_len, targets[0].tokenizer or targets[0].path)
    # round-robin over engines, so that with --jobs 2 a vLLM model and a llama.cpp one share the machine
    kinds = [t.engine or settings.engine for t in targets]
    order = sorted(range(len(targets)), key=lambda i: kinds[:i].count(kinds[i]))
    done = dict(zip(order, evaluate_all([targets[i] for i in order], task_files, text, settings)))
    died = {t.label: str(done[i]) for i, t in enumerate(targets) if isinstance(done[i], ModelProcessDied)}
    if targets[0].label in died:  # the model under evaluation itself: nothing to report
        raise ModelProcessDied(died[targets[0].label])
    results = {t.label: done[i] for i, t in enumerate(targets) if t.label not in died}
    extra = {"data": data_source(data_dir, task_files), "text": str(text_file) if text_file else None,
             "engines": {t.label: {"engine": t.engine or settings.engine, "env": dict(t.env),
                                   "tokenizer": str(t.tokenizer or t.path)} for t in targets}}
    if died:
        extra["failed"] = died
    return build_report(results, settings, extra, {t.label: t.baseline for t in targets if t.label not in died})


def _no_nan(value: Any) -> Any:
    """The report with every NaN (a stderr of one item, say) as null: NaN is not JSON, and strict parsers refuse it."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value


def check_output(path: str | None) -> None:
    """--json must be writable as a file: checked before the engines run, not after the work is done."""
    if path:
        from anychip.bench.report import check_report_file

        check_report_file(path, "eval.json", EvalDataError)


def write_report(path: str | None, report: dict[str, Any]) -> None:
    """The report as JSON at --json (checked first by check_output), NaN written as null."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(_no_nan(report), indent=2) + "\n")
        print(f"wrote {path}")


def cmd_eval(args: argparse.Namespace) -> int:
    check_output(args.json)
    settings = EvalSettings(limit=args.limit, threads=getattr(args, "threads", None), jobs=getattr(args, "jobs", 1))
    model = Path(args.model).expanduser().resolve()  # recorded as the BF16 source is: absolute
    report = run_eval(model, args.tasks, args.data, settings, args.compare_bf16, args.text,
                      head_int8=getattr(args, "head_int8", False), llama_cpp=getattr(args, "llama_cpp", None),
                      verify=getattr(args, "verify", "full"))
    report["command"] = "anychip " + " ".join(getattr(args, "argv", None) or sys.argv[1:])
    print(format_report(report))
    write_report(args.json, report)
    for reason in report.get("failed", {}).values():
        print(f"anychip eval: not in the report: {reason}", file=sys.stderr)
    return 1 if report.get("failed") else 0
