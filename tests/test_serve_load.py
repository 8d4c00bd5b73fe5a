"""Load through the front door, on loopback: `anychip serve` on the tiny synthetic checkpoint, with vLLM's slots
capped at CLIENTS (--max-num-seqs), takes CLIENTS concurrent streams to the end, frees the slots of CLIENTS clients
that hang up mid-stream, and its coverage report still passes `anychip coverage check` after both.

One server serves the module (start-up is most of the cost); the tests run in file order and the last one reads what
the first two left in the report. Every wait has a deadline so a hang fails instead of stalling CI. Each test prints
its figures (run with -s to see them)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import model_cache
from serve_process import anychip_serve

pytestmark = pytest.mark.slow

CLIENTS = 64  # also vLLM's --max-num-seqs: every slot the engine has
PROMPT_LEN = 32  # token ids; with HANGUP_TOKENS this stays inside --max-model-len 512
ANSWER_TOKENS = 16
HANGUP_TOKENS = 448  # what a disconnecting client asks for: far more than it reads before it hangs up
HANGUP_AFTER = 2  # streamed chunks a disconnecting client reads
VOCAB = (1000, 40000)  # token ids for prompts, inside the tokenizer's 49152
READY_S = 900  # start-up on a busy 2-core machine: verify, profile, load, warm-up
REQUEST_S = 300  # one request, or one wave of CLIENTS requests
# Time from the last hang-up to a complete 16-token answer: 1-2 s measured on the shared 2-core machine (0.4 s on
# an idle server). With clients that keep their sockets open instead, the answer queued behind the CLIENTS streams
# until they had generated all their tokens: 99 s on the same machine. 15 s sits between the two with ~10x headroom
# on the first; the token count the test also checks is the timing-free proof.
PROMPT_ANSWER_S = 15.0
DRAIN_S = 30  # until /metrics shows no request running or waiting


@dataclass(frozen=True)
class Server:
    url: str  # .../v1
    port: int
    model: str
    coverage: Path
    log: Path
    proc: subprocess.Popen


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    from anychip.bench.server import free_port
    from anychip.checkpoint.synthetic import PRESETS, make_synthetic

    model = make_synthetic(PRESETS["tiny"], cache=model_cache()).path
    tmp = tmp_path_factory.mktemp("serve-load")
    port, cov, log = free_port(), tmp / "coverage.json", tmp / "serve.log"
    args = ["--coverage", str(cov), "--verify", "fast", "--enforce-eager", "--max-model-len", "512",
            "--max-num-seqs", str(CLIENTS)]
    with anychip_serve(model, port, args, log, READY_S) as proc:
        yield Server(f"http://127.0.0.1:{port}/v1", port, model.name, cov, log, proc)


def metrics(srv: Server) -> dict[str, float]:
    """vLLM's Prometheus gauges and counters, summed over label sets: {"vllm:num_requests_running": 0.0, ...}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def in_flight(srv: Server) -> int:
    m = metrics(srv)
    return int(m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"])


def seconds_to_drain(srv: Server, timeout_s: float) -> float | None:
    """Seconds until /metrics shows nothing running or waiting; None if that did not happen within timeout_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if in_flight(srv) == 0:
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def stream_wave(srv: Server, clients: int, output_len: int, seed: int):
    """`clients` concurrent streamed completions through anychip bench serve's client; (records, wall seconds)."""
    from anychip.bench.serve import Scenario, run_level

    wave = run_level(srv.url, srv.model, Scenario(clients, PROMPT_LEN, output_len, clients), VOCAB, seed,
                     REQUEST_S, progress=False)
    return asyncio.run(asyncio.wait_for(wave, REQUEST_S + 30))


def test_concurrent_streams_all_complete(server):
    before = metrics(server)["vllm:generation_tokens_total"]
    records, wall = stream_wave(server, CLIENTS, ANSWER_TOKENS, seed=1)
    answered = [r for r in records if r.ok]
    failed = sorted({r.error for r in records if not r.ok})
    print(f"\nload: {CLIENTS} concurrent streams: sent {len(records)}, answered {len(answered)}, "
          f"failed {len(records) - len(answered)} in {wall:.1f} s")
    assert len(records) == CLIENTS and not failed, failed
    assert {r.output_tokens for r in answered} == {ANSWER_TOKENS}
    # Streamed: more than one chunk per answer, never more chunks than tokens. Not one chunk a token: when the API
    # server's reader lags behind the engine (64 streams on 2 cores), vLLM's output collector merges the deltas that
    # wait into one chunk (vllm/v1/engine/output_processor.py, RequestOutputCollector.put).
    chunks = sorted(len(r.chunk_times) for r in answered)
    assert chunks[0] > 1 and chunks[-1] <= ANSWER_TOKENS, chunks
    # the server generated what the clients counted: the answers were not served from elsewhere
    assert metrics(server)["vllm:generation_tokens_total"] - before == CLIENTS * ANSWER_TOKENS


async def _hang_up(port: int, body: bytes, read: asyncio.Event, close: asyncio.Event) -> int:
    """Open a streamed completion on a raw socket, read HANGUP_AFTER chunks, wait for `close`, then drop the
    connection without reading on. Returns the chunks read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise AssertionError(f"{status!r}: {(await reader.read(500))!r}")
        chunks = 0
        while chunks < HANGUP_AFTER:
            line = await reader.readline()
            if not line:
                raise AssertionError(f"the server closed the stream after {chunks} chunks")
            chunks += line.startswith(b"data: {")
        read.set()
        await close.wait()
        return chunks
    finally:
        writer.transport.abort()  # close the socket now; unread chunks stay unread


def test_disconnected_streams_free_their_slots(server):
    import numpy as np

    from anychip.bench.serve import Scenario, run_level

    rng = np.random.default_rng(2)
    bodies = [json.dumps({"model": server.model, "prompt": rng.integers(*VOCAB, PROMPT_LEN).tolist(),
                          "max_tokens": HANGUP_TOKENS, "min_tokens": HANGUP_TOKENS, "ignore_eos": True,
                          "temperature": 0.0, "stream": True}).encode() for _ in range(CLIENTS)]
    gen_before = metrics(server)["vllm:generation_tokens_total"]

    async def scenario() -> dict:
        read = [asyncio.Event() for _ in bodies]
        close = asyncio.Event()
        clients = [asyncio.create_task(_hang_up(server.port, b, r, close)) for b, r in zip(bodies, read)]
        waits = asyncio.gather(*(r.wait() for r in read))
        # a client can only finish before `close` by failing, so the first to finish is the answer
        done, _ = await asyncio.wait([*clients, waits], timeout=REQUEST_S, return_when=asyncio.FIRST_COMPLETED)
        failed = [t.exception() for t in done if t is not waits]
        assert waits in done and not failed, failed or f"not every client got {HANGUP_AFTER} chunks in {REQUEST_S} s"
        occupied = await asyncio.to_thread(in_flight, server)  # every slot holds a stream now
        close.set()
        await asyncio.wait_for(asyncio.gather(*clients), 30)
        t_hung_up = time.perf_counter()
        (answer,), _ = await asyncio.wait_for(run_level(server.url, server.model, Scenario(1, PROMPT_LEN,
                                              ANSWER_TOKENS, 1), VOCAB, 3, REQUEST_S, progress=False), REQUEST_S)
        gen_at_answer = (await asyncio.to_thread(metrics, server))["vllm:generation_tokens_total"]
        return {"occupied": occupied, "answer_ok": answer.ok, "answer_error": answer.error,
                "answer_tokens": answer.output_tokens, "answer_s": answer.end - t_hung_up,
                "gen_at_answer": gen_at_answer}

    fig = asyncio.run(scenario())
    drained = seconds_to_drain(server, DRAIN_S)
    assert drained is not None, f"/metrics shows {in_flight(server)} requests in flight {DRAIN_S} s after the answer"
    abandoned = fig["gen_at_answer"] - gen_before - fig["answer_tokens"]
    print(f"\nload: {CLIENTS} streams hung up after {HANGUP_AFTER} chunks ({fig['occupied']} of {CLIENTS} slots in "
          f"use when they did); prompt answer {fig['answer_s']:.2f} s after the last hang-up "
          f"({fig['answer_tokens']} tokens); the abandoned streams generated {abandoned:.0f} of the "
          f"{CLIENTS * HANGUP_TOKENS} tokens they asked for; nothing in flight {drained:.2f} s after the answer; "
          f"sent {CLIENTS + 1} ({CLIENTS} hung up by the client), answered {int(fig['answer_ok'])}, "
          f"failed {int(not fig['answer_ok'])}")
    assert fig["occupied"] == CLIENTS, "the disconnecting clients did not hold every slot: the test proves nothing"
    assert fig["answer_ok"] and fig["answer_tokens"] == ANSWER_TOKENS, fig["answer_error"]
    assert fig["answer_s"] < PROMPT_ANSWER_S, f"the prompt answer took {fig['answer_s']:.1f} s after the hang-ups"
    # timing-free: with every slot held, the answer could only start once a slot was free; had the hung-up streams
    # kept their slots, the first would have freed one only after HANGUP_TOKENS tokens each
    assert abandoned < CLIENTS * HANGUP_TOKENS / 4


def test_coverage_stays_strict_after_the_load(server):
    assert server.proc.poll() is None, f"the server died under load:\n{server.log.read_text()[-4000:]}"
    time.sleep(1.5)  # the engine flushes its report every 0.5 s
    check = subprocess.run([sys.executable, "-m", "anychip.cli", "coverage", "check", str(server.coverage)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    report = json.loads(server.coverage.read_text())
    assert report["strict"] and report["route_stats"]["fallback_linears"] == 0
    # the report counted the load: every answered token but each request's last was fed back through the linears
    fed = sum(p["tokens"] for p in report["phases"].values())
    assert fed >= CLIENTS * (ANSWER_TOKENS - 1) + CLIENTS * HANGUP_AFTER, \
        f"{report['phases']}: the report missed the load (run the whole module: this test reads what the others left)"
    print(f"\nload: coverage check passed after the load; {fed} tokens through the W4A8 linears: "
          f"{check.stdout.strip()}")
