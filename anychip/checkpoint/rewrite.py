"""Stream a checkpoint into a new one, tensor by tensor: the one writer behind format conversion
(pack-quantized <-> int-quantized) and the benchmark peers' derived copies (W8A8, int-quantized W4A8).

A rewrite is a plan (each source tensor -> the specs it becomes) and the values (each source tensor -> the
tensors it becomes); the destination appears atomically, with the source's side files and a stamp of the
source files, so a cached copy is rebuilt when its source changes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from anychip.checkpoint.io import ShardedWriter, TensorInfo, atomic_directory, copy_side_files, read_tensor_infos
from anychip.checkpoint.layout import TensorSpec, tensor_order
from anychip.checkpoint.manifest import write_manifest

#: Records what a derived copy was made from (kind and the source files' names, sizes and mtimes).
STAMP = "anychip-derived.json"
Plan = Callable[[TensorInfo], list[TensorSpec]]
Values = Callable[[TensorInfo, Callable[[str], torch.Tensor]], Iterator[torch.Tensor]]


def source_stamp(src: Path) -> dict[str, Any]:
    files = sorted({info.file for info in read_tensor_infos(src).values()})
    return {"source": str(src), "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


def is_cached(dst: Path, src: Path, kind: str) -> bool:
    """True when `dst` is a complete copy of kind `kind` made from `src` as it is now."""
    try:
        stamp = json.loads((dst / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("kind") == kind and stamp.get("stamp") == source_stamp(src)


def rewrite_checkpoint(src: Path, dst: Path, kind: str, config: dict[str, Any], plan: Plan, values: Values,
                       *, overwrite: bool = False, checksums: bool = True) -> Path:
    """Stream every tensor of `src` through `plan` and `values` into `dst` (atomically), with `config` as its
    config.json, the source's side files, a stamp, and SHA256SUMS when `checksums`."""
    infos = read_tensor_infos(src)
    steps = [(infos[name], plan(infos[name])) for name in sorted(infos, key=tensor_order)]
    specs = [spec for _, outs in steps for spec in outs]
    with atomic_directory(dst, overwrite=overwrite) as tmp, ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def reader(info: TensorInfo) -> Callable[[str], torch.Tensor]:
            if info.file not in handles:
                handles[info.file] = stack.enter_context(safe_open(str(info.file), framework="pt"))
            return lambda name: handles[info.file].get_tensor(name)

        with ShardedWriter(tmp, specs) as writer:
            for info, outs in steps:
                for spec, tensor in zip(outs, values(info, reader(info)), strict=True):
                    writer.write(spec.name, tensor)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_side_files(src, tmp, skip={STAMP})
        (tmp / STAMP).write_text(json.dumps({"kind": kind, "stamp": source_stamp(src)}, indent=1) + "\n")
        if checksums:
            write_manifest(tmp)
    return dst
