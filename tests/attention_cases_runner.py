"""Serves a model through vLLM's offline LLM in a fresh process with the steps that give attention a context from
the KV cache: a prompt longer than a step's token budget (chunked prefill), prompts that share cached prefixes
(prefix-cache hits), and a short and a long prompt in one step. Writes every greedy token, its logprobs and the
prompt logprobs of the first request, plus vLLM's prefix-cache counters, as JSON.

usage: python tests/attention_cases_runner.py MODEL OUT.json VOCAB
Environment (ANYCHIP_*, VLLM_*) comes from the caller.
"""

from __future__ import annotations

import json
import os
import sys

from anychip.envs import VLLM_STARTUP

for _name, _value in VLLM_STARTUP.items():
    os.environ.setdefault(_name, _value)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: tokens a step may schedule: the 300-token prompt below is prefilled in three chunks
STEP_TOKENS = 128


def main() -> None:  # a function: vLLM's worker processes re-import this file under spawn
    from vllm import LLM, SamplingParams

    model, out, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model=model, dtype="bfloat16", distributed_executor_backend="uni", max_model_len=512,
              max_num_batched_tokens=STEP_TOKENS, max_num_seqs=4, gpu_memory_utilization=0.5, seed=0,
              enable_prefix_caching=True, disable_log_stats=False)
    base = [(i * 37 + 11) % (vocab - 2) + 1 for i in range(300)]
    other = [(i * 53 + 5) % (vocab - 2) + 1 for i in range(60)]
    # prompt logprobs only in the first call: vLLM does not read the prefix cache for requests that ask for them
    first = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=0)
    later = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    rows = []
    for prompts, params in (([base], first),  # chunked prefill, then decode
                            ([base + other[:4], base[:150] + other[:1]], later),  # whole and partial cache hits
                            ([other[:3], base[:200] + other], later)):  # a short and a long prompt in one step
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
            c = o.outputs[0]
            rows.append({"token_ids": list(c.token_ids),
                         "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in c.logprobs],
                         "prompt_logprobs": [None if s is None else {str(k): v.logprob for k, v in s.items()}
                                             for s in (o.prompt_logprobs or [])]})
    counters = {m.name.removeprefix("vllm:"): m.value for m in llm.get_metrics() if m.name.startswith("vllm:prefix")}
    with open(out, "w") as f:
        json.dump({"outputs": rows, "prefix_cache": counters, "process": process()}, f)


def process() -> dict:
    """What this process's kernels depended on, for telling two runs that should agree apart: the SIMD ISA
    Inductor's probe settled on (a probe that fails falls back to a narrower one, or to scalar code, silently; the
    probe's result is cached per process) and torch's thread count."""
    import torch

    from anychip.kernels.machine import inductor_simd

    return {"inductor_vec_isa": inductor_simd(), "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    main()
