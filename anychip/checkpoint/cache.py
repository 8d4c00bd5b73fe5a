"""The model cache's bookkeeping: a lock per model, and "done" markers that let work be reused.

A marker sits beside its directory (`<dir>.done.json`, outside it, so SHA256SUMS stays exactly the files of
the checkpoint). It records the recipe that built the directory and the digest of the directory's SHA256SUMS;
a directory is reused only when the recipe matches, the digest matches and verification passes.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from anychip.checkpoint.manifest import MANIFEST, sha256_file
from anychip.errors import AnychipError


def private_dir(path: Path) -> Path:
    """`mkdir -p path`, each directory it creates user-only (0700): caches hold models and reports of what a user
    ran, which other users of the machine have no business reading or replacing. Existing ones are left alone."""
    path = Path(path)
    missing = []
    at = path
    while not at.exists():
        missing.append(at)
        at = at.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)  # mkdir's mode passes through the umask
    return path


def marker_path(directory: Path) -> Path:
    return directory.parent / f"{directory.name}.done.json"


@contextmanager
def cache_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on `directory` (a model's folder in the cache) so concurrent prepares queue."""
    private_dir(directory)
    with open(directory / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"anychip: waiting for another prepare to finish with {directory}", file=sys.stderr)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def is_done(directory: Path, recipe: dict[str, Any], verify: Callable[[Path], object]) -> bool:
    """True when `directory` was built by `recipe`, is unchanged since, and `verify(directory)` passes."""
    marker = marker_path(directory)
    if not marker.is_file() or not (directory / MANIFEST).is_file():
        return False
    try:
        done = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    if done.get("recipe") != recipe or done.get("manifest_sha256") != sha256_file(directory / MANIFEST):
        return False
    try:
        verify(directory)
    except AnychipError as exc:
        print(f"anychip: cached {directory} fails verification, rebuilding: {exc}", file=sys.stderr)
        return False
    return True


def mark_done(directory: Path, recipe: dict[str, Any]) -> None:
    data = {"recipe": recipe, "manifest_sha256": sha256_file(directory / MANIFEST)}
    marker_path(directory).write_text(json.dumps(data, indent=2) + "\n")


def clear_done(directory: Path) -> None:
    marker_path(directory).unlink(missing_ok=True)
