"""`anychip serve` as a subprocess for the slow tests: started through the front door in its own process group,
ready once /v1/models (or `ready_path`) answers, stopped with SIGTERM (then SIGKILL) to the group whatever the test did."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def anychip_serve(model: Path, port: int, args: list[str], log: Path, ready_s: float,
                  ready_path: str = "/v1/models") -> Iterator[subprocess.Popen]:
    cmd = [sys.executable, "-m", "anychip.cli", "serve", str(model), "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_s
        while True:
            assert proc.poll() is None, f"anychip serve exited {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"anychip serve not ready in {ready_s} s:\n{log.read_text()[-4000:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{ready_path}", timeout=5).read()
                break
            except OSError:
                time.sleep(2)
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
