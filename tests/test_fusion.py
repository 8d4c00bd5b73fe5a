"""The plugin's norm fusion pass (vllm_plugin/fusion.py) on graphs traced from vLLM's own IR norm ops, on the CPU:
which pairs it rewrites, which it leaves, and that the rewritten graph computes the same outputs. The kernels
behind the fused op are tested in triton_interpret_cases.py (interpreted) and test_kernels_gpu.py (CUDA)."""

from __future__ import annotations

import operator

import pytest
import torch

fusion = pytest.importorskip("anychip.vllm_plugin.fusion")
pytest.importorskip("vllm.ir.ops", reason="this vLLM has no IR norm ops")
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from anychip.kernels import ops, routes  # noqa: E402
from anychip.kernels.prepare import prepare_w4a8  # noqa: E402

K, N, G, EPS = 128, 48, 32, 1e-6


def _linear_args(seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    wq = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=gen)
    scales = torch.rand(N, K // G, generator=gen) * 0.02 + 0.001
    p = prepare_w4a8(wq, scales, G, packed=False, route=routes.REFERENCE.id)
    return p.weight, p.scales, ops.layer_tensor(seed)


def _inputs(m: int = 3) -> tuple[torch.Tensor, ...]:
    """x, residual, norm weight, then the linear's weights (graph inputs, as in vLLM's graphs)."""
    gen = torch.Generator().manual_seed(m)
    x, r = (torch.randn(m, K, generator=gen).bfloat16() for _ in range(2))
    return x, r, (torch.rand(K, generator=gen) + 0.5).bfloat16(), *_linear_args(7)


def _layer(add: bool, extra_user: bool = False):
    """A decoder-layer-like piece: norm -> W4A8 linear, the new residual returned."""
    rms, add_rms = torch.ops.vllm_ir.rms_norm.default, torch.ops.vllm_ir.fused_add_rms_norm.default

    def piece(x, r, nw, w, s, lid):
        if add:
            y, res = add_rms(x, r, nw, EPS, None)
        else:
            y, res = rms(x, nw, EPS, None), r
        out = torch.ops.anychip.w4a8_linear.default(y, w, s, None, N, K, G, routes.REFERENCE.code, lid)
        return (out, res, y.sum()) if extra_user else (out, res * 2)

    return piece


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


@pytest.mark.parametrize("add", [True, False])
def test_the_pair_becomes_one_op_with_the_same_outputs(add: bool) -> None:
    inputs = _inputs()
    gm = make_fx(_layer(add), tracing_mode="fake")(*inputs)
    want = gm(*inputs)
    assert fusion.fuse_norms(gm.graph, fuses=lambda route: True) == 1
    gm.recompile()
    targets = _targets(gm)
    assert fusion.NORM_LINEAR in targets and fusion.LINEAR not in targets
    assert not any("rms_norm" in str(t) for t in targets)
    got = gm(*inputs)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    node = next(n for n in gm.graph.nodes if n.target is fusion.NORM_LINEAR)
    assert node.meta["val"][0].shape == (3, N)


def test_left_alone_where_it_cannot_fuse() -> None:
    inputs = _inputs()
    for piece, fuses in ((_layer(True), lambda route: False),  # the route computes no norm
                         (_layer(True, extra_user=True), lambda route: True),  # the norm's output used twice
                         (_layer(False, extra_user=True), lambda route: True)):
        gm = make_fx(piece, tracing_mode="fake")(*inputs)
        before = _targets(gm)
        assert fusion.fuse_norms(gm.graph, fuses=fuses) == 0
        assert _targets(gm) == before


def test_only_routes_that_compute_the_norm_are_fused() -> None:
    assert routes.get("cuda.triton").fuses_norm
    assert sorted(r for r in routes.route_ids() if routes.get(r).fuses_norm) == [
        "cpu.amx_int8", "cpu.avx2", "cpu.avx512_vnni", "cpu.portable", "cuda.triton"]
    assert fusion.route_fuses("cuda.triton") and not fusion.route_fuses(routes.REFERENCE.code)
    assert not fusion.route_fuses("no.such.route")


def test_the_op_off_the_fusing_routes_is_the_norm_then_the_linear() -> None:
    """On a route that does not fuse (every CPU route), the fused op computes vLLM's norm, then calls the linear's
    own op: the same numbers as the pair."""
    x, r, nw, w, s, lid = _inputs(2)
    y, res = torch.ops.anychip.w4a8_linear_norm.default(x, r, nw, EPS, w, s, None, N, K, G, routes.REFERENCE.code, lid)
    normed, res_ref = torch.ops.vllm_ir.fused_add_rms_norm.default(x, r, nw, EPS, None)
    assert torch.equal(res, res_ref)
    assert torch.equal(y, torch.ops.anychip.w4a8_linear.default(normed, w, s, None, N, K, G, routes.REFERENCE.code,
                                                                 lid))
    y1, empty = torch.ops.anychip.w4a8_linear_norm.default(x, None, nw, EPS, w, s, None, N, K, G,
                                                           routes.REFERENCE.code, lid)
    assert empty.numel() == 0
    assert torch.equal(y1, torch.ops.anychip.w4a8_linear.default(torch.ops.vllm_ir.rms_norm.default(x, nw, EPS, None),
                                                                  w, s, None, N, K, G, routes.REFERENCE.code, lid))


def _silu_piece():
    def piece(y, w, s, lid):
        d = y.shape[-1] // 2
        x = torch.nn.functional.silu(y[..., :d]) * y[..., d:]
        return torch.ops.anychip.w4a8_linear.default(x, w, s, None, N, K, G, routes.REFERENCE.code, lid)

    return piece


def _silu_inputs(m: int = 3) -> tuple[torch.Tensor, ...]:
    return (torch.randn(m, 2 * K, generator=torch.Generator().manual_seed(m)).bfloat16(), *_linear_args(5))


@pytest.mark.parametrize("decomposed", [False, True])
def test_silu_and_mul_becomes_one_op(decomposed: bool) -> None:
    """SiluAndMul as its native forward traces (aten.silu, or decomposed as Inductor's post-grad graphs have it:
    a / (1 + exp(-a)) with dtype conversions) feeding a W4A8 linear becomes w4a8_linear_silu_mul on the row of 2K;
    the dead slices and silu go; the outputs are the same."""
    from torch._inductor.decomposition import select_decomp_table

    inputs = _silu_inputs()
    table = select_decomp_table() if decomposed else None
    gm = make_fx(_silu_piece(), tracing_mode="fake", decomposition_table=table)(*inputs)
    want = gm(*inputs)
    assert fusion.fuse_silu_mul(gm.graph, fuses=lambda route: True) == 1
    gm.recompile()
    targets = _targets(gm)
    assert targets == [fusion.SILU_LINEAR], targets
    assert torch.equal(gm(*inputs), want)


def test_silu_and_mul_left_alone() -> None:
    inputs = _silu_inputs()

    def swapped(y, w, s, lid):  # silu of the upper half: not SiluAndMul
        d = y.shape[-1] // 2
        x = torch.nn.functional.silu(y[..., d:]) * y[..., :d]
        return torch.ops.anychip.w4a8_linear.default(x, w, s, None, N, K, G, routes.REFERENCE.code, lid)

    for piece, fuses in ((_silu_piece(), lambda route: False), (swapped, lambda route: True)):
        gm = make_fx(piece, tracing_mode="fake")(*inputs)
        before = _targets(gm)
        assert fusion.fuse_silu_mul(gm.graph, fuses=fuses) == 0
        assert _targets(gm) == before


def test_passes_find_their_pairs_in_inductor_post_grad_graphs() -> None:
    """Through torch.compile: the passes run where vLLM runs them (Inductor's post-grad custom pass) and find the
    norm and SiluAndMul pairs of a small MLP block as this torch's decompositions leave them."""
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    found: list[tuple[int, int]] = []

    class Passes(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            found.append((fusion.fuse_norms(graph, fuses=lambda r: True),
                          fusion.fuse_silu_mul(graph, fuses=lambda r: True)))

        def uuid(self) -> str:
            return "anychip-test-fusion"

    x, r, nw, w, s, lid = _inputs()
    w2, s2, lid2 = _linear_args(9)  # gate/up: N = 2K
    wq = torch.randint(-8, 8, (2 * K, K), dtype=torch.int8, generator=torch.Generator().manual_seed(9))
    up = prepare_w4a8(wq, torch.rand(2 * K, K // G) * 0.02 + 0.001, G, packed=False, route=routes.REFERENCE.id)

    def block(x, r, nw, wu, su, wd, sd):
        h, res = torch.ops.vllm_ir.fused_add_rms_norm.default(x, r, nw, EPS, None)
        y = torch.ops.anychip.w4a8_linear.default(h, wu, su, None, 2 * K, K, G, routes.REFERENCE.code, lid)
        a = torch.nn.functional.silu(y[..., :K]) * y[..., K:]
        return torch.ops.anychip.w4a8_linear.default(a, wd, sd, None, N, K, G, routes.REFERENCE.code, lid2), res

    args = (x, r, nw, up.weight, up.scales, w2, s2)
    want = block(*args)
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=Passes(), fx_graph_cache=False):
        got = torch.compile(block, fullgraph=True)(*args)
    assert found == [(1, 1)]
    assert torch.equal(got[1], want[1])
    assert (got[0].float() - want[0].float()).abs().max().item() <= 2**-6 * want[0].float().abs().max().item()


# --- vLLM's CPU engines: the norm as the IR ops' native bodies, traced; the pass as stock Inductor's hook -----------

def _native_layer(add: bool, weight_dtype: torch.dtype = torch.bfloat16, extra_user: bool = False):
    """A piece as vLLM's CPU graphs hold it: rms_norm / fused_add_rms_norm's native bodies (vllm/ir/ops), a W4A8
    linear on a C++ CPU route (which fuses norms), the new residual carried on."""
    from vllm.ir.ops.layernorm import fused_add_rms_norm, rms_norm

    def piece(x, r, nw, w, s, lid, code):
        nw = nw.to(weight_dtype)
        if add:
            y, res = fused_add_rms_norm.impls["native"].impl_fn(x, r, nw, EPS)
        else:
            y, res = rms_norm.impls["native"].impl_fn(x, nw, EPS), r
        out = torch.ops.anychip.w4a8_linear.default(y, w, s, None, N, K, G, code, lid)
        return (out, res * 2, y.sum()) if extra_user else (out, res * 2)

    return piece


def _cpp_linear_args(seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    wq = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=gen)
    route = routes.available("cpu")[0]
    if not route.fuses_norm:
        pytest.skip(f"this CPU's best route {route.id} does not fuse norms")
    p = prepare_w4a8(wq, torch.rand(N, K // G, generator=gen) * 0.02 + 0.001, G, packed=False, route=route.id)
    return p.weight, p.scales, ops.layer_tensor(seed), p.route.code


def _compiled_with(piece, pass_, *args):
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=pass_, fx_graph_cache=False):
        return torch.compile(piece, fullgraph=True)(*args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("add", [True, False])
def test_traced_norms_fuse_on_cpu_routes(add: bool, dtype: torch.dtype) -> None:
    """The CPU pass finds the traced norm ahead of a C++ route's linear (a bf16 model, and an fp32 one, whose graph
    has no conversions) and gives vLLM's outputs: the new residual exactly, the linear within the bound of a one-ulp
    move of a norm value."""
    x, r, nw = (t.to(dtype) for t in _inputs()[:3])
    args = (x, r, nw, *_cpp_linear_args(11))
    piece = _native_layer(add, dtype)
    want = piece(*args)
    found: list[tuple[int, int]] = []

    class Counting(fusion.FusionPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            found.append(fusion.run_passes(graph, self.norms, True))

    got = _compiled_with(piece, Counting(True, None), *args)
    assert found == [(1, 0)]
    assert torch.equal(got[1], want[1])
    assert (got[0].float() - want[0].float()).abs().max().item() <= 2**-6 * want[0].float().abs().max().item()


@pytest.mark.parametrize("case", ["norm output used elsewhere", "fp32 norm weight", "reference route"])
def test_traced_norms_left_alone(case: str) -> None:
    x, r, nw = _inputs()[:3]
    lin = _cpp_linear_args(12)
    if case == "reference route":
        lin = (*_linear_args(12), routes.REFERENCE.code)
    piece = _native_layer(True, torch.float32 if case == "fp32 norm weight" else torch.bfloat16,
                          extra_user=case == "norm output used elsewhere")
    found: list[tuple[int, int]] = []

    class Counting(fusion.FusionPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            found.append(fusion.run_passes(graph, True, True))

    args = (x, r, nw, *lin)
    got = _compiled_with(piece, Counting(True, None), *args)
    assert found == [(0, 0)]
    want = piece(*args)
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("silu,env,found_silu", [(None, None, 1), (None, "0", 1), (False, None, 0), (True, "0", 1)])
def test_silu_and_norm_fuse_in_one_cpu_block(silu, env, found_silu, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole MLP block as the CPU graph holds it (traced norm, gate/up, SiluAndMul, down) on a C++ route: both
    rewrites, vLLM's outputs within the bound. The pass follows its own settings (those its uuid names), not the
    environment of the process that compiles."""
    if env is None:
        monkeypatch.delenv("ANYCHIP_FUSE_SILU", raising=False)
    else:
        monkeypatch.setenv("ANYCHIP_FUSE_SILU", env)
    from vllm.ir.ops.layernorm import fused_add_rms_norm

    x, r, nw = _inputs()[:3]
    gen = torch.Generator().manual_seed(13)
    route = _cpp_linear_args(0)[3]
    up = prepare_w4a8(torch.randint(-8, 8, (2 * K, K), dtype=torch.int8, generator=gen),
                      torch.rand(2 * K, K // G, generator=gen) * 0.02 + 0.001, G, packed=False,
                      route=routes.get(route).id)
    down = prepare_w4a8(torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=gen),
                        torch.rand(N, K // G, generator=gen) * 0.02 + 0.001, G, packed=False,
                        route=routes.get(route).id)
    lid_up, lid_down = ops.layer_tensor(3), ops.layer_tensor(4)

    def block(x, r, nw, wu, su, wd, sd):
        h, res = fused_add_rms_norm.impls["native"].impl_fn(x, r, nw, EPS)
        y = torch.ops.anychip.w4a8_linear.default(h, wu, su, None, 2 * K, K, G, route, lid_up)
        a = torch.nn.functional.silu(y[..., :K]) * y[..., K:]
        return torch.ops.anychip.w4a8_linear.default(a, wd, sd, None, N, K, G, route, lid_down), res

    args = (x, r, nw, up.weight, up.scales, down.weight, down.scales)
    want = block(*args)
    found: list[tuple[int, int]] = []

    class Counting(fusion.FusionPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            found.append(fusion.run_passes(graph, self.norms, self.silu))

    got = _compiled_with(block, Counting(True, silu), *args)
    assert found == [(1, found_silu)]
    assert torch.equal(got[1], want[1])
    assert (got[0].float() - want[0].float()).abs().max().item() <= 2**-5 * want[0].float().abs().max().item()


def test_the_pass_goes_into_the_compile_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """add_pass: into an Inductor compile config's options (its uuid names the settings, so vLLM's compile cache key
    moves with them); never over a pass that is already there; not when both rewrites are off."""
    from types import SimpleNamespace

    monkeypatch.delenv("ANYCHIP_FUSE_NORM", raising=False)
    monkeypatch.delenv("ANYCHIP_FUSE_SILU", raising=False)
    cfg = SimpleNamespace(backend="inductor", inductor_compile_config={})
    assert fusion.add_pass(cfg)
    on = cfg.inductor_compile_config["post_grad_custom_post_pass"]
    assert isinstance(on, fusion.FusionPass) and (on.norms, on.silu) == (True, None)
    monkeypatch.setenv("ANYCHIP_FUSE_SILU", "0")
    assert fusion.add_pass(cfg)  # ours is replaced by ours with the new settings
    off = cfg.inductor_compile_config["post_grad_custom_post_pass"]
    assert off.silu is False and off.uuid() != on.uuid()
    import pickle

    assert pickle.loads(pickle.dumps(off)).uuid() == off.uuid()  # vLLM pickles the config to its engine process
    mine = object()
    cfg2 = SimpleNamespace(backend="inductor", inductor_compile_config={"post_grad_custom_post_pass": mine})
    assert not fusion.add_pass(cfg2)
    assert cfg2.inductor_compile_config["post_grad_custom_post_pass"] is mine
    assert not fusion.add_pass(SimpleNamespace(backend="eager", inductor_compile_config={}))
    monkeypatch.setenv("ANYCHIP_FUSE_NORM", "0")
    cfg3 = SimpleNamespace(backend="inductor", inductor_compile_config={})
    assert not fusion.add_pass(cfg3) and cfg3.inductor_compile_config == {}
