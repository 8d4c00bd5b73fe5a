# compiled vs eager greedy logprobs for one model (argv[1]) -> json argv[3]; mode argv[2] in eager|compiled
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
model, mode, out = sys.argv[1:4]
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "In the beginning God created the heaven and the earth. And the earth was without form, and void; " * 6]
llm = LLM(model, enforce_eager=(mode == "eager"), max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=1024,
          gpu_memory_utilization=0.5)
sp = SamplingParams(temperature=0, max_tokens=24, logprobs=1, prompt_logprobs=1)
res = []
for o in llm.generate(prompts, sp):
    c = o.outputs[0]
    plp = [None if d is None else d[t].logprob for d, t in zip(o.prompt_logprobs, o.prompt_token_ids)]
    res.append({"tokens": list(c.token_ids), "lp": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], "plp": plp})
json.dump(res, open(out, "w"))
