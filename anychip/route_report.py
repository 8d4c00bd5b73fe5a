"""`anychip routes [MODEL] [--json]`: every kernel route, whether it can serve on this machine (and why not),
whether it is bit-exact with the reference; with MODEL, the route each quantized linear would get in strict mode,
from the checkpoint's headers alone (no vLLM, no weights read), and what the checkpoint contract finds wrong there."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from anychip import envs
from anychip.checkpoint.io import read_tensor_infos
from anychip.checkpoint.model_dir import ModelDir
from anychip.formats import PACK_FACTOR
from anychip.kernels import machine, routes
from anychip.kernels.policy import KernelPolicy
from anychip.kernels.routes import LinearProblem, NoKernelRoute
from anychip.kernels.routes.head import HEAD_ROUTES, select_head


def _natural(name: str) -> list:
    """Sort key of a tensor name with its numbers compared as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def quantized_linears(md: ModelDir) -> list[tuple[str, int, int]]:
    """(name, N, K) of every quantized linear as the checkpoint stores it, in file order of names."""
    infos = read_tensor_infos(md.path)
    out = []
    for name in sorted(infos, key=_natural):  # layers.2 before layers.10
        if not name.endswith(".weight_scale"):
            continue
        prefix = name.removesuffix(".weight_scale")
        if (packed := infos.get(f"{prefix}.weight_packed")) is not None:
            n, k = packed.shape[0], packed.shape[1] * PACK_FACTOR
        elif (weight := infos.get(f"{prefix}.weight")) is not None:
            n, k = weight.shape[0], weight.shape[1]
        else:
            continue
        out.append((prefix, n, k))
    return out


def plan_layers(md: ModelDir, policy: KernelPolicy, device: str) -> list[dict[str, Any]]:
    """The strict-mode route of every quantized linear (route None and the reason when none can serve)."""
    scheme = md.require_scheme()
    strict = replace(policy, allow_fallback=False)
    rows = []
    for name, n, k in quantized_linears(md):
        problem = LinearProblem(n, k, scheme.group_size, device)
        try:
            route, reason = routes.select(problem, strict).id, None
        except NoKernelRoute as exc:
            route, reason = None, str(exc)
        if route == routes.REFERENCE.id:  # forced: the plugin refuses it in strict mode (scheme.py), as here
            route, reason = None, (f"{envs.ANYCHIP_KERNEL_ISA}={policy.route} forces the reference route, which "
                                   f"strict mode refuses (set {envs.ANYCHIP_ALLOW_FALLBACK}=1 to serve on it, "
                                   "counted as fallback)")
        rows.append({"name": name, "n": n, "k": k, "group_size": scheme.group_size, "route": route,
                     "reason": reason})
    return rows


def report(model: Path | None, policy: KernelPolicy, device: str) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "machine": machine.describe() | {"forced_route": policy.route},
        "routes": [r.describe() for r in routes.ROUTES],
    }
    doc["head_routes"] = [r.describe() for r in HEAD_ROUTES]
    if device == "cpu":
        try:
            doc["head"] = {"kind": policy.head, "route": select_head(policy).id}
        except NoKernelRoute as exc:
            doc["head"] = {"kind": policy.head, "route": None, "reason": str(exc)}
    if model is not None:
        md = ModelDir.open(model)
        doc["model"] = {"path": str(md.path), "kind": md.kind, "device": device}
        doc["layers"] = plan_layers(md, policy, device)
        doc["model"]["contract"] = contract_problem(md.path)
    return doc


def contract_problem(path: Path) -> str | None:
    """What the checkpoint contract finds wrong from the headers and config alone (None: nothing), as `anychip
    verify --fast` would without reading the files' data or checksums: the engine refuses such a checkpoint
    whatever routes its linears would get."""
    from anychip.checkpoint.verify import verify_checkpoint
    from anychip.errors import AnychipError

    try:
        verify_checkpoint(path, checksums=False, values=False)
    except AnychipError as exc:
        return str(exc)
    return None


def format_text(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [f"machine: {m['machine']} {m['system']}, torch {m['torch']}, CPU features "
             f"{' '.join(m['cpu_flags']) or 'none of note'}, CUDA devices: {', '.join(m['cuda_devices']) or 'none'}"
             + (f"; forced route {m['forced_route']}" if m["forced_route"] else "")]
    lines.append(f"{'route':<17}{'device':<8}{'here':<6}{'bit-exact':<11}")
    for r in doc["routes"]:
        why = "" if r["available"] else f"  {r['id']}: {r['reason']}"
        note = " (fallback only)" if r["fallback_only"] else ""
        lines.append(f"{r['id']:<17}{r['device']:<8}{'yes' if r['available'] else 'no':<6}"
                     f"{'yes' if r['bit_exact'] else 'no':<11}{r['summary']}{note}{why}")
    lines.append(f"\n{'output head route':<27}{'here':<6}")
    for r in doc["head_routes"]:
        why = "" if r["available"] else f"  {r['id']}: {r['reason']}"
        note = " (fallback only)" if r["fallback_only"] else ""
        lines.append(f"{r['id']:<27}{'yes' if r['available'] else 'no':<6}{r['summary']}{note}{why}")
    if doc.get("head"):
        lines.append(f"the BF16 output head ({doc['head']['kind']} on the CPU) gets {doc['head']['route']}")
    if "layers" in doc:
        layers = doc["layers"]
        problem = doc["model"].get("contract")
        lines.append(f"\ncheckpoint contract (headers and config; checksums and values: `anychip verify`): "
                     + (f"REFUSED: {problem}" if problem else "ok"))
        counts = Counter(layer["route"] or "NONE" for layer in layers)
        lines.append(f"\n{doc['model']['path']} ({doc['model']['kind']}), strict mode on {doc['model']['device']}: "
                     f"{len(layers)} quantized linears: "
                     + ", ".join(f"{route} {count}" for route, count in sorted(counts.items())))
        for layer in layers:
            lines.append(f"  {layer['name']:<44} N={layer['n']:<6} K={layer['k']:<6} G{layer['group_size']:<4} "
                         f"{layer['route'] or 'no route: ' + str(layer['reason'])}")
    return "\n".join(lines)


def cmd_routes(args: argparse.Namespace) -> int:
    doc = report(Path(args.model) if args.model else None, envs.kernel_policy(allow_fallback=False), args.device)
    print(json.dumps(doc, indent=1) if args.json else format_text(doc))
    refused = bool((doc.get("model") or {}).get("contract"))
    return 1 if refused or any(layer["route"] is None for layer in doc.get("layers", [])) else 0
