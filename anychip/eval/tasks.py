"""Evaluation data: multiple-choice tasks (*.jsonl) and perplexity texts, found and parsed with file:line errors.

Two item shapes, both accepted in any file (see shared/evaldata/README.md):
  standard  {"id", "context": str, "choices": [str, ...], "label": int}      loglik(choice_i | context)
  partial   {"id", "contexts": [str, ...], "continuation": str, "label": int} loglik(continuation | context_i)
Every choice / continuation string already carries lm-eval's target delimiter (a leading space).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from anychip.envs import ANYCHIP_EVALDATA
from anychip.errors import AnychipError

#: The task name that selects perplexity instead of a *.jsonl file.
PERPLEXITY = "perplexity"
#: Shipped public-domain text for perplexity (provenance: anychip/data/README.md).
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "data" / "kjv_mark.txt"


class EvalDataError(AnychipError, ValueError):
    """Missing or malformed evaluation data; the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class Item:
    """One multiple-choice item as (context, continuation) pairs, one per choice, whatever its shape."""

    id: str
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    label: int

    @property
    def lengths(self) -> tuple[int, ...]:
        """acc_norm denominators: UTF-8 bytes of each choice's scored string."""
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
    elif "contexts" in obj:
        contexts_raw, cont = obj["contexts"], obj.get("continuation")
        if not _strings(contexts_raw) or not isinstance(cont, str):
            raise EvalDataError(f"{where}: a partial item needs 'contexts' (non-empty list of str) and "
                                "'continuation' (str)")
        contexts, continuations = tuple(contexts_raw), (cont,) * len(contexts_raw)
    else:
        raise EvalDataError(f"{where}: item has neither 'choices' (standard shape) nor 'contexts' (partial shape)")
    if not 0 <= label < len(contexts):
        raise EvalDataError(f"{where}: label {label} out of range for {len(contexts)} choices")
    return Item(item_id, contexts, continuations, label)


def _strings(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def load_task(path: Path, limit: int | None = None) -> Task:
    """The first `limit` items (all when None) of a *.jsonl task file, as lm-eval's --limit takes them."""
    if limit is not None and limit < 1:
        raise EvalDataError(f"--limit {limit}: must be at least 1")
    items: list[Item] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EvalDataError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
            items.append(parse_item(obj, f"{path}:{lineno}"))
    if not items:
        raise EvalDataError(f"{path}: no items")
    return Task(path.stem, path, tuple(items))


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def resolve_data_dir(explicit: str | Path | None = None) -> Path:
    """--data, else $ANYCHIP_EVALDATA, else shared/evaldata inside or beside the checkout."""
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
    root = _repo_root()
    candidates = [root / "shared" / "evaldata", root.parent / "shared" / "evaldata"]
    for path in candidates:
        if path.is_dir():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise EvalDataError(f"no evaluation data found (tried {tried}): pass --data DIR (a folder of *.jsonl tasks) "
                        f"or set ${ANYCHIP_EVALDATA}")


def available_tasks(data_dir: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(data_dir.glob("*.jsonl"))}


def select_tasks(names: list[str] | None, data_dir: Path | None) -> tuple[list[Path], bool]:
    """Task files to run and whether perplexity was asked for. None: every *.jsonl in data_dir, plus perplexity."""
    if names is None:
        files = available_tasks(data_dir) if data_dir is not None else {}
        return list(files.values()), True
    want_ppl = PERPLEXITY in names
    mc = [n for n in names if n != PERPLEXITY]
    if not mc:
        return [], want_ppl
    if data_dir is None:
        raise EvalDataError("multiple-choice tasks need a data directory: pass --data DIR")
    files = available_tasks(data_dir)
    missing = [n for n in mc if n not in files]
    if missing:
        raise EvalDataError(f"--tasks {','.join(missing)}: no such file in {data_dir}; available: "
                            f"{', '.join(list(files) + [PERPLEXITY])}")
    return [files[n] for n in mc], want_ppl


def load_text(path: str | Path | None) -> tuple[Path, str]:
    """The perplexity text (default: the shipped KJV Gospel of Mark)."""
    p = Path(path).expanduser() if path else DEFAULT_TEXT
    if not p.is_file():
        raise EvalDataError(f"--text {p}: no such file")
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise EvalDataError(f"--text {p}: empty")
    return p, text
