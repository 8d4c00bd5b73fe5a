"""Session 41: triton_split.py's kernel (two dots, and one dot `CAT`; pointer loads and TMA descriptors) against the
shipped `_w4a8_gemm_kernel`, bit for bit, on the CPU through Triton's interpreter (row and column tails, G128 and
G64). TRITON_INTERPRET=1 PYTHONPATH=$PWD python docs/gpu-runs/session41/interp_check.py"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import triton_split  # noqa: E402

from anychip.kernels.gpu import launch  # noqa: E402
from anychip.kernels.gpu.gluon_w4a8 import split_groups  # noqa: E402
from anychip.kernels.gpu.launch import GemmConfig  # noqa: E402
from anychip.kernels.gpu.layout import pack_nibbles  # noqa: E402

torch.manual_seed(0)
bad = 0
for m, n, k, g in [(40, 48, 256, 128), (17, 64, 384, 128), (9, 80, 256, 64)]:
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = pack_nibbles(q)
    s = (torch.rand(k // g, n) * 0.02 + 0.001).to(torch.bfloat16).contiguous()
    xq, sx = launch.quantize_act(torch.randn(m, k, dtype=torch.bfloat16))
    cfg = GemmConfig(block_m=32, block_n=32, block_k=g, swap=False, split_k=1, num_warps=4, num_stages=2, group_m=2,
                     pipe=False, fcvt=False)
    ref = torch.empty(m, n, dtype=torch.bfloat16)
    launch.launch_config(cfg, xq, sx, w, s, None, n, k, g, ref)
    xs = split_groups(xq, g).contiguous()
    for tma in (False, True):
        for cat in (False, True):
            got = torch.empty_like(ref)
            triton_split.run(xs, sx, w, s, n, k, g, got, bm=32, bn=32, tma=tma, group_m=2, cat=cat, asm=False)
            diff = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
            bad += diff
            print(f"M={m} N={n} K={k} G={g} tma={tma} cat={cat}: {diff} values differ")
sys.exit(1 if bad else 0)
