"""W4A8 CPU kernels against the torch oracle (anychip/kernels/reference.py).

Integers match exactly: the int32 group dot products (debug op), the INT8 activations and their scales, and the
whole linear when scales are powers of two (then fp32 arithmetic is exact).  Otherwise the output tolerance is
fp32: |y - ref| <= 1e-5 * max|ref| + 1e-5 * |ref|; bf16/fp16 (one rounding of the output, 2^-8 relative):
|y - ref| <= 1e-3 * max|ref| + 8e-3 * |ref|.  ref is computed in float64.

Every listed M, K, N, G appears for every ISA this machine runs; the cross product is subsampled.
"""

from __future__ import annotations

import pytest
import torch

from anychip import envs
from anychip.errors import AnychipError
from anychip.formats import pack_int4
from anychip.kernels import cpu_ext, hooks, machine, ops, routes
from anychip.kernels.policy import KernelPolicy
from anychip.kernels.prepare import prepare_w4a8, w4a8_linear
from anychip.kernels.reference import group_dot_ref, quantize_activations_ref, w4a8_linear_dynamic_ref
from anychip.kernels.routes import NoKernelRoute

ISAS = [r.id for r in routes.available("cpu")]  # route ids, best first

# (M, K, N, G, bias, dtype): every M in {1,3,7,64,512} (and 31, 47: tails past full tiles), K in
# {576,1536,2048,6144}, N in {1,17,100,576,1536}, G in {32,64,128}, with and without bias, bf16 and fp32.
CASES = [
    (1, 576, 1, 32, False, torch.bfloat16),
    (8, 576, 192, 64, True, torch.bfloat16),  # the most tokens a fused call (quantized on every thread) takes
    (9, 1536, 576, 32, False, torch.float32),  # the fewest a quantizing pass of its own takes
    (1, 2048, 1536, 128, True, torch.float32),
    (1, 6144, 100, 64, False, torch.bfloat16),
    (3, 1536, 17, 64, True, torch.bfloat16),
    (3, 6144, 576, 128, False, torch.float32),
    (7, 576, 576, 64, True, torch.float32),
    (7, 2048, 100, 32, False, torch.bfloat16),
    (64, 1536, 576, 32, False, torch.bfloat16),
    (64, 6144, 17, 128, True, torch.float32),
    (512, 576, 100, 32, True, torch.bfloat16),
    (512, 2048, 1, 128, False, torch.float32),
    (64, 576, 1536, 64, True, torch.bfloat16),
    (512, 1536, 576, 64, True, torch.float32),
    (47, 2048, 1536, 128, True, torch.bfloat16),  # tokens past the last full tile of every path, odd block count
    (31, 576, 17, 32, False, torch.float32),
]
# M = 24 is the fewest tokens for which AVX512-VNNI unpacks each pair of weight blocks before its tiles
# (ANYCHIP_UNPACK_MIN_M, w4a8_run.h), M = 23 the most that reads the packed nibbles; 512 x 960 x 576 at G = 32 is the
# default model's qkv at pp512.
DOT_CASES = [(1, 6144, 1, 128), (3, 576, 17, 32), (7, 2048, 100, 64), (64, 1536, 33, 128), (512, 576, 17, 64),
             (47, 2048, 100, 128), (23, 576, 40, 32), (24, 576, 40, 32), (512, 576, 960, 32)]


def _weights(n: int, k: int, g: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    wq = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    wq[0, :g] = -8  # the extremes of the int4 range
    wq[-1, -g:] = 7
    sw = torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3
    return wq, sw


def _acts(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    if m > 2:
        x[1] = 0  # an all-zero token
    return x.to(dtype)


def _group_dots64(xq: torch.Tensor, wq: torch.Tensor, g: int) -> torch.Tensor:
    """group_dot_ref through float64 matmuls (exact: |dot| < 2^53), for shapes where the oracle's int64
    broadcast would need gigabytes."""
    m, k = xq.shape
    n = wq.shape[0]
    xg = xq.double().view(m, k // g, g).transpose(0, 1)  # (groups, M, G)
    wg = wq.double().view(n, k // g, g).permute(1, 2, 0)  # (groups, G, N)
    return torch.bmm(xg, wg).permute(1, 2, 0)  # (M, N, groups)


def _reference(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    if m * wq.shape[0] * k <= 1 << 24:
        return w4a8_linear_dynamic_ref(x, wq, sw, bias).double()
    xq, sx = quantize_activations_ref(x)
    acc = _group_dots64(xq, wq, k // sw.shape[1])
    y = (acc * sw.double().unsqueeze(0)).sum(dim=2) * sx.double()
    return y + bias.double() if bias is not None else y


def _assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    atol_f, rtol = (1e-5, 1e-5) if y.dtype == torch.float32 else (1e-3, 8e-3)
    err = (y.double() - ref).abs()
    bound = atol_f * ref.abs().max().clamp_min(1e-6) + rtol * ref.abs()
    worst = (err - bound).max()
    assert worst <= 0, f"max error {err.max().item():.3g} exceeds tolerance (by {worst.item():.3g})"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-K{}-N{}-G{}-{}-{}".format(
    c[0], c[1], c[2], c[3], "bias" if c[4] else "nobias", str(c[5]).split(".")[-1]))
def test_linear_matches_reference(isa: str, case: tuple) -> None:
    m, k, n, g, with_bias, dtype = case
    if isa == "cpu.portable" and m * n * k > 1 << 28:
        pytest.skip("portable C++ on a 2^28-MAC shape: covered by the same code at smaller N")
    wq, sw = _weights(n, k, g, seed=m + k + n)
    x = _acts(m, k, dtype, seed=m * k)
    bias = (torch.randn(n) * 0.1).to(dtype) if with_bias else None
    prepared = prepare_w4a8(wq, sw, g, packed=False, route=isa)
    assert prepared.route.id == isa and prepared.route.kernel == "w4a8_cpu" and prepared.group_size == g
    y = w4a8_linear(x, prepared, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    _assert_close(y, _reference(x, wq, sw, bias))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", DOT_CASES, ids=lambda c: "M{}-K{}-N{}-G{}".format(*c))
def test_group_dots_exact(isa: str, case: tuple) -> None:
    m, k, n, g = case
    wq, sw = _weights(n, k, g, seed=n)
    xq, _ = quantize_activations_ref(_acts(m, k, torch.float32, seed=k))
    xq[0, :g] = -127  # extremes: the largest |dot| a group can reach
    xq[-1, -g:] = 127  # with the last row's 7s: the largest same-sign int16 pair sums (AVX2 widens every 32 k)
    p = prepare_w4a8(wq, sw, g, packed=False, route=isa)
    dots = torch.ops.anychip.w4a8_group_dots(xq, p.weight, p.scales, n, k, g, p.route.code)
    assert dots.dtype == torch.int32 and dots.shape == (m, n, k // g)
    expected = group_dot_ref(xq, wq, g) if m * n * k <= 1 << 24 else _group_dots64(xq, wq, g).to(torch.int32)
    assert torch.equal(dots, expected)


@pytest.mark.parametrize("m,k,n,g", [(32, 576, 960, 32), (47, 1536, 100, 64), (512, 2048, 576, 128),
                                     (96, 576, 33, 32), (64, 768, 48, 128), (48, 2048, 64, 128)])
def test_amx_tile_is_the_avx512_tile(m: int, k: int, n: int, g: int) -> None:
    """On a CPU with AMX-INT8, route cpu.amx_int8 runs the prefill GEMM on AMX tiles (csrc/w4a8_amx.h) from 32
    tokens: the same bits as cpu.avx512_vnni's AVX512 tiles on the same prepared weights (one layout) for the linear
    and the exact group dots, whole 16-token tiles and the tokens past them, odd block counts, G 32, 64 and 128
    (the 2 x 2 tiles of 32 tokens, and a 16-token tile after them at M = 48). Where /proc/cpuinfo lists amx_int8
    the route must be available (a refused tile permission fails here, not silently)."""
    if "cpu.avx512_vnni" not in ISAS:
        pytest.skip("no AVX512-VNNI route on this CPU")
    if "amx_int8" in machine.cpu_flags():
        assert "cpu.amx_int8" in ISAS and cpu_ext.load().amx_usable()
    if "cpu.amx_int8" not in ISAS:
        pytest.skip("this CPU (or its OS) offers no AMX-INT8: cpu.avx512_vnni serves")
    wq, sw = _weights(n, k, g, seed=m + n)
    x = _acts(m, k, torch.bfloat16, seed=k)
    xq, _ = quantize_activations_ref(x.float())
    xq[0, :g] = -127
    p = prepare_w4a8(wq, sw, g, packed=False, route="cpu.amx_int8")
    assert p.route.id == "cpu.amx_int8"
    got = {route: (torch.ops.anychip.w4a8_linear(x, p.weight, p.scales, None, n, k, g, routes.get(route).code, None),
                   torch.ops.anychip.w4a8_group_dots(xq, p.weight, p.scales, n, k, g, routes.get(route).code))
           for route in ("cpu.amx_int8", "cpu.avx512_vnni")}
    amx, avx = got["cpu.amx_int8"], got["cpu.avx512_vnni"]
    assert torch.equal(amx[0], avx[0]) and torch.equal(amx[1], avx[1])
    assert torch.equal(amx[1], group_dot_ref(xq, wq, g))
    assert torch.equal(amx[0], w4a8_linear(x, p))


@pytest.mark.parametrize("isa", ISAS)
def test_linear_exact_with_power_of_two_scales(isa: str) -> None:
    """One power of two per row (and per token): every partial sum is an exact fp32, so the whole linear is."""
    m, k, n, g = 5, 6144, 40, 64
    wq, _ = _weights(n, k, g, seed=3)
    sw = (2.0 ** -torch.randint(0, 6, (n, 1)).float()).expand(n, k // g).contiguous()
    xq, _ = quantize_activations_ref(_acts(m, k, torch.float32, seed=4))
    sx = 2.0 ** -torch.randint(0, 4, (m, 1)).float()
    p = prepare_w4a8(wq, sw, g, packed=False, route=isa)
    y = torch.ops.anychip.w4a8_linear_q(xq, sx, p.weight, p.scales, None, n, k, g, p.route.code, None, torch.float32)
    ref = (group_dot_ref(xq, wq, g).double() * sw.double()).sum(2) * sx.double()
    assert torch.equal(y.double(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 37, 576, 2048])
def test_quantize_act_bit_exact(dtype: torch.dtype, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(9, k, generator=gen) * torch.logspace(-3, 3, 9).unsqueeze(1)
    x[2] = 0  # zero row -> scale 0, q 0
    if k >= 8:
        # row 4: amax 127 -> scale exactly 1, so the halves are round-half-to-even ties
        x[4, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
        x[4, 8:] = 0.25
    x = x.to(dtype)
    xq, sx = torch.ops.anychip.quantize_act(x)
    xq_ref, sx_ref = quantize_activations_ref(x)
    assert torch.equal(xq, xq_ref) and torch.equal(sx, sx_ref)
    assert sx[2].item() == 0 and not xq[2].any()
    if k >= 8:
        assert xq[4, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,k,n,g", [(1, 576, 100, 32), (3, 2048, 17, 128), (8, 1536, 40, 64), (47, 576, 33, 32),
                                     (64, 2048, 100, 128), (512, 576, 48, 32)])
def test_bf16_scales_are_read_as_their_fp32_values(isa: str, m: int, k: int, n: int, g: int) -> None:
    """A checkpoint's bf16 scales stay bf16 in the prepared layout (fewer bytes a step); the kernels widen them
    exactly, so every route gives the bits of the fp32 layout of the same values: the linear in bf16 and fp32, its
    fused-norm form, and the linear on given INT8 activations. Scales of another dtype are prepared as fp32."""
    wq, sw = _weights(n, k, g, seed=m + n + g)
    sw16 = sw.bfloat16()
    a = prepare_w4a8(wq, sw16, g, packed=False, route=isa)
    b = prepare_w4a8(wq, sw16.float(), g, packed=False, route=isa)
    assert a.scales.dtype == torch.bfloat16 and b.scales.dtype == torch.float32
    assert torch.equal(a.scales.float(), b.scales) and torch.equal(a.weight, b.weight)
    assert prepare_w4a8(wq, sw.half(), g, packed=False, route=isa).scales.dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float32):
        x = _acts(m, k, dtype, seed=k + m)
        bias = (torch.randn(n) * 0.1).to(dtype)
        assert torch.equal(w4a8_linear(x, a, bias), w4a8_linear(x, b, bias))
    xq, _ = quantize_activations_ref(_acts(m, k, torch.float32, seed=m))
    sx = torch.rand(m, 1) * 0.01
    ya, yb = (torch.ops.anychip.w4a8_linear_q(xq, sx, p.weight, p.scales, None, n, k, g, p.route.code, None,
                                              torch.float32) for p in (a, b))
    assert torch.equal(ya, yb)
    x, res, nw = _acts(m, k, torch.bfloat16, seed=3), _acts(m, k, torch.bfloat16, seed=4), torch.rand(k).bfloat16()
    (ya, ra), (yb, rb) = (torch.ops.anychip.w4a8_linear_norm(x, res, nw, 1e-6, p.weight, p.scales, None, n, k, g,
                                                             p.route.code, None) for p in (a, b))
    assert torch.equal(ya, yb) and torch.equal(ra, rb)


def test_packed_and_int8_prepare_identically() -> None:
    k, n, g = 576, 100, 32
    wq, sw = _weights(n, k, g, seed=7)
    a = prepare_w4a8(pack_int4(wq), sw.bfloat16(), g, packed=True)
    b = prepare_w4a8(wq, sw.bfloat16(), g, packed=False)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.scales, b.scales) and a.route == b.route
    x = _acts(3, k, torch.bfloat16, seed=1)
    assert torch.equal(w4a8_linear(x, a), w4a8_linear(x, b))


def test_leading_dims_and_empty_batch() -> None:
    k, n, g = 576, 17, 64
    wq, sw = _weights(n, k, g, seed=8)
    p = prepare_w4a8(wq, sw, g, packed=False)
    x = _acts(6, k, torch.float32, seed=2)
    y = w4a8_linear(x.view(2, 3, k), p)
    assert y.shape == (2, 3, n) and torch.equal(y.view(6, n), w4a8_linear(x, p))
    assert w4a8_linear(x[:0], p).shape == (0, n)


def test_env_switch_forces_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    wq, sw = _weights(17, 576, 32, seed=9)
    for isa in ISAS:
        for name in (isa, isa.split(".")[1]):  # the route id, and the short name older settings used
            monkeypatch.setenv(envs.ANYCHIP_KERNEL_ISA, name)
            p = prepare_w4a8(wq, sw, 32, packed=False, policy=envs.kernel_policy())
            assert p.route.id == isa and p.route.isa == isa.split(".")[1]
    monkeypatch.setenv(envs.ANYCHIP_KERNEL_ISA, "reference")
    p = prepare_w4a8(wq, sw, 32, packed=False, policy=envs.kernel_policy())
    assert p.route is routes.REFERENCE
    x = _acts(3, 576, torch.bfloat16, seed=3)
    assert torch.equal(w4a8_linear(x, p), w4a8_linear_dynamic_ref(x, wq, sw))
    monkeypatch.setenv(envs.ANYCHIP_KERNEL_ISA, "no_such_isa")
    with pytest.raises(NoKernelRoute, match="ANYCHIP_KERNEL_ISA"):
        prepare_w4a8(wq, sw, 32, packed=False, policy=envs.kernel_policy())


def test_unavailable_isa_is_an_error() -> None:
    wq, sw = _weights(17, 576, 32, seed=9)
    missing = [i for i in ("cpu.avx512_vnni", "cpu.avx2", "arm.kleidiai") if i not in ISAS]
    for isa in missing:
        with pytest.raises(NoKernelRoute, match="not available"):
            prepare_w4a8(wq, sw, 32, packed=False, route=isa)
    with pytest.raises(NoKernelRoute, match="serves cuda tensors") as info:
        prepare_w4a8(wq, sw, 32, packed=False, route="cuda.triton")
    offered = str(info.value).split("one of (")[1].split(")")[0].split(", ")
    assert offered and all(routes.get(r).unavailable() is None for r in offered), offered  # routes this CPU has


def test_no_fast_route_errors_say_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(envs.ANYCHIP_ALLOW_FALLBACK, raising=False)
    monkeypatch.delenv(envs.ANYCHIP_STRICT, raising=False)
    monkeypatch.delenv(envs.ANYCHIP_KERNEL_ISA, raising=False)
    wq, sw = _weights(17, 576, 64, seed=10)
    with pytest.raises(AnychipError, match="not divisible by group size 128"):
        prepare_w4a8(wq, sw[:, :4], 128, packed=False)
    wq16, sw16 = _weights(17, 576, 16, seed=11)
    with pytest.raises(NoKernelRoute, match="re-quantize"):
        prepare_w4a8(wq16, sw16, 16, packed=False)
    p = prepare_w4a8(wq16, sw16, 16, packed=False, policy=KernelPolicy(allow_fallback=True))
    assert p.route is routes.REFERENCE and p.route.kernel == "reference"
    with pytest.raises(NoKernelRoute, match="packed=False"):
        prepare_w4a8(wq, sw, 64, packed=True)


def test_route_registry() -> None:
    ids = routes.route_ids()
    assert len(set(ids)) == len(ids) and "reference" in ids and "reference" not in ISAS
    assert set(ISAS) <= set(ids) and ISAS == [r.id for r in routes.preferred("cpu") if r.unavailable() is None]
    assert routes.get("avx2").id == "cpu.avx2" and routes.get("cpu.avx2") is routes.get("avx2")
    if machine.is_x86():
        assert "arm.kleidiai" not in ISAS and ISAS[-1] == "cpu.portable"
        # /proc/cpuinfo agrees with __builtin_cpu_supports
        assert [routes.get(i).isa for i in ISAS] == cpu_ext.load().cpu_isas()


class _Tiny(torch.nn.Module):
    def __init__(self, p, bias: torch.Tensor) -> None:
        super().__init__()
        self.p, self.bias = p, bias
        self.register_buffer("layer_id", ops.layer_tensor(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(x) * 2
        return w4a8_linear(h, self.p, self.bias, layer_id=self.layer_id) + 1


def test_torch_compile_fullgraph_counts_in_the_kernel() -> None:
    """The C++ route's op stays opaque under torch.compile and counts its calls itself, at the phase slot the table
    names, with no Python observer called."""
    k, n, g = 576, 100, 64
    wq, sw = _weights(n, k, g, seed=12)
    module = _Tiny(prepare_w4a8(wq, sw, g, packed=False), torch.randn(n).bfloat16())
    assert module.p.route.counts_in_kernel
    x = _acts(4, k, torch.bfloat16, seed=5)
    expected = module(x)
    calls: list[tuple[int, int]] = []
    compiled = torch.compile(module, fullgraph=True, dynamic=False)
    table = hooks.KernelCounts.zeros(8)
    with hooks.observing(lambda layer, tokens: calls.append((layer, tokens))), hooks.counting_in_kernels(table):
        y = compiled(x)
        table.slot.fill_(hooks.SLOTS.index("decode"))
        compiled(x)
        compiled(x)
    assert torch.equal(y, expected)
    assert calls == []
    assert table.counts[5].tolist() == [[1, 4], [0, 0], [2, 8]]  # warmup, prefill, decode: [calls, tokens]
    assert table.counts.sum().item() == 15  # no other layer counted
    compiled(x)  # uninstalled: nothing counts
    assert table.counts.sum().item() == 15


def test_kernel_counts_skip_layers_outside_the_table() -> None:
    k, n, g = 576, 17, 32
    wq, sw = _weights(n, k, g, seed=13)
    p = prepare_w4a8(wq, sw, g, packed=False)
    x = _acts(3, k, torch.float32, seed=6)
    table = hooks.KernelCounts.zeros(2)
    with hooks.counting_in_kernels(table):
        for layer in (-1, 1, 2, 99):
            w4a8_linear(x, p, layer_id=layer)
        xq, sx = torch.ops.anychip.quantize_act(x)
        torch.ops.anychip.w4a8_linear_q(xq, sx, p.weight, p.scales, None, n, k, g, p.route.code, ops.layer_tensor(0),
                                         torch.float32)
        table.slot.fill_(7)  # not a slot: not counted
        w4a8_linear(x, p, layer_id=1)
    assert table.counts[:, 0].tolist() == [[1, 3], [1, 3]]
    assert table.counts[:, 1:].sum().item() == 0
    previous = hooks.install_kernel_counts(None)  # the context manager put back what was there before
    hooks.install_kernel_counts(previous)
    assert previous is None or previous.counts.data_ptr() != table.counts.data_ptr()


def test_python_routes_go_through_the_same_op_and_notify() -> None:
    """The reference route (Python) runs through the same op names: counted by the observer, not the table."""
    k, n, g = 576, 17, 32
    wq, sw = _weights(n, k, g, seed=14)
    p = prepare_w4a8(wq, sw, g, packed=False, route="reference")
    assert not p.route.counts_in_kernel
    x = _acts(3, k, torch.bfloat16, seed=7)
    calls: list[tuple[int, int]] = []
    table = hooks.KernelCounts.zeros(8)
    with hooks.observing(lambda layer, tokens: calls.append((layer, tokens))), hooks.counting_in_kernels(table):
        y = w4a8_linear(x, p, layer_id=3)
        four = ops.layer_tensor(4)
        compiled = torch.compile(lambda v: w4a8_linear(v, p, layer_id=four), fullgraph=True, dynamic=False)
        y2 = compiled(x)
    assert torch.equal(y, w4a8_linear_dynamic_ref(x, wq, sw)) and torch.equal(y2, y)
    assert calls == [(3, 3), (4, 3)] and table.counts.sum().item() == 0


def test_ops_keep_routing_strict() -> None:
    """A route code the C++ kernels do not serve goes to its route object, which refuses what it cannot serve:
    never another route."""
    k, n, g = 576, 17, 32
    wq, sw = _weights(n, k, g, seed=15)
    p = prepare_w4a8(wq, sw, g, packed=False)
    x = _acts(2, k, torch.float32, seed=8)
    args = (p.weight, p.scales, None, n, k, g)
    with pytest.raises(NoKernelRoute, match="CUDA route cuda.triton"):
        torch.ops.anychip.w4a8_linear(x, *args, routes.get("cuda.triton").code, None)
    with pytest.raises(NoKernelRoute, match="unknown kernel route 999"):
        torch.ops.anychip.w4a8_linear(x, *args, 999, None)
    with pytest.raises(NoKernelRoute, match="unknown kernel route -1"):
        torch.ops.anychip.w4a8_linear(x, *args, -1, None)
    assert torch.equal(torch.ops.anychip.w4a8_linear(x, *args, p.route.code, None), w4a8_linear(x, p))
    missing = [r for r in routes.ROUTES if getattr(r, "counts_in_kernel", False) and r.id not in ISAS]
    for route in missing:  # a C++ route this CPU lacks is refused by the C++ kernel, naming the route
        with pytest.raises(RuntimeError, match=f"lacks ISA .*{route.id}"):
            torch.ops.anychip.w4a8_linear(x, *args, route.code, None)


def test_cpp_route_ids_match_the_python_routes() -> None:
    """The ops take a route's code: the C++ kernels serve codes 0..len(route_ids) - 1 as their ISA codes, the same
    pairs the Python routes declare, and every other route has a code of its own outside that range."""
    cpp = cpu_ext.load().route_ids()
    ours = [r for r in routes.ROUTES if getattr(r, "counts_in_kernel", False)]
    assert sorted(r.id for r in ours) == sorted(cpp)
    assert all(cpp[r.code] == r.id for r in ours)
    assert len({r.code for r in routes.ROUTES}) == len(routes.ROUTES)
    assert all(r.code >= 64 for r in routes.ROUTES if r not in ours)
    assert all(routes.get(r.code) is r for r in routes.ROUTES)


@pytest.mark.parametrize("op", ["quantize_act", "w4a8_linear", "w4a8_linear_q", "w4a8_group_dots"])
def test_cpu_kernels_are_cpp_and_cuda_reaches_python(op: str) -> None:
    """Once the extension is loaded, a CPU call dispatches to the C++ kernel; a CUDA call to ops.py's Python."""
    cpu_ext.load()
    table = dict(line.split(": ", 1) for line in torch._C._dispatch_dump_table(f"anychip::{op}").splitlines()
                 if ": " in line)
    assert "w4a8_cpu.cpp" in table["CPU"]
    assert "ops.py" in table["CUDA"] and "ops.py" in table["Meta"]


def test_amx_is_a_policy_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """ANYCHIP_CPU_AMX=0 reaches the kernel policy, which then never picks cpu.amx_int8 (cpu.avx512_vnni serves);
    forcing the route still takes it. The kernels themselves read no environment."""
    monkeypatch.delenv(envs.ANYCHIP_KERNEL_ISA, raising=False)
    monkeypatch.setenv("ANYCHIP_CPU_AMX", "0")
    off = envs.kernel_policy()
    assert off.cpu_amx is False
    monkeypatch.delenv("ANYCHIP_CPU_AMX")
    on = envs.kernel_policy()
    assert on.cpu_amx is True
    amx = routes.get("cpu.amx_int8")
    assert "ANYCHIP_CPU_AMX=0" in (amx.off_by(off) or "") and amx.off_by(on) is None
    if "cpu.amx_int8" not in ISAS:
        pytest.skip("no AMX-INT8 on this CPU")
    wq, sw = _weights(32, 576, 32, seed=1)
    assert prepare_w4a8(wq, sw, 32, packed=False, policy=on).route.id == "cpu.amx_int8"
    assert prepare_w4a8(wq, sw, 32, packed=False, policy=off).route.id == "cpu.avx512_vnni"
    assert prepare_w4a8(wq, sw, 32, packed=False, policy=off.forcing("amx_int8")).route.id == "cpu.amx_int8"
