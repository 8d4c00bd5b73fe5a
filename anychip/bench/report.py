"""Writing a benchmark's results: JSON, a Markdown table with the same stem, PNG plots beside them.

Shared by `bench latency` and `bench serve`; each supplies its rows, table and plot function.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from anychip.errors import AnychipError


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as a user would type it: `anychip bench ...`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return "anychip " + shlex.join(argv)


def source_notes(machine_doc: dict[str, Any], rows: Sequence[dict[str, Any]] = (), name: str = "system") -> list[str]:
    """Markdown notes naming the commit measured (and uncommitted anychip files), plus one per row that an earlier
    run measured at another commit (rows merged with --append carry their own `source`)."""
    def note(src: dict[str, Any]) -> str:
        dirty = src.get("uncommitted") or []
        return f"anychip at commit {src.get('commit')}" + (f", with uncommitted changes in {', '.join(dirty)}"
                                                            if dirty else "")

    src = machine_doc.get("source") or {}
    notes = [f"- {note(src)}"] if src else []
    seen = set()
    for r in rows:
        key = (r.get(name), json.dumps(r.get("source"), sort_keys=True))
        if r.get("source") and r["source"] != src and key not in seen:
            seen.add(key)
            notes.append(f"- {r.get(name)} (measured {r.get('measured_at')}): {note(r['source'])}")
    return notes


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.{digits}f}"


def fmt_sig(x: float | None, digits: int = 4) -> str:
    """x to `digits` significant digits, for ratios of very different scales (TTFT efficiency is about 1e-4)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}g}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 1) -> str:
    """A GitHub table: the first `text_columns` columns left-aligned, the numbers right-aligned."""
    right = ["---" if i < text_columns else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(right) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def check_json_path(path: str | Path | None) -> None:
    """--json names a file this run can write, and not the Markdown or plot that go beside it (same stem, .md and
    .png): checked before any measurement, which a bad path would otherwise lose at its end."""
    if not path:
        return
    path = Path(path)
    if path.suffix.lower() in (".md", ".png"):
        raise AnychipError(f"--json {path}: the report's Markdown and plot are written beside the JSON as "
                           f"{path.stem}.md and {path.stem}.png, so this name would be overwritten: name the JSON "
                           f"file (e.g. {path.with_suffix('.json')})")
    check_report_file(path, "bench.json")


def check_report_file(path: str | Path, example: str, error: type[Exception] = AnychipError) -> None:
    """--json `path` can be written as a file (not a folder; its nearest existing folder writable), else `error`:
    checked before the work whose report it is (bench and eval alike)."""
    path = Path(path)
    if path.is_dir():
        raise error(f"--json {path}: is a folder; name the report's file (e.g. {path / example})")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise error(f"--json {path}: {parent} is not a writable folder")


def read_report_to_append(path: Path, benchmark: str, is_one: Callable[[dict[str, Any]], bool]
                          ) -> dict[str, Any] | None:
    """--append's earlier `benchmark` report at `path` (None when there is none yet); an error naming the file
    when it is not JSON or `is_one` says it is not such a report (checked before measuring: a corrupt file was
    silently overwritten, a report of another benchmark failed after the run)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AnychipError(f"--append {path}: not a bench {benchmark} report ({exc}): name another --json, or move "
                           "that file away") from None
    if not isinstance(doc, dict) or not is_one(doc):
        raise AnychipError(f"--append {path}: not a bench {benchmark} report (its benchmark is "
                           f"{doc.get('benchmark') if isinstance(doc, dict) else type(doc).__name__!r})")
    return doc


def write_outputs(json_path: Path, doc: dict[str, Any], markdown: str,
                  plot: Callable[[dict[str, Any], Path], None] | None = None) -> list[Path]:
    """Write doc as JSON, markdown as the same stem .md, and plot(doc, stem.png). Returns the paths written.
    A failing plot is reported, not fatal: the numbers matter more than the picture."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(_clean(doc), indent=1, default=_jsonable, allow_nan=False) + "\n")
    md = json_path.with_suffix(".md")
    md.write_text(markdown.rstrip() + "\n")
    written = [json_path, md]
    if plot is not None:
        png = json_path.with_suffix(".png")
        try:
            import matplotlib

            matplotlib.use("Agg")
            plot(doc, png)
            written.append(png)
        except Exception as exc:  # matplotlib missing or a plot bug: keep the numbers
            print(f"anychip bench: plot {png} not written: {type(exc).__name__}: {exc}", file=sys.stderr)
    return written


def _clean(x: Any) -> Any:
    """NaN and infinities become null, so the JSON is strict (readable by any parser)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "as_dict"):
        return _clean(x.as_dict())
    return x


def _jsonable(x: Any) -> Any:
    if hasattr(x, "as_dict"):
        return x.as_dict()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
