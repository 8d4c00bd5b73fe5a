# One small decode linear at 1 or 2 threads (session 38, docs/kernels-cpu.md).  usage: OMP_NUM_THREADS=1|2 linear_threads.py
import os, time
import torch
from anychip.kernels.prepare import prepare_w4a8, w4a8_linear
from anychip.kernels import ops
torch.manual_seed(0)
lid = ops.layer_tensor(0)
def mk(n, k, g=32):
    return prepare_w4a8(torch.randint(-8, 8, (n, k), dtype=torch.int8), (torch.rand(n, k // g) * 0.01 + 0.001).to(torch.bfloat16), g, packed=False)
def t(fn, reps=3000):
    for _ in range(100): fn()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(reps): fn()
        ts.append((time.perf_counter() - t0) / reps * 1e6)
    return min(ts)
x = torch.randn(1, 576, dtype=torch.bfloat16)
for n in (16, 64, 192, 576):
    p = mk(n, 576)
    print(os.environ.get("OMP_NUM_THREADS"), n, round(t(lambda: w4a8_linear(x, p, layer_id=lid)), 2))
