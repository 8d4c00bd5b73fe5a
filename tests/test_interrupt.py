"""`anychip quantize` and `anychip prepare` killed (SIGKILL) part way never leave a directory that verify accepts,
unless it is the complete checkpoint, byte for byte what an uninterrupted run writes.

The kill points are exact: a driver process patches one function so that its n-th call kills the process (before
or after the real call), then runs the CLI. A run that exits without being killed fails the test, so every point
is really reached. A few kills at random times are added on top.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anychip.checkpoint.quantize import quantize_checkpoint
from anychip.checkpoint.scheme import W4A8Scheme
from anychip.checkpoint.verify import verify_checkpoint
from anychip.errors import AnychipError

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)

# argv: MODULE:ATTR:N:before|after, then the anychip CLI arguments.
DRIVER = r"""
import importlib, os, signal, sys
from anychip.cli import main

spec, argv = sys.argv[1], sys.argv[2:]
module, attr, n, when = spec.split(":")
owner = importlib.import_module(module)
parts = attr.split(".")
for part in parts[:-1]:
    owner = getattr(owner, part)
real = getattr(owner, parts[-1])
calls = [0]

def killer(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(n) and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    out = real(*args, **kwargs)
    if calls[0] == int(n) and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return out

setattr(owner, parts[-1], killer)
sys.exit(main(argv))
"""

INCOMPLETE = [
    "anychip.checkpoint.io:ShardedWriter.write:1:after",  # first tensor written
    "anychip.checkpoint.io:ShardedWriter.write:15:after",  # mid-way through the weights
    "anychip.checkpoint.quantize:copy_side_files:1:after",  # weights, config, tokenizer; no SHA256SUMS yet
]
COMPLETE_IN_TEMPORARY = [
    "anychip.checkpoint.quantize:write_manifest:1:after",  # every file written, not yet verified
    "anychip.checkpoint.verify:verify_checkpoint:1:after",  # verified in the temporary directory
    "os:replace:1:before",  # about to rename into place
]
RENAMED = "os:replace:1:after"


def kill_at(point: str, argv: list[str], cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", DRIVER, point, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"{point} was never reached (rc {proc.returncode}):\n{proc.stderr[-2000:]}"


def directories_left(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.is_dir())


def assert_nothing_half_done(parent: Path, reference: Path) -> dict[str, int]:
    """Every directory in `parent`: verify refuses it, or it is the complete checkpoint (same bytes as
    `reference`, file for file). Returns how many of each were found."""
    seen = {"refused": 0, "complete": 0}
    for d in directories_left(parent):
        try:
            verify_checkpoint(d)
        except AnychipError:
            seen["refused"] += 1
            continue
        files = sorted(p.name for p in d.iterdir())
        assert files == sorted(p.name for p in reference.iterdir()), f"{d} verifies but holds {files}"
        for name in files:
            assert (d / name).read_bytes() == (reference / name).read_bytes(), f"{d / name} differs from a full run"
        seen["complete"] += 1
    return seen


@pytest.fixture(scope="module")
def src(tiny_llama) -> Path:
    return tiny_llama(**SHAPE)


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory) -> Path:
    return quantize_checkpoint(src, tmp_path_factory.mktemp("ref") / "w4a8", W4A8Scheme(64))


@pytest.mark.parametrize("point", INCOMPLETE + COMPLETE_IN_TEMPORARY + [RENAMED])
def test_quantize_killed_at_a_point(src, reference, tmp_path, point):
    parent = tmp_path / "out"
    parent.mkdir()
    kill_at(point, ["quantize", str(src), str(parent / "w4a8"), "--group-size", "64"], tmp_path)
    seen = assert_nothing_half_done(parent, reference)
    dst_done = (parent / "w4a8").is_dir()
    assert dst_done == (point == RENAMED), "the destination appears exactly when renamed into place"
    assert seen == {"refused": int(point in INCOMPLETE), "complete": int(point not in INCOMPLETE)}, seen
    if not dst_done:  # the interrupted run does not block the next one
        rc = subprocess.run([sys.executable, "-m", "anychip.cli", "quantize", str(src), str(parent / "w4a8"),
                             "--group-size", "64"], capture_output=True, text=True, timeout=300)
        assert rc.returncode == 0, rc.stderr[-2000:]
        verify_checkpoint(parent / "w4a8")


def test_quantize_killed_at_random_times(src, reference, tmp_path):
    """SIGKILL after a random delay within a full run's duration (measured first), three times."""
    argv = [sys.executable, "-m", "anychip.cli", "quantize", str(src)]
    t0 = time.monotonic()
    subprocess.run(argv + [str(tmp_path / "timed"), "--group-size", "64"], check=True, capture_output=True)
    full = time.monotonic() - t0
    shutil.rmtree(tmp_path / "timed")
    rng = random.Random(13)
    for i in range(3):
        parent = tmp_path / f"out{i}"
        parent.mkdir()
        proc = subprocess.Popen(argv + [str(parent / "w4a8"), "--group-size", "64"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 1.0) * full)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert_nothing_half_done(parent, reference)


# `prepare --synthetic` with a tiny shape; the BF16 default model (the tokenizer's source) is converted first.
TINY = "layers=2,hidden=128,intermediate=256,heads=4,kv_heads=2,vocab=49152,group=64"
PREPARE_POINTS = [
    "anychip.checkpoint.from_gguf:write_manifest:1:before",  # BF16 conversion written, no SHA256SUMS
    "anychip.checkpoint.io:ShardedWriter.write:3:after",  # synthetic weights part written
    "anychip.checkpoint.synthetic:write_manifest:1:after",  # synthetic complete, not yet verified
    "anychip.checkpoint.synthetic:mark_done:1:before",  # in place, not yet marked done
]


@pytest.mark.slow
def test_prepare_killed_at_points(tmp_path):
    from anychip.checkpoint.synthetic import parse_shape

    from anychip.checkpoint.default_bf16 import _verify_bf16

    cache = tmp_path / "cache"
    bf16_root, synthetic_root = cache / "smollm2-135m-instruct", cache / "synthetic"
    dst = synthetic_root / parse_shape(TINY).dirname
    argv = ["prepare", "--synthetic", TINY, "--cache", str(cache)]
    for point in PREPARE_POINTS:
        kill_at(point, argv, tmp_path)
        for d in directories_left(bf16_root):
            if d.name.startswith("."):  # an interrupted conversion is never a BF16 model directory
                with pytest.raises(AnychipError):
                    _verify_bf16(d)
    assert dst.is_dir() and not (dst.parent / f"{dst.name}.done.json").exists()
    verify_checkpoint(dst)  # killed after the rename: complete, only the marker is missing
    # The next prepare rebuilds what is not marked done and finishes; its output is what the leftovers are judged by.
    out = subprocess.run([sys.executable, "-m", "anychip.cli", *argv], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((dst.parent / f"{dst.name}.done.json").read_text())["recipe"]["step"] == "synthetic"
    reference = tmp_path / "reference"
    shutil.move(dst, reference)
    seen = assert_nothing_half_done(synthetic_root, reference)
    assert seen == {"refused": 1, "complete": 1}, seen  # the part-written one; the one killed after its manifest


def _descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            out += [int(child), *_descendants(int(child))]
    return out


@pytest.mark.slow
def test_serve_names_a_dead_engine(src, tmp_path):
    """The real stack: `anychip serve` on a tiny W4A8 model, its engine process SIGKILLed once it is ready."""
    import socket

    model = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(64))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "anychip.cli", "serve", str(model), "--port", str(port),
                                 "--served-model-name", "tiny", "--enforce-eager", "--max-model-len", "256",
                                 "--coverage", str(tmp_path / "coverage.json")],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 500
        while "anychip serve: ready at" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(2)
        assert '"model": "tiny"' in log.read_text()  # the curl example names the served model
        procs = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _descendants(proc.pid)}
        engine = [pid for pid, cmd in procs.items() if b"EngineCore" in cmd]
        server = [pid for pid, cmd in procs.items() if b"vllm.entrypoints.openai.api_server" in cmd]
        (victim,) = engine or server  # no separate engine process when multiprocessing is off
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(timeout=120)
        assert rc != 0
        assert "anychip serve: error: the vLLM server " in log.read_text()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
