"""M = 16 decode tiles on one GPU: a wider grid of GemmConfigs than launch._DECODE's four (tile width, K step,
split-K, warps, stages, weights on the MMA's M side), at the kernel report's and llama shapes, weights rotated
through copies beyond the L2 (as the tuner and `bench kernels` time them), beside cuBLAS BF16 timed the same way.
Outputs compared bit for bit with the regime's default config. Writes JSON to argv[1] after every shape; stops
starting shapes after argv[2] seconds."""
import json
import os
import sys
import time

import torch

from anychip.kernels.gpu import launch
from anychip.kernels.gpu.timing import graph_ms, rotation

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from operands import operands  # noqa: E402

OUT = sys.argv[1]
BUDGET_S = float(sys.argv[2]) if len(sys.argv) > 2 else 240
M, G = 16, 128
dev = torch.device("cuda")
SHAPES = [(4096, 4096), (14336, 4096), (16384, 2048), (3072, 2048), (2048, 8192)]  # (N, K)
# (block_n, block_k, swap, num_warps, num_stages, split_k); block_m 16
GRID = [(bn, bk, sw, w, st, sp)
        for sw, bn, w in ((False, 32, 4), (False, 64, 4), (True, 64, 4), (True, 128, 4), (True, 128, 8))
        for bk in (256, 512)
        for st in (3,)
        for sp in (2, 4, 8)] + [
    (32, 1024, False, 4, 2, 4), (64, 1024, False, 4, 2, 4), (64, 1024, True, 4, 2, 4),
    (32, 256, False, 4, 4, 8), (64, 256, True, 4, 4, 8), (32, 512, False, 2, 3, 8), (64, 512, False, 8, 3, 4),
    (32, 256, False, 4, 3, 16), (64, 256, True, 4, 3, 16)]
t0 = time.time()
rows = []
sms = launch.multiprocessors(dev)
print(torch.cuda.get_device_name(dev), sms, "SMs", len(GRID), "grid configs", flush=True)
for n, kk in SHAPES:
    if time.time() - t0 > BUDGET_S:
        break
    gen = torch.Generator(device=dev).manual_seed(n + kk)
    xq, sx, w, s, xb, wb = operands(M, n, kk, G, gen, dev)
    nb = rotation(wb.numel() * 2, dev)
    wbs = [wb] + [wb.clone() for _ in range(nb - 1)]
    row = {"m": M, "n": n, "k": kk, "gpu": torch.cuda.get_device_name(dev)}
    row["cublas_bf16_ms"] = graph_ms([lambda w_=w_: torch.mm(xb, w_.t()) for w_ in wbs], replays=2, samples=5)
    del wbs
    copies = rotation(w.numel() + s.numel() * 2, dev)
    ops = [(w, s)] + [(w.clone(), s.clone()) for _ in range(copies - 1)]
    shipped = [c for c in launch.candidates(M, n, kk, G, sms) if isinstance(c, launch.GemmConfig)]
    grid = [launch.GemmConfig(16, bn, bk, sw, sp, wa, st) for bn, bk, sw, wa, st, sp in GRID
            if (kk // G) >= sp * max(bk // G, 1)]
    res, ref = {}, None
    for cfg in list(dict.fromkeys(shipped + grid)):
        if time.time() - t0 > BUDGET_S + 60:
            break
        out = torch.empty((M, n), dtype=torch.bfloat16, device=dev)
        fns = [(lambda w_=w_, s_=s_, cfg=cfg: launch.launch_config(cfg, xq, sx, w_, s_, None, n, kk, G, out))
               for w_, s_ in ops]
        try:
            ms = graph_ms(fns, replays=max(2, 10 // len(fns)), samples=5)
        except Exception as exc:  # noqa: BLE001 - out of resources etc.: record and go on
            res[str(cfg)] = {"error": repr(exc)[:200]}
            continue
        fns[0]()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone()
        res[str(cfg)] = {"ms": round(ms, 5), "equal": bool(torch.equal(out, ref)), "shipped": cfg in shipped}
    row["configs"] = res
    timed = [(r["ms"], c) for c, r in res.items() if "ms" in r]
    best_ship = min((r["ms"], c) for c, r in res.items() if "ms" in r and r["shipped"])
    best_all = min(timed)
    row["best_shipped"], row["best"] = best_ship, best_all
    row["copies"] = copies
    equal = all(r.get("equal", True) for r in res.values())
    print(f"N={n} K={kk}: bf16 {row['cublas_bf16_ms']:.4f} | shipped best {best_ship[0]:.4f} "
          f"(x{row['cublas_bf16_ms'] / best_ship[0]:.2f}) | grid best {best_all[0]:.4f} "
          f"(x{row['cublas_bf16_ms'] / best_all[0]:.2f}) [{best_all[1]}] eq={equal} n={len(timed)} "
          f"t={time.time() - t0:.0f}", flush=True)
    rows.append(row)
    json.dump(rows, open(OUT, "w"), indent=1)
print("done", time.time() - t0)
