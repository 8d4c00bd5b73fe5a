"""SHA256SUMS: every file of a checkpoint directory, in exactly the format `sha256sum -c` reads."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tqdm import tqdm

from anychip.errors import AnychipError

MANIFEST = "SHA256SUMS"
_CHUNK = 1 << 20


class ManifestError(AnychipError):
    """A checksum does not match, or a file is missing from the directory or from SHA256SUMS."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


#: What tools put beside a checkpoint's files, never read by anychip or vLLM, so neither listed nor required:
#: `hf download --local-dir`'s metadata, a git clone's (the Hub adds .gitattributes to every uploaded repo), and
#: macOS Finder's. A SHA256SUMS that does list one of them is still checked against it.
IGNORED_DIRS = (".cache/huggingface/", ".git/")
IGNORED_NAMES = (".gitattributes", ".DS_Store")


def ignored(rel: str) -> bool:
    """Whether the relative POSIX path `rel` is tool metadata (IGNORED_DIRS, IGNORED_NAMES)."""
    return rel.startswith(IGNORED_DIRS) or rel.rsplit("/", 1)[-1] in IGNORED_NAMES


def listed_files(directory: Path, with_ignored: bool = False) -> list[str]:
    """Every regular file under `directory` except SHA256SUMS (and, unless with_ignored, the tool metadata
    `ignored` names), as sorted POSIX relative paths."""
    names = []
    for path in directory.rglob("*"):
        rel = path.relative_to(directory).as_posix()
        if path.is_file() and rel != MANIFEST and (with_ignored or not ignored(rel)):
            if any(c in rel for c in "\n\\"):
                raise ManifestError(f"{path}: file names with newlines or backslashes cannot go in {MANIFEST}")
            names.append(rel)
    return sorted(names)


def _hash_all(directory: Path, names: list[str], desc: str) -> dict[str, str]:
    total = sum((directory / n).stat().st_size for n in names)
    digests = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False, disable=total < (64 << 20)) as bar:
        for name in names:
            digests[name] = sha256_file(directory / name)
            bar.update((directory / name).stat().st_size)
    return digests


def write_manifest(directory: Path) -> Path:
    """Write `directory/SHA256SUMS` over every other file; `sha256sum -c SHA256SUMS` passes in `directory`."""
    digests = _hash_all(directory, listed_files(directory), "sha256")
    path = directory / MANIFEST
    path.write_text("".join(f"{hexd}  {name}\n" for name, hexd in digests.items()))
    return path


def read_manifest(directory: Path) -> dict[str, str]:
    path = directory / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{path} is missing: this directory was not written by anychip, or was changed "
                            "since (re-create it with `anychip quantize` or `anychip prepare --force`); a W4A8 "
                            f"checkpoint made by another tool: `anychip verify --write-sums {directory}` checks it "
                            "and records its checksums")
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path}: not a text file ({exc}): re-create it (`sha256sum` lines)") from exc
    entries: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):  # blank lines and comments, as `sha256sum -c` skips them
            continue
        hexd, sep, name = line.partition("  ")
        if not sep:
            hexd, sep, name = line.partition(" *")  # sha256sum's binary-mode marker
        if not sep or len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd.lower()) or not name:
            raise ManifestError(f"{path}:{lineno}: not a `sha256sum` line: {line[:80]!r}")
        name = name.removeprefix("./")  # `find . -type f -exec sha256sum {} +` writes ./name
        if name in entries:
            raise ManifestError(f"{path}:{lineno}: {name} is listed twice: a SHA256SUMS with two checksums for "
                                "one file cannot vouch for it (re-create it: `anychip verify --write-sums`)")
        entries[name] = hexd.lower()
    return entries


def check_manifest(directory: Path, expect: dict[str, str] | None = None) -> dict[str, str]:
    """Check every listed checksum, that every file is listed, and the `expect`ed digests; returns the digests."""
    entries = read_manifest(directory)
    present = listed_files(directory)
    unlisted = sorted(set(present) - set(entries))
    if unlisted:
        raise ManifestError(f"{directory / unlisted[0]} is not listed in {MANIFEST}: a file was added after the "
                            "checkpoint was written (remove it, or re-create the checkpoint)")
    missing = sorted(set(entries) - set(listed_files(directory, with_ignored=True)))
    if missing:
        raise ManifestError(f"{directory / missing[0]} is listed in {MANIFEST} but missing: re-create the checkpoint")
    for name, want in (expect or {}).items():
        if name not in entries:
            raise ManifestError(f"--expect-sha256 {name}: no such file in {MANIFEST} of {directory}")
        if entries[name] != want.lower():
            raise ManifestError(f"{directory / name}: {MANIFEST} says {entries[name]}, but {want} was expected: "
                                "this is not the checkpoint you asked for")
    actual = _hash_all(directory, sorted(entries), "verify sha256")
    for name, want in entries.items():
        if actual[name] != want:
            raise ManifestError(f"{directory / name}: sha256 {actual[name]} does not match {MANIFEST} ({want}): "
                                "the file is corrupt or was changed; re-create the checkpoint")
    return actual
