"""A graph pass that moves what vLLM computes ahead of a W4A8 linear into the linear's own kernels.

In vLLM's compiled graph a decoder layer's input norm and post-attention norm (`vllm_ir.rms_norm`,
`vllm_ir.fused_add_rms_norm`, before vLLM lowers its IR ops) each feed one W4A8 linear (the merged qkv or gate/up
projection), and SiluAndMul (traced from its native forward: two slices of the gate/up output, silu, a product)
feeds the down projection; the linear's kernels then quantize that output per token. Where a route computes these
inside its own kernels (Route.fuses_norm, Route.fuses_silu_mul: the CUDA Triton route, which at one token does
them, the quantization and the GEMV in a single launch, and the C++ x86 routes, which compute them while they
quantize the linear's input), the pass replaces the pair by `anychip::w4a8_linear_norm`
(same outputs: the linear's and, for fused_add_rms_norm, the new residual) or `anychip::w4a8_linear_silu_mul`: one
launch fewer per pair. Numerics: the norm as vLLM's IR op defines it (reference.rms_norm_ref) and SiluAndMul as its
native forward computes it (reference.silu_and_mul_ref), then the checkpoint's W4A8 linear; nothing about the
quantization changes.

A pair is left alone unless the producer's output has no other user, its dtypes and shapes are the linear's input
(a norm's weight (K,), no variance_size; SiluAndMul's halves [0, K) and [K, 2K) of one row) and the linear's route
fuses it; the pass changes nothing in a graph without such pairs (other models, routes that fuse neither).
ANYCHIP_FUSE_NORM=0 turns the norm half off. The SiluAndMul half runs where the route fuses it by default
(Route.fuse_silu_by_default: the C++ x86 routes) unless ANYCHIP_FUSE_SILU=0, and on the CUDA route only with
ANYCHIP_FUSE_SILU=1 (one H200 run, docs/gpu-notes.md session 10, did not show it faster: each GEMV program
recomputes silu over the whole row for the token's scale). The plugin puts the pass into each engine's compile
options (`install`, `add_pass`): a CUDA engine's post-grad pass manager runs it after vLLM's own fusion passes and
before the IR lowering; a CPU engine, which vLLM compiles with stock Inductor and the IR ops off, runs it as
Inductor's post-grad hook, where a norm is the IR op's traced native body (`_decomposed_norm`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.symbolic_shapes import statically_known_true

from anychip import envs
from anychip.kernels import ops, routes  # noqa: F401  (ops registers torch.ops.anychip.*)

try:  # vLLM's pass base (a CustomGraphPass): its CUDA backend takes only those from the compile options
    from vllm.compilation.passes.inductor_pass import InductorPass as _PassBase
except Exception:  # a vLLM without it: stock Inductor still runs any CustomGraphPass
    _PassBase = CustomGraphPass

log = logging.getLogger(__name__)

LINEAR = torch.ops.anychip.w4a8_linear.default
NORM_LINEAR = torch.ops.anychip.w4a8_linear_norm.default
SILU_LINEAR = torch.ops.anychip.w4a8_linear_silu_mul.default


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


def _same(a: Any, b: Any) -> bool:
    """a == b for sizes or shapes, symbolic ones included, known without adding a guard: a matcher that compared two
    token counts with == would make the compiled graph assume them equal (vLLM's CPU engines mark them dynamic, and
    torch refuses the constraint)."""
    if isinstance(a, (tuple, list, torch.Size)) or isinstance(b, (tuple, list, torch.Size)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(statically_known_true(a == b))


def _linears(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is LINEAR]


def _fake_call(op: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """op's output on the fake values of args' nodes (the `val` meta a new node of the graph needs)."""
    vals = [_val(v) if isinstance(v, fx.Node) else v for v in args]
    mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        return op(*vals, **kwargs)


def _route_has(route: int | str, capability: str) -> bool:
    """Whether the route of this op code (the linear's `route` argument) or id has the capability."""
    try:
        return getattr(routes.get(route), capability)
    except Exception:  # an unknown route: not ours to fuse
        return False


def route_fuses(route: int | str) -> bool:
    return _route_has(route, "fuses_norm")


class _Pair:
    """One norm feeding one W4A8 linear, and how to rewrite it."""

    def __init__(self, linear: fx.Node, norm: fx.Node, out: fx.Node, args: dict[str, Any], add: bool) -> None:
        self.linear, self.norm, self.out, self.args, self.add = linear, norm, out, args, add
        self.residuals = [u for u in norm.users if u is not out] if add else []  # getitem(norm, 1) nodes


def _pair(linear: fx.Node, targets: tuple[Any, Any], fuses: Callable[[str], bool]) -> _Pair | None:
    rms, add_rms = targets
    lin = _bound(linear)
    out = lin.get("x")
    if not isinstance(out, fx.Node) or len(out.users) != 1 or not fuses(lin.get("route", -1)):
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
            or xv is None or wv is None or wv.dtype != xv.dtype or not _same(wv.shape, (k,))
            or not _same(xv.shape[-1], k)):
        return None
    if add:
        rv = _val(args.get("x_residual"))
        if rv is None or rv.dtype != xv.dtype or not _same(rv.shape, xv.shape):
            return None
        if any(u.target is not operator.getitem or u.args[1] not in (0, 1) for u in norm.users):
            return None
    return _Pair(linear, norm, out, args, add)


# --- SiluAndMul ahead of a linear (the down projection) -------------------------------------------------------

_aten = torch.ops.aten
_CONVERT = (torch.ops.prims.convert_element_type.default, _aten._to_copy.default)


def _through_converts(node: Any) -> Any:
    while isinstance(node, fx.Node) and node.target in _CONVERT:
        node = node.args[0]
    return node


def _call(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _silu_input(node: Any) -> Any:
    """a when node computes silu(a) (up to dtype conversions) in one of the forms a traced SiluAndMul takes after
    decomposition: silu(a), a * sigmoid(a), a / (1 + exp(-a)); else None."""
    node = _through_converts(node)
    if _call(node, _aten.silu.default):
        return node.args[0]
    if _call(node, _aten.mul.Tensor) and len(node.args) == 2:
        for a, b in (node.args, node.args[::-1]):
            if _call(b, _aten.sigmoid.default) and b.args[0] is a:
                return a
    if _call(node, _aten.div.Tensor) and len(node.args) == 2:
        a, den = node.args
        if _call(den, _aten.add.Tensor) and den.args[1] == 1 and _call(den.args[0], _aten.exp.default):
            neg = den.args[0].args[0]
            if _call(neg, _aten.neg.default) and neg.args[0] is a:
                return a
    return None


def _last_dim_slice(node: Any) -> tuple[fx.Node, int, int] | None:
    """(source, start, end) of a slice along the last dimension, else None."""
    if not _call(node, _aten.slice.Tensor):
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    src, dim, start, end = args[0], args[1] if args[1] is not None else 0, args[2] or 0, args[3]
    val = _val(src)
    if val is None or not isinstance(start, int) or not isinstance(end, int) or dim not in (-1, val.dim() - 1):
        return None
    return src, start, end


def _silu_mul_source(x: Any, k: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """(y, the nodes between y and x) when x = silu(y[..., :k]) * y[..., k:2k] (y's last dimension 2k), else None."""
    if not _call(x, _aten.mul.Tensor) or len(x.args) != 2:
        return None
    for act, up in (x.args, x.args[::-1]):
        a = _silu_input(act)
        gate = _last_dim_slice(_through_converts(a))
        upper = _last_dim_slice(_through_converts(up))
        if gate is None or upper is None or gate[0] is not upper[0]:
            continue
        y = gate[0]
        if not _same(_val(y).shape[-1], 2 * k) or gate[1:] != (0, k) or upper[1] != k or upper[2] < 2 * k:
            continue
        return y, _ancestors(x, stop=y)
    return None


def _erase_unused(graph: fx.Graph, nodes: Any) -> None:
    """Erase those of `nodes` that nothing uses any more, users before what they use."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)


def _ancestors(node: fx.Node, stop: fx.Node) -> list[fx.Node]:
    """node and the calls it depends on down to (not including) stop."""
    seen: list[fx.Node] = []
    todo = [node]
    while todo:
        n = todo.pop()
        if n is stop or n in seen or not isinstance(n, fx.Node) or n.op != "call_function":
            continue
        seen.append(n)
        todo.extend(a for a in n.all_input_nodes)
    return seen


def silu_fuser(setting: bool | None) -> Callable[[int | str], bool]:
    """route -> whether the route computes SiluAndMul and the fusion is on for it under `setting` (ANYCHIP_FUSE_SILU's
    value: True on, False off, None each route's default, Route.fuse_silu_by_default)."""

    def fuses(route: int | str) -> bool:
        if setting is False or not _route_has(route, "fuses_silu_mul"):
            return False
        return setting is True or _route_has(route, "fuse_silu_by_default")

    return fuses


def route_fuses_silu(route: int | str) -> bool:
    """silu_fuser under this process's ANYCHIP_FUSE_SILU."""
    return silu_fuser(envs.fuse_silu())(route)


def fuse_silu_mul(graph: fx.Graph, fuses: Callable[[int], bool] = route_fuses_silu) -> int:
    """Replace every W4A8 linear fed by SiluAndMul (its one user) by anychip::w4a8_linear_silu_mul on the gate/up
    output itself, where the linear's route computes SiluAndMul; returns how many."""
    done = 0
    for linear in _linears(graph):
        lin = _bound(linear)
        x, k = lin.get("x"), lin.get("k")
        if not isinstance(x, fx.Node) or len(x.users) != 1 or not fuses(lin.get("route", -1)):
            continue
        try:
            found = _silu_mul_source(x, k)
        except Exception as exc:  # as in fuse_norms: an unknown shape of graph is left alone
            log.debug("anychip: SiluAndMul fusion skipped a linear: %r", exc)
            continue
        if found is None:
            continue
        y, chain = found
        xv, yv = _val(x), _val(y)
        if xv is None or yv is None or yv.dtype != xv.dtype:
            continue
        new_args = (y, *linear.args[1:])
        with graph.inserting_before(linear):
            fused = graph.call_function(SILU_LINEAR, new_args, dict(linear.kwargs))
        fused.meta["val"] = _fake_call(SILU_LINEAR, new_args, dict(linear.kwargs))
        linear.replace_all_uses_with(fused)
        graph.erase_node(linear)
        _erase_unused(graph, chain)
        done += 1
    if done:
        graph.lint()
    return done


def fuse_norms(graph: fx.Graph, fuses: Callable[[int], bool] = route_fuses) -> int:
    """Rewrite every fusable (norm, W4A8 linear) pair of `graph` in place; returns how many."""
    targets = _norm_ops()
    if targets is None:
        return 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    done = 0
    for linear in _linears(graph):
        try:
            pair = _pair(linear, targets, fuses)
        except Exception as exc:  # a graph shape this matcher does not know: leave the pair as vLLM made it
            log.debug("anychip: norm fusion skipped a linear: %r", exc)
            continue
        if pair is not None and _rewrite(graph, pair, order):
            done += 1
    if done:
        graph.lint()
    return done


def _norm_linear_nodes(graph: fx.Graph, where: Any, new_args: tuple, linear: fx.Node,
                       residual: bool) -> tuple[fx.Node, fx.Node | None]:
    """anychip::w4a8_linear_norm(*new_args) inserted at `where` (a graph.inserting_* context) in place of `linear`,
    which it replaces and erases: its output node and, when `residual`, its new-residual node."""
    kwargs = dict(linear.kwargs)
    with where:
        fused = graph.call_function(NORM_LINEAR, new_args, kwargs)
    with graph.inserting_after(fused):
        y = graph.call_function(operator.getitem, (fused, 0))
    out = _fake_call(NORM_LINEAR, new_args, kwargs)
    fused.meta["val"], y.meta["val"] = out, out[0]
    res = None
    if residual:
        with graph.inserting_after(y):
            res = graph.call_function(operator.getitem, (fused, 1))
        res.meta["val"] = out[1]
    linear.replace_all_uses_with(y)
    graph.erase_node(linear)
    return y, res


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
    _, residual = _norm_linear_nodes(graph, where, new_args, linear, pair.add)
    graph.erase_node(pair.out)
    if residual is not None:
        for r in pair.residuals:
            r.replace_all_uses_with(residual)
            graph.erase_node(r)
    if pair.add:
        graph.erase_node(norm)
    return True


# --- RMSNorm as vLLM's CPU graphs hold it: the IR op's native body, traced ------------------------------------

def _rsqrt_of_mean_square(rs: Any, h: fx.Node) -> float | None:
    """eps when rs = rsqrt(mean(h ** 2, [-1], keepdim=True) + eps), else None."""
    if not _call(rs, _aten.rsqrt.default):
        return None
    add = rs.args[0]
    if not _call(add, _aten.add.Tensor) or len(add.args) != 2 or not isinstance(add.args[1], (int, float)):
        return None
    mean = add.args[0]
    if not _call(mean, _aten.mean.dim) or len(mean.args) < 3 or list(mean.args[1]) not in ([-1], [_val(h).dim() - 1]):
        return None
    if mean.args[2] is not True or mean.kwargs.get("dtype") is not None:
        return None
    sq = mean.args[0]
    if _call(sq, _aten.pow.Tensor_Scalar) and sq.args[0] is h and sq.args[1] == 2:
        return float(add.args[1])
    if _call(sq, _aten.mul.Tensor) and sq.args[0] is h and sq.args[1] is h:
        return float(add.args[1])
    return None


def _widened(node: Any, dtype: torch.dtype) -> Any:
    """The tensor node whose fp32 copy `node` is (through one conversion), for a tensor of `dtype`; None if not."""
    if _call(node, *_CONVERT) and node.args[1:2] == (torch.float32,) or (
            _call(node, _aten._to_copy.default) and node.kwargs.get("dtype") == torch.float32):
        src = node.args[0]
        return src if getattr(_val(src), "dtype", None) == dtype else None
    return node if dtype == torch.float32 and getattr(_val(node), "dtype", None) == torch.float32 else None


class _NormMatch:
    """x0 (+ r0) -> RMSNorm (weight, eps) -> the linear's input; h: fp32 x0 (+ r0); chain: the nodes the fused op
    replaces; residuals: the nodes that carry h rounded to the model's dtype on to later layers."""

    def __init__(self, x0: fx.Node, r0: fx.Node | None, weight: fx.Node, eps: float, h: fx.Node,
                 chain: list[fx.Node], residuals: list[fx.Node]) -> None:
        self.x0, self.r0, self.weight, self.eps, self.h, self.chain, self.residuals = (
            x0, r0, weight, eps, h, chain, residuals)


def _decomposed_norm(x: Any, k: int) -> _NormMatch | None:
    """The RMSNorm feeding a W4A8 linear's input x in the form vLLM's IR ops' native bodies take once traced
    (rms_norm / fused_add_rms_norm: h = fp32 x (+ fp32 residual); y = (h * rsqrt(mean(h^2) + eps)) as the weight's
    dtype, times the weight; as the input's dtype), the weight's dtype the input's; else None."""
    xv = _val(x)
    if xv is None or not _same(xv.shape[-1], k):
        return None
    dtype = xv.dtype
    top = _through_converts(x)
    if not _call(top, _aten.mul.Tensor) or len(top.args) != 2:
        return None
    for scaled, weight in (top.args, top.args[::-1]):
        wv = _val(weight)
        if wv is None or not _same(wv.shape, (k,)) or wv.dtype != dtype or not isinstance(weight, fx.Node):
            continue
        inner = _through_converts(scaled)
        if not _call(inner, _aten.mul.Tensor) or len(inner.args) != 2:
            continue
        for h, rs in (inner.args, inner.args[::-1]):
            if not isinstance(h, fx.Node) or getattr(_val(h), "dtype", None) != torch.float32:
                continue
            eps = _rsqrt_of_mean_square(rs, h)
            if eps is None:
                continue
            x0 = r0 = None
            if _call(h, _aten.add.Tensor) and len(h.args) == 2 and not h.kwargs:  # fused_add_rms_norm's h = x + r
                x0, r0 = _widened(h.args[0], dtype), _widened(h.args[1], dtype)
                if x0 is None or r0 is None or not _same(_val(x0).shape, _val(r0).shape):
                    x0 = r0 = None
            if x0 is None:
                x0 = _widened(h, dtype)
            if x0 is None or not _same(_val(x0).shape, xv.shape):
                continue
            chain = _ancestors(x, stop=h) + ([h] if x0 is not h else [])
            if r0 is not None:
                chain += [a for a in h.args if a not in (x0, r0)]
            # h's users beyond the norm carry the new residual on: in the model's dtype (copies of h rounded to it,
            # or h itself in an fp32 model); without a residual add there must be none
            rest = [u for u in h.users if u not in chain]
            if r0 is None and rest:
                continue
            if dtype == torch.float32:
                residuals = [h] if rest else []
            elif all(_call(u, *_CONVERT) and u.args[1:2] == (dtype,) for u in rest):
                residuals = rest
            else:
                continue
            if any(len(n.users) != 1 for n in _ancestors(x, stop=h) if n is not x) or len(x.users) != 1:
                continue
            return _NormMatch(x0, r0, weight, eps, h, chain, residuals)
    return None


def fuse_decomposed_norms(graph: fx.Graph, fuses: Callable[[int], bool] = route_fuses) -> int:
    """Rewrite every (traced RMSNorm, W4A8 linear) pair of `graph` (_decomposed_norm) whose route fuses norms into
    anychip::w4a8_linear_norm, placed once h and the op's inputs exist; returns how many."""
    done = 0
    for linear in _linears(graph):
        lin = _bound(linear)
        if not fuses(lin.get("route", -1)):
            continue
        try:
            m = _decomposed_norm(lin.get("x"), lin.get("k"))
        except Exception as exc:  # a graph shape this matcher does not know: leave the pair as vLLM made it
            log.debug("anychip: norm fusion skipped a linear: %r", exc)
            continue
        if m is None:
            continue
        # the fused op goes after h and after every input it takes, and before whatever reads the new residual
        order = {node: i for i, node in enumerate(graph.nodes)}
        new_args = (m.x0, m.r0, m.weight, m.eps, *linear.args[1:])
        anchor = max((a for a in (m.h, *new_args) if isinstance(a, fx.Node)), key=order.__getitem__)
        readers = [u for r in m.residuals for u in r.users if u not in m.chain]
        if any(order[u] <= order[anchor] for u in readers):
            continue
        _, res = _norm_linear_nodes(graph, graph.inserting_after(anchor), new_args, linear, bool(m.residuals))
        for r in m.residuals:
            if r is m.h:  # an fp32 model: h itself is the new residual for its other users
                _replace_uses_outside(r, res, set(m.chain))
            else:
                r.replace_all_uses_with(res)
        _erase_unused(graph, set(m.chain) | set(m.residuals))
        done += 1
    if done:
        graph.lint()
    return done


def _replace_uses_outside(node: fx.Node, new: fx.Node, inside: set[fx.Node]) -> None:
    for user in list(node.users):
        if user not in inside and user is not new:
            user.replace_input_with(node, new)


def run_passes(graph: fx.Graph, norms: bool, silu: bool | None) -> tuple[int, int]:
    """Both rewrites on `graph`: the norms (vLLM's IR ops, or their traced bodies) and SiluAndMul, under these
    settings (ANYCHIP_FUSE_NORM's and ANYCHIP_FUSE_SILU's values), whatever this process's environment says."""
    n = (fuse_norms(graph) + fuse_decomposed_norms(graph)) if norms else 0
    s = fuse_silu_mul(graph, fuses=silu_fuser(silu)) if silu is not False else 0
    if n or s:
        log.info("anychip: RMSNorm moved into %d and SiluAndMul into %d W4A8 linears of a compiled graph", n, s)
    return n, s


class FusionPass(_PassBase):
    """The rewrites as one Inductor post-grad pass, put into an engine's compile options (`add_pass`): vLLM's
    CUDA engines hand a pass found there to their post-grad pass manager (after vLLM's own passes, before its IR
    lowering), and its CPU engines compile with stock torch.compile (backend "inductor", the same options) and
    Inductor runs it itself. Module-level and holding only its settings, so that vLLM can pickle the config that
    carries it to its engine process; uuid() names the rewrite's source and settings, and vLLM hashes the compile
    config through it: a compile cache made with other fusion settings is not reused."""

    def __init__(self, norms: bool, silu: bool | None) -> None:
        self.norms, self.silu = norms, silu

    def __call__(self, graph: fx.Graph) -> None:
        run_passes(graph, self.norms, self.silu)

    def uuid(self) -> str:
        source = inspect.getsource(inspect.getmodule(fuse_norms))
        return hashlib.sha256(f"{source}{self.norms}{self.silu}".encode()).hexdigest()


_POST_GRAD_KEY = "post_grad_custom_post_pass"  # vLLM's Platform.pass_key on every platform it has


def add_pass(compilation_config: Any) -> bool:
    """Put FusionPass into an engine's Inductor options (compilation_config.inductor_compile_config) when it
    compiles with Inductor and nothing else holds that hook (a user's own pass stays); returns whether it did."""
    norms, silu = envs.fuse_norm(), envs.fuse_silu()
    if not norms and silu is False:
        return False
    if getattr(compilation_config, "backend", None) != "inductor":
        return False
    options = getattr(compilation_config, "inductor_compile_config", None)
    if not isinstance(options, dict):
        return False
    current = options.get(_POST_GRAD_KEY)
    if current is not None and not isinstance(current, FusionPass):
        log.info("anychip: the compile config already has a post-grad pass (%r); not adding the fusion pass", current)
        return False
    options[_POST_GRAD_KEY] = FusionPass(norms, silu)
    return True


_installed = False


def install() -> bool:
    """Have vLLM's platform add FusionPass to every engine config it finishes (once a process; after the platform's
    own settings, which choose the compile backend); False where this vLLM has no platform to hook (then vLLM
    serves unfused)."""
    global _installed
    if not _installed:
        from anychip.vllm_plugin import compat

        _installed = compat.install_config_hook(lambda vllm_config: add_pass(vllm_config.compilation_config))
    return _installed
