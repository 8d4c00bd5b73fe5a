"""A/B of the prepared scale dtype on one decode step's linears (not part of the package).

The same random INT4 weights and bf16-valued group scales, prepared twice through `prepare_w4a8`: once from bf16
scales (the layout now keeps them bf16) and once from their fp32 copy (the old fp32 layout). Every rep runs both
steps' linears at M = 1 in turn, alternating which goes first; the fastest and the median step of each are printed.
Usage: python ab.py [--model llama-1b|default] [--reps 200]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from anychip import envs
from anychip.kernels.prepare import prepare_w4a8, w4a8_linear

SHAPES = {  # (layers, group, ((K, N), ...))
    "default": (30, 32, ((576, 960), (576, 576), (576, 3072), (1536, 576))),
    "llama-1b": (16, 128, ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048))),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    layers, g, shapes = SHAPES[a.model]
    policy = envs.kernel_policy()
    gen = torch.Generator().manual_seed(0)
    arms: dict[str, list] = {"bf16": [], "fp32": []}
    for _ in range(layers):
        for k, n in shapes:
            wq = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
            sw = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3).bfloat16()
            arms["bf16"].append(prepare_w4a8(wq, sw, g, packed=False, policy=policy))
            arms["fp32"].append(prepare_w4a8(wq, sw.float(), g, packed=False, policy=policy))
    xs = {k: torch.randn(1, k, generator=gen).bfloat16() for _, shp in SHAPES.items() for k, _ in shp[2]}
    nbytes = {arm: sum(p.weight.numel() + p.scales.numel() * p.scales.element_size() for p in ps)
              for arm, ps in arms.items()}
    same = all(torch.equal(w4a8_linear(xs[p.k], p), w4a8_linear(xs[q.k], q)) for p, q in zip(*arms.values()))
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for rep in range(a.reps + 4):
        order = ("bf16", "fp32") if rep % 2 else ("fp32", "bf16")
        for arm in order:
            t0 = time.perf_counter()
            for p in arms[arm]:
                w4a8_linear(xs[p.k], p)
            if rep >= 4:
                times[arm].append(time.perf_counter() - t0)
    out = {"model": a.model, "group": g, "route": arms["bf16"][0].route.id, "threads": torch.get_num_threads(),
           "reps": a.reps, "same_bits": same}
    for arm, ts in times.items():
        ts.sort()
        out[arm] = {"bytes": nbytes[arm], "min_ms": round(ts[0] * 1e3, 3),
                    "median_ms": round(ts[len(ts) // 2] * 1e3, 3), "gbs_at_min": round(nbytes[arm] / ts[0] / 1e9, 1)}
    out["fp32_over_bf16_min"] = round(times["fp32"][0] / times["bf16"][0], 3)
    mid = len(times["fp32"]) // 2
    out["fp32_over_bf16_median"] = round(times["fp32"][mid] / times["bf16"][mid], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
