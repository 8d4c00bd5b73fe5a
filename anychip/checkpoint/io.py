"""Safetensors on disk without loading whole models: header reads, a streaming sharded writer, atomic directories.

The writer is planned: the caller names every tensor (dtype, shape) up front, so each shard's header is written
first and tensors are then streamed into place one at a time. Memory stays at one tensor however large the model.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from anychip.checkpoint.layout import TensorSpec
from anychip.errors import AnychipError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 2_000_000_000
_MAX_HEADER = 100_000_000

#: safetensors dtype codes <-> torch dtypes (the ones a Llama checkpoint can hold).
ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
ST_CODES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}


class CheckpointFileError(AnychipError):
    """A weights file or index is missing, truncated or malformed; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it; `start`/`end` are absolute byte offsets in `file`."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return ST_DTYPES.get(self.dtype)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one .safetensors header and check it against the file's size (catches truncation) and its own
    layout: the tensors' byte ranges, sorted by offset, tile the data section exactly (no gap, no overlap)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointFileError(f"{path}: {size} bytes is too short for a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointFileError(f"{path}: header length {n} exceeds the file ({size} bytes): truncated?")
            text = f.read(n)
            if not text.startswith(b"{"):  # as the safetensors library requires (json.loads would skip a BOM)
                raise CheckpointFileError(f"{path}: the safetensors header does not start with '{{' "
                                          f"(starts {text[:8]!r}): the safetensors library refuses it")
            header = json.loads(text.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointFileError(f"{path}: unreadable safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object")
    base, infos = 8 + n, {}
    for name, h in header.items():
        if name == "__metadata__":
            if not isinstance(h, dict) or not all(isinstance(v, str) for v in h.values()):
                raise CheckpointFileError(f"{path}: __metadata__ must map strings to strings, got {h!r:.80}")
            continue
        try:
            dtype, shape, (b, e) = h["dtype"], h["shape"], h["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointFileError(f"{path}: malformed header entry for {name}: want dtype, shape and "
                                      "data_offsets [begin, end]; re-create the file") from exc
        if (not isinstance(dtype, str) or not isinstance(shape, list) or not all(map(_is_count, shape))
                or not _is_count(b) or not _is_count(e) or e < b):
            raise CheckpointFileError(f"{path}: malformed header entry for {name} (dtype {dtype!r}, shape {shape!r}, "
                                      f"data_offsets {h['data_offsets']!r}); re-create the file")
        count = 1
        for d in shape:
            count *= d
        if dtype in _ITEMSIZE and e - b != count * _ITEMSIZE[dtype]:
            raise CheckpointFileError(f"{path}: {name} spans {e - b} bytes but {dtype}{list(shape)} needs "
                                      f"{count * _ITEMSIZE[dtype]}")
        infos[name] = TensorInfo(name, dtype, tuple(shape), path, base + b, base + e)
    _check_tiling(path, infos, base, size)
    return infos


def _check_tiling(path: Path, infos: dict[str, TensorInfo], base: int, size: int) -> None:
    """Sorted by offset, each tensor must start where the previous one ends, from the data start to the end."""
    at, prev = base, None
    for info in sorted(infos.values(), key=lambda i: (i.start, i.end)):
        if info.start != at:
            where = f"after {prev.name}" if prev else "at the start of the data"
            what = (f"overlaps {prev.name} by {at - info.start} bytes" if info.start < at
                    else f"leaves a gap of {info.start - at} bytes {where}")
            raise CheckpointFileError(f"{path}: header offsets of {info.name} {what} (data_offsets "
                                      f"[{info.start - base}, {info.end - base}]): the header is corrupt; "
                                      "re-create the file")
        at, prev = info.end, info
    if at != size:
        raise CheckpointFileError(f"{path}: header describes {at} bytes but the file has {size}: "
                                  f"{'truncated' if size < at else 'trailing bytes'}; re-create it")


def _weight_map(index: Path) -> dict[str, str]:
    """The index's {tensor: shard file name}; shard names must be plain .safetensors names in the same folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CheckpointFileError(f"{index}: malformed index ({exc}); re-create the checkpoint") from exc
    if not isinstance(weight_map, dict):
        raise CheckpointFileError(f"{index}: weight_map is a JSON {type(weight_map).__name__}, not an object")
    if not weight_map:
        raise CheckpointFileError(f"{index}: weight_map is empty: the index lists no tensors; re-create the checkpoint")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(".safetensors") or Path(file).name != file:
            raise CheckpointFileError(f"{index}: {name} maps to {file!r}, not a .safetensors file beside the index")
    return weight_map


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory: those the index names, else model.safetensors."""
    index = directory / INDEX
    if index.exists():
        files = [directory / f for f in sorted(set(_weight_map(index).values()))]
    else:
        files = [directory / SINGLE]
        # vLLM loads every *.safetensors of a folder without an index: one beside model.safetensors would be served
        # unchecked (Mistral's consolidated*.safetensors aside, which vLLM reads in Mistral's format instead)
        mistral = is_mistral_format(directory)
        stray = sorted(p.name for p in directory.glob("*.safetensors") if p.name != SINGLE
                       and not (mistral and p.name.startswith("consolidated")))
        if stray:
            why = ("without the index that names the shards (model.safetensors.index.json)"
                   if not (directory / SINGLE).exists() else "beside model.safetensors, with no index")
            raise CheckpointFileError(f"{directory}: {', '.join(stray[:4])} {why}: vLLM would load every "
                                      "*.safetensors file here; remove the stray files or restore the index")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        pickled = sorted(p.name for p in directory.glob("*.bin") if p.is_file())
        how = (f"; it holds PyTorch pickles ({', '.join(pickled[:3])}): save it as safetensors first, e.g. "
               "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR, safe_serialization=True)"
               if pickled else "; re-create the checkpoint")
        raise CheckpointFileError(f"{directory}: weights file(s) {', '.join(missing)} missing (safetensors weights "
                                  f"are required{how})")
    return files


def read_tensor_infos(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of a model directory, from the headers only; checks the index against the shards."""
    infos: dict[str, TensorInfo] = {}
    for path in weight_files(directory):
        for name, info in read_header(path).items():
            if name in infos:
                raise CheckpointFileError(f"{name} is stored twice: in {infos[name].file.name} and {path.name}")
            infos[name] = info
    index = directory / INDEX
    if index.exists():
        weight_map = _weight_map(index)
        for name, info in infos.items():
            if weight_map.get(name) != info.file.name:
                raise CheckpointFileError(f"{index}: {name} is in {info.file.name} but the index says "
                                          f"{weight_map.get(name)}")
        stray = sorted(set(weight_map) - set(infos))
        if stray:
            raise CheckpointFileError(f"{index}: lists {stray[0]} (and {len(stray) - 1} more) that no shard holds")
    return infos


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """Load one tensor by its header entry (for small tensors such as weight_shape)."""
    dtype = info.torch_dtype
    if dtype is None:
        raise CheckpointFileError(f"{info.file}: {info.name} has unsupported dtype {info.dtype}")
    with open(info.file, "rb") as f:
        f.seek(info.start)
        data = bytearray(f.read(info.nbytes))
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(info.shape) if data else \
        torch.empty(info.shape, dtype=dtype)


def _shard_plan(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


class ShardedWriter:
    """Write tensors, in the planned order, into shards of at most `max_shard_bytes` (one larger tensor gets a
    shard of its own). One shard is `model.safetensors`; several are `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json`. Use as a context manager; `write` each planned tensor once, in order."""

    def __init__(self, directory: Path, specs: list[TensorSpec], max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("ShardedWriter: duplicate tensor names in the plan")
        self.directory = directory
        self.shards = _shard_plan(specs, max_shard_bytes)
        n = len(self.shards)
        self.files = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._queue = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._pos = 0
        self._shard = -1
        self._fh = None

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if exc_type is None:
            self._finish()

    def _open(self, i: int) -> None:
        if self._fh is not None:
            self._fh.close()
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in self.shards[i]:
            header[spec.name] = {"dtype": ST_CODES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._fh = open(self.directory / self.files[i], "wb")
        self._fh.write(struct.pack("<Q", len(raw)) + raw)
        self._shard = i

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self._queue):
            raise ValueError(f"ShardedWriter: {name} was not planned (all planned tensors are written)")
        shard, spec = self._queue[self._pos]
        if name != spec.name:
            raise ValueError(f"ShardedWriter: expected {spec.name} next, got {name}")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{name}: planned {spec.dtype} {list(spec.shape)}, got {tensor.dtype} "
                             f"{list(tensor.shape)}")
        if shard != self._shard:
            self._open(shard)
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._fh.write(memoryview(data))
        self._pos += 1

    def _finish(self) -> None:
        if self._pos != len(self._queue):
            missing = self._queue[self._pos][1].name
            raise ValueError(f"ShardedWriter: closed before writing {missing} "
                             f"({len(self._queue) - self._pos} planned tensors left)")
        if len(self.files) > 1:
            weight_map = {spec.name: self.files[i] for i, spec in self._queue}
            total = sum(spec.nbytes for _, spec in self._queue)
            (self.directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                            "weight_map": weight_map}, indent=2) + "\n")


@contextmanager
def atomic_directory(dst: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `dst` to fill; rename it to `dst` only when the block succeeds.

    An existing `dst` is an error unless `overwrite`, in which case it is replaced only after the new
    directory is complete.
    """
    dst = dst.absolute()
    if dst.exists() and not overwrite:
        raise AnychipError(f"{dst} already exists: remove it or choose another output directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():
            old = dst.parent / f".{dst.name}.old-{os.getpid()}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


#: Files of a model directory that a converted checkpoint must not inherit (weights, config, manifests).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx", ".tflite",
                    ".npz", ".npy", ".pkl", ".pickle")
#: ... nor archives and backup copies (a `pytorch_model.bin.bak` of the BF16 weights doubled a probe's W4A8 folder)
_NOT_COPIED_SUFFIXES = _WEIGHT_SUFFIXES + (".zip", ".tar", ".gz", ".xz", ".zst", ".bak", ".old", ".orig", ".tmp",
                                           ".swp", "~")
_NOT_COPIED_NAMES = {"config.json", INDEX, "pytorch_model.bin.index.json", "SHA256SUMS", "README.md"}


#: Subfolders a model folder's tokenizer owns: transformers saves named chat templates (`tool_use`, ...) in it.
_SIDE_FOLDERS = ("additional_chat_templates",)


def copy_side_files(src: Path, dst: Path, skip: set[str] = frozenset()) -> list[str]:
    """Copy tokenizer files, generation_config, chat templates (every plain top-level file that is not weights or
    a copy of them, an archive, config, index, manifest, README or a marker, and the named chat templates' folder)
    from src to dst; returns the names copied."""
    copied = []
    if is_mistral_format(src):  # params.json describes consolidated*.safetensors, which no copy gets
        skip = set(skip) | {MISTRAL_PARAMS}
    for path in sorted(src.iterdir()):
        name = path.name
        if name in _SIDE_FOLDERS and path.is_dir():
            shutil.copytree(path, dst / name)
            copied.append(name + "/")
            continue
        if (not path.is_file() or name.startswith(".") or name in _NOT_COPIED_NAMES or name in skip
                or name.startswith("anychip-") or name.endswith(_NOT_COPIED_SUFFIXES)
                or any(f"{suffix}." in name for suffix in _WEIGHT_SUFFIXES)):  # model.safetensors.part1, ...
            continue
        shutil.copyfile(path, dst / name)
        copied.append(name)
    return copied


#: Mistral's own format beside the Hugging Face one in a repo: its config, next to consolidated*.safetensors.
MISTRAL_PARAMS = "params.json"


def is_mistral_format(src: Path) -> bool:
    """Whether src also holds Mistral's own format (params.json and consolidated*.safetensors), which vLLM then
    prefers: its config format and, with a tokenizer.model.v* or tekken.json, the mistral_common tokenizer."""
    return (src / MISTRAL_PARAMS).is_file() and any(src.glob("consolidated*.safetensors"))


MISTRAL_NOTE = ("{src} also holds Mistral's own format (params.json, consolidated*.safetensors), which vLLM serves "
                "with Mistral's config and tokenizer; the W4A8 copy is Hugging Face format only (config.json, the "
                "HF tokenizer files), so vLLM serves it the Hugging Face way. To compare the two alike, serve the "
                "source with --config-format hf --load-format safetensors --tokenizer-mode hf")


def not_carried(src: Path) -> list[str]:
    """What of a source folder a converted checkpoint does not get beside its weights and config (copy_side_files'
    rules): subfolders, the model card, archives and backup copies; for the converter to say so."""
    left = []
    for path in sorted(src.iterdir()):
        name = path.name
        if name.startswith("."):
            continue
        if path.is_dir() and name not in _SIDE_FOLDERS:
            left.append(name + "/")
        elif name == "README.md" or (name.endswith(_NOT_COPIED_SUFFIXES) and not name.endswith(_WEIGHT_SUFFIXES)):
            left.append(name)
        elif name == MISTRAL_PARAMS and is_mistral_format(src):
            left.append(name)
    return left
