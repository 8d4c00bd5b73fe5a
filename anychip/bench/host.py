"""The machine a benchmark runs on: what it is, which anychip source it runs, and how busy it is.

The reference machine is shared (2 cores, several people's work): a report records the load it was measured under,
and `--wait-idle` waits for a quiet moment before measuring.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from anychip import __version__
from anychip.envs import ANYCHIP_SOURCE_COMMIT


def machine() -> dict[str, Any]:
    """Where it ran: CPU model, core count, memory, Python and anychip versions."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    mem_gib = None
    try:
        kib = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal"))
        mem_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "arch": platform.machine(), "cpus": cpus, "memory_gib": mem_gib,
            "python": platform.python_version(), "anychip": __version__, "source": source_state()}


def source_state() -> dict[str, Any]:
    """The anychip commit measured, and files under anychip/ that differ from it (work in progress measured).
    ANYCHIP_SOURCE_COMMIT names it for a tree without its own .git (a `git archive` export run elsewhere), where
    git would otherwise answer for whatever repository lies above it."""
    if commit := os.environ.get(ANYCHIP_SOURCE_COMMIT):
        return {"commit": commit, "uncommitted": []}
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", "anychip"], cwd=root, capture_output=True,
                                text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "uncommitted": [line[3:] for line in status]}


def cpu_busy(window_s: float = 3.0) -> float:
    """Fraction of all CPUs busy over window_s, from /proc/stat (other processes: ours are idle between systems)."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields[:8]), idle

    total0, idle0 = sample()
    time.sleep(window_s)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(max_wait_s: float, busy_below: float = 0.25) -> float:
    """Wait (at most max_wait_s) until the machine is nearly idle; returns the seconds waited beyond the first
    3 s sample (0 when it was idle at once). On a shared machine this keeps other people's work out of the
    measurement; the row records the wait."""
    t0 = time.monotonic()
    if cpu_busy() < busy_below:
        return 0.0
    while time.monotonic() - t0 < max_wait_s and cpu_busy() >= busy_below:
        time.sleep(5)
    return time.monotonic() - t0


#: What warm_python does in its child: byte-compile each package (writes only missing or stale .pyc files), then
#: import them, and on "cuda" create the CUDA context (torch's CUDA libraries read from disk once).
_WARM_CHILD = """
import compileall, importlib, importlib.util, os, sys
device, names = sys.argv[1], sys.argv[2:]
for name in names:
    spec = importlib.util.find_spec(name)
    for where in (spec.submodule_search_locations or []) if spec else []:
        compileall.compile_dir(where, quiet=2, workers=os.cpu_count() or 1)
for name in names:
    importlib.import_module(name)
if device == "cuda":
    import torch
    torch.zeros(1, device="cuda")
"""


def warm_python(packages: tuple[str, ...], device: str = "cpu", timeout_s: float = 900.0) -> dict[str, Any]:
    """Before the first engine of a comparison: one throwaway process byte-compiles and imports `packages` (and on
    "cuda" creates a CUDA context), so the first system measured does not pay alone for what every later one finds
    done: Python compiling a freshly installed package's modules (about 30 s for vLLM on a fresh GPU machine, whose
    staged copy has no .pyc), the OS reading the libraries from disk. Returns {"seconds", "packages", "device"} and
    "error" (the child's last stderr line) if it failed, which does not stop the comparison."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"packages": list(packages), "device": device}
    try:
        done = subprocess.run([sys.executable, "-c", _WARM_CHILD, device, *packages], capture_output=True,
                              text=True, timeout=timeout_s)
        if done.returncode:
            out["error"] = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:300]
    except subprocess.TimeoutExpired:
        out["error"] = f"not finished in {timeout_s:.0f} s"
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out
