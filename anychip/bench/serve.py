"""`anychip bench serve URL`: a streaming OpenAI-completions client that measures TTFT, TPOT, ITL and throughput
under concurrency, against any OpenAI-compatible server (anychip's, stock vLLM's, llama.cpp's).

Prompts are random token ids of exactly the requested input length (the completions endpoint takes token-id
prompts); outputs are held to the requested length with ignore_eos and min_tokens where the server honours them
(the row records the output tokens the server reported). Per concurrency level, `num_prompts` requests are
issued by `concurrency` workers; throughput is over the level's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anychip.bench.host import machine, wait_for_idle
from anychip.bench.metrics import RequestRecord, efficiency, ratio, summarize_serve
from anychip.bench.report import (check_json_path, command_line, fmt, fmt_sig, markdown_table, now,
                                  read_report_to_append, source_notes, write_outputs)
from anychip.errors import AnychipError

#: The reference article's scenario: one card, 64 concurrent requests, 4k/16k/32k input, 1k output.
ARTICLE = {"concurrency": [64], "input_len": [4096, 16384, 32768], "output_len": [1024]}


@dataclass(frozen=True)
class Scenario:
    concurrency: int
    input_len: int
    output_len: int
    num_prompts: int


def scenarios(concurrency: list[int], input_lens: list[int], output_lens: list[int],
              num_prompts: int | None) -> list[Scenario]:
    """Every (input, output) pair at every concurrency; num_prompts defaults to 2x concurrency, at least 8."""
    for name, values in (("--concurrency", concurrency), ("--input-len", input_lens), ("--output-len", output_lens)):
        if not values or min(values) < 1:
            raise AnychipError(f"{name} {values}: give positive integers, e.g. {name} 1,4,16")
    return [Scenario(c, i, o, num_prompts or max(8, 2 * c))
            for i, o in itertools.product(input_lens, output_lens) for c in concurrency]


def apply_preset(args: argparse.Namespace) -> None:
    """--preset article fills concurrency and lengths; --scale shrinks the lengths (not the concurrency)."""
    if args.scale <= 0:
        raise AnychipError(f"--scale {args.scale}: must be positive (e.g. 0.05 for a small CPU)")
    if args.preset == "article":
        args.concurrency = ARTICLE["concurrency"]
        args.input_len, args.output_len = ARTICLE["input_len"], ARTICLE["output_len"]
    if args.scale != 1.0:
        args.input_len = [max(1, round(n * args.scale)) for n in args.input_len]
        args.output_len = [max(1, round(n * args.scale)) for n in args.output_len]


# ---- the client ----


async def _one(client: Any, url: str, model: str, prompt: list[int], max_tokens: int,
               timeout_s: float) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    rec = RequestRecord(start=time.perf_counter(), end=math.nan, prompt_tokens=len(prompt), output_tokens=0)
    usage = None
    try:
        async with client.stream("POST", f"{url}/completions", json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("choices"):
                    rec.chunk_times.append(time.perf_counter())
                usage = event.get("usage") or usage
    except Exception as exc:  # a failed request is counted, not fatal
        rec.ok, rec.error = False, f"{type(exc).__name__}: {exc}"
    rec.end = time.perf_counter()
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        rec.output_tokens = int(usage.get("completion_tokens") or len(rec.chunk_times))
    else:
        rec.output_tokens = len(rec.chunk_times)
    if rec.ok and not rec.chunk_times:
        rec.ok, rec.error = False, "the stream carried no tokens"
    return rec


async def run_level(url: str, model: str, sc: Scenario, vocab: tuple[int, int], seed: int,
                    timeout_s: float, progress: bool = True) -> tuple[list[RequestRecord], float]:
    """num_prompts requests through `concurrency` workers; returns the records and the level's wall time."""
    import httpx

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(vocab[0], vocab[1], sc.input_len).tolist() for _ in range(sc.num_prompts)]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[RequestRecord] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sc.num_prompts, desc=f"c={sc.concurrency} in={sc.input_len} out={sc.output_len}",
                   unit="req", leave=False)
    limits = httpx.Limits(max_connections=sc.concurrency, max_keepalive_connections=sc.concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                records.append(await _one(client, url, model, prompt, sc.output_len, timeout_s))
                if bar is not None:
                    bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(sc.concurrency, sc.num_prompts))))
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return records, duration


def server_model(url: str, timeout_s: float = 10.0) -> str:
    """The first model the server lists at /models."""
    import httpx

    try:
        r = httpx.get(f"{url}/models", timeout=timeout_s)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as exc:
        raise AnychipError(f"{url}/models: {type(exc).__name__}: {exc}: is an OpenAI-compatible server running "
                           "there? (URL ends in /v1)") from exc


def check_loopback(url: str) -> None:
    """Refuse nothing, but say clearly when a benchmark targets a non-local server."""
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"anychip bench serve: note: {host} is not a loopback address; network latency is included")


# ---- rows, report ----


def row_for(label: str, url: str, model: str, sc: Scenario, records: list[RequestRecord], duration: float,
            peak_tflops: float | None, peak_gbps: float | None) -> dict[str, Any]:
    summary = summarize_serve(records, duration)
    errors = sorted({r.error for r in records if not r.ok})
    short = [r.output_tokens for r in records if r.ok and r.output_tokens != sc.output_len]
    row = {"label": label, "url": url, "model": model, "concurrency": sc.concurrency, "input_len": sc.input_len,
           "output_len": sc.output_len, "num_prompts": sc.num_prompts, **summary.as_dict(),
           "efficiency": efficiency(summary, peak_tflops, peak_gbps), "errors": errors[:5]}
    if short:
        row["output_len_note"] = (f"{len(short)} request(s) returned {min(short)}..{max(short)} tokens instead of "
                                  f"{sc.output_len}: the server ignored min_tokens/ignore_eos")
    return row


def _key(row: dict[str, Any]) -> tuple[int, int, int]:
    return row["input_len"], row["output_len"], row["concurrency"]


def comparisons(rows: list[dict[str, Any]], baseline: str | None) -> list[dict[str, Any]]:
    """For each label other than the baseline: TTFT and throughput ratios at every shared scenario."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    if len(labels) < 2 or (baseline is not None and baseline not in labels):
        return []  # a named baseline that is not here: no ratios against another label instead (publish says so)
    base = baseline if baseline is not None else labels[-1]
    base_rows = {_key(r): r for r in rows if r["label"] == base}
    out = []
    for r in rows:
        b = base_rows.get(_key(r))
        if r["label"] == base or b is None:
            continue
        out.append({"label": r["label"], "baseline": base, "concurrency": r["concurrency"],
                    "input_len": r["input_len"], "output_len": r["output_len"],
                    "ttft_ratio": ratio(r["ttft"]["mean_ms"], b["ttft"]["mean_ms"]),
                    "tpot_ratio": ratio(r["tpot"]["mean_ms"], b["tpot"]["mean_ms"]),
                    "output_throughput_ratio": ratio(r["output_throughput"], b["output_throughput"]),
                    "ttft_no_worse": r["ttft"]["mean_ms"] <= b["ttft"]["mean_ms"]})
    return out


def render_markdown(doc: dict[str, Any]) -> str:
    lines = ["# anychip bench serve", "", "Commands:", ""] + [f"- `{c}`" for c in doc["commands"]] + [
        "", f"Machine: {doc['machine']['cpu']}, {doc['machine']['cpus']} CPUs; {doc['created']}. Streaming "
        "completions, random token-id prompts, ignore_eos. Times in ms (mean / p50 / p99).", ""]
    if doc.get("not_run"):
        lines += [f"**Incomplete**: levels not measured yet when this report was written (the run was still going, "
                  f"or was stopped): {', '.join(doc['not_run'])}.", ""]
    headers = ["server", "conc", "in", "out", "ok/fail", "req/s", "out tok/s", "total tok/s", "TTFT mean / p50 / p99",
               "TPOT mean", "ITL p50 / p99"]
    table = []
    for r in sorted(doc["rows"], key=lambda r: (_key(r), r["label"])):
        t, i = r["ttft"], r["itl"]
        table.append([r["label"], r["concurrency"], r["input_len"], r["output_len"], f"{r['completed']}/{r['failed']}",
                      fmt(r["request_throughput"], 2), fmt(r["output_throughput"]), fmt(r["total_throughput"]),
                      f"{fmt(t['mean_ms'])} / {fmt(t['p50_ms'])} / {fmt(t['p99_ms'])}", fmt(r["tpot"]["mean_ms"]),
                      f"{fmt(i['p50_ms'])} / {fmt(i['p99_ms'])}"])
    lines.append(markdown_table(headers, table))
    if doc["comparisons"]:
        lines += ["", f"## Against {doc['comparisons'][0]['baseline']} (ratio of means)", ""]
        lines.append(markdown_table(
            ["server", "conc", "in", "out", "TTFT ratio (< 1 is better)", "TPOT ratio", "out tok/s ratio",
             "TTFT no worse"],
            [[c["label"], c["concurrency"], c["input_len"], c["output_len"], fmt(c["ttft_ratio"], 2),
              fmt(c["tpot_ratio"], 2), fmt(c["output_throughput_ratio"], 2), "yes" if c["ttft_no_worse"] else "no"]
             for c in doc["comparisons"]]))
    eff = [r for r in doc["rows"] if r["efficiency"]]
    if eff:
        keys = sorted({k for r in eff for k in r["efficiency"]})
        lines += ["", "## Efficiency (per peak TFLOPS / per peak GB/s given on the command line)", ""]
        lines.append(markdown_table(["server", "conc", "in", "out"] + keys, [
            [r["label"], r["concurrency"], r["input_len"], r["output_len"]]
            + [fmt_sig(r["efficiency"].get(k)) for k in keys] for r in eff]))
    notes = []
    for label in dict.fromkeys(r["label"] for r in doc["rows"]):
        srv = next((r["server"] for r in doc["rows"] if r["label"] == label and r.get("server")), None)
        if srv:
            notes.append(f"- {label}: launched for {srv['model']}, anychip plugin {'on' if srv['plugin'] else 'off'}"
                         f"{', vLLM flags ' + ' '.join(srv['extra_args']) if srv['extra_args'] else ''}; "
                         f"ready after {srv['start_s']} s")
            sizes = srv.get("cuda_graph_sizes")
            if sizes:
                notes.append(f"- {label}: CUDA graphs captured for {len(sizes)} step sizes up to {max(sizes)} tokens "
                             "(serve's profile; anychip/cuda_graphs.py)")
            if srv.get("tokenizer_gap"):
                notes.append(f"- {label}: warning: {srv['tokenizer_gap']}")
    notes += [f"- {r['label']} c={r['concurrency']} in={r['input_len']}: {r['output_len_note']}"
              for r in doc["rows"] if r.get("output_len_note")]
    loads = [f"{r['label']} c={r['concurrency']}: {r['loadavg'][0]:.1f}/{r['loadavg'][1]:.1f}"
             + (f", waited {r['waited_for_idle_s']:.0f} s for idle" if r.get("waited_for_idle_s") else "")
             for r in doc["rows"] if r.get("loadavg")]
    if loads:
        notes.append("- 1-minute load average before/after each level (other work on the machine shows here): "
                     + "; ".join(loads))
    busy = [f"{r['label']} c={r['concurrency']} in={r['input_len']}: {r['api_process_cpu_share']:.2f}"
            for r in doc["rows"] if r.get("api_process_cpu_share") is not None]
    if busy:
        notes.append("- CPU share of the launched server's API process during each level (near 1.00: one core of "
                     "vLLM's frontend, not the engine, may have set the pace): " + "; ".join(busy))
    notes += [f"- {r['label']} c={r['concurrency']} in={r['input_len']}: errors: {'; '.join(r['errors'])}"
              for r in doc["rows"] if r["errors"]]
    notes += source_notes(doc["machine"], doc["rows"], "label")
    if notes:
        lines += ["", "## Notes", ""] + notes
    return "\n".join(lines)


def plot(doc: dict[str, Any], png: Path) -> None:
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    shapes = sorted({(r["input_len"], r["output_len"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label in dict.fromkeys(r["label"] for r in rows):
        for shape in shapes:
            pts = sorted((r["concurrency"], r) for r in rows if r["label"] == label
                         and (r["input_len"], r["output_len"]) == shape)
            if not pts:
                continue
            xs = [c for c, _ in pts]
            name = f"{label} {shape[0]}/{shape[1]}" if len(shapes) > 1 else label
            axes[0].plot(xs, [r["ttft"]["mean_ms"] for _, r in pts], marker="o", label=name)
            axes[1].plot(xs, [r["output_throughput"] for _, r in pts], marker="o", label=name)
    for ax, title in ((axes[0], "TTFT mean (ms, lower is better)"), (axes[1], "output tokens/s (higher is better)")):
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in rows})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"anychip bench serve — {doc['machine']['cpu']}, {doc['machine']['cpus']} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _merge(path: Path, doc: dict[str, Any], label: str) -> dict[str, Any]:
    """Keep the other labels' rows from an existing report (each row carries the command that measured it)."""
    old = read_serve_report(path)
    if old is None:
        return doc
    doc["rows"] = [r for r in old.get("rows", []) if r["label"] != label] + doc["rows"]
    return doc


def read_serve_report(path: Path) -> dict[str, Any] | None:
    """--append's earlier serve report (report.read_report_to_append), whose rows carry their labels."""
    return read_report_to_append(path, "serve", lambda doc: doc.get("benchmark") == "serve" and isinstance(
        doc.get("rows"), list) and all(isinstance(r, dict) and "label" in r for r in doc["rows"]))


def measure_server(url: str, args: argparse.Namespace,
                   on_row: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Every scenario against one server; one row each. on_row(rows so far) runs after each level, so a run cut
    short (a timeout, a crash of a later level) keeps the levels it finished. A server this process launched
    (`url.pid`) also gets each level's CPU share of its API process: near 1.0, one core of the frontend, not the
    engine, may have set the pace."""
    from anychip.bench.server import process_cpu_s

    check_loopback(url)
    pid = getattr(url, "pid", None)
    lo, hi = (args.vocab_range + [0, 0])[:2]
    if not 0 <= lo < hi:
        raise AnychipError(f"--vocab-range {args.vocab_range}: give LO,HI with 0 <= LO < HI")
    model = args.model or server_model(url)
    label = args.label or Path(model).name
    plan = scenarios(args.concurrency, args.input_len, args.output_len, args.num_prompts)
    print(f"anychip bench serve: {url} model {model} as {label!r}: {len(plan)} level(s)")
    # one short request first: the server's first request pays one-off costs
    asyncio.run(run_level(url, model, Scenario(1, min(args.input_len), 2, 1), (lo, hi), args.seed + 999,
                          args.timeout_s, progress=False))
    rows = []
    for n, sc in enumerate(plan):
        waited = wait_for_idle(args.wait_idle) if args.wait_idle else None
        load_before = os.getloadavg()[0]
        cpu_before = process_cpu_s(pid)
        records, duration = asyncio.run(run_level(url, model, sc, (lo, hi), args.seed + n, args.timeout_s))
        row = row_for(label, url, model, sc, records, duration, args.peak_tflops, args.peak_gbps)
        row["loadavg"] = [load_before, os.getloadavg()[0]]
        cpu_after = process_cpu_s(pid)
        if cpu_before is not None and cpu_after is not None and duration > 0:
            row["api_process_cpu_share"] = round((cpu_after - cpu_before) / duration, 3)
        row["waited_for_idle_s"] = waited
        rows.append(row)
        print(f"  c={sc.concurrency:<3} in={sc.input_len:<6} out={sc.output_len:<5} {row['completed']}/"
              f"{sc.num_prompts} ok  TTFT {fmt(row['ttft']['mean_ms'])} ms  TPOT {fmt(row['tpot']['mean_ms'])} ms  "
              f"{fmt(row['output_throughput'])} out tok/s  {fmt(row['total_throughput'])} total tok/s"
              + (f"  errors: {row['errors'][0]}" if row["errors"] else ""))
        if on_row is not None:
            on_row(rows)
    return rows


def graph_sizes(flags: list[str]) -> list[int] | None:
    """The CUDA graph capture sizes a server's flags give it through --compilation-config, if they give any."""
    for name, value in zip(flags, flags[1:]):
        if name == "--compilation-config":
            try:
                sizes = json.loads(value).get("cudagraph_capture_sizes")
            except (ValueError, AttributeError):
                return None
            return [int(s) for s in sizes] if isinstance(sizes, list) else None
    return None


def tokenizer_gap(model: Path) -> str | None:
    """Why a model's server may be measured wrongly: ids its vocabulary has and its tokenizer lacks. A model that
    samples one (a random-weight model made before its tokenizer covered its vocabulary) makes vLLM's detokenizer
    decode the whole prompt again at each such step, so at long inputs the API process, not the engine, sets the
    pace (measured: 10x the API process's CPU time at 16k-token prompts)."""
    from anychip.checkpoint.model_dir import ModelDir
    from anychip.checkpoint.verify import tokenizer_size

    try:
        vocab = int(ModelDir.open(model).config.get("vocab_size") or 0)
        tok = tokenizer_size(model)
    except (OSError, ValueError, TypeError, AnychipError):
        return None
    if tok is None or vocab <= tok:
        return None
    return (f"{model.name}: its vocabulary has {vocab} ids, its tokenizer {tok}; a sampled id above {tok - 1} makes "
            "the server's detokenizer decode the whole prompt again, so long-input TTFT/TPOT measure the API "
            "process (rebuild a synthetic model with this anychip: its tokenizer covers the vocabulary)")


def _launched(args: argparse.Namespace,
              on_row: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    import tempfile

    from anychip.bench.server import local_server

    model = Path(args.launch).expanduser().resolve()
    args.label = args.label or (("vllm-" if args.stock else "anychip-") + model.name)
    if args.server_log:
        log = Path(args.server_log).expanduser().resolve()
        log.parent.mkdir(parents=True, exist_ok=True)
    else:
        log = Path(tempfile.mkdtemp(prefix="anychip-bench-serve-")) / "server.log"
    print(f"anychip bench serve: starting {'stock vLLM' if args.stock else 'anychip'} server for {model} (log: {log})")
    gap = tokenizer_gap(model)
    if gap:
        print(f"anychip bench serve: warning: {gap}")
    t0 = time.perf_counter()
    with local_server(model, plugin=not args.stock, extra=args.server_arg, log=log) as url:
        server = {"model": str(model), "plugin": not args.stock, "extra_args": args.server_arg,
                  "start_s": round(time.perf_counter() - t0, 1), "log": str(log), "tokenizer_gap": gap,
                  "command": url.command, "cuda_graph_sizes": graph_sizes(url.command or [])}

        def tagged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [dict(r, server=server) for r in rows]

        rows = measure_server(url, args, None if on_row is None else lambda rows: on_row(tagged(rows)))
    return tagged(rows)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    check_json_path(args.json)
    if args.append and args.json:
        read_serve_report(Path(args.json))  # before any server starts
    apply_preset(args)
    plan = scenarios(args.concurrency, args.input_len, args.output_len, args.num_prompts)  # checked before a server
    if bool(args.url) == bool(args.launch):
        raise AnychipError("give either a server URL or --launch MODEL (not both, not neither)")
    if (args.stock or args.server_arg or args.server_log) and not args.launch:
        raise AnychipError("--stock, --server-arg and --server-log only apply with --launch MODEL")
    where = machine()  # before measuring: the source state is the one the server loads
    lo, hi = (args.vocab_range + [0, 0])[:2]
    command = command_line(getattr(args, "argv", None))
    measured_at = now()

    def publish(rows: list[dict[str, Any]]) -> None:
        """Write the report with the levels measured so far (again after every level)."""
        if not args.json:
            return
        rows = [dict(r, command=command, measured_at=measured_at, source=where.get("source")) for r in rows]
        doc = {"benchmark": "serve", "created": now(), "machine": where, "rows": rows,
               "settings": {"vocab_range": [lo, hi], "seed": args.seed, "preset": args.preset, "scale": args.scale,
                            "peak_tflops": args.peak_tflops, "peak_gbps": args.peak_gbps}}
        path = Path(args.json)
        if args.append:
            doc = _merge(path, doc, rows[0]["label"] if rows else "")
        doc["commands"] = list(dict.fromkeys(r["command"] for r in doc["rows"] if r.get("command")))
        doc["comparisons"] = comparisons(doc["rows"], args.baseline)
        done = {(r["concurrency"], r["input_len"], r["output_len"]) for r in rows}
        if not_run := [f"c={sc.concurrency} in={sc.input_len} out={sc.output_len}" for sc in plan
                       if (sc.concurrency, sc.input_len, sc.output_len) not in done]:
            doc["not_run"] = not_run  # a report written between levels: what a run stopped there lacks
        labels = sorted({r["label"] for r in doc["rows"]})
        if args.baseline is not None and args.baseline not in labels:
            print(f"anychip bench serve: --baseline {args.baseline}: no rows with that label (labels: "
                  f"{', '.join(labels)}): no ratios written", file=sys.stderr)
        for p in write_outputs(path, doc, render_markdown(doc), plot):
            print(f"wrote {p}")

    if args.launch:
        rows = _launched(args, publish)
    else:
        url = args.url.rstrip("/")
        rows = measure_server(url if url.endswith("/v1") else url + "/v1", args, publish)
    if not rows:
        publish(rows)
    return 0 if all(r["failed"] == 0 for r in rows) else 1
