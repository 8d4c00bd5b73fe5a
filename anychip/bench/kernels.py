"""`anychip bench kernels`: our W4A8 linear against every CPU route torch and stock vLLM offer, in one run.

Peers, each timed on the same shapes:
  bf16     F.linear with BF16 weights (vLLM's unquantized CPU path)
  w4a16    aten._weight_int4pack_mm_for_cpu (INT4 weights, BF16 activations; torchao's CPU route)
  int_mm   torch._int_mm on pre-quantized INT8 (no group scales, no activation quantization: a ceiling)
  dyn4bit  aten._dyn_quant_matmul_4bit (what stock vLLM runs for W4A8 on x86: a dequantizing fallback)
Weights are rotated through enough copies to exceed twice the last-level cache, so M=1 measures streaming from
DRAM as a decoder does. Timings are medians of repeated batches; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from anychip import envs
from anychip.bench.report import check_json_path
from anychip.errors import AnychipError
from anychip.kernels import cpu_ext, routes
from anychip.kernels.prepare import prepare_w4a8
from anychip.kernels.routes.base import PreparedW4A8

SHAPES: tuple[tuple[int, int], ...] = ((2048, 6144), (6144, 2048), (2048, 2048), (576, 1536), (1536, 576))
#: (model, layer, K, N) of every linear a decode step runs at M=1, as vLLM merges them (qkv, gate_up), plus
#: SmolLM2-135M's unmerged ones: the default model (hidden 576, intermediate 1536) and the llama-1b / llama-2b
#: synthetic shapes (anychip/checkpoint/synthetic.py).
DECODE_SHAPES: tuple[tuple[str, str, int, int], ...] = (
    ("smollm2-135m", "k_proj / v_proj", 576, 192),
    ("smollm2-135m", "q_proj / o_proj", 576, 576),
    ("smollm2-135m", "qkv_proj", 576, 960),
    ("smollm2-135m", "gate_proj / up_proj", 576, 1536),
    ("smollm2-135m", "gate_up_proj", 576, 3072),
    ("smollm2-135m", "down_proj", 1536, 576),
    ("llama-1b", "qkv_proj", 2048, 3072),
    ("llama-1b", "o_proj", 2048, 2048),
    ("llama-1b", "gate_up_proj", 2048, 16384),
    ("llama-1b", "down_proj", 8192, 2048),
    ("llama-2b", "qkv_proj", 2048, 4096),
    ("llama-2b", "gate_up_proj", 2048, 12288),
    ("llama-2b", "down_proj", 6144, 2048),
)
TOKENS: tuple[int, ...] = (1, 4, 512)
GROUP_SIZE = 128  # the scheme's default; 64 where K is not a multiple of 128 (K=576)
PEERS: tuple[str, ...] = ("bf16", "w4a16", "int_mm", "dyn4bit")
_OP = torch.ops.anychip.w4a8_linear.default  # registered by kernels.prepare's import of kernels.ops


@dataclass(frozen=True)
class Targets:
    """The goals the report checks (reported, never asserted)."""

    m1_bandwidth_frac: float = 0.60  # M=1, large shapes: weight bytes / time vs measured read bandwidth
    decode_bandwidth_frac: float = 0.70  # M=1, every DECODE_SHAPES linear, the same ratio
    m1_vs_bf16: float = 2.0
    m1_vs_w4a16: float = 1.3
    m512_vs_bf16: float = 1.5
    m512_vs_int_mm: float = 0.7
    vs_dyn4bit: float = 100.0


def llc_bytes() -> int:
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        if (index / "level").read_text().strip() == "3":
            size = (index / "size").read_text().strip()
            return int(size[:-1]) * 1024 if size.endswith("K") else int(size)
    return 32 << 20


def read_bandwidth_gbs(
    size: int = 1 << 30, reps: int = 5, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Streaming read bandwidth: the C++ probe (xor-reduce of 64-byte vectors) and torch.sum on fp32."""
    buf = torch.ones(size, dtype=torch.uint8)
    ext = cpu_ext.load(envs.build_dir())

    def best(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = clock()
            fn()
            times.append(clock() - t0)
        return size / min(times) / 1e9

    probe = best(lambda: ext.read_bytes(buf))
    fbuf = buf.view(torch.float32)
    tsum = best(lambda: fbuf.sum())
    return {"probe_gbs": round(probe, 2), "torch_sum_gbs": round(tsum, 2), "read_gbs": round(max(probe, tsum), 2)}


def time_ms(
    calls: list[Callable[[], object]], budget_s: float, min_iters: int = 3, clock: Callable[[], float] = time.perf_counter,
    batch_s: float = 0.005, max_batches: int = 60,
) -> float:
    """Per-call time: the fastest of short batches (about batch_s each), calls cycling through the weight copies.

    On a machine shared with other work, preemption only ever adds time, and a short batch has a fair chance of
    running undisturbed; the minimum is that undisturbed time.  budget_s=0 with min_iters=1: one cold call (for
    peers that take seconds)."""
    if budget_s > 0 or min_iters > 1:
        for fn in calls[: min(len(calls), 2)]:
            fn()
    t0 = clock()
    calls[0]()
    once = max(clock() - t0, 1e-6)
    if budget_s == 0 and min_iters == 1:
        return once * 1e3
    per_batch = max(1, int(batch_s / once))
    batches = max(min_iters, min(max_batches, int(budget_s / (once * per_batch))))
    best, i = float("inf"), 0
    for _ in range(batches):
        t0 = clock()
        for _ in range(per_batch):
            calls[i % len(calls)]()
            i += 1
        best = min(best, (clock() - t0) / per_batch)
    return best * 1e3


def _copies(bytes_per_copy: int, llc: int) -> int:
    """Copies of a weight that total twice the LLC: a small decode linear (62 KB) needs about a thousand."""
    return max(1, min(4096, -(-2 * llc // max(bytes_per_copy, 1))))


def bench_shape(
    m: int, k: int, n: int, llc: int, budget_s: float, dyn_iters: int, clock: Callable[[], float] = time.perf_counter,
    peers: tuple[str, ...] = PEERS, batch_s: float = 0.005, group: int | None = None,
) -> dict[str, object]:
    """One shape, ours and `peers`; dyn_iters=0 leaves dyn4bit out. batch_s: see time_ms. group: the group size
    (a model's); by default GROUP_SIZE, or 64 where it does not divide K."""
    timed = functools.partial(time_ms, clock=clock, batch_s=batch_s, max_batches=max(60, int(0.3 / batch_s)))
    g = group or (GROUP_SIZE if k % GROUP_SIZE == 0 else 64)
    gen = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    wq = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    sw = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).bfloat16()  # a checkpoint's scales are bf16
    x = torch.randn(m, k, generator=gen).bfloat16()
    row: dict[str, object] = {"M": m, "K": k, "N": n, "G": g}

    # ours: the op vLLM calls (quantize + GEMM + dequant, output bf16)
    policy = envs.kernel_policy()
    ours = prepare_w4a8(wq, sw, g, packed=False, policy=policy)
    ours_bytes = ours.weight.numel() + ours.scales.numel() * ours.scales.element_size()
    preps = [ours] + [replace(ours, weight=ours.weight.clone(), scales=ours.scales.clone())
                      for _ in range(_copies(ours_bytes, llc) - 1)]
    row["anychip_ms"] = timed([lambda p=p: _call(x, p) for p in preps], budget_s)
    row["weight_bytes"] = ours_bytes
    row["isa"] = ours.route.isa
    row["route"] = ours.route.id
    del preps

    if "bf16" in peers:
        wdq = (wq.float().view(n, k // g, g) * sw.unsqueeze(2)).reshape(n, k)
        wb = wdq.bfloat16()
        ws = [wb] + [wb.clone() for _ in range(_copies(wb.numel() * 2, llc) - 1)]
        row["bf16_ms"] = timed([lambda w=w: F.linear(x, w) for w in ws], budget_s)
        del ws

    if "w4a16" in peers:
        w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu((wq.int() + 8).contiguous(), 2)
        sz = torch.stack([sw.t(), torch.zeros_like(sw.t())], dim=2).bfloat16().contiguous()  # (K/G, N, 2)
        w4s = [w4] + [w4.clone() for _ in range(_copies(w4.numel() + sz.numel() * 2, llc) - 1)]
        row["w4a16_ms"] = timed(
            [lambda w=w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, g, sz) for w in w4s], budget_s
        )
        del w4s

    if "int_mm" in peers:
        xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
        wts = [wq.t()] + [wq.clone().t() for _ in range(_copies(wq.numel(), llc) - 1)]  # (K, N) views, as Linear
        row["int_mm_ms"] = timed([lambda w=w: torch._int_mm(xq, w) for w in wts], budget_s)
        del wts

    if dyn_iters and "dyn4bit" in peers:
        u = (wq.to(torch.int16) + 8).to(torch.uint8).view(n, k // 2, 2)
        nibbles = (u[..., 0] | (u[..., 1] << 4)).contiguous()
        dyn = torch.ops.aten._dyn_quant_pack_4bit_weight(nibbles, sw.bfloat16(), None, g, k, n)
        xf = x.float()  # group-wise requires fp32 activations, as vLLM's Dynamic4bitLinearKernel upcasts
        row["dyn4bit_ms"] = time_ms(
            [lambda: torch.ops.aten._dyn_quant_matmul_4bit(xf, dyn, g, k, n)], 0.0, min_iters=dyn_iters, clock=clock
        )

    ours_ms = float(row["anychip_ms"])  # type: ignore[arg-type]
    for peer in PEERS:
        if f"{peer}_ms" in row:
            row[f"vs_{peer}"] = round(float(row[f"{peer}_ms"]) / ours_ms, 2)  # type: ignore[arg-type]
    row["weight_gbs"] = round(ours_bytes / (ours_ms * 1e-3) / 1e9, 2)
    row["gops"] = round(2 * m * n * k / (ours_ms * 1e-3) / 1e9, 1)
    for key in ("anychip_ms", "bf16_ms", "w4a16_ms", "int_mm_ms", "dyn4bit_ms"):
        if key in row:
            row[key] = round(float(row[key]), 4)  # type: ignore[arg-type]
    return row


def _call(x: torch.Tensor, p: PreparedW4A8) -> torch.Tensor:
    """The op's OpOverload, called from Python with no wrapper around it: as vLLM's compiled graph calls it with
    Inductor's Python wrapper. Each call carries a few µs of Python and dispatcher time that a graph with the C++
    wrapper (vLLM's CPU engines under the plugin) does not pay, which weighs on the smallest shapes."""
    return _OP(x, p.weight, p.scales, None, p.n, p.k, p.group_size, p.route.code, None)


def bench_decode_shape(model: str, layer: str, k: int, n: int, llc: int, budget_s: float, read_gbs: float,
                       clock: Callable[[], float] = time.perf_counter, group: int | None = None) -> dict[str, object]:
    """One decode linear at M=1 at the model's group size: ours against W4A16 and BF16, and our weight bytes / time
    vs the read bandwidth."""
    row: dict[str, object] = {"model": model, "layer": layer}
    # 1 ms batches: a decode linear takes 10-1000 us, and on a shared machine a short batch is the likelier to
    # run with both threads undisturbed
    row |= bench_shape(1, k, n, llc, budget_s, 0, clock=clock, peers=("bf16", "w4a16"), batch_s=0.001, group=group)
    row["bandwidth_frac"] = round(float(row["weight_gbs"]) / read_gbs, 3)  # type: ignore[arg-type]
    return row


@dataclass(frozen=True)
class DecodeStep:
    """One model's decode step as vLLM runs it: `layers` x the merged linears (label, K, N) at group size `group`,
    then the BF16 output head (vocab, hidden)."""

    name: str
    layers: int
    group: int
    linears: tuple[tuple[str, int, int], ...]
    head: tuple[int, int]

    @classmethod
    def of_config(cls, config: dict[str, object], name: str) -> DecodeStep:
        """From a Llama config.json: the checkpoint's group size when it is quantized, else the largest supported
        one that divides every K."""
        from anychip.checkpoint.layout import DecoderDims
        from anychip.formats import GROUP_SIZES

        d = DecoderDims.from_config(config)  # type: ignore[arg-type]
        linears = tuple((label, k, n) for label, (n, k) in d.merged_linear_shapes().items())
        groups = (config.get("quantization_config") or {}).get("config_groups") or {}  # type: ignore[union-attr]
        sizes = [int(g["weights"]["group_size"]) for g in groups.values() if g.get("weights", {}).get("group_size")]
        fits = [g for g in GROUP_SIZES if all(k % g == 0 for _, k, _ in linears)]
        group = sizes[0] if sizes else max(fits or [min(GROUP_SIZES)])
        return cls(name, d.layers, group, linears, (d.vocab, d.hidden))

    @classmethod
    def of_model(cls, model: Path) -> DecodeStep:
        path = Path(model) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise AnychipError(f"--model {model}: cannot read {path}: {exc}") from exc
        from anychip.checkpoint.layout import check_architecture

        check_architecture(config, str(path))  # an MoE or fused-projection model is not timed as a dense Llama
        return cls.of_config(config, Path(model).name)

    def decode_shapes(self) -> tuple[tuple[str, str, int, int], ...]:
        """Its linears as DECODE_SHAPES rows."""
        return tuple((self.name, label, k, n) for label, k, n in self.linears)


#: The default model's (SmolLM2-135M, G=32 as its checkpoint) step, when no --model is given.
DEFAULT_STEP = DecodeStep("smollm2-135m", 30, 32, (("qkv_proj", 576, 960), ("o_proj", 576, 576),
                                                   ("gate_up_proj", 576, 3072), ("down_proj", 1536, 576)),
                          (49152, 576))


def bench_decode_step(reps: int, clock: Callable[[], float] = time.perf_counter,
                      step: DecodeStep = DEFAULT_STEP) -> dict[str, object]:
    """The kernels of one decode step in the model's order, outside vLLM: every W4A8 linear at M=1 with distinct
    weights (for the default model 60 MB: beyond a 32 MB LLC, so each streams from DRAM; on a CPU whose L3 holds a
    whole step, such as the 480 MB the Xeon VMs report, from L3 — as in a real step on either), then the head
    through its route. Per step: the fastest and the median of `reps` steps, for the linears and
    the head."""
    from anychip.kernels.routes.head import select_head

    policy = envs.kernel_policy()
    gen = torch.Generator().manual_seed(0)
    g = step.group
    layers = [prepare_w4a8(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen),
                           (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3).bfloat16(), g, packed=False,
                           policy=policy)
              for _ in range(step.layers) for _, k, n in step.linears]
    head = select_head(policy).prepare((torch.randn(*step.head, generator=gen) * 0.05).bfloat16(), policy)
    xs = {k: torch.randn(1, k, generator=gen).bfloat16() for k in {k for _, k, _ in step.linears} | {step.head[1]}}
    lin_s, head_s = [], []
    for rep in range(reps + 2):  # two warm-up steps
        t0 = clock()
        for p in layers:
            _call(xs[p.k], p)
        t1 = clock()
        head.logits(xs[step.head[1]])
        if rep >= 2:
            lin_s.append(t1 - t0), head_s.append(clock() - t1)
    lin_bytes = sum(p.weight.numel() + p.scales.numel() * p.scales.element_size() for p in layers)
    head_bytes = step.head[0] * step.head[1] * 2

    def stats(times: list[float], nbytes: int) -> dict[str, float]:
        return {"min_ms": round(min(times) * 1e3, 3), "median_ms": round(sorted(times)[len(times) // 2] * 1e3, 3),
                "gbs_at_min": round(nbytes / min(times) / 1e9, 2)}

    return {"model": step.name, "group_size": g, "layers": step.layers,
            "linears": {"calls": len(layers), "bytes": lin_bytes, **stats(lin_s, lin_bytes)},
            "head": {"route": head.route.id, "shape": list(step.head), "bytes": head_bytes,
                     **stats(head_s, head_bytes)}, "reps": reps}


def check_targets(rows: list[dict[str, object]], read_gbs: float, t: Targets,
                  decode: list[dict[str, object]] | None = None) -> list[dict[str, object]]:
    """One entry per target: the worst case over the rows it covers, and whether it is met."""
    large = [r for r in rows if r["M"] == 1 and int(r["K"]) * int(r["N"]) >= 2048 * 2048]
    m1 = [r for r in rows if r["M"] == 1]
    m512 = [r for r in rows if r["M"] == 512]

    def worst(name: str, subset: list[dict[str, object]], key: str, goal: float, scale: float = 1.0):
        subset = [r for r in subset if key in r]
        if not subset:
            return None
        values = [float(r[key]) * scale for r in subset]  # type: ignore[arg-type]
        return {"target": name, "goal": goal, "worst": round(min(values), 2), "met": min(values) >= goal}

    out = [
        worst("M=1 large: weight GB/s / read bandwidth", large, "weight_gbs", t.m1_bandwidth_frac, 1 / read_gbs),
        worst("M=1 decode shapes: weight GB/s / read bandwidth", decode or [], "bandwidth_frac",
              t.decode_bandwidth_frac),
        worst("M=1: x BF16 F.linear", m1, "vs_bf16", t.m1_vs_bf16),
        worst("M=1: x W4A16 int4pack_mm", m1, "vs_w4a16", t.m1_vs_w4a16),
        worst("M=512: x BF16 F.linear", m512, "vs_bf16", t.m512_vs_bf16),
        worst("M=512: x torch._int_mm", m512, "vs_int_mm", t.m512_vs_int_mm),
        worst("all: x dyn4bit", rows, "vs_dyn4bit", t.vs_dyn4bit),
    ]
    return [o for o in out if o is not None]


def _fmt(r: dict[str, object], key: str, spec: str = ".4f") -> str:
    return format(r[key], spec) if key in r else "-"


def markdown_run(run: dict[str, object]) -> list[str]:
    bw = run["bandwidth"]
    lines = [
        f"### {run['title']}",
        "",
        f"Read bandwidth {bw['read_gbs']} GB/s (C++ probe {bw['probe_gbs']}, torch.sum {bw['torch_sum_gbs']}); "
        f"load average {run['load_before']} before, {run['load_after']} after.",
    ]
    if run["rows"]:
        lines += [
            "",
            "| M | K | N | anychip | bf16 | w4a16 | int_mm | dyn4bit | xbf16 | xw4a16 | xint_mm | xdyn4bit "
            "| weight GB/s | GOPS |",
            "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
    for r in run["rows"]:  # type: ignore[union-attr]
        lines.append(
            f"| {r['M']} | {r['K']} | {r['N']} | {_fmt(r, 'anychip_ms')} | {_fmt(r, 'bf16_ms')} "
            f"| {_fmt(r, 'w4a16_ms')} | {_fmt(r, 'int_mm_ms')} | {_fmt(r, 'dyn4bit_ms', '.1f')} "
            f"| {_fmt(r, 'vs_bf16', '')} | {_fmt(r, 'vs_w4a16', '')} | {_fmt(r, 'vs_int_mm', '')} "
            f"| {_fmt(r, 'vs_dyn4bit', '')} | {r['weight_gbs']} | {r['gops']} |"
        )
    if run.get("decode_rows"):
        lines += ["", "M=1, every linear of a decode step at the model's group size (the op called from Python, as a "
                  "graph with Inductor's Python wrapper calls it: a few µs a call more than from the C++ "
                  "wrapper):", "",
                  "| model | layer | K | N | G | anychip | w4a16 | bf16 | xw4a16 | xbf16 | weight GB/s "
                  "| of read bandwidth |",
                  "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for r in run["decode_rows"]:  # type: ignore[union-attr]
            lines.append(
                f"| {r['model']} | {r['layer']} | {r['K']} | {r['N']} | {r.get('G', '')} | {_fmt(r, 'anychip_ms')} "
                f"| {_fmt(r, 'w4a16_ms')} "
                f"| {_fmt(r, 'bf16_ms')} | {_fmt(r, 'vs_w4a16', '')} | {_fmt(r, 'vs_bf16', '')} | {r['weight_gbs']} "
                f"| {float(r['bandwidth_frac']):.0%} |")
    if step := run.get("decode_step"):
        lines += ["", f"A {step.get('model', DEFAULT_STEP.name)} decode step's kernels in the model's order "
                  f"(G={step.get('group_size', DEFAULT_STEP.group)}, distinct weights, "
                  f"{step['reps']} steps; the op called as vLLM's graph calls it, no vLLM around it):", "",
                  "| part | MB read | fastest ms | median ms | GB/s at fastest | of read bandwidth |",
                  "|---|--:|--:|--:|--:|--:|"]
        for name, part in ((f"{step['linears']['calls']} W4A8 linears", step["linears"]), (f"head ({step['head']['route']})", step["head"])):
            lines.append(f"| {name} | {part['bytes'] / 1e6:.1f} | {part['min_ms']} | {part['median_ms']} "
                         f"| {part['gbs_at_min']} | {part['gbs_at_min'] / float(bw['read_gbs']):.0%} |")
    lines += ["", "| target | goal | worst case | met |", "|---|--:|--:|:-:|"]
    for t in run["targets"]:  # type: ignore[union-attr]
        lines.append(f"| {t['target']} | {t['goal']} | {t['worst']} | {'yes' if t['met'] else 'no'} |")
    return lines + [""]


def markdown(report: dict[str, object]) -> str:
    lines = [
        "# W4A8 kernel benchmark",
        "",
        f"Command: `{report['command']}`",
        "",
        f"CPU: {report['cpu']} ({report['cores']} cores), ISA {report['isa']}, torch {report['torch']}. "
        f"Grid rows G={GROUP_SIZE} (64 where it does not divide K), decode rows the model's (column G); activations "
        "BF16, every method's weights rotated through copies totalling 2x the LLC. Times in ms: the fastest of short "
        "batches (preemption only adds time). `xPEER` = peer time / ours (above 1: we are faster). Weight GB/s "
        "counts the int4 bytes plus the group scales that we read (bf16, as a checkpoint's).",
        "",
    ]
    for run in report["runs"]:  # type: ignore[union-attr]
        lines += markdown_run(run)
    return "\n".join(lines)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _progress(title: str, row: dict[str, object]) -> None:
    print(f"[{title}] M={row['M']:4d} K={row['K']:5d} N={row['N']:5d}  " + "  ".join(
        f"{key[:-3]} {row[key]:.4f}" for key in row if str(key).endswith("_ms")), flush=True)


def bench_run(
    title: str, threads: int, clock: Callable[[], float], quick: bool, dyn_iters: int, llc: int,
    decode_only: bool = False, step: DecodeStep | None = None,
) -> dict[str, object]:
    """The SHAPES x TOKENS grid (unless decode_only), then every decode linear at M=1 (DECODE_SHAPES, or the
    given model's step), then (decode_only) the whole step's kernels."""
    shapes = SHAPES[:2] + SHAPES[3:4] if quick else SHAPES
    budget_s = 0.3 if quick else 1.0
    with _threads(threads):
        load_before = _load()
        bandwidth = read_bandwidth_gbs(size=(256 << 20) if quick else (1 << 30), clock=clock)
        rows = []
        for m, (k, n) in [] if decode_only else [(m, kn) for m in TOKENS for kn in shapes]:
            rows.append(bench_shape(m, k, n, llc, budget_s, dyn_iters, clock=clock))
            _progress(title, rows[-1])
        decode = []
        for model, layer, k, n in step.decode_shapes() if step is not None else DECODE_SHAPES:
            group = step.group if step is not None else DEFAULT_STEP.group if model == DEFAULT_STEP.name else None
            decode.append(bench_decode_shape(model, layer, k, n, llc, budget_s, float(bandwidth["read_gbs"]), clock,
                                             group))
            _progress(title, decode[-1])
        timed = bench_decode_step(20 if quick else 60, clock, step or DEFAULT_STEP) if decode_only else None
        # other work on a shared machine takes bandwidth at times: the best of the probes before and after is the
        # bandwidth every fraction is taken of (the stricter choice)
        after = read_bandwidth_gbs(size=(256 << 20) if quick else (1 << 30), clock=clock)
        if after["read_gbs"] > bandwidth["read_gbs"]:
            bandwidth = after
            for row in decode:
                row["bandwidth_frac"] = round(float(row["weight_gbs"]) / float(after["read_gbs"]), 3)
    run: dict[str, object] = {
        "title": title, "threads": threads, "clock": clock.__name__, "load_before": load_before,
        "load_after": _load(), "bandwidth": bandwidth, "rows": rows, "decode_rows": decode,
    }
    if timed is not None:
        run["decode_step"] = timed
    run["targets"] = check_targets(rows, float(bandwidth["read_gbs"]), Targets(), decode)
    return run


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    """All threads by wall clock (what a caller sees), then one thread by its CPU time: on a machine shared with
    other work, preemption inflates wall-clock times of multi-threaded calls far more than the kernels' own cost."""
    check_json_path(args.json)
    quick = bool(getattr(args, "quick", False))
    decode_only = bool(getattr(args, "decode_only", False))
    if getattr(args, "device", "cpu") == "cuda":  # the NVIDIA route's own benchmark (kernels_gpu.py)
        from anychip.bench import kernels_gpu

        argv = ["--json", args.json, "--md", str(Path(args.json).with_suffix(".md"))] if args.json else []
        return kernels_gpu.main(argv + (["--tokens", "1", "16", "4096"] if quick else []))
    step = DecodeStep.of_model(Path(args.model)) if getattr(args, "model", None) else None
    llc = llc_bytes()
    threads = torch.get_num_threads()
    runs = [
        bench_run(f"{threads} threads, wall clock", threads, time.perf_counter, quick, 1 if quick else 3, llc,
                  decode_only, step),
        bench_run("1 thread, thread CPU time", 1, time.thread_time, quick, 1, llc, decode_only, step),
    ]
    report: dict[str, object] = {
        "command": ("anychip bench kernels" + (" --quick" if quick else "") + (" --decode-only" if decode_only else "")
                    + (f" --model {args.model}" if getattr(args, "model", None) else "")
                    + (f" --json {args.json}" if args.json else "")),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "isa": routes.available("cpu")[0].isa,
        "route": routes.available("cpu")[0].id,
        "threads": threads,
        "torch": torch.__version__,
        "llc_bytes": llc,
        "group_size": GROUP_SIZE,
        "bandwidth": runs[0]["bandwidth"],
        "rows": runs[0]["rows"],
        "targets": runs[0]["targets"],
        "runs": runs,
    }
    text = markdown(report)
    print(text)
    if getattr(args, "json", None):
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        path.with_suffix(".md").write_text(text)
        print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--decode-only", action="store_true", help="only the M=1 decode shapes (DECODE_SHAPES)")
    parser.add_argument("--model", help="a model directory: its decode step's shapes instead of the default's")
    sys.exit(cmd_bench_kernels(parser.parse_args()))
