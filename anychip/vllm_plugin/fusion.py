"""A graph pass that moves vLLM's RMSNorm into the W4A8 linear that consumes it.

In vLLM's compiled graph a decoder layer's input norm and post-attention norm (`vllm_ir.rms_norm`,
`vllm_ir.fused_add_rms_norm`, before vLLM lowers its IR ops) each feed one W4A8 linear (the merged qkv or gate/up
projection), whose kernels quantize the norm's output per token. Where a route computes the norm inside its own
kernels (Route.fuses_norm: the CUDA Triton route, which at one token does norm, quantization and GEMV in a single
launch), this pass replaces the pair by `anychip::w4a8_linear_norm`: same inputs, same outputs (the linear's and,
for fused_add_rms_norm, the new residual), one launch fewer per norm. Numerics: the norm as vLLM's IR op defines
it (ops.py, reference.rms_norm_ref), then the checkpoint's W4A8 linear; nothing about the quantization changes.

A pair is left alone unless the norm's output has no other user, its weight has the input's dtype and shape (K,),
it normalizes the whole row (no variance_size) and the linear's route fuses norms; the pass changes nothing in a
graph without such pairs (CPUs, other models). ANYCHIP_FUSE_NORM=0 turns it off. The plugin installs it into
vLLM's post-grad pass manager (`install`), where it runs with vLLM's own fusion passes, before the IR lowering.
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from anychip import envs
from anychip.kernels import ops, routes  # noqa: F401  (ops registers torch.ops.anychip.*)

log = logging.getLogger(__name__)

LINEAR = torch.ops.anychip.w4a8_linear.default
NORM_LINEAR = torch.ops.anychip.w4a8_linear_norm.default
_LINEAR_ARGS = [a.name for a in LINEAR._schema.arguments]


def _norm_ops() -> tuple[Any, Any] | None:
    """vLLM's IR norm ops (rms_norm, fused_add_rms_norm), None before vLLM registered them (or in a vLLM without)."""
    try:
        return torch.ops.vllm_ir.rms_norm.default, torch.ops.vllm_ir.fused_add_rms_norm.default
    except (AttributeError, RuntimeError):
        return None


def _bound(node: fx.Node) -> dict[str, Any]:
    """node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    values.update({a.name: v for a, v in zip(schema.arguments, node.args)})
    values.update(node.kwargs)
    return values


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def route_fuses(route_id: str) -> bool:
    try:
        return routes.get(route_id).fuses_norm
    except Exception:  # an unknown id: not ours to fuse
        return False


class _Pair:
    """One norm feeding one W4A8 linear, and how to rewrite it."""

    def __init__(self, linear: fx.Node, norm: fx.Node, out: fx.Node, args: dict[str, Any], add: bool) -> None:
        self.linear, self.norm, self.out, self.args, self.add = linear, norm, out, args, add
        self.residuals = [u for u in norm.users if u is not out] if add else []  # getitem(norm, 1) nodes


def _pair(linear: fx.Node, targets: tuple[Any, Any], fuses: Callable[[str], bool]) -> _Pair | None:
    rms, add_rms = targets
    lin = dict(zip(_LINEAR_ARGS, linear.args)) | dict(linear.kwargs)
    out = lin.get("x")
    if not isinstance(out, fx.Node) or len(out.users) != 1 or not fuses(lin.get("route", "")):
        return None
    if out.target is rms:
        norm, add = out, False
    elif (out.target is operator.getitem and out.args[1] == 0 and isinstance(out.args[0], fx.Node)
          and out.args[0].target is add_rms):
        norm, add = out.args[0], True
    else:
        return None
    args = _bound(norm)
    x, weight, k = args.get("x"), args.get("weight"), lin.get("k")
    xv, wv = _val(x), _val(weight)
    if (args.get("variance_size") is not None or not isinstance(args.get("epsilon"), (int, float))
            or xv is None or wv is None or wv.dtype != xv.dtype or tuple(wv.shape) != (k,) or xv.shape[-1] != k):
        return None
    if add:
        rv = _val(args.get("x_residual"))
        if rv is None or rv.dtype != xv.dtype or rv.shape != xv.shape:
            return None
        if any(u.target is not operator.getitem or u.args[1] not in (0, 1) for u in norm.users):
            return None
    return _Pair(linear, norm, out, args, add)


def fuse_norms(graph: fx.Graph, fuses: Callable[[str], bool] = route_fuses) -> int:
    """Rewrite every fusable (norm, W4A8 linear) pair of `graph` in place; returns how many."""
    targets = _norm_ops()
    if targets is None:
        return 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    done = 0
    for linear in [n for n in graph.nodes if n.op == "call_function" and n.target is LINEAR]:
        pair = _pair(linear, targets, fuses)
        if pair is not None and _rewrite(graph, pair, order):
            done += 1
    if done:
        graph.lint()
    return done


def _rewrite(graph: fx.Graph, pair: _Pair, order: dict[fx.Node, int]) -> bool:
    linear, norm = pair.linear, pair.norm
    rest = list(linear.args[1:])
    # the fused node takes the norm's place when the linear's other inputs (weights: graph inputs) come before it,
    # so every user of the new residual follows it; else the linear's place, if no residual user comes earlier
    early = all(order.get(a, -1) < order[norm] for a in rest if isinstance(a, fx.Node))
    if not early and any(order.get(u, -1) < order[linear] for r in pair.residuals for u in r.users):
        return False
    a = pair.args
    new_args = (a["x"], a["x_residual"] if pair.add else None, a["weight"], float(a["epsilon"]), *rest)
    where = graph.inserting_after(norm) if early else graph.inserting_before(linear)
    with where:
        fused = graph.call_function(NORM_LINEAR, new_args, dict(linear.kwargs))
    with graph.inserting_after(fused):
        y = graph.call_function(operator.getitem, (fused, 0))
    with graph.inserting_after(y):
        residual = graph.call_function(operator.getitem, (fused, 1)) if pair.add else None
    vals = [_val(v) if isinstance(v, fx.Node) else v for v in new_args]
    mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode if mode is not None else _no_mode():
        out = NORM_LINEAR(*vals, **dict(linear.kwargs))
    fused.meta["val"], y.meta["val"] = out, out[0]
    linear.replace_all_uses_with(y)
    graph.erase_node(linear)
    graph.erase_node(pair.out)
    if residual is not None:
        residual.meta["val"] = out[1]
        for r in pair.residuals:
            r.replace_all_uses_with(residual)
            graph.erase_node(r)
    if pair.add:
        graph.erase_node(norm)
    return True


class _no_mode:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_installed = False


def install() -> bool:
    """Add the pass to vLLM's post-grad pass manager (its `configure`, once a process); False when this vLLM has no
    such manager or the pass is turned off."""
    global _installed
    if _installed:
        return True
    if not envs.fuse_norm():
        return False
    try:
        from vllm.compilation.passes.inductor_pass import InductorPass
        from vllm.compilation.passes.pass_manager import PostGradPassManager
    except ImportError as exc:
        log.info("anychip: no norm fusion in this vLLM (%s)", exc)
        return False

    class AnychipNormFusion(InductorPass):
        def __call__(self, graph: fx.Graph) -> None:
            count = fuse_norms(graph)
            if count:
                log.info("anychip: RMSNorm moved into %d W4A8 linears of a compiled graph", count)

        def uuid(self) -> str:  # the rewrite's source, not only this wrapper's: a change recompiles
            return InductorPass.hash_source(inspect.getsource(inspect.getmodule(fuse_norms)))

    original = PostGradPassManager.configure

    def configure(self: Any, config: Any, _original: Callable = original) -> None:
        _original(self, config)
        if not any(type(p).__name__ == AnychipNormFusion.__name__ for p in self.passes):
            self.passes.append(AnychipNormFusion())

    PostGradPassManager.configure = configure
    _installed = True
    return True
