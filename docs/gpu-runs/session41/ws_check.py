"""Session 41: the warp-specialized Gluon GEMM (gluon_ws.py) bit for bit against the shipped Triton GEMM, then
timed beside it and cuBLAS BF16 (same process, CUDA-graph replays over rotating weight copies). Run in its own
process under a timeout: a hand-over error between partitions would hang, not fail.
python docs/gpu-runs/session41/ws_check.py OUT.json   (PYTHONPATH=$PWD)"""
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gluon_ws  # noqa: E402

from anychip.kernels.gpu import gluon_w4a8 as gw  # noqa: E402
from anychip.kernels.gpu import launch, timing  # noqa: E402
from anychip.kernels.gpu.layout import pack_nibbles  # noqa: E402

G = 128
VARIANTS = {"ws_u4": dict(), "ws_u2": dict(unroll=2), "ws_u4_s6": dict(stages=6), "ws_u8": dict(unroll=8)}


def main(out_path: str) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows, t0 = [], time.time()
    for n, k, ms in [(4096, 2048, (512, 4096)), (2048, 6144, (512, 4096)), (4096, 640, (100,))]:  # the last: tails
        q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=dev)
        weight = pack_nibbles(q)
        scales = (torch.rand(k // G, n, device=dev) * 0.02 + 0.001).to(torch.bfloat16).contiguous()
        wbf = (q.float() * scales.float().t().repeat_interleave(G, dim=1)).to(torch.bfloat16)
        ws = [(weight.clone(), scales.clone()) for _ in range(timing.rotation(weight.numel() * 2, dev))]
        wbs = [wbf.clone() for _ in range(timing.rotation(wbf.numel() * 2, dev))]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, sx = launch.quantize_act(x)
            xs = gw.split_groups(xq, G).contiguous()
            cfg = launch.serving_config(m, n, k, G, dev)
            ref = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            launch.launch_config(cfg, xq, sx, weight, scales, None, n, k, G, ref)
            outs = [torch.empty_like(ref) for _ in ws]
            row = {"m": m, "n": n, "k": k, "shipped_cfg": str(cfg)}
            row["bf16_ms"] = timing.graph_ms([lambda w=w: torch.mm(x, w.t()) for w in wbs])
            row["shipped_ms"] = timing.graph_ms(
                [lambda w=w, o=o: launch.launch_config(cfg, xq, sx, w[0], w[1], None, n, k, G, o)
                 for w, o in zip(ws, outs)])
            for name, kw in VARIANTS.items():
                try:
                    got = torch.empty_like(ref)
                    gluon_ws.run(xs, sx, weight, scales, n, k, G, got, **kw)
                    torch.cuda.synchronize()
                    row[name + "_mismatch"] = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
                    row[name + "_ms"] = timing.graph_ms(
                        [lambda w=w, o=o, kw=kw: gluon_ws.run(xs, sx, w[0], w[1], n, k, G, o, **kw)
                         for w, o in zip(ws, outs)])
                except Exception as exc:  # noqa: BLE001
                    row[name + "_error"] = repr(exc)[:300]
                    traceback.print_exc()
            rows.append(row)
            print(f"[{time.time() - t0:6.1f}s] M={m} N={n} K={k} " + " ".join(
                f"{kk[:-3]}={v:.4f}" for kk, v in row.items() if kk.endswith("_ms")) + " mism " + str(
                {kk[:-9]: v for kk, v in row.items() if kk.endswith("_mismatch")}), flush=True)
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
