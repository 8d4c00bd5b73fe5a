"""The C++ CPU routes' fused ops: anychip::w4a8_linear_norm and w4a8_linear_silu_mul compute vLLM's RMSNorm (with
fused_add_rms_norm's residual) or SiluAndMul while they quantize the linear's input (csrc/pre_ops.h), where the
plugin's graph pass puts them (vllm_plugin/fusion.py).

Numerics are reference.rms_norm_ref / silu_and_mul_ref followed by the linear. The norm's sum of squares runs in
another order than torch's and silu's exp is a polynomial, so a rounded value may move by one ulp (and, rarely, a
token's INT8 activations with it): the tests ask for the reference's bits where the arithmetic is exact in any order
(rows of small integers), within a bound elsewhere, and check every SIMD level the CPU has against the reference
value by value (`pre_values`: 16-bit values within two ulps and at most 1% of them off torch's)."""

from __future__ import annotations

import pytest
import torch

from anychip.kernels import cpu_ext, hooks, ops, routes
from anychip.kernels.prepare import prepare_w4a8, w4a8_linear
from anychip.kernels.reference import quantize_activations_ref, rms_norm_ref, silu_and_mul_ref
from anychip.vllm_plugin import fusion

OPS = torch.ops.anychip
ISAS = [r.id for r in routes.available("cpu") if getattr(r, "fuses_norm", False)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-5


def _prepared(n: int, k: int, g: int, isa: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wq = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    return prepare_w4a8(wq, torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3, g, packed=False, route=isa)


def _rows(m: int, k: int, dtype: torch.dtype, seed: int, integers: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if integers:
        return torch.randint(-8, 9, (m, k), generator=gen).to(dtype)
    return (torch.randn(m, k, generator=gen) * 3).to(dtype)


def _rel(y: torch.Tensor, want: torch.Tensor) -> float:
    return ((y.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


LEVELS = (0, 1, 2)  # pre_values' SIMD levels: scalar, AVX2 (NEON), AVX512; capped at what this CPU runs


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 9, 70])  # the fused small-call path (M <= 8) and the row-pass path
@pytest.mark.parametrize("residual", [False, True])
def test_norm_inside_the_linear(isa: str, dtype: torch.dtype, m: int, residual: bool) -> None:
    n, k, g = 80, 576, 32
    p = _prepared(n, k, g, isa, seed=m)
    nw = (torch.rand(k, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    for integers in (True, False):
        x, r = _rows(m, k, dtype, m, integers), _rows(m, k, dtype, m + 100, integers)
        r = r if residual else None
        y, rout = OPS.w4a8_linear_norm(x, r, nw, EPS, p.weight, p.scales, None, n, k, g, p.route.code, None)
        normed, r_ref = rms_norm_ref(x, nw, EPS, r)
        want = OPS.w4a8_linear(normed, p.weight, p.scales, None, n, k, g, p.route.code, None)
        assert torch.equal(rout, r_ref) if residual else rout.numel() == 0
        if integers:
            assert torch.equal(y, want)
        else:
            assert _rel(y, want) < 1e-2


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 9, 70])
def test_silu_and_mul_inside_the_linear(isa: str, dtype: torch.dtype, m: int) -> None:
    n, k, g = 48, 1536, 32
    p = _prepared(n, k, g, isa, seed=m + 7)
    x = _rows(m, 2 * k, dtype, m, integers=False)
    x[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 120.0, -120.0, 1e-30, -1e-30]).to(dtype)  # exp's edges
    got = OPS.w4a8_linear_silu_mul(x, p.weight, p.scales, None, n, k, g, p.route.code, None)
    want = OPS.w4a8_linear(silu_and_mul_ref(x), p.weight, p.scales, None, n, k, g, p.route.code, None)
    assert torch.isfinite(got).all()
    assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [576, 100, 7])  # whole vectors, and tails of every width
def test_every_simd_level_computes_the_reference(dtype: torch.dtype, k: int) -> None:
    ext = cpu_ext.load()
    gen = torch.Generator().manual_seed(k)
    x2 = (torch.randn(6, 2 * k, generator=gen) * 4).to(dtype)
    x, r = (torch.randn(6, k, generator=gen) * 3).to(dtype), torch.randn(6, k, generator=gen).to(dtype)
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    silu_ref = silu_and_mul_ref(x2).float()
    norm_ref, res_ref = rms_norm_ref(x, nw, EPS, r)
    # one fp32 ulp is 2^-23; the norm's sums of squares differ by more in fp32 (a serial sum of 576 in scalar code)
    ulp = 2.0 ** -18 if dtype == torch.float32 else 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    for level in LEVELS:
        silu, _ = ext.pre_values(x2, None, None, 0.0, 2, level)
        norm, res = ext.pre_values(x, r, nw, EPS, 1, level)
        assert torch.equal(res, res_ref)
        for got, want in ((silu, silu_ref), (norm, norm_ref.float())):
            assert (got - want).abs().le(2 * ulp * want.abs() + 1e-30).all(), f"level {level}"
            if dtype != torch.float32:
                assert (got != want).float().mean().item() <= 0.01, f"level {level}"
    ints = torch.randint(-8, 9, (6, k), generator=gen).to(dtype)
    want, _ = rms_norm_ref(ints, nw, EPS)
    for level in LEVELS:
        assert torch.equal(ext.pre_values(ints, None, nw, EPS, 1, level)[0], want.float())


def test_fused_ops_count_and_flag_their_layers() -> None:
    """The fused ops count the call in the kernels' table as the plain op does, and flag the layer as fused (read
    through hooks.fused_layers, which the coverage report's per-layer `fused` comes from)."""
    isa = ISAS[0]
    n, k, g = 32, 576, 32
    p = _prepared(n, k, g, isa, seed=1)
    down = _prepared(n, k, g, isa, seed=2)
    x = _rows(2, k, torch.bfloat16, 4, integers=False)
    nw = torch.ones(k, dtype=torch.bfloat16)
    table = hooks.KernelCounts.zeros(4000)
    with hooks.counting_in_kernels(table):
        table.slot.fill_(hooks.SLOTS.index("prefill"))
        OPS.w4a8_linear_norm(x, x, nw, EPS, p.weight, p.scales, None, n, k, g, p.route.code, ops.layer_tensor(3901))
        OPS.w4a8_linear_silu_mul(torch.cat([x, x], 1), down.weight, down.scales, None, n, k, g, down.route.code,
                                 ops.layer_tensor(3902))
    assert table.counts[3901, 1].tolist() == [1, 2] and table.counts[3902, 1].tolist() == [1, 2]
    fused = hooks.fused_layers()
    assert fused[3901] == {"rms_norm"} and fused[3902] == {"silu_and_mul"}


def test_fused_ops_refuse_what_they_cannot_compute() -> None:
    isa = ISAS[0]
    n, k, g = 32, 576, 32
    p = _prepared(n, k, g, isa, seed=1)
    x = _rows(2, k, torch.bfloat16, 4, integers=False)
    with pytest.raises(RuntimeError, match="norm_weight"):
        OPS.w4a8_linear_norm(x, None, torch.ones(k), EPS, p.weight, p.scales, None, n, k, g, p.route.code, None)
    with pytest.raises(RuntimeError, match="residual"):
        OPS.w4a8_linear_norm(x, x[:1], torch.ones(k, dtype=x.dtype), EPS, p.weight, p.scales, None, n, k, g,
                             p.route.code, None)
    with pytest.raises(RuntimeError, match="2K"):
        OPS.w4a8_linear_silu_mul(x, p.weight, p.scales, None, n, k, g, p.route.code, None)


def test_reference_route_reaches_the_python_twin() -> None:
    """A route the extension does not implement (the torch reference) goes through the op's Python twin, which
    composes vLLM's definition with the plain linear."""
    cpu_ext.load()
    n, k, g = 16, 64, 32
    gen = torch.Generator().manual_seed(5)
    p = prepare_w4a8(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen), torch.rand(n, 2) * 0.02 + 1e-3,
                     g, packed=False, route=routes.REFERENCE.id)
    x2 = _rows(3, 2 * k, torch.float32, 1, integers=False)
    got = OPS.w4a8_linear_silu_mul(x2, p.weight, p.scales, None, n, k, g, p.route.code, None)
    assert torch.equal(got, OPS.w4a8_linear(silu_and_mul_ref(x2), p.weight, p.scales, None, n, k, g, p.route.code,
                                            None))


def test_which_routes_the_pass_fuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ x86 routes fuse both by default; ANYCHIP_FUSE_SILU=0 keeps SiluAndMul apart; the CUDA route fuses
    SiluAndMul only when asked; Arm routes and the torch reference fuse neither."""
    monkeypatch.delenv("ANYCHIP_FUSE_SILU", raising=False)
    for rid in ("cpu.avx512_vnni", "cpu.amx_int8", "cpu.avx2", "cpu.portable"):
        assert fusion.route_fuses(rid) and fusion.route_fuses_silu(rid)
    for rid in ("arm.dotprod", "arm.i8mm", routes.REFERENCE.id):
        assert not fusion.route_fuses(rid) and not fusion.route_fuses_silu(rid)
    assert fusion.route_fuses("cuda.triton") and not fusion.route_fuses_silu("cuda.triton")
    monkeypatch.setenv("ANYCHIP_FUSE_SILU", "1")
    assert fusion.route_fuses_silu("cuda.triton") and fusion.route_fuses_silu("cpu.avx2")
    monkeypatch.setenv("ANYCHIP_FUSE_SILU", "0")
    assert not fusion.route_fuses_silu("cpu.avx2") and not fusion.route_fuses_silu("cuda.triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [576, 100, 7])
def test_a_row_holding_nan_or_inf_is_nan_at_every_simd_level(dtype: torch.dtype, k: int) -> None:
    """A NaN or inf anywhere in a token (the vector body, the tail, the last lane) gives it scale NaN and q 0 at
    every quantization level, as the reference: its outputs are NaN, not finite values from codes clamped to -127
    (x86's max drops a NaN). The other rows are untouched, and the linear's output rows follow."""
    ext = cpu_ext.load()
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(k)) * 3
    where = [0, k - 1, k // 2, min(16, k - 1), k - 1]
    for row, (col, value) in enumerate(zip(where, [float("nan"), float("nan"), float("inf"), float("-inf"),
                                                   float("inf")]), start=1):
        x[row, col] = value
    x = x.to(dtype)
    want_q, want_s = quantize_activations_ref(x)
    assert want_s[1:6].isnan().all() and not want_q[1:6].any() and want_s[[0, 6]].isfinite().all()
    for level in LEVELS:
        q, s = ext.quantize_at_level(x, level)
        assert torch.equal(q, want_q), f"level {level}"
        assert torch.equal(s.isnan(), want_s.isnan()) and torch.equal(s[[0, 6]], want_s[[0, 6]]), f"level {level}"
    if k % 32:
        return
    for route in [r.id for r in routes.available("cpu")]:
        wq = torch.randint(-8, 8, (24, k), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
        p = prepare_w4a8(wq, torch.rand(24, k // 32) * 0.01 + 1e-3, 32, packed=False, route=route)
        y = w4a8_linear(x, p, None)
        assert y[1:6].isnan().all() and y[[0, 6]].isfinite().all(), route
