"""Session 40: the Gluon W4A8 GEMM (async wgmma, rescale of group g-1 overlapping group g's dots) against the
shipped Triton GEMM (the GPU's tuned config) and cuBLAS BF16, same process, bit for bit and timed.

python docs/gpu-runs/session40/gluon_ab.py OUT.json   (PYTHONPATH=$PWD; no vLLM needed)
"""
import json
import os
import sys
import time
import traceback

import torch

from anychip.kernels.gpu import gluon_w4a8 as gw
from anychip.kernels.gpu import launch, timing
from anychip.kernels.gpu.layout import pack_nibbles

G = 128
SHAPES = [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144)]  # llama-2b qkv, o, gate/up, down (N, K)
MS = [512, 2048, 4096]
if os.environ.get("AB_QUICK"):  # the first shape and the down projection, two token counts
    SHAPES, MS = [SHAPES[0], SHAPES[3]], [512, 4096]
CONFIGS = [gw.WgmmaConfig(128, 64, 8, 4), gw.WgmmaConfig(64, 128, 8, 4), gw.WgmmaConfig(128, 64, 8, 3),
           gw.WgmmaConfig(128, 64, 8, 4, unroll=64)]  # the last: K's groups all unrolled (one trip)


def main(out_path: str) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    t0 = time.time()
    for n, k in SHAPES:
        q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=dev)
        weight = pack_nibbles(q)
        scales = (torch.rand(k // G, n, device=dev) * 0.02 + 0.001).to(torch.bfloat16).contiguous()
        wbf = (q.float() * scales.float().t().repeat_interleave(G, dim=1)).to(torch.bfloat16)
        copies = timing.rotation(weight.numel() + scales.numel() * 2, dev)
        ws = [(weight.clone(), scales.clone()) for _ in range(copies)]
        wbs = [wbf.clone() for _ in range(timing.rotation(wbf.numel() * 2, dev))]
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, sx = launch.quantize_act(x)
            xs = gw.split_groups(xq, G).contiguous()
            cfg = launch.serving_config(m, n, k, G, dev)
            ref = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            launch.launch_config(cfg, xq, sx, weight, scales, None, n, k, G, ref)
            row = {"m": m, "n": n, "k": k, "shipped_cfg": str(cfg)}
            row["bf16_ms"] = timing.graph_ms([lambda w=w: torch.mm(x, w.t()) for w in wbs])
            outs = [torch.empty_like(ref) for _ in ws]
            row["shipped_ms"] = timing.graph_ms(
                [lambda w=w, o=o: launch.launch_config(cfg, xq, sx, w[0], w[1], None, n, k, G, o)
                 for w, o in zip(ws, outs)])
            row["split_ms"] = timing.graph_ms([lambda: gw.split_groups(xq, G).contiguous()])
            row["quant_ms"] = timing.graph_ms([lambda: launch.quantize_act(x)])
            for c in CONFIGS:
                name = f"gluon_{c.block_m}x{c.block_n}w{c.num_warps}s{c.stages}u{c.unroll}"
                try:
                    got = torch.empty_like(ref)
                    gw.w4a8_gemm_wgmma(xs, sx, weight, scales, None, n, k, G, got, c)
                    torch.cuda.synchronize()
                    row[name + "_mismatch"] = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
                    row[name + "_maxdiff"] = float((got.float() - ref.float()).abs().max())
                    row[name + "_ms"] = timing.graph_ms(
                        [lambda w=w, o=o: gw.w4a8_gemm_wgmma(xs, sx, w[0], w[1], None, n, k, G, o, c)
                         for w, o in zip(ws, outs)])
                except Exception as exc:  # noqa: BLE001
                    row[name + "_error"] = repr(exc)[:400]
                    traceback.print_exc()
            rows.append(row)
            best = min((v, kk) for kk, v in row.items() if kk.startswith("gluon") and kk.endswith("_ms"))
            print(f"[{time.time() - t0:6.1f}s] M={m} N={n} K={k} bf16 {row['bf16_ms']:.4f} shipped "
                  f"{row['shipped_ms']:.4f} best gluon {best[0]:.4f} ({best[1]}) "
                  f"mism {[v for kk, v in row.items() if kk.endswith('_mismatch')]}",
                  flush=True)
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
