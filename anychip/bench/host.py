"""The machine a benchmark runs on: what it is, which anychip source it runs, and how busy it is.

The reference machine is shared (2 cores, several people's work): a report records the load it was measured under,
and `--wait-idle` waits for a quiet moment before measuring.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from anychip import __version__


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
    if commit := os.environ.get("ANYCHIP_SOURCE_COMMIT"):
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
