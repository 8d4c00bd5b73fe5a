"""A local OpenAI server for `bench serve` comparisons and tests: the vLLM server command `anychip serve MODEL`
runs (same profile settings; the checkpoint verification step is left out), on 127.0.0.1, with the anychip
plugin (ours) or without it (stock vLLM), stopped and reaped on exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from anychip.bench.latency import plugins_without_anychip
from anychip.serve import server_command
from anychip.errors import AnychipError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class ServerURL(str):
    """A launched server's base URL (…/v1); `pid` is its API process (vLLM's engine core runs in a child);
    `command`: the command line it was started with (serve's profile and the user's flags)."""

    pid: int | None = None
    command: list[str] | None = None


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system, all threads, not children) a process has used; None where unknown."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@contextmanager
def local_server(model: Path, *, plugin: bool = True, port: int | None = None, extra: list[str] | None = None,
                 log: Path | None = None, ready_timeout_s: float = 600.0) -> Iterator[ServerURL]:
    """Start anychip's vLLM server command for MODEL on 127.0.0.1 and yield its base URL (…/v1) once /v1/models answers.

    plugin=False sets VLLM_PLUGINS to every installed plugin but anychip: stock vLLM with the same settings.
    The server runs in its own process group, which is interrupted, then killed, on exit, also when this process
    is sent SIGTERM (`timeout`, a job scheduler): the server would otherwise outlive it and keep the GPU's memory."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}/v1"
    cmd, profile_env = server_command(Path(model).resolve(), "127.0.0.1", port, list(extra or []))
    env = {**os.environ, **profile_env}
    if not plugin:
        env["VLLM_PLUGINS"] = plugins_without_anychip()
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    previous = _exit_on_sigterm()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not _ready(url):
            if proc.poll() is not None:
                raise AnychipError(f"server for {model} exited with {proc.returncode} before it was ready"
                                   + (f" (log: {log})" if log else ""))
            if time.monotonic() > deadline:
                raise AnychipError(f"server for {model} not ready after {ready_timeout_s:.0f} s"
                                   + (f" (log: {log})" if log else ""))
            time.sleep(1)
        served = ServerURL(url)
        served.pid = proc.pid
        served.command = list(cmd)
        yield served
    finally:
        _stop(proc)
        if log:
            out.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_on_sigterm() -> object | None:
    """SIGTERM becomes SystemExit, so the `finally` that stops the server runs; returns the handler it replaced
    (None off the main thread, where Python cannot set handlers: there the caller owns signals)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _terminated)


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (anychip serve and the vLLM server it started), SIGKILL to whatever
    of the group is left after 30 s."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    try:
        os.killpg(pgid, signal.SIGINT)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
