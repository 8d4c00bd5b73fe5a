"""Prefill GEMM at M = 512-2048: the shipped candidates against split-K and narrower tiles (session 39)."""
import json, sys, time
import torch
from anychip.kernels.gpu import launch
from anychip.kernels.gpu.launch import GemmConfig
from anychip.kernels.gpu.timing import graph_ms

dev = torch.device("cuda")
G = 128
shapes = [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144),  # llama-2b qkv, o, gate/up, down
          (3072, 2048), (16384, 2048), (2048, 8192)]                # llama-1b qkv, gate/up, down (o as 2b's)
extra_rows = [(128, 64, 128, False, 4, 4, False), (128, 64, 128, False, 4, 4, True), (128, 128, 128, False, 8, 3, False),
              (128, 64, 256, False, 4, 3, False)]
narrow = [GemmConfig(64, 64, 128, False, 1, 4, 4), GemmConfig(64, 64, 128, False, 1, 4, 4, pipe=True),
          GemmConfig(128, 32, 128, False, 1, 4, 4), GemmConfig(64, 64, 256, False, 1, 4, 3)]
out = {}
t_start = time.time()
for m in [int(a) for a in sys.argv[1].split(",")]:
    for n, k in shapes:
        gen = torch.Generator(device=dev).manual_seed(m + n + k)
        w = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, device=dev, generator=gen)
        s = (torch.rand((k // G, n), device=dev, generator=gen) / 50 + 1e-3).bfloat16()
        xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev, generator=gen)
        sx = torch.rand((m,), dtype=torch.float32, device=dev, generator=gen) / 100 + 1e-4
        y = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
        base = launch.candidates(m, n, k, G, launch.multiprocessors(dev))
        extra = [GemmConfig(bm, bn, bk, sw, sp, wa, st, pipe=p) for bm, bn, bk, sw, wa, st, p in extra_rows
                 for sp in (2, 3, 4)] + narrow
        ref = None
        res = {}
        for cfg in base + extra:
            launch.launch_config(cfg, xq, sx, w, s, None, n, k, G, y)
            if ref is None:
                ref = y.float().clone()
            err = float((y.float() - ref).abs().max() / ref.abs().max())
            ms = graph_ms([lambda cfg=cfg: launch.launch_config(cfg, xq, sx, w, s, None, n, k, G, y)], replays=20, samples=7)
            res[str(cfg)] = (ms, err, cfg in base)
        bb = min((v[0], c) for c, v in res.items() if v[2])
        be = min((v[0], c) for c, v in res.items() if not v[2])
        maxerr = max(v[1] for v in res.values())
        print(f"M={m} N={n} K={k}: shipped best {bb[0]*1000:.1f} us {bb[1]}\n    new best {be[0]*1000:.1f} us ({bb[0]/be[0]:.3f}x) {be[1]}  max rel err {maxerr:.2e}", flush=True)
        out[f"{m}:{n}:{k}"] = {c: v for c, v in res.items()}
json.dump(out, open(sys.argv[2], "w"), indent=1)
print("done", round(time.time() - t_start), "s")
