"""The sweep behind docs/bench/accuracy.md: BF16 against W4A8 quantizer recipes of one model, in one run.

Runs on any torch device through anychip.eval's TorchEngine: the BF16 model in bf16, and each W4A8 variant with
its decoder linears on the reference arithmetic (INT4 weights dequantized, activations quantized per token to
INT8; SimulatedW4A8Linear) and, where smoothing changed them, its RMSNorm weights replaced. Variants:

    bf16                          the source model
    a8                            BF16 weights, INT8 activations only
    default                       the recipe `anychip prepare` uses (PrepareRecipe + gptq.DEFAULT_GPTQ)
    rtn-gG[-amax|-clip|-mse][-sg] round to nearest, scales by scales.py (default amax; -sg: signed)
    gptq-gG[-sN][-lN][-dX][-rN][-amax|-clip|-mse][-ao][-ts][-sm|-smn][-fN][-tN][-eN][-uX][-as][-sg][-gen|-xNAME]
                                  GPTQ: N calibration sequences (default 128) of N tokens each (-l, default
                                  512), damp X, calibration windows drawn with seed N (default 0; to see
                                  run-to-run spread), scale search,
                                  act-order (static groups), true-sequential, smoothing at all four points (-sm)
                                  or at the two RMSNorms only (-smn), scales refit against the full Hessian
                                  (GPTQConfig.refit N), N block-tuning steps a layer after GPTQ
                                  (GPTQConfig.tune_steps), N steps of end-to-end scale tuning after GPTQ
                                  (GPTQConfig.e2e_steps) at step size X (-u, GPTQConfig.e2e_lr),
                                  asymmetric calibration (-as: GPTQConfig.asymmetric),
                                  signed group scales (-sg: GPTQConfig.signed_scales; for rtn too),
                                  calibration text sampled from the model (-gen)
                                  or read from the file `--text NAME=PATH` names (-xNAME; default: the shipped
                                  text)
    default[-fN][-tN][-eN][-uX][-dX][-as][-sg][-sN][-lN][-xNAME]
                                  the default recipe with GPTQConfig.refit N (and tune_steps N, e2e_steps N,
                                  e2e_lr X, damp X, asymmetric, N calibration sequences of N tokens, the
                                  calibration text --text NAME=PATH names)
    any of these + -wonly         activations left in float (INT4 weights alone)
    llama.cpp-TYPE                the peer: llama.cpp's own GGUF of the BF16 source (TYPE Q4_0, Q8_0 or F32, made
                                  by llama.cpp's quantizer) scored through llama-cpp-python on the CPU, on the
                                  same requests (needs `make peers`; --threads)

Unnamed options take GPTQConfig's field defaults (the smoothing search on 2048 tokens; `default` uses
DEFAULT_GPTQ's 512), and every flag left out is off: `gptq-g32-s32-clip` is the recipe before act-order and
smoothing existed. Deltas are W4A8 - BF16 with paired 95% CIs per item.

    python docs/bench/accuracy_sweep.py --bf16 DIR --out sweep.json --variants bf16,default,gptq-g32-s32-clip
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from anychip.checkpoint.gptq import DEFAULT_GPTQ, GENERATED, GPTQConfig, run_gptq
from anychip.checkpoint.prepare import DEFAULT_RECIPE
from anychip.checkpoint.rtn import quantize_with_scales
from anychip.checkpoint.scales import SCALE_SEARCHES, search_scales
from anychip.checkpoint.scheme import DECODER_LINEARS, W4A8Scheme
from anychip.checkpoint.smooth import POINT_NAMES
from anychip.eval import runner
from anychip.eval.engines import TorchEngine, simulate_w4a8
from anychip.eval.runner import EvalSettings, evaluate_engine
from anychip.eval.scoring import TaskScore, compare
from anychip.eval.tasks import load_text, resolve_data_dir, select_tasks

NORM_POINTS = ("attn_in", "mlp_in")


def linears(model) -> list[str]:
    return [f"model.layers.{i}.{lin}" for i in range(model.config.num_hidden_layers) for lin in DECODER_LINEARS]


def parse_variant(name: str, texts: dict[str, Path] | None = None) -> tuple[str, int, GPTQConfig | str, str | None,
                                                                           bool]:
    """name -> (method, group size, GPTQConfig for gptq or the scale search for rtn, the calibration (None: the
    shipped text, "generated", or a file of `texts`), quantize activations)."""
    texts = texts or {}
    head, _, rest = name.partition("-")
    extra = rest.split("-") if rest else []
    named = {f"x{key}": str(path) for key, path in texts.items()}  # -xNAME: the file --text NAME=PATH names
    if (any(f[:1] == "u" and f[1:].replace(".", "", 1).isdigit() for f in extra)
            and not any(f[:1] == "e" and f[1:].isdigit() for f in extra)):
        raise SystemExit(f"variant {name!r}: -uX is the step size of end-to-end tuning: add -eN")
    if head == "default" and all(f in ("as", "sg") or f in named or f[:1] in "ftsle" and f[1:].isdigit()
                                 or f[:1] in "du" and f[1:].replace(".", "", 1).isdigit() for f in extra):
        refit = next((int(f[1:]) for f in extra if f[0] == "f"), DEFAULT_GPTQ.refit)
        tune = next((int(f[1:]) for f in extra if f[0] == "t"), DEFAULT_GPTQ.tune_steps)
        e2e = next((int(f[1:]) for f in extra if f[0] == "e"), DEFAULT_GPTQ.e2e_steps)
        e2e_lr = next((float(f[1:]) for f in extra if f[0] == "u"), DEFAULT_GPTQ.e2e_lr)
        damp = next((float(f[1:]) for f in extra if f[0] == "d"), DEFAULT_GPTQ.damp)
        samples = next((int(f[1:]) for f in extra if f[0] == "s" and f[1:].isdigit()), DEFAULT_RECIPE.gptq_samples)
        seq_len = next((int(f[1:]) for f in extra if f[0] == "l"), DEFAULT_GPTQ.seq_len)
        config = replace(DEFAULT_GPTQ, samples=samples, seq_len=seq_len, refit=refit, tune_steps=tune, damp=damp,
                         e2e_steps=e2e, e2e_lr=e2e_lr, asymmetric=DEFAULT_GPTQ.asymmetric or "as" in extra,
                         signed_scales=DEFAULT_GPTQ.signed_scales or "sg" in extra)
        calibration = next((named[f] for f in reversed(extra) if f in named), None)
        return DEFAULT_RECIPE.method, DEFAULT_RECIPE.group_size or 32, config, calibration, True
    method, group, *flags = name.split("-")
    if method not in ("rtn", "gptq") or not group.startswith("g") or not group[1:].isdigit():
        raise SystemExit(f"variant {name!r}: use bf16, a8, default, rtn-gG[...] or gptq-gG[...] (see --help)")
    act = "wonly" not in flags
    calibration = next((named[f] for f in reversed(flags) if f in named), GENERATED if "gen" in flags else None)
    search = next((f for f in flags if f in SCALE_SEARCHES), "amax" if method == "rtn" else None)
    known = {"wonly", "gen", "ao", "ts", "sm", "smn", "as", "sg", *SCALE_SEARCHES, *named}
    for f in flags:
        if f not in known and not (f[0] in "sldrft" and f[1:].replace(".", "").isdigit()
                                   or f[0] in "eu" and f[1:].replace(".", "", 1).isdigit()):
            raise SystemExit(f"variant {name!r}: unknown option -{f} (-xNAME needs --text NAME=PATH)")
    if method == "rtn":
        return method, int(group[1:]), search + ("-sg" if "sg" in flags else ""), None, act
    samples = next((int(f[1:]) for f in flags if f[0] == "s" and f[1:].isdigit()), 128)
    seq_len = next((int(f[1:]) for f in flags if f[0] == "l" and f[1:].isdigit()), GPTQConfig.seq_len)
    damp = next((float(f[1:]) for f in flags if f[0] == "d" and f[1:].replace(".", "").isdigit()), 0.01)
    seed = next((int(f[1:]) for f in flags if f[0] == "r" and f[1:].isdigit()), 0)
    refit = next((int(f[1:]) for f in flags if f[0] == "f" and f[1:].isdigit()), 0)
    tune = next((int(f[1:]) for f in flags if f[0] == "t" and f[1:].isdigit()), 0)
    e2e = next((int(f[1:]) for f in flags if f[0] == "e" and f[1:].isdigit()), 0)
    e2e_lr = next((float(f[1:]) for f in flags if f[0] == "u" and f[1:].replace(".", "", 1).isdigit()),
                  GPTQConfig.e2e_lr)
    smooth = POINT_NAMES if "sm" in flags else NORM_POINTS if "smn" in flags else ()
    config = replace(GPTQConfig(), samples=samples, seq_len=seq_len, damp=damp, seed=seed,
                     scale_search=search or "clip", act_order="ao" in flags, true_sequential="ts" in flags,
                     smooth=smooth, refit=refit, tune_steps=tune, e2e_steps=e2e, e2e_lr=e2e_lr,
                     asymmetric="as" in flags,
                     signed_scales="sg" in flags)
    return method, int(group[1:]), config, calibration, act


def quantize_variant(name: str, bf16: Path, model, device: str, texts: dict[str, Path] | None = None
                     ) -> tuple[dict, dict, bool, dict]:
    """({prefix: (wq, scales) or None}, {BF16 tensor: replacement}, quantize activations, recipe record)."""
    if name == "a8":
        return {p: None for p in linears(model)}, {}, True, {}
    method, group, how, calibration, act = parse_variant(name, texts)
    if method == "gptq":
        res = run_gptq(bf16, W4A8Scheme(group_size=group), calibration=calibration, config=how, device=device)
        return res.weights, res.dense, act, {"gptq": how.recipe(), "smoothing": res.smoothing,
                                             "tuning": res.tuning, "e2e_tuning": res.e2e,
                                             "calibration": calibration or "shipped"}
    out = {}
    for prefix in linears(model):
        w = model.get_submodule(prefix).weight.data.float()
        scales = search_scales(w, group, how.removesuffix("-sg"), signed=how.endswith("-sg"))
        out[prefix] = (quantize_with_scales(w, scales).cpu(), scales.cpu())
    return out, {}, act, {"rtn": how}


def load_base(path: Path, limit: int | None = None, name: str = "bf16") -> tuple[dict, dict]:
    """The `name` entry of an earlier sweep's report (and its per-item outcomes, the first `limit` of each task)
    to take deltas against."""
    report = json.loads(path.read_text())
    items = json.loads(path.with_suffix(".items.json").read_text())
    if name not in items:
        raise SystemExit(f"{path} has no variant {name!r} (it has {', '.join(items)})")
    tasks = {t: TaskScore(tuple(v["acc"][:limit]), tuple(v["acc_norm"][:limit])) for t, v in items[name].items()}
    return report["variants"][name], tasks


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--bf16", required=True, type=Path, help="the BF16 model directory (anychip prepare's bf16/)")
    p.add_argument("--data", help="a folder of *.jsonl tasks (default: the built-in tasks)")
    p.add_argument("--tasks", help="comma-separated (default: the four built-in tasks, or every *.jsonl in "
                                   "--data, plus perplexity)")
    p.add_argument("--variants", default="bf16,default")
    p.add_argument("--base", type=Path, help="an earlier sweep's JSON whose bf16 run the deltas use (skips bf16)")
    p.add_argument("--limit", type=int, help="first N items of each task (a subset: say so when reporting)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--text", action="append", default=[], metavar="NAME=PATH",
                   help="a calibration text the variants' -xNAME option reads (repeatable)")
    p.add_argument("--threads", type=int, help="CPU threads of a llama.cpp variant (default: every CPU)")
    args = p.parse_args()
    texts = {}
    for spec in args.text:
        key, _, path = spec.partition("=")
        if not key or not Path(path).is_file():
            raise SystemExit(f"--text {spec!r}: use NAME=PATH of an existing file")
        texts[key] = Path(path)

    names = args.tasks.split(",") if args.tasks else None
    data_dir = resolve_data_dir(args.data) if names is None or any(n != "perplexity" for n in names) else None
    task_files, want_ppl = select_tasks(names, data_dir)
    text_file, text = load_text(None) if want_ppl else (None, None)
    settings = EvalSettings(limit=args.limit, engine="torch", device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.bf16, local_files_only=True)
    report: dict = {"command": "python " + " ".join(sys.argv), "device": args.device,
                    "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                    "torch": torch.__version__, "settings": settings.__dict__, "text": str(text_file),
                    "variants": {}}
    base_tasks, base_ppl = None, None
    if args.base:
        entry, base_tasks = load_base(args.base, args.limit)
        base_ppl = entry.get("ppl")
        report["base"] = str(args.base)
        report["variants"]["bf16"] = entry
    items: dict = {}
    for name in args.variants.split(","):
        t0 = time.perf_counter()
        if name.startswith(LLAMA_CPP):
            engine, recipe = llama_cpp_variant(name, args.bf16, replace(settings, threads=args.threads))
            quant_s = time.perf_counter() - t0
            res = evaluate_engine(engine, name, task_files, text, settings)
            engine.close()
            record(report, items, name, res, quant_s, recipe, base_tasks, base_ppl, args.out)
            continue
        model = AutoModelForCausalLM.from_pretrained(args.bf16, dtype=torch.bfloat16, local_files_only=True)
        model = model.to(args.device).eval()
        recipe: dict = {}
        if name != "bf16":
            weights, dense, act, recipe = quantize_variant(name, args.bf16, model, args.device, texts)
            with torch.no_grad():
                for tensor, value in dense.items():
                    model.get_parameter(tensor).copy_(value)
            simulate_w4a8(model, weights, quantize_activations=act)
        quant_s = time.perf_counter() - t0
        res = evaluate_engine(TorchEngine(model, tokenizer, name=name), name, task_files, text, settings)
        del model
        if name == "bf16":
            base_tasks, base_ppl = res.tasks, res.ppl
        record(report, items, name, res, quant_s, recipe, base_tasks, base_ppl, args.out)
    return 0


LLAMA_CPP = runner.LLAMA_CPP + "-"  # the label eval gives its llama.cpp peers: llama.cpp-Q4_0


def llama_cpp_variant(name: str, bf16: Path, settings: EvalSettings):
    """(engine, recipe record) of a `llama.cpp-TYPE` variant: llama.cpp's GGUF of the BF16 source on the CPU,
    started as `anychip eval --llama-cpp TYPE` starts it."""
    from importlib.metadata import version

    from anychip.eval.llama_cpp_engine import gguf_for

    ftype = name[len(LLAMA_CPP):]
    gguf = gguf_for(bf16, ftype)
    target = runner.Target(name, gguf, engine=runner.LLAMA_CPP, tokenizer=bf16)
    return (runner.make_engine(target, settings),
            {"llama.cpp": ftype, "gguf": gguf.name, "llama_cpp_python": version("llama_cpp_python"),
             "threads": settings.threads})


def record(report: dict, items: dict, name: str, res, quant_s: float, recipe: dict, base_tasks, base_ppl,
           out: Path) -> None:
    """Add one variant's outcome (and its deltas against the base) to the report and the per-item file."""
    entry = {"quantize_s": quant_s, "seconds": res.seconds, "ppl": res.ppl, "recipe": recipe,
             "tasks": {t: s.summary() for t, s in res.tasks.items()}}
    if base_tasks is not None and name != "bf16":
        entry["delta"] = {t: compare(s, base_tasks[t]) for t, s in res.tasks.items()}
        if res.ppl and base_ppl:
            entry["delta"]["perplexity"] = {"ppl_increase_pct": 100 * (res.ppl["ppl"] / base_ppl["ppl"] - 1)}
    report["variants"][name] = entry
    items[name] = {t: {"acc": s.acc_items, "acc_norm": s.acc_norm_items} for t, s in res.tasks.items()}
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".items.json").write_text(json.dumps(items))
    print(summary_line(name, entry), flush=True)


def summary_line(name: str, entry: dict) -> str:
    parts = [f"{name}: quantize {entry['quantize_s']:.0f}s eval {sum(entry['seconds'].values()):.0f}s"]
    if entry.get("ppl"):
        parts.append(f"ppl {entry['ppl']['ppl']:.3f}")
    for t, d in entry.get("delta", {}).items():
        if t == "perplexity":
            parts.append(f"ppl {d['ppl_increase_pct']:+.1f}%")
        else:
            lo, hi = d["acc_norm_ci95"]
            parts.append(f"{t} {100 * d['acc_norm']:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]")
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
