# Offline repro of the article preset's TTFT gap: prefill streams of 4096-token chunks, pure and mixed with decode,
# then a kernel profile of pure-prefill steps. One model per process. usage: ttft.py MODEL LABEL OUTJSON
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import numpy as np
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model, label, out = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
extra = {}
if os.environ.get("CAPTURE") == "sparse":  # vLLM's default sizes plus eight up to the step budget
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16)) + [768, 1024, 1536, 2048, 2560, 3072,
                                                                              3584, 4096]
    extra["compilation_config"] = {"cudagraph_capture_sizes": sizes}
label = label + ("-" + os.environ["CAPTURE"] if os.environ.get("CAPTURE") else "")
llm = LLM(model=model, max_num_batched_tokens=4096, max_model_len=17408, gpu_memory_utilization=0.85, seed=0,
          **extra)
start_s = time.perf_counter() - t0
rng = np.random.default_rng(0)


def level(n, length, out_tokens, tag, profile=False):
    ps = [TokensPrompt(prompt_token_ids=rng.integers(100, 49000, length).tolist()) for _ in range(n)]
    sp = SamplingParams(max_tokens=out_tokens, min_tokens=out_tokens, ignore_eos=True, temperature=0.0,
                        detokenize=False)
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(ps, sp, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    if prof is not None:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))
    row = {"label": label, "tag": tag, "n": n, "len": length, "out": out_tokens, "s": round(dt, 4),
           "prefill_tok_s": round(n * length / dt)}
    print(json.dumps(row), flush=True)
    return row


rows = [{"label": label, "tag": "start", "s": round(start_s, 1)}]
rows.append(level(1, 4096, 2, "warm"))
rows.append(level(64, 4096, 1, "A1 pure 4k"))
rows.append(level(64, 4096, 16, "B mixed 4k out16"))
rows.append(level(16, 16384, 1, "C pure 16k"))
rows.append(level(64, 4096, 1, "A2 pure 4k"))
if os.environ.get("PROFILE"):
    rows.append(level(16, 4096, 1, "P profiled 4k", profile=True))
e = [level(1, 1100, 1, "E one 1100-token prompt") for _ in range(12)]
rows.append({"label": label, "tag": "E one 1100-token prompt, median of 12", "s": sorted(r["s"] for r in e)[6]})
print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(out, "w"), indent=1)
