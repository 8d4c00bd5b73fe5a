"""The cases test_triton_interpret.py runs in a process started with TRITON_INTERPRET=1 (see there); not collected
on their own (the file name does not start with test_): `TRITON_INTERPRET=1 pytest tests/triton_interpret_cases.py`.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("set TRITON_INTERPRET=1 before triton is imported (test_triton_interpret.py does)",
                allow_module_level=True)

from anychip.kernels.gpu import launch, triton_w4a8  # noqa: E402
from anychip.kernels.gpu.layout import pack_nibbles  # noqa: E402
from anychip.kernels.reference import (group_dot_ref, quantize_activations_ref, rms_norm_ref,  # noqa: E402
                                      silu_and_mul_ref, w4a8_linear_ref)
from kernels_gpu_cases import activations, assert_close, config_id, new_counter, weights  # noqa: E402


def _layout(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton route's layout (layout.py) of (N, K) int8 weights and (N, K/G) scales."""
    return pack_nibbles(q), s.t().contiguous()


def test_the_kernels_are_interpreted() -> None:
    """Guards the fixture: a compiled kernel here would need a GPU and prove nothing on the CPU."""
    assert type(triton_w4a8._w4a8_gemm_kernel).__name__ == "InterpretedFunction"
    assert launch.k is triton_w4a8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 64), (3, 576), (5, 4160)])  # 4160 > the kernel's 4096 block: two passes
def test_quantize_bit_exact(m: int, k: int, dtype: torch.dtype) -> None:
    x = activations(m, k, dtype, seed=m + k)
    if m > 2:
        x[1] = 0  # a zero row: scale 0, q 0
    xq, sx = launch.quantize_act(x)
    rq, rs = quantize_activations_ref(x)
    assert torch.equal(sx, rs) and torch.equal(xq, rq)


@pytest.mark.parametrize("m,k,g", [(3, 640, 128), (2, 576, 64), (1, 5120, 128)])  # 5120: two blocks
def test_quantize_in_split_order(m: int, k: int, g: int) -> None:
    """The Gluon GEMM's activations (each group's even columns, then its odd ones), by the quantization kernel
    itself and through the fused norm prologue: the same values and scales as quantize_act's, reordered."""
    from anychip.kernels.gpu.gluon_w4a8 import split_groups

    x = activations(m, k, torch.bfloat16, seed=m * k)
    rq, rs = quantize_activations_ref(x)
    xs, sx = launch.quantize_act(x, split=g)
    assert torch.equal(sx, rs) and torch.equal(xs, split_groups(rq, g))
    norm = launch.Norm(torch.rand(k, dtype=torch.bfloat16) + 0.5, 1e-6)
    plain, plain_s = launch.pre_quantize(x, norm, k)
    split, split_s = launch.pre_quantize(x, norm, k, split=g)
    assert torch.equal(split_s, plain_s) and torch.equal(split, split_groups(plain, g))


def test_quantize_ties_round_half_to_even() -> None:
    halves = torch.arange(-126, 127, dtype=torch.float32) + 0.5
    x = torch.stack([torch.cat([halves, torch.tensor([127.0])]), torch.cat([halves / 4, torch.tensor([127.0 / 4])])])
    xq, sx = launch.quantize_act(x)
    rq, rs = quantize_activations_ref(x)
    assert torch.equal(sx, rs) and torch.equal(xq, rq)
    assert xq[0, 126].item() == 0 and xq[0, 127].item() == 2  # 0.5 -> 0, 1.5 -> 2


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m,n,k,g", [(1, 17, 256, 32), (7, 40, 384, 64), (3, 33, 256, 128)])
def test_group_dots_exact(m: int, n: int, k: int, g: int, swap: bool) -> None:
    q, _ = weights(n, k, g, seed=m + n)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    xq[0, :g] = 127  # one group at the extremes
    got = launch.group_dots(xq, pack_nibbles(q), n, k, g, swap=swap)
    assert torch.equal(got, group_dot_ref(xq, q, g))


def _configs() -> list[tuple[int, int, launch.GemmConfig]]:
    cases = [(m, 32, cfg) for m in (1, 33, 130) for cfg in launch.candidates(m, 40, 512, 32)]
    # the pipelined rescale at the default group size too
    cases += [(m, 128, cfg) for m in (33, 130) for cfg in launch.candidates(m, 40, 512, 128) if cfg.pipe]
    cases += [(7, 32, launch.GemmConfig(16, 32, 64, split_k=3)),
              (7, 32, launch.GemmConfig(16, 16, 128, swap=True, split_k=5)),
              (7, 64, launch.GemmConfig(16, 32, 128, pipe=True, split_k=3)),  # two groups a step
              (7, 64, launch.GemmConfig(16, 16, 128, swap=True, pipe=True, split_k=5)),
              # split-order activations (cat): given in column order, reordered by w4a8_linear_q
              (33, 32, launch.GemmConfig(32, 32, 128, cat=True)),
              (33, 128, launch.GemmConfig(32, 32, 128, swap=True, pipe=True, cat=True)),
              (7, 64, launch.GemmConfig(16, 16, 128, swap=True, split_k=3, cat=True))]
    return cases


@pytest.mark.parametrize("m,g,cfg", _configs(), ids=config_id)
def test_linear_q_pow2_scales_exact(m: int, g: int, cfg: launch.GemmConfig) -> None:
    n, k = 40, 512
    q, s = weights(n, k, g, seed=m, pow2=True)
    gen = torch.Generator().manual_seed(m + 1)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    sx = 2.0 ** torch.randint(-9, -5, (m, 1), generator=gen).float()
    bias = torch.randn(n, generator=gen)
    w, sw = _layout(q, s)
    y = launch.w4a8_linear_q(xq, sx, w, sw, bias, n, k, g, torch.float32, config=cfg)
    assert torch.equal(y, w4a8_linear_ref(xq, sx, q, s, bias, out_dtype=torch.float32))
    assert not launch._locks(xq.device).any()  # split-K re-arms every semaphore it took


@pytest.mark.parametrize("pipe", [False, True])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m,g", [(33, 32), (130, 128)])
def test_fcvt_rescale_gives_the_same_bits(m: int, g: int, swap: bool, pipe: bool) -> None:
    """The rescale's two int32 -> fp32 forms (fcvt: an integer add and an exact subtraction) give the same output
    bits with real-valued scales, a group sum at the extreme included (16 x 127 x 8 x G)."""
    n, k = 40, 512
    q, s = weights(n, k, g, seed=m + g)
    q[0, :g] = -8  # one group of weights and one of activations at the extremes
    gen = torch.Generator().manual_seed(m)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    xq[0, :g] = -127
    sx = torch.rand((m, 1), generator=gen) / 100 + 1e-4
    w, sw = _layout(q, s)
    got = [launch.w4a8_linear_q(xq, sx, w, sw, None, n, k, g, torch.float32,
                                config=launch.GemmConfig(32, 32, 128, swap, pipe=pipe, fcvt=fcvt))
           for fcvt in (False, True)]
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("m,k,one_pass_max", [(3, 1000, launch.QUANTIZE_ONE_PASS), (2, 1000, 64), (1, 4104, 1024)])
def test_quantize_words_one_pass_and_in_blocks(m: int, k: int, one_pass_max: int) -> None:
    """The GEMV's activation words hold exactly quantize_act's values, whether the row is read once or in
    blocks (K not a power of two, a last block part full; a zero row)."""
    x = activations(m, k, torch.bfloat16, seed=k + m)
    x[-1] = 0
    rq, rs = quantize_activations_ref(x)
    xw, sx = launch.quantize_words(x, one_pass_max=one_pass_max)
    assert launch.quantize_words_options(k, one_pass_max)["ONE_PASS"] == (one_pass_max == launch.QUANTIZE_ONE_PASS)
    assert torch.equal(xw, launch.words_of(rq)) and torch.equal(sx, rs.reshape(-1))


@pytest.mark.parametrize("n,k,g", [(40, 512, 128), (33, 640, 128), (300, 576, 64)])  # a partial K step; N tails
def test_gemv_fused_quantization_and_every_config(n: int, k: int, g: int) -> None:
    """Batch one: quantize_words packs exactly quantize_act's INT8 values and scale; every GEMV candidate is
    bit-exact with power-of-two scales (pre-quantized, with bias), and within tolerance on bf16 activations."""
    q, s = weights(n, k, g, seed=n, pow2=True)
    w, sw = _layout(q, s)
    x = activations(1, k, torch.bfloat16, seed=k)
    rq, rs = quantize_activations_ref(x)
    xw, sxw = launch.quantize_words(x)
    assert torch.equal(xw, launch.words_of(rq)) and torch.equal(sxw, rs.reshape(-1))
    xq = torch.randint(-127, 128, (1, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    sx = torch.full((1, 1), 2.0**-7)
    bias = torch.randn(n)
    exact = w4a8_linear_ref(xq, sx, q, s, bias, out_dtype=torch.float32)
    configs = [c for c in launch.candidates(1, n, k, g) if isinstance(c, launch.GemvConfig)]
    assert configs and configs[0] == launch.serving_config(1, n, k, g, xq.device)  # the GEMV is M = 1's default
    for cfg in configs:
        assert torch.equal(launch.w4a8_linear_q(xq, sx, w, sw, bias, n, k, g, torch.float32, config=cfg), exact)
        y = launch.w4a8_linear(x, w, sw, bias.bfloat16(), n, k, g, config=cfg)
        assert y.dtype == torch.bfloat16
        assert_close(y, w4a8_linear_ref(rq, rs, q, s, bias.bfloat16(), out_dtype=torch.float64))
    assert not launch._locks(xq.device).any()


@pytest.mark.parametrize("n,k,g,warps", [(40, 512, 128, 4), (33, 4160, 64, 2)])  # 4160 > XBLOCK 2048: three passes
def test_gemv_fused_is_the_two_launch_gemv(n: int, k: int, g: int, warps: int) -> None:
    """A fused GEMV (the token quantized inside, one launch) gives the same bits as the same tiling after
    quantize_words, for a bf16 token, a zero token (output = bias) and an fp32 token; the amax in one block or in
    several; split-K."""
    w, sw = _layout(*weights(n, k, g, seed=k))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k)).bfloat16()
    fused = launch.GemvConfig(16, 2 * g, launch.split_for(1, n, k, g, 16, 16, 2 * g, 8, 132), warps, fused=True)
    options = launch.gemv_launch(fused, n, k, g, *[None] * 10)[2]
    assert fused.split_k > 1 and options["FUSED"] and options["XBLOCK"] == min(1 << (k - 1).bit_length(), 1024 * warps)
    for x in (activations(1, k, torch.bfloat16, seed=n), torch.zeros(1, k, dtype=torch.bfloat16),
              activations(1, k, torch.float32, seed=n + 1)):
        two = launch.w4a8_linear(x, w, sw, bias.to(x.dtype), n, k, g, config=replace(fused, fused=False))
        one = launch.w4a8_linear(x, w, sw, bias.to(x.dtype), n, k, g, config=fused)
        assert torch.equal(one, two)
        if not x.any():
            assert torch.equal(one[0], bias)
    assert not launch._locks(w.device).any()
    assert any(c.fused for c in launch.candidates(1, n, k, g) if isinstance(c, launch.GemvConfig))


@pytest.mark.parametrize("split", [1, 3])
def test_gemv_two_steps_ahead_is_the_same(split: int) -> None:
    """ahead=2 (two steps of weights in flight) over many main-loop steps, a split whose stretch is not a multiple
    of the steps in flight, and a partial last step: the same bits as ahead=1."""
    n, k, g = 24, 64 * 13, 64
    w, sw = _layout(*weights(n, k, g, seed=9))
    x = activations(1, k, torch.bfloat16, seed=10)
    one = launch.GemvConfig(16, 128, split_k=split, fused=True)
    two = replace(one, ahead=2)
    assert launch.gemv_launch(two, n, k, g, *[None] * 10)[2]["AHEAD"] == 2
    assert torch.equal(launch.w4a8_linear(x, w, sw, None, n, k, g, config=two),
                       launch.w4a8_linear(x, w, sw, None, n, k, g, config=one))
    with pytest.raises(ValueError, match="ahead"):
        launch.GemvConfig(16, 128, ahead=3)


def _integer_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """bf16 rows of small integers: with K a power of two the norm's mean of squares is exact in any order."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (m, k), generator=gen).bfloat16()


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("m,k,warps", [(1, 512, 4), (1, 4096, 2), (3, 512, 4), (2, 8192, 4)])
def test_norm_inside_the_kernels_is_the_norm_then_the_linear(m: int, k: int, warps: int, residual: bool) -> None:
    """w4a8_linear_pre with a Norm (vLLM's rms_norm / fused_add_rms_norm computed inside the fused GEMV at one
    token, by the norm-and-quantize kernel before the GEMM otherwise) gives the bits of the reference norm
    followed by the unfused linear, and the new residual exactly; one pass or several over the row (K 4096 with
    2 warps: 2048 a block; K 8192: two of the rows kernel's 4096)."""
    n, g = 40, 128
    w, sw = _layout(*weights(n, k, g, seed=k + m))
    x = _integer_rows(m, k, seed=k)
    r = _integer_rows(m, k, seed=k + 1) if residual else None
    nw = (torch.rand(k, generator=torch.Generator().manual_seed(m)) + 0.5).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16()
    y_ref, r_ref = rms_norm_ref(x, nw, 1e-6, r)
    rq, rs = quantize_activations_ref(y_ref)
    configs = [launch.GemvConfig(16, 256, split_k=3, num_warps=warps, fused=True)] if m == 1 else []
    configs += [launch.serving_config(m, n, k, g, x.device)]
    for cfg in configs:
        rout = None if r is None else torch.empty_like(x)
        norm = launch.Norm(nw, 1e-6, r, rout)
        got = launch.w4a8_linear_pre(x, norm, w, sw, bias, n, k, g, config=cfg)
        want = launch.w4a8_linear_q(rq, rs, w, sw, bias, n, k, g, torch.bfloat16,
                                    config=replace(cfg, fused=False) if isinstance(cfg, launch.GemvConfig) else cfg)
        assert torch.equal(got, want), cfg
        if r is not None:
            assert torch.equal(rout, r_ref)
    xq, sx = launch.pre_quantize(x, launch.Norm(nw, 1e-6, r, None if r is None else torch.empty_like(x)), k)
    assert torch.equal(xq, rq) and torch.equal(sx, rs)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m,k,g", [(5, 512, 128), (33, 576, 32)])
def test_split_order_gemm_is_the_gemm(m: int, k: int, g: int, swap: bool) -> None:
    """A GemmConfig with cat quantizes the activations in split order (by quantize_act, and by the norm prologue)
    and gives the same bits as the same tile on activations in column order, through every entry point."""
    n = 40
    w, sw = _layout(*weights(n, k, g, seed=m + k))
    x = activations(m, k, torch.bfloat16, seed=m)
    nw = (torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16()
    plain = launch.GemmConfig(32, 32, 128, swap=swap, pipe=swap)
    cat = replace(plain, cat=True)
    assert launch.split_order(cat) and not launch.split_order(plain)
    for run in (lambda c: launch.w4a8_linear(x, w, sw, bias, n, k, g, config=c),
                lambda c: launch.w4a8_linear_pre(x, launch.Norm(nw, 1e-6), w, sw, bias, n, k, g, config=c),
                lambda c: launch.w4a8_linear_q(*launch.quantize_act(x), w, sw, bias, n, k, g, torch.float32,
                                               config=c)):
        assert torch.equal(run(cat), run(plain))


def test_norm_inside_the_kernels_on_real_valued_rows() -> None:
    """Random bf16 rows, K not a power of two: the output within the bf16 tolerance of the reference chain."""
    n, k, g = 33, 576, 64
    q, s = weights(n, k, g, seed=3)
    w, sw = _layout(q, s)
    nw = (torch.rand(k, generator=torch.Generator().manual_seed(4)) + 0.5).bfloat16()
    for m in (1, 4):
        x, r = activations(m, k, torch.bfloat16, seed=5), activations(m, k, torch.bfloat16, seed=6)
        y_ref, r_ref = rms_norm_ref(x, nw, 1e-5, r)
        rout = torch.empty_like(x)
        got = launch.w4a8_linear_pre(x, launch.Norm(nw, 1e-5, r, rout), w, sw, None, n, k, g)
        assert torch.equal(rout, r_ref)
        assert_close(got, w4a8_linear_ref(*quantize_activations_ref(y_ref), q, s, out_dtype=torch.float64))


@pytest.mark.parametrize("k,warps", [(512, 4), (4160, 2)])  # 4160: the row in several blocks of 2048 / 4096
def test_silu_and_mul_inside_the_kernels(k: int, warps: int) -> None:
    """w4a8_linear_pre with SiluMul (vLLM's SiluAndMul of a row of 2K): the fused GEMV, the rows kernel before the
    GEMM and the GEMV after them quantize the same INT8 values (the same bits out), within tolerance of the
    reference SiluAndMul followed by the linear."""
    n, g = 40, 64
    q, s = weights(n, k, g, seed=k)
    w, sw = _layout(q, s)
    y2 = activations(3, 2 * k, torch.bfloat16, seed=k + 1)
    ref = silu_and_mul_ref(y2)
    xq, sx = launch.pre_quantize(y2, launch.SiluMul(), k)
    assert xq.shape == (3, k)
    rq, rs = quantize_activations_ref(ref)
    assert (xq.int() - rq.int()).abs().max().item() <= 1 and torch.allclose(sx, rs, rtol=2**-7)
    fused = launch.GemvConfig(16, 256, split_k=3, num_warps=warps, fused=True)
    one = launch.w4a8_linear_pre(y2[:1], launch.SiluMul(), w, sw, None, n, k, g, config=fused)
    two = launch.w4a8_linear_q(xq[:1], sx[:1], w, sw, None, n, k, g, torch.bfloat16, config=replace(fused, fused=False))
    assert torch.equal(one, two)
    rows = launch.w4a8_linear_pre(y2, launch.SiluMul(), w, sw, None, n, k, g)
    assert torch.equal(rows, launch.w4a8_linear_q(xq, sx, w, sw, None, n, k, g, torch.bfloat16))
    assert_close(rows, w4a8_linear_ref(rq, rs, q, s, out_dtype=torch.float64))
    with pytest.raises(ValueError, match="SiluMul"):
        launch.w4a8_linear_pre(y2[:, :k], launch.SiluMul(), w, sw, None, n, k, g)


def test_gemv_counts_once_a_launch_and_refuses_more_rows() -> None:
    n, k, g = 40, 512, 64
    w, sw = _layout(*weights(n, k, g, seed=6))
    counter = new_counter(slot="decode")
    cfg = launch.GemvConfig(16, 64, split_k=4)
    for _ in range(3):
        launch.w4a8_linear(torch.randn(1, k), w, sw, None, n, k, g, config=cfg, counter=counter)
    assert counter.cell.tolist() == [[0, 0], [0, 0], [3, 3]]  # split-K's programs count once
    with pytest.raises(ValueError, match="one token"):
        launch.w4a8_linear(torch.randn(2, k), w, sw, None, n, k, g, config=cfg)
    assert launch.gemv_fits(100, 4) and launch.gemv_fits(576, 576) and launch.gemv_fits(576, 32) is None
    assert all(not isinstance(c, launch.GemvConfig) for c in launch.candidates(1, n, 96 * 6, 96))


def test_linear_bf16_within_tolerance() -> None:
    m, n, k, g = 5, 48, 384, 64
    q, s = weights(n, k, g, seed=3)
    x = activations(m, k, torch.bfloat16, seed=4)
    bias = torch.randn(n).bfloat16()
    w, sw = _layout(q, s.bfloat16())
    xq, sx = launch.quantize_act(x)
    y = launch.w4a8_linear_q(xq, sx, w, sw, bias, n, k, g, torch.bfloat16)
    rq, rs = quantize_activations_ref(x)
    assert_close(y, w4a8_linear_ref(rq, rs, q, s.bfloat16(), bias, out_dtype=torch.float64))


def test_gemm_bumps_the_coverage_counter_once_a_launch() -> None:
    n, k, g = 40, 256, 64
    w, sw = _layout(*weights(n, k, g, seed=5))
    counter = new_counter(slot="decode")
    for m, cfg in ((1, launch.GemmConfig(16, 32, 64, split_k=4)), (3, launch.GemmConfig(16, 32, 256))):
        xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        launch.w4a8_linear_q(xq, torch.ones(m, 1), w, sw, None, n, k, g, torch.float32, config=cfg, counter=counter)
    assert counter.cell.tolist() == [[0, 0], [0, 0], [2, 4]]  # split-K's four programs count once


@pytest.mark.parametrize("k", [512, 4160])  # the row in one block, and in two (the running amax across blocks)
def test_a_token_holding_nan_or_inf_gives_nan_outputs(k: int) -> None:
    """A NaN or inf in a token (or in what its norm / SiluAndMul computes) gives it scale NaN and q 0, as the
    reference: the linear's row is NaN on every path (GEMM, GEMV, fused GEMV, both prologues), where maxNum and the
    clamp once made it finite. The other tokens keep their bits."""
    n, g = 40, 64
    q, s = weights(n, k, g, seed=k)
    w, sw = _layout(q, s)
    x = activations(4, k, torch.bfloat16, seed=k + 3)
    x[1, k - 1], x[2, 5], x[3, k // 2] = float("nan"), float("inf"), float("-inf")
    rq, rs = quantize_activations_ref(x)
    xq, sx = launch.quantize_act(x)
    assert torch.equal(xq, rq) and torch.equal(sx[0], rs[0]) and sx[1:].isnan().all()
    xw, sxw = launch.quantize_words(x)
    assert torch.equal(xw, launch.words_of(rq)) and sxw[1:].isnan().all()
    gemm = launch.GemmConfig(16, 64, 64)
    for rows in (launch.w4a8_linear(x, w, sw, None, n, k, g, config=gemm),
                 launch.w4a8_linear_q(xq, sx, w, sw, None, n, k, g, torch.bfloat16, config=gemm)):
        assert rows[1:].isnan().all() and rows[0].isfinite().all()
    for one in range(4):
        y = launch.w4a8_linear(x[one:one + 1], w, sw, None, n, k, g, config=launch.GemvConfig(16, 256, fused=True))
        assert y.isnan().all() if one else y.isfinite().all()
    norm = launch.Norm(torch.rand(k, dtype=torch.bfloat16) + 0.5, 1e-6,
                       residual=activations(4, k, torch.bfloat16, seed=1), residual_out=torch.empty_like(x))
    out = launch.w4a8_linear_pre(x, norm, w, sw, None, n, k, g)
    assert out[1:].isnan().all() and out[0].isfinite().all()
    _, r_ref = rms_norm_ref(x, norm.weight, 1e-6, norm.residual)
    assert torch.equal(norm.residual_out.isnan(), r_ref.isnan())
    y2 = activations(2, 2 * k, torch.bfloat16, seed=k)
    y2[1, 3] = float("nan")
    for cfg in (None, launch.GemvConfig(16, 256, fused=True)):
        if cfg is None:
            out = launch.w4a8_linear_pre(y2, launch.SiluMul(), w, sw, None, n, k, g)
            assert out[1].isnan().all() and out[0].isfinite().all()
        else:
            out = launch.w4a8_linear_pre(y2[1:], launch.SiluMul(), w, sw, None, n, k, g, config=cfg)
            assert out.isnan().all()


def test_bf16_rounding_keeps_the_gpus_nan() -> None:
    """NVIDIA GPUs return the canonical NaN 0x7FFFFFFF from fp32 arithmetic (a fused_add_rms_norm's x + r when
    either is NaN); the bf16 rounding by integer arithmetic once carried it into the sign bit (-0.0). Fed here
    directly, since numpy keeps other NaN payloads."""
    import triton
    import triton.language as tl

    @triton.jit
    def rounded(v_ptr, o_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(o_ptr + offs, triton_w4a8._rounded(tl.load(v_ptr + offs), tl.bfloat16))

    bits = torch.tensor([0x7FFFFFFF, 0x7FC00000, -1, 0x7F800000, 0x3F800001, 0x3F808000, 0, -(2**31)],
                        dtype=torch.int64).to(torch.int32)
    v = bits.view(torch.float32)
    out = torch.empty_like(v)
    rounded[(1,)](v, out, N=8)
    want = v.bfloat16().float()
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out[~want.isnan()], want[~want.isnan()])
