# Batch-one decode of the bench's own engine (runners.VllmTimed, batch-64 settings) with the engine core in this
# process (VLLM_ENABLE_V1_MULTIPROCESSING=0, anychip's default) or in its own (=1, vLLM's default; set by the caller).
# usage: mp.py MODEL LABEL
import os, sys, time
from anychip.bench.runners import RunSpec, VllmTimed
model, label = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
spec = RunSpec(system=label, engine="vllm", model=model, pp=512, tg=128, reps=1, threads=16, device="cuda", batch=64)
eng = VllmTimed(spec, max_len=640)
start = time.perf_counter() - t0
for _ in range(3):
    eng.decode(1000, 128)
times = sorted(eng.decode(1000 + i, 128) for i in range(7))
print(f"RESULT {label} MP={os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')} start {start:.1f} s "
      f"decode ms/token median {times[3] / 128 * 1e3:.3f} min {times[0] / 128 * 1e3:.3f} max {times[-1] / 128 * 1e3:.3f}",
      flush=True)
