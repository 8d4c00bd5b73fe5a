"""Paired deltas between variants of different accuracy sweeps (`accuracy_sweep.py` reports), on the same items.

Each sweep writes REPORT.json and REPORT.items.json (per variant, per task, each item's 0/1 acc and acc_norm). A
variant is named FILE:NAME (FILE a sweep's report JSON, NAME one of its variants). For every pair A,B given with
--pair, the tasks both have are paired item by item (they must have the same number of items: the same task
files, the same --limit), and perplexity is compared where both reports have it.

    python docs/bench/accuracy_pairs.py --pair docs/bench/accuracy_refit.json:default-f3,q4.json:llama.cpp-Q4_0 \\
        --json pairs.json

--merge OUT.json IN.json ... first joins sweep reports that ran the same variants on different tasks (one
invocation a task, so that a stopped run keeps the tasks it finished) into one report and items file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from accuracy_sweep import load_base  # the sibling script: Python puts a script's folder on the path

from anychip.eval.scoring import TaskScore, compare


def load(spec: str) -> tuple[dict[str, TaskScore], float | None]:
    """FILE:NAME -> ({task: its items' outcomes}, perplexity or None)."""
    file, _, name = spec.rpartition(":")
    if not file or not name:
        raise SystemExit(f"{spec!r}: use FILE:NAME, a sweep report and one of its variants")
    entry, tasks = load_base(Path(file), name=name)
    return tasks, (entry.get("ppl") or {}).get("ppl")


def pair(a: str, b: str) -> dict:
    """{task: A - B deltas with paired 95% CIs} and, where both have it, perplexity's change A / B - 1."""
    (ta, pa), (tb, pb) = load(a), load(b)
    out: dict = {}
    for task in sorted(set(ta) & set(tb)):
        if ta[task].n != tb[task].n:
            raise SystemExit(f"{task}: {a} has {ta[task].n} items, {b} {tb[task].n}: pair the same items")
        out[task] = {**compare(ta[task], tb[task]), "n": ta[task].n}
    if pa and pb:
        out["perplexity"] = {"a": pa, "b": pb, "ppl_change_pct": 100 * (pa / pb - 1)}
    return out


def merge(out: Path, inputs: list[Path]) -> None:
    """One sweep report (and items file) of several that ran the same variants on different tasks."""
    report: dict = {"merged": [str(p) for p in inputs], "commands": [], "variants": {}}
    items: dict = {}
    for path in inputs:
        part = json.loads(path.read_text())
        report["commands"].append(part.get("command"))
        for key in ("device", "device_name", "torch", "base"):
            report.setdefault(key, part.get(key))
        for name, entry in part["variants"].items():
            into = report["variants"].setdefault(name, {"tasks": {}, "seconds": {}, "delta": {}})
            for key in ("tasks", "seconds", "delta"):
                into[key].update(entry.get(key) or {})
            for key in ("recipe", "quantize_s"):
                into.setdefault(key, entry.get(key))
            if entry.get("ppl"):
                into["ppl"] = entry["ppl"]
        for name, tasks in json.loads(path.with_suffix(".items.json").read_text()).items():
            items.setdefault(name, {}).update(tasks)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".items.json").write_text(json.dumps(items))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--pair", action="append", default=[], metavar="A,B", help="FILE:NAME,FILE:NAME (repeatable)")
    p.add_argument("--json", type=Path, help="write {\"A - B\": deltas} here")
    p.add_argument("--merge", nargs="+", type=Path, metavar=("OUT", "IN"), help="join sweep reports (see above)")
    args = p.parse_args()
    if args.merge:
        if len(args.merge) < 2:
            raise SystemExit("--merge OUT.json IN.json ...")
        merge(args.merge[0], args.merge[1:])
    result = {}
    for spec in args.pair:
        a, _, b = spec.partition(",")
        deltas = pair(a, b)
        result[f"{a} - {b}"] = deltas
        print(f"{a} - {b}")
        for task, d in deltas.items():
            if task == "perplexity":
                print(f"  perplexity {d['a']:.3f} vs {d['b']:.3f}: {d['ppl_change_pct']:+.1f}%")
            else:
                lo, hi = d["acc_norm_ci95"]
                print(f"  {task:<16} acc_norm {100 * d['acc_norm']:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]"
                      f"  acc {100 * d['acc']:+.2f}  (n={d['n']})")
    if args.json:
        args.json.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "pairs": result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
