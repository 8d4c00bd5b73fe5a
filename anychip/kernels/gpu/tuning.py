"""Tuned GEMM configs per GPU and shape, so that no request ever waits for the tuner.

A config is looked up by (M bucket, N, K, G) on one GPU model (launch._key's bucket: "gemv" for M = 1, "decode"
for M <= 16, "mid" for M <= 64, then one entry an octave of M up to 4096). Where the answer comes from, first hit wins:
  1. this process (`launch.tuned()`);
  2. the disk cache, `<tuning_dir>/<gpu>.json`, written by earlier engines on this machine;
  3. the table shipped with anychip, `anychip/kernels/gpu/tuned/<gpu>.json` (made on a lent GPU with
     `python -m anychip.kernels.gpu.tuning`);
  4. at load (`KernelPolicy.gpu_tuning == "load"`, the default), `tune_linear` times every bucket's candidates on
     the layer's own weights once and writes the disk cache; with "off", the regime's default config.
The request path only reads: a shape first seen at run time gets the default config, never a timing stall.

File format: {"gpu": name, "triton": version, "entries": {"<bucket>:<N>:<K>:<G>": {GemmConfig fields}}}; a GEMV
entry has GemvConfig's fields and "kind": "gemv".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path

import torch

from anychip.envs import ANYCHIP_GPU_TUNING_DIR
from anychip.kernels.gpu import launch, precompile

SHIPPED_DIR = Path(__file__).parent / "tuned"
#: (bucket, M the candidates are timed at): gemv is batch one (the GEMV's configs against the decode tiles, each
#: with its activation quantization); decode at two tokens (memory-bound: its 16-row tiles cost the same at any
#: M <= 16); prefill at the octave's top.
BUCKETS: tuple[tuple[str | int, int], ...] = (("gemv", 1), ("decode", 2), ("mid", 64)) + tuple(
    (m, m) for m in (128, 256, 512, 1024, 2048, 4096))
TUNING_MODES = ("load", "off")

_files: dict[Path, dict[str, dict]] = {}  # path -> entries, read once a process


def slug(gpu_name: str) -> str:
    """'nvidia-h200' for 'NVIDIA H200': the file name of that GPU model's table."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


def gpu_slug(device: torch.device) -> str:
    return slug(torch.cuda.get_device_name(device))


def entry_key(bucket: str | int, n: int, k: int, g: int) -> str:
    return f"{bucket}:{n}:{k}:{g}"


def _read(path: Path) -> dict[str, dict]:
    """The file's entries (key -> fields), read once a process. A damaged cache is rebuilt, never fatal: a file
    that is not this format's JSON counts as empty, an entry that is not an object is left out, each with a
    warning."""
    if path not in _files:
        try:
            doc = json.loads(path.read_text())
            entries = doc.get("entries") if isinstance(doc, dict) else None
            if not isinstance(entries, dict):
                raise ValueError("not a tuning table (an object with an \"entries\" object)")
        except FileNotFoundError:
            entries = {}
        except (OSError, ValueError) as exc:
            print(f"anychip: ignoring unreadable GPU tuning file {path}: {exc}", file=sys.stderr)
            entries = {}
        bad = [key for key, value in entries.items() if not isinstance(value, dict)]
        if bad:
            print(f"anychip: ignoring {len(bad)} malformed entries of GPU tuning file {path} ({bad[0]}: "
                  f"{entries[bad[0]]!r}); those shapes are timed again", file=sys.stderr)
        _files[path] = {key: value for key, value in entries.items() if key not in bad}
    return _files[path]


def _write(path: Path, device: torch.device, new: dict[str, dict]) -> None:
    """Merge `new` into the file atomically, under a lock (re-read first: another engine may have written since).
    A file that cannot be written costs only the timing again at the next start: a warning, never an error."""
    import fcntl

    import triton

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / f".{path.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _files.pop(path, None)
            entries = {**_read(path), **new}
            doc = {"gpu": torch.cuda.get_device_name(device), "triton": triton.__version__,
                   "entries": dict(sorted(entries.items()))}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f, indent=1)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        _files[path] = entries
    except OSError as exc:
        print(f"anychip: could not save GPU tuning results to {path} ({exc}); this engine serves with them, the "
              f"next one times those shapes again (set {ANYCHIP_GPU_TUNING_DIR} to a writable folder)",
              file=sys.stderr)


def _config(fields: dict, bucket: str | int | None = None) -> launch.Config | None:
    """A table entry as a config, or None (timed again) when it is not one: written by another anychip version or
    by hand (a field of the wrong type, a value the config refuses, a GEMV config for more than one token)."""
    fields = dict(fields)
    kind = fields.pop("kind", "gemm")
    cls = launch.CONFIG_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None or (kind == "gemv" and bucket not in (None, "gemv")):
        return None
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    if set(fields) - set(types) or any(type(v) is not (bool if types[name] in (bool, "bool") else int)
                                       for name, v in fields.items()):
        return None
    try:
        return cls(**fields)
    except (TypeError, ValueError):
        return None


def _fields(cfg: launch.Config) -> dict:
    """A config as a table entry: its fields, and "kind": "gemv" for the GEMV's, "wgmma" for the Gluon GEMM's."""
    kind = launch.config_kind(cfg)
    return asdict(cfg) if kind == "gemm" else {**asdict(cfg), "kind": kind}


def lookup(bucket: str | int, n: int, k: int, g: int, device: torch.device,
           tuning_dir: Path | None) -> launch.Config | None:
    """The disk cache's or the shipped table's config for this shape on this GPU model, if either has one."""
    file, key = f"{gpu_slug(device)}.json", entry_key(bucket, n, k, g)
    for path in ([tuning_dir / file] if tuning_dir else []) + [SHIPPED_DIR / file]:
        if key in (entries := _read(path)) and (cfg := _config(entries[key], bucket)) is not None:
            return cfg
    return None


def tune_linear(weight: torch.Tensor, scales: torch.Tensor, n: int, k: int, g: int, mode: str,
                tuning_dir: Path | None, precompile_threads: int = 0, retune: bool | Collection[str] = False,
                times: dict[str, dict[str, float]] | None = None, wgmma: bool = False) -> None:
    """Make every bucket's config known for this linear before it serves (called at load, by the route's
    prepare): from the caches, else (mode "load") timed here on the layer's weights and written to the disk
    cache; mode "off" leaves unknown buckets on their default config. precompile_threads > 0: then compile the
    configs' kernels on that many background threads (precompile.py). retune: time every bucket even where a
    table knows it (the table maker), or only the buckets named ("gemv", "decode", "mid", "512", ...).
    times: filled with each timed bucket's {config: ms}. wgmma: time the Gluon GEMM's tiles too where the GPU runs
    them (launch.wgmma_capable)."""
    if mode not in TUNING_MODES:
        raise ValueError(f"GPU tuning mode {mode!r} is not one of {TUNING_MODES}")
    device = weight.device
    if device.type != "cuda":
        return
    fresh: dict[str, dict] = {}
    for bucket, m in BUCKETS:
        if launch.config_for(m, n, k, g, device) is not None:
            continue
        again = retune if isinstance(retune, bool) else str(bucket) in retune
        cfg = None if again else lookup(bucket, n, k, g, device, tuning_dir)
        if isinstance(cfg, launch.WgmmaConfig) and not launch.wgmma_capable(device):
            cfg = None  # a Gluon GEMM entry where this Triton has no Gluon: time (or default) as if unknown
        if cfg is None and mode == "load":
            timed: dict[str, float] = {}
            cfg = _time_candidates(m, weight, scales, n, k, g, timed, wgmma)
            if times is not None:
                times[entry_key(bucket, n, k, g)] = timed
            if cfg is not None:
                fresh[entry_key(bucket, n, k, g)] = _fields(cfg)
        if cfg is not None:
            launch.remember(m, n, k, g, device, cfg)
    if fresh and tuning_dir is not None:
        _write(tuning_dir / f"{gpu_slug(device)}.json", device, fresh)
    # the configs are settled: compile their kernels in the background, before vLLM's warm-up and graph capture
    precompile.submit(n, k, g, device, [bucket for bucket, _ in BUCKETS], scales.dtype, precompile_threads)


def _time_candidates(m: int, weight: torch.Tensor, scales: torch.Tensor, n: int, k: int, g: int,
                     times: dict[str, float] | None = None, wgmma: bool = True) -> launch.Config | None:
    """The fastest candidate at M tokens, timed as it serves: in a CUDA graph (no launch cost hides a short
    kernel), and for decode and mid M over weight copies beyond the L2 cache (weights stream from HBM, as in a
    model; prefill is compute-bound, one copy). times: filled with each candidate's ms. A candidate that does not
    compile or launch on this GPU (shared memory, registers, a Triton that lacks something) is left out with a
    warning; None where none ran (the bucket keeps its default config)."""
    from anychip.kernels.gpu.timing import graph_ms, rotation

    device = weight.device
    gen = torch.Generator(device=device).manual_seed(m * 7919 + n)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device, generator=gen)
    sx = torch.rand((m,), dtype=torch.float32, device=device, generator=gen) / 100 + 1e-4
    x = torch.randn((m, k), dtype=torch.float32, device=device, generator=gen).bfloat16()
    out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    nbytes = weight.numel() + scales.numel() * scales.element_size()
    copies = rotation(nbytes, device) if m <= launch.MID_M else 1
    operands = [(weight, scales)] + [(weight.clone(), scales.clone()) for _ in range(copies - 1)]
    options = launch.candidates(m, n, k, g, launch.multiprocessors(device), wgmma and launch.wgmma_capable(device))
    ms: dict[launch.Config, float] = {}
    for cfg in options:
        if launch.regime(m) == "gemv":  # the GEMV quantizes inside: time every candidate with its quantization
            calls = [lambda cfg=cfg, w=w, s=s: launch.w4a8_linear(x, w, s, None, n, k, g, config=cfg)
                     for w, s in operands]
        else:
            calls = [lambda cfg=cfg, w=w, s=s: launch.launch_config(cfg, xq, sx, w, s, None, n, k, g, out)
                     for w, s in operands]  # (a WgmmaConfig reads xq's columns in another order: the same time)
        try:
            ms[cfg] = graph_ms(calls, replays=max(2, 16 // len(calls)), samples=5)
        except Exception as exc:  # noqa: BLE001 -- Triton's compile / resource errors have no common base
            print(f"anychip: GPU tuning left out {cfg} at M={m} N={n} K={k} G={g}: {type(exc).__name__}: "
                  f"{str(exc)[:200]}", file=sys.stderr)
            continue
        if times is not None:
            times[str(cfg)] = round(ms[cfg], 5)
    return min(ms, key=ms.__getitem__) if ms else None


def shapes_of(config: dict) -> list[tuple[int, int, int]]:
    """(N, K, G) of every quantized linear a Llama-style config.json has, as vLLM merges them (qkv, gate_up)."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    groups = [grp for grp in config["quantization_config"]["config_groups"].values()]
    g = int(groups[0]["weights"]["group_size"])
    return sorted({((heads + 2 * kv) * head_dim, hidden, g), (hidden, heads * head_dim, g), (2 * inter, hidden, g),
                   (hidden, inter, g)})


def main(argv: list[str] | None = None) -> int:
    """Tune the shapes of the given model directories (or N,K,G triples) on this GPU into a table file."""
    parser = argparse.ArgumentParser(prog="python -m anychip.kernels.gpu.tuning", description=main.__doc__)
    parser.add_argument("shapes", nargs="+", help="a model directory (its config.json) or N,K,G")
    parser.add_argument("--out", type=Path, default=SHIPPED_DIR, help="folder of the <gpu>.json table")
    parser.add_argument("--times", type=Path, help="also write every candidate's time per shape and bucket (JSON)")
    parser.add_argument("--retune", action="store_true", help="time every shape, also those the tables know "
                        "(their entries are replaced)")
    parser.add_argument("--bucket", action="append", choices=[str(b) for b, _ in BUCKETS],
                        help="with --retune: re-time only this M bucket (repeatable); the others come from the tables")
    parser.add_argument("--wgmma", action="store_true", help="time the Gluon GEMM's tiles too (sm_90; the policy's "
                        "gpu_wgmma)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    triples: list[tuple[int, int, int]] = []
    for text in args.shapes:
        path = Path(text)
        if (path / "config.json").exists():
            triples += shapes_of(json.loads((path / "config.json").read_text()))
        else:
            triples.append(tuple(int(v) for v in text.split(",")))  # type: ignore[arg-type]
    launch.clear_tuning()
    t0 = time.perf_counter()
    times: dict[str, dict[str, float]] = {}
    for n, k, g in sorted(set(triples)):
        gen = torch.Generator(device=device).manual_seed(n * 31 + k)
        weight = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, device=device, generator=gen)
        # BF16, as every checkpoint's scales reach the kernels (the layout keeps them as they are): Triton compiles
        # another kernel for fp32 scales, whose fastest config differs (session 39: the pipelined 128 x 64 tile won
        # every prefill shape with BF16 scales, while the table timed with fp32 ones had mostly picked the plain one)
        scales = (torch.rand((k // g, n), dtype=torch.float32, device=device, generator=gen) / 50 + 1e-3).bfloat16()
        retune = set(args.bucket) if args.retune and args.bucket else args.retune
        tune_linear(weight, scales, n, k, g, "load", args.out, retune=retune, times=times, wgmma=args.wgmma)
        print(f"N={n} K={k} G={g}: " + ", ".join(
            f"{b}={launch.config_for(m, n, k, g, device)}" for b, m in BUCKETS), flush=True)
    print(f"tuned {len(set(triples))} shapes in {time.perf_counter() - t0:.0f} s -> {args.out}")
    if args.times:
        args.times.write_text(json.dumps({"gpu": torch.cuda.get_device_name(device), "times_ms": times}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
