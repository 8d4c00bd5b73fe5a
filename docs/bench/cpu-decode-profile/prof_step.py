# Per-operator self CPU time of a batch-one decode step of the bench's own CPU engine (2 threads): five timed loops
# of 256 tokens, then 64 steps under torch.profiler. usage: prof_step.py MODEL [STEPS] (session 37, docs/kernels-cpu.md)
import os, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch
from anychip.bench.runners import RunSpec, VllmTimed
model = sys.argv[1]; steps = int(sys.argv[2]) if len(sys.argv) > 2 else 64
spec = RunSpec(system="anychip-w4a8", engine="vllm", model=model, pp=512, tg=128, reps=1, threads=2, device="cpu")
eng = VllmTimed(spec, max_len=640)
for _ in range(3):
    eng.decode(1000, 128)
ts = sorted(eng.decode(1000 + i, 256) / 256 * 1e3 for i in range(5))
print("ms a token (5 x 256):", [round(t, 3) for t in ts])
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    wall = eng.decode(2000, steps)
print(f"profiled: {wall / steps * 1e3:.3f} ms a token")
for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:28]:
    print(f"{e.key[:70]:<70} {e.count / steps:6.1f} calls  {e.self_cpu_time_total / steps / 1e3:7.3f} ms self  "
          f"{e.cpu_time_total / steps / 1e3:7.3f} ms total")
