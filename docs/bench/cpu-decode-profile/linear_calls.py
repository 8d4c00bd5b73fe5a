# A decode linear call by call (session 38, docs/kernels-cpu.md), 2 threads unless OMP_NUM_THREADS says otherwise.
# usage: linear_calls.py          the fixed cost of a tiny call, each of the default model's four shapes hot and from
#                                 a ring of 30 copies, and the 120 calls of a step
#        linear_calls.py sizes    N = 16 / 64 / 192 / 576 at K = 576, hot (run with OMP_NUM_THREADS=1, then 2)
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch

from anychip.kernels import ops
from anychip.kernels.prepare import prepare_w4a8, w4a8_linear

torch.manual_seed(0)
lid = ops.layer_tensor(0)


def mk(n, k, g=32):
    wq = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    sc = (torch.rand(n, k // g) * 0.01 + 0.001).to(torch.bfloat16)
    return prepare_w4a8(wq, sc, g, packed=False)


def best_us(fn, reps=2000, rounds=5):
    for _ in range(50):
        fn()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ts.append((time.perf_counter() - t0) / reps * 1e6)
    return min(ts)


x = torch.randn(1, 576, dtype=torch.bfloat16)
if sys.argv[1:] == ["sizes"]:
    for n in (16, 64, 192, 576):
        p = mk(n, 576)
        print(os.environ["OMP_NUM_THREADS"], "threads, N", n, round(best_us(lambda: w4a8_linear(x, p, layer_id=lid),
                                                                            3000, 7), 2), "us")
    sys.exit()
p = mk(16, 576)
print("route", p.route.id)
print("tiny 16x576 op us", round(best_us(lambda: w4a8_linear(x, p, layer_id=lid)), 2))
print("torch.empty us", round(best_us(lambda: torch.empty(1, 16, dtype=torch.bfloat16)), 2))
print("a trivial aten op us", round(best_us(lambda: torch.ops.aten.add(x, x)), 2))
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ring = [[mk(n, k) for n, k in shapes] for _ in range(30)]
xs = {576: x, 1536: torch.randn(1, 1536, dtype=torch.bfloat16)}
for j, (n, k) in enumerate(shapes):
    pp = ring[0][j]
    hot = best_us(lambda: w4a8_linear(xs[k], pp, layer_id=lid))

    def cold():
        for r in ring:
            w4a8_linear(xs[k], r[j], layer_id=lid)

    c = best_us(cold, reps=20) / len(ring)
    mb = (n * k / 2 + n * k / 32 * 2) / 1e6
    print(f"{n}x{k}: {mb:.3f} MB hot {hot:.2f} us ({mb / hot * 1e3:.0f} GB/s) ring {c:.2f} us ({mb / c * 1e3:.0f} GB/s)")


def step():
    for r in ring:
        for j, (n, k) in enumerate(shapes):
            w4a8_linear(xs[k], r[j], layer_id=lid)


s = best_us(step, reps=10)
tot = sum((n * k / 2 + n * k / 32 * 2) for n, k in shapes) * 30 / 1e6
print(f"step of 120: {s / 1e3:.3f} ms, {tot:.1f} MB, {tot / s * 1e3:.1f} GB/s")
