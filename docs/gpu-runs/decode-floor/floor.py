# Where a batch-one decode step goes: the bench's own engine (VllmTimed, batch-64 settings as in bench latency),
# decode of 128 tokens timed 5 times, then one under torch.profiler: GPU busy time (union of kernel intervals)
# against the wall time, per step. usage: floor.py MODEL LABEL OUT.json
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch
from torch.autograd import DeviceType
from anychip.bench.runners import RunSpec, VllmTimed

model, label, out = sys.argv[1], sys.argv[2], sys.argv[3]
spec = RunSpec(system=label, engine="vllm", model=model, pp=512, tg=128, reps=1, threads=16, device="cuda", batch=64)
eng = VllmTimed(spec, max_len=640)
for _ in range(3):
    eng.decode(1000, 128)
times = sorted(eng.decode(1000 + i, 128) for i in range(7))
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
with prof:
    wall = eng.decode(2000, 128)
ivs = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
busy, cur_s, cur_e = 0.0, None, None
for s, e in ivs:
    if cur_e is None or s > cur_e:
        if cur_e is not None:
            busy += cur_e - cur_s
        cur_s, cur_e = s, e
    else:
        cur_e = max(cur_e, e)
if cur_e is not None:
    busy += cur_e - cur_s
span = (ivs[-1][1] - ivs[0][0]) if ivs else 0
ksum = sum(e - s for s, e in ivs)
row = dict(label=label, decode128_s=times, median_ms_per_token=round(times[3] / 128 * 1e3, 4),
           profiled_wall_ms=round(wall * 1e3, 2), kernels=len(ivs), kernel_sum_ms=round(ksum / 1e3, 2),
           gpu_busy_ms=round(busy / 1e3, 2), gpu_span_ms=round(span / 1e3, 2),
           busy_ms_per_token=round(busy / 1e3 / 128, 4))
print(json.dumps(row), flush=True)
top = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60)
print(top)
json.dump(row, open(out, "w"), indent=1)
