"""`python -m anychip.bench.kernels_gpu --json PATH`: the Triton W4A8 linear against cuBLAS and Marlin peers on one GPU.

Systems, each timed on the same shapes in the same run:
  w4a8       torch.ops.anychip.w4a8_linear: bf16 in, per-token INT8 quantization + INT4 x INT8 GEMM, bf16 out
  w4a8_gemm  the GEMM alone on pre-quantized activations (anychip::w4a8_linear_q)
  bf16       F.linear with BF16 weights (cuBLAS)
  int_mm     torch._int_mm on INT8 weights and activations (cuBLASLt IMMA, no group scales, no quantization: a
             ceiling for the integer arithmetic; it needs M > 16, so M <= 16 runs padded to 32 rows)
  marlin_w4a16, marlin_w4a8
             vLLM's Marlin GEMM on the same INT4 weights, repacked as vLLM serves a GPTQ linear, with BF16 or
             per-token INT8 activations (vllm_plugin/marlin_peer.py); each is checked once per shape against the torch
             reference, and the columns are None with a reason where vLLM's Marlin cannot run
Timing: each system's calls are captured in a CUDA graph (as vLLM captures decode steps) that rotates through
enough weight copies to exceed three times the L2 cache, so weights stream from HBM as in a real model; the
figure is the median over several graph replays of the time per call. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import anychip.kernels.ops  # noqa: F401  (registers torch.ops.anychip.*)
from anychip import envs
from anychip.kernels.gpu.timing import graph_ms, rotation
from anychip.kernels.prepare import prepare_w4a8
from anychip.kernels.reference import dequantize_weight_ref, quantize_activations_ref

SHAPES: tuple[tuple[int, int], ...] = ((2048, 6144), (6144, 2048), (4096, 4096), (4096, 14336))  # (K, N)
TOKENS: tuple[int, ...] = (1, 16, 512, 4096)
NOMINAL_HBM_GBS = 4800.0  # H200 datasheet
MARLIN_PEERS = {"marlin_w4a16": False, "marlin_w4a8": True}  # name -> INT8 activations
# ||y - ref|| / ||ref||; expected about 0.002: the bf16 output, bf16 dequantized weights (W4A16) and the int16 group
# scales (W4A8) each round at 2^-9. A layout or scale mistake gives errors of order 1.
MARLIN_MAX_REL_ERR = 0.01


def copy_bandwidth_gbs(size: int = 2 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written (the ceiling for streaming kernels)."""
    src = torch.randn(size // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = graph_ms([lambda: dst.copy_(src)], replays=10, samples=5)
    return 2 * size / ms / 1e6


def _copies(nbytes: int) -> int:
    return rotation(nbytes, torch.device("cuda"))


def bench_shape(m: int, k: int, n: int, g: int) -> dict[str, object]:
    gen = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randint(-8, 8, (n, k), device="cuda", dtype=torch.int8, generator=gen)
    s = (torch.rand(n, k // g, device="cuda", generator=gen) * 0.02 + 0.002).to(torch.bfloat16)
    flops = 2.0 * m * n * k
    row: dict[str, object] = {"m": m, "k": k, "n": n, "group_size": g}

    policy = envs.kernel_policy()
    prepared = prepare_w4a8(q, s, g, packed=False, policy=policy)
    w4_bytes = prepared.weight.numel() + prepared.scales.numel() * prepared.scales.element_size()
    preps = [prepared] + [prepare_w4a8(q, s, g, packed=False, policy=policy) for _ in range(_copies(w4_bytes) - 1)]
    ops = torch.ops.anychip
    row["w4a8_ms"] = graph_ms([lambda p=p: ops.w4a8_linear(x, p.weight, p.scales, None, n, k, g, p.route.code, None)
                               for p in preps])
    from anychip.kernels.gpu import launch

    xq, sx = ops.quantize_act(x)
    cfg = launch.serving_config(m, n, k, g, x.device)
    if isinstance(cfg, launch.GemvConfig):  # the GEMV alone, on activations already packed into its words
        xw, out = launch.words_of(xq), torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        row["w4a8_gemm_ms"] = graph_ms([lambda p=p: launch.launch_gemv(cfg, xw, sx, p.weight, p.scales, None, n, k,
                                                                        g, out) for p in preps])
    else:
        row["w4a8_gemm_ms"] = graph_ms([lambda p=p: ops.w4a8_linear_q(xq, sx, p.weight, p.scales, None, n, k, g,
                                                                      p.route.code, None, torch.bfloat16)
                                        for p in preps])
    row["w4a8_config"] = str(launch.config_for(m, n, k, g, x.device))
    del preps, prepared

    w16 = q.to(torch.bfloat16) * 0.01
    bf16 = [w16] + [w16.clone() for _ in range(_copies(w16.numel() * 2) - 1)]
    row["bf16_ms"] = graph_ms([lambda w=w: F.linear(x, w) for w in bf16])
    del bf16, w16
    row |= marlin_columns(x, q, s, g, _copies(w4_bytes))

    m_pad = max(m, 32)
    xq_pad = torch.randint(-127, 128, (m_pad, k), device="cuda", dtype=torch.int8, generator=gen)
    w8 = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen)
    w8s = [w8] + [w8.clone() for _ in range(_copies(w8.numel()) - 1)]
    row["int_mm_ms"] = graph_ms([lambda w=w: torch._int_mm(xq_pad, w.t()) for w in w8s])
    row["int_mm_m"] = m_pad
    del w8s, w8

    sized = [("w4a8", w4_bytes), ("w4a8_gemm", w4_bytes), ("bf16", n * k * 2), ("int_mm", n * k)]
    for name in MARLIN_PEERS:
        if row[f"{name}_ms"] is not None:
            row[f"{name}_speedup_vs_bf16"] = round(row["bf16_ms"] / row[f"{name}_ms"], 2)
            sized.append((name, w4_bytes))  # Marlin's repacked INT4 words and bf16 scales are the same bytes
    for name, nbytes in sized:
        ms = row[f"{name}_ms"]
        row[f"{name}_tops"] = round(flops / ms / 1e9, 2)
        row[f"{name}_weight_gbs"] = round(nbytes / ms / 1e6, 1)
        row[f"{name}_ms"] = round(ms, 5)
    row["speedup_vs_bf16"] = round(row["bf16_ms"] / row["w4a8_ms"], 2)
    row["speedup_vs_int_mm"] = round(row["int_mm_ms"] / row["w4a8_ms"], 2)
    return row


def peer_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, int8_activations: bool) -> torch.Tensor:
    """fp32 (M, N): x @ dequantized W^T, with x first quantized per token as the INT8 peer does (anychip's own
    quantizer; vLLM's rounds ties away from zero, which moves a rare element by one step)."""
    if int8_activations:
        xq, sx = quantize_activations_ref(x)
        xf = xq.float() * sx
    else:
        xf = x.float()
    return xf @ dequantize_weight_ref(q, s).t()


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def marlin_columns(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, g: int, copies: int) -> dict[str, object]:
    """vLLM's Marlin peers on the bench's weights: per peer its relative error against peer_reference, then the
    time per call over `copies` rotating weight copies; `<peer>_skipped` says why a peer has no time."""
    from anychip.vllm_plugin import marlin_peer

    reason = marlin_peer.unavailable_reason()
    cols: dict[str, object] = {}
    for name, int8 in MARLIN_PEERS.items():
        cols |= {f"{name}_ms": None, f"{name}_speedup_vs_bf16": None, f"{name}_rel_err": None,
                 f"{name}_skipped": reason}
        if reason:  # main() prints it once
            continue
        try:
            calls = [marlin_peer.make_marlin(q, s, g, int8_activations=int8)]
            err = relative_error(calls[0](x), peer_reference(x, q, s, int8))
            cols[f"{name}_rel_err"] = round(err, 5)
            if not err <= MARLIN_MAX_REL_ERR:  # also catches NaN
                cols[f"{name}_skipped"] = f"relative error {err:.3g} > {MARLIN_MAX_REL_ERR} against the torch reference"
                continue
            calls += [marlin_peer.make_marlin(q, s, g, int8_activations=int8) for _ in range(copies - 1)]
            cols[f"{name}_ms"] = graph_ms([lambda f=f: f(x) for f in calls])
        except Exception as exc:  # vLLM's internals: the peer's column says what failed, the bench goes on
            cols[f"{name}_skipped"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if cols[f"{name}_skipped"]:
            print(f"{name} M={x.shape[0]} K={q.shape[1]} N={q.shape[0]}: {cols[f'{name}_skipped']}", file=sys.stderr)
    return cols


def compile_reports(k: int = 4096, n: int = 4096, g: int = 128) -> list[dict[str, object]]:
    """Registers, spills, shared memory and MMA instruction of every candidate config (no timing)."""
    from anychip.kernels.gpu import launch

    q = torch.randint(-8, 8, (n, k), device="cuda", dtype=torch.int8)
    scales = torch.rand(n, k // g, device="cuda").to(torch.bfloat16)
    p = prepare_w4a8(q, scales, g, packed=False, policy=envs.kernel_policy())
    out = []
    for m in (1, 64, 4096):
        xq, sx = torch.ops.anychip.quantize_act(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        for cfg in launch.candidates(m, n, k, g, launch.multiprocessors(xq.device)):
            out.append({"m": m, **launch.compile_report(xq, sx, p.weight, p.scales, n, k, g, cfg)})
    return out


def device_info() -> dict[str, object]:
    props = torch.cuda.get_device_properties(0)
    info = {"gpu": props.name, "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda, "host": platform.node()}
    try:
        import triton

        info["triton"] = triton.__version__
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip()
    except (ImportError, OSError, subprocess.SubprocessError):
        pass
    return info


def _cell(value: object, fmt: str, unit: str = "") -> str:
    return "-" if value is None else format(value, fmt) + unit


def marlin_markdown(report: dict[str, object]) -> list[str]:
    """The vLLM Marlin peers beside W4A8 and BF16, and why any peer has no time."""
    peer = report.get("marlin", {})
    lines = ["", f"vLLM Marlin peers (vLLM {peer.get('vllm') or 'not installed'}) on the same INT4 weights (uint4b8, "
             f"G={report['group_size']}), timed the same way: W4A16 has BF16 activations; W4A8 quantizes "
             "activations per token to INT8 inside the call (vLLM's VLLM_MARLIN_INPUT_DTYPE=int8 path). Each was "
             f"checked against the torch reference first (relative error, at most {MARLIN_MAX_REL_ERR}).", "",
             "| M | K | N | bf16 ms | w4a8 ms | marlin w4a16 ms | marlin w4a8 ms | w4a8 vs bf16 "
             "| marlin w4a16 vs bf16 | marlin w4a8 vs bf16 | rel err w4a16 / w4a8 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(
            f"| {r['m']} | {r['k']} | {r['n']} | {r['bf16_ms']:.4f} | {r['w4a8_ms']:.4f} "
            f"| {_cell(r.get('marlin_w4a16_ms'), '.4f')} | {_cell(r.get('marlin_w4a8_ms'), '.4f')} "
            f"| {r['speedup_vs_bf16']:.2f}x | {_cell(r.get('marlin_w4a16_speedup_vs_bf16'), '.2f', 'x')} "
            f"| {_cell(r.get('marlin_w4a8_speedup_vs_bf16'), '.2f', 'x')} "
            f"| {_cell(r.get('marlin_w4a16_rel_err'), '.4f')} / {_cell(r.get('marlin_w4a8_rel_err'), '.4f')} |")
    skipped = {}
    for r in report["rows"]:
        for name in MARLIN_PEERS:
            if r.get(f"{name}_skipped"):
                skipped.setdefault((name, r[f"{name}_skipped"]), []).append(f"M={r['m']} K={r['k']} N={r['n']}")
    if skipped:
        lines.append("")
    every = len(report["rows"])
    lines += [f"- {name} not timed ({'all shapes' if len(shapes) == every else ', '.join(shapes)}): {why}"
              for (name, why), shapes in skipped.items()]
    return lines


def markdown(report: dict[str, object]) -> str:
    dev = report["device"]
    lines = [
        "# W4A8 Triton kernels on an NVIDIA GPU",
        "",
        f"Device: {dev['gpu']} ({dev['multiprocessors']} SMs, {dev['memory_gib']} GiB), torch {dev['torch']}, "
        f"CUDA {dev['cuda']}, triton {dev.get('triton', '?')}; measured copy bandwidth "
        f"{report['copy_gbs']:.0f} GB/s (read + write), datasheet {NOMINAL_HBM_GBS:.0f} GB/s.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"G={report['group_size']}, bf16 activations and output. Times are per call, the median of CUDA graph "
        "replays over rotating weight copies (weights stream from HBM). TOPS = 2MNK / time; weight GB/s = weight "
        "bytes (W4A8: packed INT4 + bf16 scales; bf16: 2 B; int_mm: 1 B per weight) / time. int_mm runs "
        "M <= 16 padded to 32 rows (its minimum is 17).",
        "",
        "| M | K | N | w4a8 ms | GEMM only ms | bf16 ms | int_mm ms | w4a8 TOPS | bf16 TFLOP/s | int_mm TOPS "
        "| w4a8 weight GB/s | GEMM weight GB/s | bf16 weight GB/s | vs bf16 | vs int_mm |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['m']} | {r['k']} | {r['n']} | {r['w4a8_ms']:.4f} | {r['w4a8_gemm_ms']:.4f} | {r['bf16_ms']:.4f} "
            f"| {r['int_mm_ms']:.4f} | {r['w4a8_tops']:.1f} | {r['bf16_tops']:.1f} | {r['int_mm_tops']:.1f} "
            f"| {r['w4a8_weight_gbs']:.0f} | {r['w4a8_gemm_weight_gbs']:.0f} | {r['bf16_weight_gbs']:.0f} "
            f"| {r['speedup_vs_bf16']:.2f}x "
            f"| {r['speedup_vs_int_mm']:.2f}x |")
    lines += marlin_markdown(report)
    lines += ["", "Compiler report per candidate config (K=N=4096, G=128):", "",
              "| M | config | registers | spills | shared bytes | MMA |", "|---:|---|---:|---:|---:|---|"]
    lines += [f"| {c['m']} | {c['config']} | {c['registers']} | {c['spills']} | {c['shared_bytes']} | {c['mma']} |"
              for c in report.get("compile_report", [])]
    lines += ["", "Tile configs chosen by the tuner (per shape and regime):", ""]
    lines += [f"- M={r['m']} K={r['k']} N={r['n']}: {r['w4a8_config']}" for r in report["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m anychip.bench.kernels_gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the full report here")
    ap.add_argument("--md", type=Path, help="write a Markdown table here")
    ap.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark times the NVIDIA GPU route; `anychip bench kernels` times the CPU",
              file=sys.stderr)
        return 2
    report: dict[str, object] = {
        "command": "python -m anychip.bench.kernels_gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": device_info(), "group_size": args.group_size, "copy_gbs": round(copy_bandwidth_gbs(), 1),
        "nominal_hbm_gbs": NOMINAL_HBM_GBS, "rows": []}
    from anychip.vllm_plugin import marlin_peer

    report["marlin"] = {"vllm": marlin_peer.vllm_version(), "unavailable": marlin_peer.unavailable_reason()}
    if report["marlin"]["unavailable"]:
        print(f"vLLM Marlin peers not timed: {report['marlin']['unavailable']}", file=sys.stderr)
    try:
        report["compile_report"] = compile_reports()
    except Exception as exc:  # a diagnostic: never stop the timings for it
        print(f"compile report failed: {exc!r}", file=sys.stderr)
    for k, n in SHAPES:
        for m in args.tokens:
            row = bench_shape(m, k, n, args.group_size)
            report["rows"].append(row)
            print(f"M={m:5d} K={k:5d} N={n:5d}  w4a8 {row['w4a8_ms']:.4f} ms (gemm {row['w4a8_gemm_ms']:.4f})  "
                  f"bf16 {row['bf16_ms']:.4f}  int_mm {row['int_mm_ms']:.4f}  "
                  f"marlin w4a16 {_cell(row['marlin_w4a16_ms'], '.4f')} w4a8 {_cell(row['marlin_w4a8_ms'], '.4f')}  "
                  f"w4a8 {row['w4a8_weight_gbs']:.0f} GB/s  {row['w4a8_tops']:.0f} TOPS", flush=True)
    text = markdown(report)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
