# pp512 loop of the bench's CPU engine for `perf record -a` (session 45). usage: perf_prefill.py MODEL SECONDS
import os, sys, time, random
os.environ.setdefault("OMP_NUM_THREADS", "2")
from anychip.bench.runners import RunSpec, VllmTimed
model = sys.argv[1]; secs = float(sys.argv[2])
spec = RunSpec(system="anychip-w4a8", engine="vllm", model=model, pp=512, tg=128, reps=1, threads=2, device="cpu")
eng = VllmTimed(spec, max_len=640)
rng = random.Random(0)
ids = lambda: [rng.randrange(1000, 40000) for _ in range(512)]
for _ in range(3): eng.prefill(ids())
ts = sorted(eng.prefill(ids()) * 1e3 for i in range(8))
print("ms pp512:", [round(t, 1) for t in ts[:4]], flush=True)
open("ready", "w").write("1")
t0 = time.time()
while time.time() - t0 < secs: eng.prefill(ids())
