"""Runs vLLM's offline LLM in a fresh process for the plugin tests and prints one JSON line.

usage: python tests/vllm_runner.py MODEL OUT.json [--max-tokens N] [--prompt TEXT ...] [--prompt-ids 1,2,3 ...]
Environment (ANYCHIP_*, VLLM_PLUGINS) comes from the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from anychip.envs import VLLM_STARTUP

for _name, _value in VLLM_STARTUP.items():
    os.environ.setdefault(_name, _value)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:  # a function: vLLM's worker processes re-import this file under spawn
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", action="append", default=[])
    p.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids "
                   "(tokenizer-independent)")
    p.add_argument("--logprobs", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="vLLM's default torch.compile mode instead of eager")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prompt-logprobs", action="store_true", help="record the logprob of every prompt token")
    p.add_argument("--alone", action="store_true", help="after the batched run, generate each prompt again in a "
                   "call of its own (rows under \"alone\")")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="the step's token budget: a longer "
                   "prompt is prefilled in chunks")
    p.add_argument("--sample-seed", type=int, default=None, help="sample at temperature 1 with this seed instead "
                   "of greedy decoding")
    p.add_argument("--embed", action="store_true", help="a pooling runner (runner=\"pooling\"): the prompts' "
                   "embeddings instead of generated tokens")
    a = p.parse_args()
    from vllm import LLM, SamplingParams

    t0 = time.time()
    tp = a.tensor_parallel_size
    llm = LLM(model=a.model, dtype="bfloat16", enforce_eager=not a.compile,
              distributed_executor_backend="uni" if tp == 1 else "mp", tensor_parallel_size=tp,
              max_model_len=a.max_model_len, max_num_batched_tokens=a.max_num_batched_tokens,
              gpu_memory_utilization=0.5, seed=0,
              **({"runner": "pooling"} if a.embed else {}))
    start_s = time.time() - t0
    if a.embed:
        embeddings = [list(o.outputs.embedding) for o in llm.embed(a.prompt)]
        with open(a.out, "w") as f:
            json.dump({"embeddings": embeddings, "quantization": llm.llm_engine.vllm_config.model_config.quantization,
                       "engine_start_s": start_s}, f)
        return
    sampling = {"temperature": 0.0} if a.sample_seed is None else {"temperature": 1.0, "seed": a.sample_seed}
    params = SamplingParams(**sampling, max_tokens=a.max_tokens, ignore_eos=True,
                            logprobs=a.logprobs or None, prompt_logprobs=0 if a.prompt_logprobs else None)
    prompts = a.prompt + [{"prompt_token_ids": [int(t) for t in ids.split(",")]} for ids in a.prompt_ids]
    rows = [row(o, a) for o in llm.generate(prompts, params)]
    alone = [row(llm.generate([q], params, use_tqdm=False)[0], a) for q in prompts] if a.alone else None
    quant = llm.llm_engine.vllm_config.model_config.quantization
    with open(a.out, "w") as f:
        json.dump({"outputs": rows, "alone": alone, "quantization": quant, "engine_start_s": start_s}, f)


def row(o, a: argparse.Namespace) -> dict:
    c = o.outputs[0]
    out = {"prompt": o.prompt, "prompt_token_ids": list(o.prompt_token_ids), "text": c.text,
           "token_ids": list(c.token_ids)}
    if a.prompt_logprobs:  # the logprob of each prompt token after the first, given the ones before it
        out["prompt_logprobs"] = [step[t].logprob for step, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
    if a.logprobs:
        out["logprobs"] = [{str(k): v.logprob for k, v in step.items()} for step in c.logprobs]
    return out


if __name__ == "__main__":
    main()
