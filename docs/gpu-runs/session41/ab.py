"""Session 41's A/B harness, shared by gluon_diag.py and ws_check.py: per (N, K) shape random INT4 weights and
scales (and their BF16 product for cuBLAS), per token count M the shipped Triton GEMM's output as the reference,
then cuBLAS BF16, the shipped tile and each variant timed in the same process (CUDA-graph replays over rotating
weight copies, `timing.graph_ms`), the checked variants compared bit for bit. A row is printed and the JSON
rewritten after every M, so a timeout keeps what finished.

A variant is (fn, kwargs, checked): fn(xs, sx, weight, scales, n, k, g, out, **kwargs) with xs the activations in
`split_groups` order."""
import json
import time
import traceback

import torch

from anychip.kernels.gpu import gluon_w4a8 as gw
from anychip.kernels.gpu import launch, timing
from anychip.kernels.gpu.layout import pack_nibbles


def run(out_path: str, cases, variants: dict, g: int = 128, device: str = "cuda") -> list[dict]:
    """cases: [(n, k, token counts)]. Returns the rows (also written to out_path)."""
    dev = torch.device(device)
    torch.manual_seed(0)
    rows, t0 = [], time.time()
    for n, k, ms in cases:
        q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=dev)
        weight = pack_nibbles(q)
        scales = (torch.rand(k // g, n, device=dev) * 0.02 + 0.001).to(torch.bfloat16).contiguous()
        wbf = (q.float() * scales.float().t().repeat_interleave(g, dim=1)).to(torch.bfloat16)
        ws = [(weight.clone(), scales.clone()) for _ in range(timing.rotation(weight.numel() * 2, dev))]
        wbs = [wbf.clone() for _ in range(timing.rotation(wbf.numel() * 2, dev))]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, sx = launch.quantize_act(x)
            xs = gw.split_groups(xq, g).contiguous()
            cfg = launch.serving_config(m, n, k, g, dev)
            ref = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            launch.launch_config(cfg, xq, sx, weight, scales, None, n, k, g, ref)
            outs = [torch.empty_like(ref) for _ in ws]
            row = {"m": m, "n": n, "k": k, "shipped_cfg": str(cfg)}
            row["bf16_ms"] = timing.graph_ms([lambda w=w: torch.mm(x, w.t()) for w in wbs])
            row["shipped_ms"] = timing.graph_ms(
                [lambda w=w, o=o: launch.launch_config(cfg, xq, sx, w[0], w[1], None, n, k, g, o)
                 for w, o in zip(ws, outs)])
            for name, (fn, kw, checked) in variants.items():
                try:
                    got = torch.empty_like(ref)
                    fn(xs, sx, weight, scales, n, k, g, got, **kw)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    if checked:
                        row[name + "_mismatch"] = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
                    row[name + "_ms"] = timing.graph_ms(
                        [lambda w=w, o=o, fn=fn, kw=kw: fn(xs, sx, w[0], w[1], n, k, g, o, **kw)
                         for w, o in zip(ws, outs)])
                except Exception as exc:  # noqa: BLE001
                    row[name + "_error"] = repr(exc)[:300]
                    traceback.print_exc()
            rows.append(row)
            print(f"[{time.time() - t0:6.1f}s] M={m} N={n} K={k} " + " ".join(
                f"{kk[:-3]}={v:.4f}" for kk, v in row.items() if kk.endswith("_ms")) + " mism " + str(
                {kk[:-9]: v for kk, v in row.items() if kk.endswith("_mismatch")}), flush=True)
            json.dump({"device": torch.cuda.get_device_name() if dev.type == "cuda" else device, "rows": rows},
                      open(out_path, "w"), indent=1)
    return rows
