"""The sweep behind docs/bench/accuracy.md: BF16 against W4A8 variants of one model, on full evaluation sets.

Runs on any torch device through anychip.eval's TorchEngine: the BF16 model in bf16, and each W4A8 variant with
its decoder linears on the reference arithmetic (INT4 weights dequantized, activations quantized per token to
INT8; SimulatedW4A8Linear). Variants are named METHOD-gG[-sSAMPLES][-dDAMP][-mse][-gen][-wonly], e.g. rtn-g64,
gptq-g32-s128-mse. -mse searches each group's clipping (GPTQ's `mse` option; for RTN the same search); -gen
calibrates GPTQ on text sampled from the model itself; -wonly leaves activations in float (INT4 weights alone).
`a8` keeps BF16 weights and quantizes activations only.

    python docs/bench/accuracy_sweep.py --bf16 DIR --data shared/evaldata --out sweep.json \
        --variants bf16,rtn-g64,rtn-g32,gptq-g64-s128,gptq-g32-s128 --device cuda
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from anychip.checkpoint.gptq import GPTQConfig, run_gptq, searched_scales
from anychip.checkpoint.rtn import quantize_with_scales, rtn_quantize
from anychip.checkpoint.scheme import DECODER_LINEARS, W4A8Scheme
from anychip.eval.engines import TorchEngine, simulate_w4a8
from anychip.eval.runner import EvalSettings, evaluate_engine
from anychip.eval.scoring import compare
from anychip.eval.tasks import load_text, resolve_data_dir, select_tasks

VARIANT = re.compile(r"^(rtn|gptq)-g(\d+)(?:-s(\d+))?(?:-d([0-9.]+))?(-mse)?(-gen)?(-wonly)?$")


def linears(model) -> list[str]:
    return [f"model.layers.{i}.{lin}" for i in range(model.config.num_hidden_layers) for lin in DECODER_LINEARS]


def rtn_searched(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    scales = torch.cat([searched_scales(w[:, g:g + group], group) for g in range(0, k, group)], dim=1)
    return quantize_with_scales(w, scales), scales


def quantized_weights(name: str, bf16: Path, model, device: str) -> tuple[dict, bool]:
    """{prefix: (wq, scales) or None} and whether activations are quantized."""
    if name == "a8":
        return {p: None for p in linears(model)}, True
    m = VARIANT.match(name)
    if not m:
        raise SystemExit(f"variant {name!r}: use bf16, a8 or METHOD-gG[-sSAMPLES][-dDAMP][-mse][-wonly]")
    method, group, mse, gen, act = m.group(1), int(m.group(2)), bool(m.group(5)), bool(m.group(6)), not m.group(7)
    scheme = W4A8Scheme(group_size=group)
    if method == "gptq":
        config = GPTQConfig(samples=int(m.group(3) or 128), damp=float(m.group(4) or 0.01), scale_search=mse)
        return run_gptq(bf16, scheme, calibration="generated" if gen else None, config=config, device=device), act
    out = {}
    for prefix in linears(model):
        w = model.get_submodule(prefix).weight.data.float()
        out[prefix] = rtn_searched(w, group) if mse else rtn_quantize(w.cpu(), group, prefix)
    return out, act


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bf16", required=True, type=Path)
    p.add_argument("--data")
    p.add_argument("--tasks", help="comma-separated (default: every *.jsonl in --data, plus perplexity)")
    p.add_argument("--variants", default="bf16,rtn-g64,rtn-g32,gptq-g64-s128,gptq-g32-s128")
    p.add_argument("--limit", type=int)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()

    names = args.tasks.split(",") if args.tasks else None
    data_dir = resolve_data_dir(args.data) if names is None or any(n != "perplexity" for n in names) else None
    task_files, want_ppl = select_tasks(names, data_dir)
    text_file, text = load_text(None) if want_ppl else (None, None)
    settings = EvalSettings(limit=args.limit, engine="torch", device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.bf16, local_files_only=True)
    report: dict = {"command": "python " + " ".join(sys.argv), "device": args.device,
                    "torch": torch.__version__, "settings": settings.__dict__, "text": str(text_file),
                    "variants": {}}
    results = {}
    for name in args.variants.split(","):
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(args.bf16, dtype=torch.bfloat16, local_files_only=True)
        model = model.to(args.device).eval()
        if name != "bf16":
            weights, act = quantized_weights(name, args.bf16, model, args.device)
            simulate_w4a8(model, weights, quantize_activations=act)
        quant_s = time.perf_counter() - t0
        res = evaluate_engine(TorchEngine(model, tokenizer, name=name), name, task_files, text, settings)
        del model
        results[name] = res
        entry = {"quantize_s": quant_s, "seconds": res.seconds, "ppl": res.ppl,
                 "tasks": {t: s.summary() for t, s in res.tasks.items()}}
        if "bf16" in results and name != "bf16":
            base = results["bf16"]
            entry["delta"] = {t: compare(s, base.tasks[t]) for t, s in res.tasks.items()}
            if res.ppl and base.ppl:
                entry["delta"]["perplexity"] = {"ppl_increase_pct": 100 * (res.ppl["ppl"] / base.ppl["ppl"] - 1)}
        report["variants"][name] = entry
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        items = {n: {t: {"acc": s.acc_items, "acc_norm": s.acc_norm_items} for t, s in r.tasks.items()}
                 for n, r in results.items()}
        args.out.with_suffix(".items.json").write_text(json.dumps(items))
        print(json.dumps({name: entry}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
