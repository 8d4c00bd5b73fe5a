"""A/B on one GPU: the W4A8 GEMM's group rescale with the int32 -> fp32 conversion instruction (fcvt off) against
the integer-add form (fcvt on), every candidate of the regime and two wider prefill tiles, at the llama-1b /
llama-2b / kernel-report shapes, M = 512, 4096, 16 (weights rotated through copies beyond the L2) and 2048, in that
order until the budget (argv[2] seconds) is spent; cuBLAS BF16 and INT8 (torch._int_mm) timed the same way beside;
the first TMA_CONFIGS non-swap prefill tiles also with TMA loads (tma.py). Outputs compared bit for bit. Writes
JSON to argv[1] after every shape."""
import dataclasses
import json
import os
import sys
import time

import torch

from anychip.kernels.gpu import launch
from anychip.kernels.gpu.timing import graph_ms, rotation

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tma  # noqa: E402
from operands import operands  # noqa: E402

OUT = sys.argv[1]
BUDGET_S = float(sys.argv[2]) if len(sys.argv) > 2 else 300
dev = torch.device("cuda")
SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (4096, 4096), (4096, 2048), (12288, 2048),
          (2048, 6144), (14336, 4096)]  # (N, K), G = 128
EXTRA = [launch.GemmConfig(128, 128, 128, False, 1, 4, 3), launch.GemmConfig(128, 256, 128, False, 1, 8, 3)]
TMA_CONFIGS = int(os.environ.get("TMA_CONFIGS", "2"))  # the first non-swap candidates also run with TMA loads
g = 128
t0 = time.time()
rows = []
sms = launch.multiprocessors(dev)
print(torch.cuda.get_device_name(dev), flush=True)


def call(cfg, xq, sx, w, s, out, fcvt, n, kk):
    """One launch of cfg with the rescale's form `fcvt`, as the route launches it (split-K scratch included)."""
    cfg = dataclasses.replace(cfg, fcvt=fcvt)
    return lambda: launch.launch_config(cfg, xq, sx, w, s, None, n, kk, g, out)


DECODE_SHAPES = [(4096, 4096), (14336, 4096), (3072, 2048), (16384, 2048)]
PLAN = [(512, SHAPES[:5]), (4096, SHAPES[:5]), (16, DECODE_SHAPES), (512, SHAPES[5:]), (4096, SHAPES[5:]),
        (2048, SHAPES)]
for m, shapes in PLAN:
    for n, kk in shapes:
        if time.time() - t0 > BUDGET_S:
            break
        gen = torch.Generator(device=dev).manual_seed(n + kk + m)
        xq, sx, w, s, xb, wb = operands(m, n, kk, g, gen, dev)
        w8 = torch.randint(-127, 128, (n, kk), dtype=torch.int8, device=dev, generator=gen)
        row = {"m": m, "n": n, "k": kk, "gpu": torch.cuda.get_device_name(dev)}
        if m <= launch.MID_M:  # memory-bound: weights rotate through copies beyond the L2, as the tuner times them
            nb = rotation(wb.numel() * 2, dev)
            wbs = [wb] + [wb.clone() for _ in range(nb - 1)]
            row["cublas_bf16_ms"] = graph_ms([lambda w_=w_: torch.mm(xb, w_.t()) for w_ in wbs], replays=2, samples=5)
            row["cublas_int8_ms"] = float("nan")
            del wbs
            copies = rotation(w.numel() + s.numel() * 2, dev)
            cands = list(dict.fromkeys(launch.candidates(m, n, kk, g, sms)))
            cands = [c for c in cands if isinstance(c, launch.GemmConfig)]
        else:
            copies = 1
            row["cublas_bf16_ms"] = graph_ms([lambda: torch.mm(xb, wb.t())], replays=10, samples=5)
            row["cublas_int8_ms"] = graph_ms([lambda: torch._int_mm(xq, w8.t())], replays=10, samples=5)
            cands = list(dict.fromkeys(launch.candidates(m, n, kk, g, sms) + EXTRA))
        ops = [(w, s)] + [(w.clone(), s.clone()) for _ in range(copies - 1)]
        row["copies"] = copies
        res = {}
        tma_left = TMA_CONFIGS
        for cfg in cands:
            outs = []
            for fcvt in (False, True):
                out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
                fns = [call(cfg, xq, sx, w_, s_, out, fcvt, n, kk) for w_, s_ in ops]
                try:
                    ms = graph_ms(fns, replays=max(2, 10 // len(fns)), samples=5)
                except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: record and go on
                    res.setdefault(str(cfg), {})["error"] = repr(exc)[:200]
                    break
                res.setdefault(str(cfg), {})["fcvt" if fcvt else "cvt"] = round(ms, 5)
                outs.append(out)
            if len(outs) == 2:
                res[str(cfg)]["equal"] = bool(torch.equal(outs[0], outs[1]))
                if not cfg.swap and cfg.split_k == 1 and copies == 1 and tma_left > 0:  # the tile with TMA loads
                    tma_left -= 1
                    out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
                    try:
                        res[str(cfg)]["tma_fcvt"] = round(graph_ms([lambda: tma.launch(
                            xq, sx, w, s, out, g, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, True)],
                            replays=10, samples=5), 5)
                        res[str(cfg)]["tma_equal"] = bool(torch.equal(out, outs[0]))
                    except Exception as exc:  # noqa: BLE001
                        res[str(cfg)]["tma_error"] = repr(exc)[:200]
        row["configs"] = res
        best = {v: min(((r[v], c) for c, r in res.items() if v in r), default=(float("inf"), ""))
                for v in ("cvt", "fcvt", "tma_fcvt")}
        row["best"] = {v: {"ms": b[0], "config": b[1]} for v, b in best.items()}
        fl = 2 * m * n * kk
        equal = all(r.get("equal", True) for r in res.values())
        print(f"M={m} N={n} K={kk}: bf16 {row['cublas_bf16_ms']:.4f} int8 {row['cublas_int8_ms']:.4f} | cvt "
              f"{best['cvt'][0]:.4f} ({fl / best['cvt'][0] / 1e9:.0f} TOPS) fcvt {best['fcvt'][0]:.4f} "
              f"({fl / best['fcvt'][0] / 1e9:.0f}) x{best['cvt'][0] / best['fcvt'][0]:.2f} "
              f"vsBF16 {row['cublas_bf16_ms'] / best['fcvt'][0]:.2f} eq={equal}"
              f" [{best['fcvt'][1]}] tma {best['tma_fcvt'][0]:.4f} [{best['tma_fcvt'][1]}] "
              f"tma_eq={all(r.get('tma_equal', True) for r in res.values())} t={time.time() - t0:.0f}", flush=True)
        rows.append(row)
        json.dump(rows, open(OUT, "w"), indent=1)
print("done", time.time() - t0)
