"""Issue 14: which decoder layers' W4A8 quantization moves HellaSwag scores. The BF16 source with one
layer at a time on the default checkpoint's reference W4A8 arithmetic (its 7 linears as SimulatedW4A8Linear, its two
smoothed RMSNorm weights), TorchEngine on the CPU, the first N items. Per item: the acc_norm margin (gold's
length-normalized loglik minus the best other's); per variant: mean change of that margin against BF16, acc_norm.
usage: python docs/bench/accuracy_layers.py BF16_DIR W4A8_DIR N OUT.json [variants: bf16,all,0,1,...]"""
import copy, json, sys, time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from anychip.checkpoint.torch_model import load_reference_model
from anychip.eval.engines import SimulatedW4A8Linear, TorchEngine
from anychip.eval.runner import EvalSettings, evaluate_engine
from anychip.eval.tasks import load_task, select_tasks

bf16_dir, w4_dir, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(2)
files, _ = select_tasks(["hellaswag"], None)
task = load_task(files[0], n)
settings = EvalSettings(limit=n, engine="torch")
tok = AutoTokenizer.from_pretrained(bf16_dir, local_files_only=True)
base = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16, local_files_only=True).eval()
ref = load_reference_model(w4_dir, dtype=torch.bfloat16)
quant = {name: m for name, m in ref.named_modules() if hasattr(m, "wq") and hasattr(m, "scales")}
layers = len(base.model.layers)
variants = sys.argv[5].split(",") if len(sys.argv) > 5 else ["bf16", "all"] + [str(i) for i in range(layers)]


def build(which: str):
    model = copy.deepcopy(base)
    chosen = range(layers) if which == "all" else [] if which == "bf16" else [int(which)]
    for i in chosen:
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(model.model.layers[i], norm).weight.data.copy_(getattr(ref.model.layers[i], norm).weight.data)
        for name, m in quant.items():
            if name.startswith(f"model.layers.{i}."):
                parent, child = name.rsplit(".", 1)
                old = model.get_submodule(name)
                setattr(model.get_submodule(parent), child, SimulatedW4A8Linear.from_int4(m.wq, m.scales, old.bias))
    return model


def margins(logliks):
    out = []
    for ll, item in zip(logliks, task.items):
        normed = [x / max(k, 1) for x, k in zip(ll, item.lengths)]
        gold = normed[item.label]
        out.append(gold - max(v for j, v in enumerate(normed) if j != item.label))
    return out


report = {"n": n, "variants": {}}
for which in variants:
    t0 = time.perf_counter()
    engine = TorchEngine(build(which), tok, max_len=2048)
    res = evaluate_engine(engine, which, files, None, settings)
    m = margins(res.logliks["hellaswag"])
    report["variants"][which] = {"margins": m, "acc_norm": sum(x > 0 for x in m) / len(m),
                                 "seconds": round(time.perf_counter() - t0, 1)}
    b = report["variants"].get("bf16")
    dm = (sum(x - y for x, y in zip(m, b["margins"])) / len(m)) if b else None
    print(which, "acc_norm", round(100 * report["variants"][which]["acc_norm"], 2), "mean dmargin",
          None if dm is None else round(dm, 5), report["variants"][which]["seconds"], "s", flush=True)
    json.dump(report, open(out, "w"))
