"""The GPU's SM clock while a benchmark repetition runs, sampled with nvidia-smi.

A GPU lowers its clocks when its load is light or its power or temperature high; a kernel that waits on memory
latency slows with the clock. `bench latency --device cuda` records, for every repetition, the median SM clock
sampled during its prefill and during its decode, so that a slow repetition can be told from a slow clock.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from statistics import median
from typing import IO


class ClockSampler:
    """Runs `command` (one SM clock in MHz a line, e.g. nvidia-smi's -lms loop) while in a `with` block and keeps
    every reading with the monotonic time it arrived."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.samples: list[tuple[float, float]] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    @classmethod
    def for_device(cls, device: str, period_ms: int = 50) -> ClockSampler | None:
        """A sampler of the GPU a CUDA run uses (the first of CUDA_VISIBLE_DEVICES), None elsewhere or without
        nvidia-smi."""
        smi = shutil.which("nvidia-smi")
        if device != "cuda" or smi is None:
            return None
        index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
        return cls([smi, "-i", index, "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", f"-lms={period_ms}"])

    def __enter__(self) -> ClockSampler:
        try:
            self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
            return self
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True)
        self._reader.start()
        return self

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                self.samples.append((time.monotonic(), float(line.strip())))
            except ValueError:  # "[N/A]" or a header: not a reading
                continue

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def median_between(self, t0: float, t1: float) -> float | None:
        """The median reading that arrived in [t0, t1] (monotonic seconds), None when none did."""
        inside = [mhz for t, mhz in list(self.samples) if t0 <= t <= t1]
        return median(inside) if inside else None
