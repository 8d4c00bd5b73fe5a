# Session 46: where batch 64 (512 in, 128 out) spends its time, anychip W4A8 against vLLM BF16, with the engine the
# bench builds (RunSpec + VllmTimed: same step budget, capture sizes, KV bytes). Times 64 x 512 with max_tokens=1
# (the prefill steps) and with 128 (the whole run), then one profiled whole run: CUDA time by kernel family.
# usage: b64split.py MODEL SYSTEM OUTJSON   (one engine per process)
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import numpy as np

if __name__ == "__main__":
    model, system, out = sys.argv[1], sys.argv[2], sys.argv[3]
    from anychip.bench.runners import RunSpec, VllmTimed, context_needed
    spec = RunSpec(system=system, engine="vllm", model=model, pp=512, tg=128, reps=3, threads=16, device="cuda",
                   batch=64)
    t0 = time.perf_counter()
    eng = VllmTimed(spec, context_needed(512, 128, 64))
    start = time.perf_counter() - t0
    import torch
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 30000, 512).tolist() for _ in range(64)]
    rows = {"system": system, "start_s": round(start, 1)}
    eng.batch(prompts, 2)  # warm-up
    for tag, steps in (("prefill", 1), ("whole", 128)):
        ts = [eng.batch(prompts, steps) for _ in range(2)]
        rows[tag] = [round(t, 4) for t in ts]
        print(system, tag, rows[tag], flush=True)
    rows["decode_s"] = round(min(rows["whole"]) - min(rows["prefill"]), 4)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for tag, steps in (("whole", 128),):
        with torch.profiler.profile(activities=acts) as prof:
            eng.batch(prompts, steps)
            torch.cuda.synchronize()
        fam = {}
        top = []
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
            if t <= 0:
                continue
            n = e.key.lower()
            f = ("w4a8" if ("w4a8" in n or "anychip" in n or "_gemm" in n and "int8" in n) else
                 "gemm_bf16" if any(s in n for s in ("nvjet", "cutlass", "gemm", "sm90_xmma", "cublas")) else
                 "attention" if any(s in n for s in ("flash", "attn", "fmha")) else
                 "quant" if "quant" in n else "other")
            fam[f] = fam.get(f, 0) + t
            top.append((t, e.key[:110], e.count))
        top.sort(reverse=True)
        rows[f"profile_{tag}_us"] = {k: round(v) for k, v in fam.items()}
        rows[f"top_{tag}"] = [(round(t), k, c) for t, k, c in top[:25]]
        print(system, tag, rows[f"profile_{tag}_us"], flush=True)
        for t, k, c in top[:25]:
            print(f"  {t/1e3:9.2f} ms  x{c:6d}  {k}", flush=True)
    json.dump(rows, open(out, "w"), indent=1)
