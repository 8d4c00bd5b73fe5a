"""The output-head routes (kernels/routes/head.py, csrc/head_cpu.h) against the torch oracle (reference.py).

BF16 head: products and sums in fp32, compared with a float64 reference. Tolerance: the fp32 sum of K products
errs by at most about K * 2^-24 * sum_k |x_k w_k| in the worst case; we allow 1e-5 * sum_k |x_k w_k| (covers
K <= 2048 at a tenth of the worst case, which random signs never approach), plus one rounding of the output
(2^-8 relative for bf16 and fp16 outputs, none for fp32).
INT8 head: the INT32 dots are exact and the fp32 epilogue is the reference's, so outputs match exactly.

Shapes include M = 1, K not a multiple of 16 or 32 (the SIMD blocks), N not a multiple of the 4-row tile.
"""

from __future__ import annotations

import pytest
import torch

from anychip.kernels.policy import KernelPolicy
from anychip.kernels.reference import head_bf16_ref, head_int8_ref, quantize_head_int8_ref
from anychip.kernels.routes import NoKernelRoute
from anychip.kernels.routes.head import HEAD_ROUTES, select_head

BF16 = [r for r in HEAD_ROUTES if r.kind == "bf16" and not r.fallback_only and r.unavailable() is None]
INT8 = [r for r in HEAD_ROUTES if r.kind == "int8" and not r.fallback_only and r.unavailable() is None]

# (M, K, N, x dtype, bias)
CASES = [
    (1, 576, 1000, torch.bfloat16, False),
    (1, 576, 4099, torch.float32, True),
    (1, 37, 7, torch.bfloat16, False),
    (1, 100, 1, torch.float16, True),
    (2, 2048, 130, torch.bfloat16, True),
    (3, 64, 9, torch.float32, False),
    (5, 1536, 257, torch.bfloat16, False),
    (9, 48, 33, torch.bfloat16, True),
]


def _inputs(m, k, n, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("route", BF16, ids=lambda r: r.id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-{str(c[3])[6:]}-b{int(c[4])}")
def test_bf16_head_matches_reference(route, case):
    m, k, n, dtype, bias = case
    x, w, b = _inputs(m, k, n, dtype, bias)
    head = route.prepare(w, KernelPolicy())
    assert head.weight.data_ptr() == w.data_ptr(), "the BF16 head is served from the checkpoint's tensor, no copy"
    y = head.logits(x, b)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = head_bf16_ref(x.double(), w, b)  # float64, not rounded to x's dtype
    mag = x.double().abs() @ w.double().abs().t()
    rel = 0.0 if dtype == torch.float32 else 2.0**-8
    tol = 1e-5 * mag + rel * ref.abs() + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= tol).all()), f"{route.id}: max err {float(err.max()):.3g}, worst err/tol {float((err / tol).max()):.3g}"


@pytest.mark.parametrize("route", INT8, ids=lambda r: r.id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-{str(c[3])[6:]}-b{int(c[4])}")
def test_int8_head_matches_reference_exactly(route, case):
    m, k, n, dtype, bias = case
    x, w, b = _inputs(m, k, n, dtype, bias, seed=1)
    head = route.prepare(w, KernelPolicy(head="int8"))
    assert head.weight.dtype == torch.int8 and head.scales.shape == (n,)
    y = head.logits(x, b)
    ref = head_int8_ref(x, head.weight, head.scales, b)
    assert torch.equal(y, ref), f"{route.id}: {int((y != ref).sum())} of {y.numel()} outputs differ"


@pytest.mark.parametrize("route", BF16 + INT8, ids=lambda r: r.id)
def test_a_tokens_logits_do_not_depend_on_the_batch(route):
    """Batch invariance: each token's logits, computed among M tokens (every tile shape, leftover tokens and rows,
    K with and without a SIMD tail), are the bits it gets alone. The BF16 tiles used to keep two accumulators for
    a lone token and one for several, so a row differed in its last bit with the batch around it."""
    k_n = [(576, 1030), (100, 37)]
    for k, n in k_n:
        x, w, _ = _inputs(19, k, n, torch.bfloat16, False, seed=2)
        head = route.prepare(w, KernelPolicy(head=route.kind))
        alone = torch.cat([head.logits(x[i:i + 1]) for i in range(len(x))])
        for m in (2, 3, 4, 5, 6, 7, 8, 9, 19):
            for start in (0, len(x) - m):
                got = head.logits(x[start:start + m])
                assert torch.equal(got, alone[start:start + m]), (
                    f"{route.id} K={k} N={n}: {m} tokens from {start}, "
                    f"{int((got != alone[start:start + m]).any(dim=1).sum())} differ from their logits alone")


def test_int8_head_quantizer_round_trips_within_half_a_step():
    w = (torch.randn(64, 576, generator=torch.Generator().manual_seed(2)) * 0.05).to(torch.bfloat16)
    w[3] = 0  # an all-zero row gets scale 0
    wq, sw = quantize_head_int8_ref(w)
    assert int(wq.abs().max()) <= 127 and float(sw[3]) == 0.0 and not wq[3].any()
    err = (wq.float() * sw[:, None] - w.float()).abs()
    assert bool((err <= sw[:, None] * (0.5 + 1e-5) + 1e-12).all())  # half a step, plus fp32 rounding of w / sw


def test_head_leading_dims_and_empty_batch():
    route = BF16[0]
    x, w, _ = _inputs(6, 96, 40, torch.bfloat16, False)
    head = route.prepare(w, KernelPolicy())
    y = head.logits(x.view(2, 3, 96), None)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y.view(6, 40), head.logits(x, None))
    assert head.logits(x[:0], None).shape == (0, 40)


def test_select_head_follows_the_policy():
    assert select_head(KernelPolicy()).kind == "bf16"
    assert select_head(KernelPolicy(head="int8")).kind == "int8"
    assert select_head(KernelPolicy(route="cpu.portable")).id == "cpu.head_bf16.portable"
    assert select_head(KernelPolicy(route="reference", head="int8")).id == "reference.head_int8"
    with pytest.raises(ValueError, match="--head"):
        KernelPolicy(head="int4")
    with pytest.raises(NoKernelRoute, match="bf16 head"):
        BF16[0].prepare(torch.zeros(4, 8, dtype=torch.float16), KernelPolicy())


def test_head_op_has_a_meta_kernel():
    BF16[0].prepare(torch.zeros(4, 8, dtype=torch.bfloat16), KernelPolicy())  # loads the extension
    x = torch.empty(3, 8, dtype=torch.bfloat16, device="meta")
    w = torch.empty(50, 8, dtype=torch.bfloat16, device="meta")
    assert torch.ops.anychip.head_bf16(x, w, None, 0).shape == (3, 50)


def test_head_int8_quantization_is_the_same_in_row_blocks():
    torch.manual_seed(0)
    w = (torch.randn(37, 64) * torch.rand(37, 1) * 4).to(torch.bfloat16)
    w[5] = 0  # an all-zero row: scale 0, INT8 zeros
    whole_q, whole_s = quantize_head_int8_ref(w, rows=1 << 20)
    for rows in (1, 8, 36):
        q, s = quantize_head_int8_ref(w, rows=rows)
        assert torch.equal(q, whole_q) and torch.equal(s, whole_s)
    wf = w.float()
    expect_s = wf.abs().amax(dim=1) / 127
    assert torch.equal(whole_s, expect_s) and whole_s[5] == 0 and not whole_q[5].any()
    safe = torch.where(expect_s > 0, expect_s, torch.ones_like(expect_s))
    assert torch.equal(whole_q, torch.round(wf / safe[:, None]).clamp(-127, 127).to(torch.int8))


def test_each_head_op_refuses_the_other_kinds_isa_code():
    """AVX512-BF16 (code 2) has only a BF16 head kernel and AVX512-VNNI (code 3) only an INT8 one: the ops refuse
    the other kind's code instead of running some other kernel for it. On a CPU without the instruction set the
    code is refused as unsupported, which the same check covers."""
    from anychip.kernels.routes.head import Bf16Avx512, Int8Avx512Vnni

    BF16[0].prepare(torch.zeros(4, 8, dtype=torch.bfloat16), KernelPolicy())  # loads the extension
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.randn(8, 64).to(torch.bfloat16)
    wq, sw = quantize_head_int8_ref(w)
    with pytest.raises(RuntimeError, match="ISA code 3"):
        torch.ops.anychip.head_bf16(x, w, None, Int8Avx512Vnni.code)
    with pytest.raises(RuntimeError, match="ISA code 2"):
        torch.ops.anychip.head_int8(x, wq, sw, None, Bf16Avx512.code)


def test_the_vnni_int8_head_is_chosen_where_the_cpu_has_it():
    """The INT8 head's best route: AVX512-VNNI, then AVX2, then portable; a forced AVX2 linear route takes the
    AVX2 head."""
    from anychip.kernels.routes.head import Int8Avx2, Int8Avx512Vnni

    vnni, avx2 = Int8Avx512Vnni().unavailable() is None, Int8Avx2().unavailable() is None
    expected = Int8Avx512Vnni.id if vnni else Int8Avx2.id if avx2 else "cpu.head_int8.portable"
    assert select_head(KernelPolicy(head="int8")).id == expected
    if avx2:
        assert select_head(KernelPolicy(head="int8", route="cpu.avx2")).id == Int8Avx2.id
