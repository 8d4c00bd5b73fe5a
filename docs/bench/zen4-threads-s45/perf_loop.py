# Batch-one decode loop of the bench's CPU engine for `perf record -a` (session 45, docs/kernels-cpu.md "Where the
# threads of a decode step go"). usage: perf_loop.py MODEL SECONDS; writes ./ready once warm, then decodes 128-token
# requests until SECONDS have passed.
import os, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "2")
from anychip.bench.runners import RunSpec, VllmTimed
model = sys.argv[1]; secs = float(sys.argv[2])
spec = RunSpec(system="anychip-w4a8", engine="vllm", model=model, pp=512, tg=128, reps=1, threads=2, device="cpu")
eng = VllmTimed(spec, max_len=640)
for _ in range(3):
    eng.decode(1000, 128)
ts = sorted(eng.decode(1000 + i, 128) / 128 * 1e3 for i in range(3))
print("ms a token:", [round(t, 3) for t in ts], flush=True)
open("ready", "w").write("1")
t0 = time.time(); n = 0
while time.time() - t0 < secs:
    eng.decode(3000 + n, 128); n += 1
print("loops", n, flush=True)
