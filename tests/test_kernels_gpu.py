"""The Triton W4A8 kernels against the torch oracle (reference.py), on a CUDA device.

Integers must match exactly (activation quantization, per-group INT32 sums, and whole linears whose scales are
powers of two); other outputs within the tolerance kernels_gpu_cases.py states. Skipped without a CUDA device or
triton; layout tests that need neither are in test_kernels_gpu_layout.py, and test_triton_interpret.py runs the same
kernels through Triton's interpreter on the CPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the Triton W4A8 kernels run on NVIDIA GPUs only", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch ship it)")

from anychip.formats import pack_int4  # noqa: E402
from anychip.kernels import hooks, ops, routes  # noqa: E402
from anychip.kernels.gpu import launch, unavailable_reason  # noqa: E402
from anychip.kernels.prepare import prepare_w4a8, w4a8_linear  # noqa: E402
from anychip.kernels.reference import (group_dot_ref, quantize_activations_ref, rms_norm_ref,  # noqa: E402
                                      silu_and_mul_ref, w4a8_linear_ref)
from anychip.kernels.routes import NoKernelRoute  # noqa: E402
from kernels_gpu_cases import activations, assert_close, config_id, new_counter, weights  # noqa: E402

DEV = torch.device("cuda")
if reason := unavailable_reason(DEV):
    pytest.skip(reason, allow_module_level=True)

MS = (1, 3, 7, 64, 512)
KS = (576, 1536, 2048, 6144)
NS = (1, 17, 100, 576)
OPS = torch.ops.anychip


# --- activation quantization: bit-exact -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("m", MS)
def test_quantize_bit_exact(m: int, k: int, dtype: torch.dtype) -> None:
    x = activations(m, k, dtype, seed=m * 7 + k)
    if m > 2:
        x[1] = 0  # a zero row: scale 0, q 0
    xq, sx = OPS.quantize_act(x.to(DEV))
    rq, rs = quantize_activations_ref(x)
    assert torch.equal(sx.cpu(), rs)
    assert torch.equal(xq.cpu(), rq)


@pytest.mark.parametrize("k", [576, 6144])
def test_a_token_holding_nan_or_inf_is_nan_compiled(k: int) -> None:
    """Compiled, as the interpreted case checks: a NaN or inf in a token gives scale NaN, q 0 and NaN outputs on
    the GEMM, the fused GEMV and the fused_add_rms_norm prologue, whose new residual keeps the NaN (the GPU's NaN
    0x7FFFFFFF once rounded to -0.0 there)."""
    n, g = 64, 64
    q, s = weights(n, k, g, seed=k)
    from anychip.kernels.gpu.layout import pack_nibbles

    w, sw = pack_nibbles(q).to(DEV), s.t().contiguous().to(DEV)
    x = activations(4, k, torch.bfloat16, seed=k).to(DEV)
    x[1, k - 1], x[2, 3], x[3, k // 2] = float("nan"), float("inf"), float("-inf")
    xq, sx = launch.quantize_act(x)
    rq, rs = quantize_activations_ref(x.cpu())
    assert torch.equal(xq.cpu(), rq) and torch.equal(sx.cpu().isnan(), rs.isnan())
    y = launch.w4a8_linear(x, w, sw, None, n, k, g, config=launch.GemmConfig(16, 64, 64))
    assert y[1:].isnan().all() and y[0].isfinite().all()
    for one in range(4):
        y = launch.w4a8_linear(x[one:one + 1], w, sw, None, n, k, g, config=launch.GemvConfig(16, 256, fused=True))
        assert y.isnan().all() if one else y.isfinite().all()
    r = activations(4, k, torch.bfloat16, seed=1).to(DEV)
    norm = launch.Norm(torch.rand(k, dtype=torch.bfloat16, device=DEV) + 0.5, 1e-6, residual=r,
                       residual_out=torch.empty_like(x))
    out = launch.w4a8_linear_pre(x, norm, w, sw, None, n, k, g)
    assert out[1:].isnan().all() and out[0].isfinite().all()
    _, r_ref = rms_norm_ref(x.cpu(), norm.weight.cpu(), 1e-6, r.cpu())
    assert torch.equal(norm.residual_out.cpu().isnan(), r_ref.isnan())


ONE = launch.QUANTIZE_ONE_PASS


@pytest.mark.parametrize("m,k,one_pass_max", [(3, 1000, ONE), (2, 1000, 64), (1, 14336, ONE), (2, 14336, 4096)])
def test_quantize_words_one_pass_and_in_blocks(m: int, k: int, one_pass_max: int) -> None:
    """The GEMV's activation words hold exactly quantize_act's values, the row read once or in blocks."""
    x = activations(m, k, torch.bfloat16, seed=k + m)
    x[-1] = 0
    rq, rs = quantize_activations_ref(x)
    xw, sx = launch.quantize_words(x.to(DEV), one_pass_max=one_pass_max)
    assert torch.equal(xw.cpu(), launch.words_of(rq)) and torch.equal(sx.cpu(), rs.reshape(-1))


def test_quantize_ties_round_half_to_even() -> None:
    halves = torch.arange(-126, 127, dtype=torch.float32) + 0.5  # x / scale lands exactly on .5
    rows = [torch.cat([halves, torch.tensor([127.0])]),  # scale = 1
            torch.cat([halves * 2, torch.tensor([254.0])]),  # scale = 2
            torch.cat([halves / 4, torch.tensor([127.0 / 4])])]  # scale = 0.25
    x = torch.stack(rows)
    xq, sx = OPS.quantize_act(x.to(DEV))
    rq, rs = quantize_activations_ref(x)
    assert torch.equal(sx.cpu(), rs) and torch.equal(xq.cpu(), rq)
    assert xq[0, 126].item() == 0 and xq[0, 127].item() == 2  # 0.5 -> 0, 1.5 -> 2


# --- exact integer group sums ------------------------------------------------------------------------------------

@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m,n,k,g", [(1, 17, 576, 32), (7, 100, 576, 64), (64, 1, 2048, 128), (3, 576, 1536, 64)])
def test_group_dots_exact(m: int, n: int, k: int, g: int, swap: bool) -> None:
    q, s = weights(n, k, g, seed=m + n)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    p = prepare_w4a8(pack_int4(q).to(DEV), s.to(DEV), g, packed=True)
    got = launch.group_dots(xq.to(DEV), p.weight, n, k, g, swap=swap)
    assert torch.equal(got.cpu(), group_dot_ref(xq, q, g))


def test_group_dots_extremes_through_op() -> None:
    m, n, k, g = 5, 40, 512, 128
    q = torch.full((n, k), -8, dtype=torch.int8)
    q[::2] = 7
    xq = torch.full((m, k), 127, dtype=torch.int8)
    xq[1::2] = -127
    s = torch.ones(n, k // g)
    p = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False)
    got = OPS.w4a8_group_dots(xq.to(DEV), p.weight, p.scales, n, k, g, p.route.code)
    assert torch.equal(got.cpu(), group_dot_ref(xq, q, g))
    assert got.abs().max().item() == 127 * 8 * g


# --- whole linears: exact with power-of-two scales, for every tile config --------------------------------------

def _all_configs() -> list[tuple[int, int, launch.GemmConfig]]:
    out = []
    for g in (32, 128):
        for m in (1, 33, 300):
            for cfg in launch.candidates(m, 576, 2048, g):
                out.append((m, g, cfg))
        out.append((7, g, launch.GemmConfig(16, 32, 256, split_k=3)))
        out.append((7, g, launch.GemmConfig(16, 64, 128, swap=True, split_k=5)))
    out.append((7, 128, launch.GemmConfig(16, 32, 256, pipe=True, split_k=3)))
    return out


@pytest.mark.parametrize("m,g,cfg", _all_configs(), ids=config_id)
def test_linear_q_pow2_scales_exact(m: int, g: int, cfg: launch.GemmConfig) -> None:
    n, k = 100, 2048
    q, s = weights(n, k, g, seed=m, pow2=True)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    sx = 2.0 ** torch.randint(-9, -5, (m, 1)).float()
    bias = torch.randn(n)
    p = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False)
    y = launch.w4a8_linear_q(xq.to(DEV), sx.to(DEV), p.weight, p.scales, bias.to(DEV), n, k, g, torch.float32,
                             config=cfg)
    assert torch.equal(y.cpu(), w4a8_linear_ref(xq, sx, q, s, bias, out_dtype=torch.float32))


def test_split_k_semaphores_repeat_exactly() -> None:
    """Many back-to-back split-K launches on fresh inputs: a missing barrier or a stale semaphore shows up as a
    result that differs from run to run."""
    n, k, g = 100, 2048, 32
    q, s = weights(n, k, g, seed=11, pow2=True)
    p = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False)
    cfg = launch.GemmConfig(16, 32, 64, split_k=16)
    for i in range(20):
        xq = torch.randint(-127, 128, (1 + i % 5, k), dtype=torch.int8)
        sx = torch.full((xq.shape[0], 1), 2.0**-7)
        y = launch.w4a8_linear_q(xq.to(DEV), sx.to(DEV), p.weight, p.scales, None, n, k, g, torch.float32,
                                 config=cfg)
        assert torch.equal(y.cpu(), w4a8_linear_ref(xq, sx, q, s, None, out_dtype=torch.float32)), i


# --- whole linears through the torch op, over shapes that include the awkward ones ----------------------------

def _linear_cases() -> list[tuple]:
    cases = []
    for i, m in enumerate(MS):
        for j, k in enumerate(KS):
            gs = [g for g in (32, 64, 128) if k % g == 0]
            dtype = (torch.bfloat16, torch.float32)[(i + j) % 2]
            cases.append((m, k, NS[(i + j) % 4], gs[(i + 2 * j) % len(gs)], (i + j) // 2 % 2 == 0, dtype))
    cases.append((512, 6144, 576, 32, True, torch.float16))
    return cases


@pytest.mark.parametrize("n,k,g", [(17, 576, 32), (576, 2048, 128), (6144, 2048, 128), (100, 14336, 128),
                                   (2048, 8192, 64)])
def test_fused_gemv_is_the_two_launch_gemv(n: int, k: int, g: int) -> None:
    """Every fused GEMV candidate (the token quantized inside the GEMV's programs) gives the bits of the same tiling
    after quantize_words, on fresh tokens each time (a zero token too); split-K semaphores left armed."""
    q, s = weights(n, k, g, seed=n + k)
    p = prepare_w4a8(q.to(DEV), s.to(DEV).bfloat16(), g, packed=False)
    bias = torch.randn(n).bfloat16().to(DEV)
    fused = [c for c in launch.candidates(1, n, k, g) if isinstance(c, launch.GemvConfig) and c.fused]
    assert fused
    for i, cfg in enumerate(fused * 2):
        x = activations(1, k, torch.bfloat16, seed=i).to(DEV) if i != 3 else torch.zeros(1, k, dtype=torch.bfloat16,
                                                                                             device=DEV)
        one = launch.w4a8_linear(x, p.weight, p.scales, bias, n, k, g, config=cfg)
        two = launch.w4a8_linear(x, p.weight, p.scales, bias, n, k, g, config=replace(cfg, fused=False))
        assert torch.equal(one, two), cfg
    assert not launch._locks(DEV).any()


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("m", [1, 3, 64, 512])
def test_norm_inside_the_kernels(m: int, residual: bool) -> None:
    """anychip::w4a8_linear_norm (the plugin's fused RMSNorm + linear) at the llama-2b qkv shape: on rows of small
    integers (the mean of squares exact in any order) the bits of vLLM's norm followed by the linear, the new
    residual exact; on random rows within 1% (the compiled rsqrt and sum order may move a bf16 ulp)."""
    n, k, g = 4096, 2048, 128
    q, s = weights(n, k, g, seed=m)
    p = prepare_w4a8(q.to(DEV), s.to(DEV).bfloat16(), g, packed=False)
    gen = torch.Generator().manual_seed(m)
    nw = (torch.rand(k, generator=gen) + 0.5).bfloat16().to(DEV)
    for integers in (True, False):
        if integers:
            x, r = (torch.randint(-8, 9, (m, k), generator=gen).bfloat16().to(DEV) for _ in range(2))
        else:
            x, r = activations(m, k, torch.bfloat16, seed=m).to(DEV), activations(m, k, torch.bfloat16, seed=2).to(DEV)
        r = r if residual else None
        y, rout = OPS.w4a8_linear_norm(x, r, nw, 1e-5, p.weight, p.scales, None, n, k, g, p.route.code, None)
        normed, r_ref = rms_norm_ref(x, nw, 1e-5, r)
        want = OPS.w4a8_linear(normed, p.weight, p.scales, None, n, k, g, p.route.code, None)
        assert torch.equal(rout, r_ref) if residual else rout.numel() == 0
        if integers:
            assert torch.equal(y, want)
        else:
            assert ((y.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    counter = new_counter(DEV)
    with hooks.observing(lambda layer, tokens: counter):  # the fused op counts its layer's call on the device
        OPS.w4a8_linear_norm(x, r, nw, 1e-5, p.weight, p.scales, None, n, k, g, p.route.code, ops.layer_tensor(0))
    torch.cuda.synchronize()
    assert counter.cell[0].tolist() == [1, m]


@pytest.mark.parametrize("m", [1, 3, 64, 512])
def test_silu_and_mul_inside_the_kernels(m: int) -> None:
    """anychip::w4a8_linear_silu_mul (the plugin's fused SiluAndMul + linear) at the llama-2b down projection: the
    same INT8 activations as the rows kernel (the same bits out at one token, fused GEMV or not), within 1% of vLLM's
    SiluAndMul followed by the linear (silu's exp may move a bf16 ulp), counted on the device."""
    n, k, g = 2048, 6144, 128
    q, s = weights(n, k, g, seed=m + 1)
    p = prepare_w4a8(q.to(DEV), s.to(DEV).bfloat16(), g, packed=False)
    y2 = activations(m, 2 * k, torch.bfloat16, seed=m).to(DEV)
    got = OPS.w4a8_linear_silu_mul(y2, p.weight, p.scales, None, n, k, g, p.route.code, None)
    xq, sx = launch.pre_quantize(y2, launch.SiluMul(), k)
    assert torch.equal(got, launch.w4a8_linear_q(xq, sx, p.weight, p.scales, None, n, k, g, torch.bfloat16))
    want = OPS.w4a8_linear(silu_and_mul_ref(y2), p.weight, p.scales, None, n, k, g, p.route.code, None)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    counter = new_counter(DEV)
    with hooks.observing(lambda layer, tokens: counter):
        OPS.w4a8_linear_silu_mul(y2, p.weight, p.scales, None, n, k, g, p.route.code, ops.layer_tensor(0))
    torch.cuda.synchronize()
    assert counter.cell[0].tolist() == [1, m]


@pytest.mark.parametrize("m,k,n,g,has_bias,dtype", _linear_cases())
def test_linear_op_matches_reference(m: int, k: int, n: int, g: int, has_bias: bool, dtype: torch.dtype) -> None:
    q, s = weights(n, k, g, seed=m * 13 + n)
    x = activations(m, k, dtype, seed=k + n)
    bias = torch.randn(n).to(dtype) if has_bias else None
    p = prepare_w4a8(pack_int4(q).to(DEV), s.to(DEV), g, packed=True)
    assert p.route.kernel == "triton" and p.route.device == "cuda" and p.weight.is_cuda
    y = OPS.w4a8_linear(x.to(DEV), p.weight, p.scales, None if bias is None else bias.to(DEV), n, k, g,
                        p.route.code, None)
    assert y.dtype == dtype and y.shape == (m, n)
    xq, sx = quantize_activations_ref(x)
    assert_close(y, w4a8_linear_ref(xq, sx, q, s, bias, out_dtype=torch.float64))


def test_bf16_scales_and_batched_input() -> None:
    n, k, g = 576, 1536, 64
    q, s = weights(n, k, g, seed=1)
    s = s.to(torch.bfloat16)
    p = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False)
    assert p.scales.dtype == torch.bfloat16  # kept: lossless and half the bytes
    x = activations(2 * 5, k, torch.bfloat16, seed=2).view(2, 5, k)
    y = w4a8_linear(x.to(DEV), p)
    assert y.shape == (2, 5, n)
    xq, sx = quantize_activations_ref(x.view(-1, k))
    assert_close(y.view(-1, n), w4a8_linear_ref(xq, sx, q, s, None, out_dtype=torch.float64))


def test_packed_and_int8_checkpoints_agree() -> None:
    n, k, g = 100, 2048, 128
    q, s = weights(n, k, g, seed=3)
    a = prepare_w4a8(pack_int4(q).to(DEV), s.to(DEV), g, packed=True)
    b = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.scales, b.scales)
    x = activations(7, k, torch.bfloat16, seed=4).to(DEV)
    assert torch.equal(w4a8_linear(x, a), w4a8_linear(x, b))


# --- the op in the settings vLLM runs it in ------------------------------------------------------------------

class _Linear(torch.nn.Module):
    def __init__(self, p, bias: torch.Tensor) -> None:
        super().__init__()
        self.p = p
        self.register_buffer("weight", p.weight)
        self.register_buffer("scales", p.scales)
        self.register_buffer("bias", bias)
        self.register_buffer("layer_id", ops.layer_tensor(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        y = torch.ops.anychip.w4a8_linear(x, self.weight, self.scales, self.bias, p.n, p.k, p.group_size,
                                          p.route.code, self.layer_id)
        return torch.nn.functional.silu(y) * 2


@pytest.mark.parametrize("residual", [False, True])
def test_direct_launches_are_the_jit_launches(monkeypatch, residual: bool) -> None:
    """direct.py launches the compiled kernels without Triton's JIT: checked (set_check), every direct launch first
    asks the JIT which kernel it would run and fails if that is not the one launched.  Token counts that change
    the integer specializations (1, divisible by 16 or not), an input whose rows start off the 16-byte alignment,
    and the fused-norm op: the bits equal the JIT's launches (set_enabled(False))."""
    from anychip.kernels.gpu import direct

    n, k, g = 576, 2048, 128
    q, s = weights(n, k, g, seed=11)
    p = prepare_w4a8(q.to(DEV), s.to(DEV).bfloat16(), g, packed=False)
    nw = (torch.rand(k) + 0.5).bfloat16().to(DEV)
    monkeypatch.setitem(direct._SETTINGS, "check", True)
    monkeypatch.setitem(direct._SETTINGS, "enabled", True)
    for m in (1, 3, 16, 17, 64, 512, 3, 1):  # repeats: the second launch of a specialization is direct
        base = activations(m, k + 8, torch.bfloat16, seed=m).to(DEV)
        # contiguous; a row stride not divisible by 16; rows starting off the 16-byte alignment
        for x in (activations(m, k, torch.bfloat16, seed=m).to(DEV), base[:, :k], base[:, 1:k + 1]):
            r = torch.randn(m, k, device=DEV, dtype=torch.bfloat16) if residual else None
            got = [OPS.w4a8_linear(x, p.weight, p.scales, None, n, k, g, p.route.code, None),
                   *OPS.w4a8_linear_norm(x, r, nw, 1e-5, p.weight, p.scales, None, n, k, g, p.route.code, None)]
            direct.set_enabled(False)
            want = [OPS.w4a8_linear(x, p.weight, p.scales, None, n, k, g, p.route.code, None),
                    *OPS.w4a8_linear_norm(x, r, nw, 1e-5, p.weight, p.scales, None, n, k, g, p.route.code, None)]
            direct.set_enabled(True)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    launched = {kernel.fn.__name__: len(d._entries) for kernel, d in launch._DIRECT.items()}
    assert launched.get("_w4a8_gemm_kernel") and launched.get("_pre_quantize_rows_kernel"), launched
    assert direct.check_enabled()


def test_direct_launches_call_launch_hooks(monkeypatch) -> None:
    """A profiler's launch hook (triton.knobs.runtime.launch_enter_hook) sees every launch, direct ones included,
    with the kernel's name, as under the JIT; without a hook the direct launch passes none."""
    from triton import knobs

    from anychip.kernels.gpu import direct

    n, k, g = 576, 2048, 128
    q, s = weights(n, k, g, seed=12)
    p = prepare_w4a8(q.to(DEV), s.to(DEV).bfloat16(), g, packed=False)
    x = activations(5, k, torch.bfloat16, seed=5).to(DEV)
    monkeypatch.setitem(direct._SETTINGS, "enabled", True)
    OPS.w4a8_linear(x, p.weight, p.scales, None, n, k, g, p.route.code, None)  # the JIT's launch, kept for later
    names: list[str] = []

    def hook(meta) -> None:
        names.append(meta["name"] if isinstance(meta, dict) else meta.get()["name"])  # Triton's LazyDict: get()

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton 3.6's HookChain
        chain.add(hook)
        undo = lambda: chain.remove(hook)  # noqa: E731
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
        undo = lambda: None  # noqa: E731
    try:
        for _ in range(3):
            OPS.w4a8_linear(x, p.weight, p.scales, None, n, k, g, p.route.code, None)
    finally:
        undo()
    torch.cuda.synchronize()
    assert len(names) >= 3 and all("_w4a8_" in nm or "quantize" in nm for nm in names), names


def test_torch_compile_fullgraph() -> None:
    n, k, g = 576, 1536, 64
    q, s = weights(n, k, g, seed=5)
    p = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False)
    module = _Linear(p, torch.randn(n, device=DEV, dtype=torch.bfloat16))
    compiled = torch.compile(module, fullgraph=True)
    calls = []
    with hooks.observing(lambda layer, tokens: calls.append((layer, tokens))):
        for m in (1, 7, 64):
            x = activations(m, k, torch.bfloat16, seed=m).to(DEV)
            torch.testing.assert_close(compiled(x), module(x))
    assert (3, 7) in calls  # the observer hook runs inside the compiled graph


@pytest.mark.parametrize("tuned_first", [True, False])
def test_cuda_graph_capture(tuned_first: bool) -> None:
    n, k, g = 17 if tuned_first else 100, 2048, 128
    q, s = weights(n, k, g, seed=6)
    p = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False)
    x = activations(3, k, torch.bfloat16, seed=7).to(DEV)
    if tuned_first:
        eager = w4a8_linear(x, p)  # tunes outside the capture
    else:  # compiled (as vLLM's warm-up runs do) but not tuned: the capture must not time configs
        xq, sx = OPS.quantize_act(x)
        default = launch.candidates(3, n, k, g, launch.multiprocessors(DEV))[0]
        launch.w4a8_linear_q(xq, sx, p.weight, p.scales, None, n, k, g, x.dtype, config=default)
        launch.clear_tuning()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = w4a8_linear(x, p)  # untuned: the default config, no timing inside a capture
    torch.cuda.current_stream().wait_stream(stream)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    xq, sx = quantize_activations_ref(x.cpu())
    assert_close(y, w4a8_linear_ref(xq, sx, q, s, None, out_dtype=torch.float64))
    if tuned_first:
        assert torch.equal(y, eager)


@pytest.mark.parametrize("split", [1, 4])
def test_pdl_chain_in_a_graph_is_the_plain_chain(split: int) -> None:
    """GEMVs back to back, each reading the one ahead's output and residual (norm inside, as vLLM's decode step
    chains them), split-K semaphores and scratch shared: launched as programmatic dependent launches (each starts
    while the one ahead finishes and waits for it before reading) they give the bits of plain launches, captured in
    a CUDA graph and replayed on fresh inputs, and the counter counts each replay once a launch."""
    if not launch.gemv_pdl(DEV):
        pytest.skip(f"{torch.cuda.get_device_name(DEV)}: no programmatic dependent launch (compute capability < 9.0)")
    n, k, g, links = 2048, 2048, 128, 12
    layers = []
    for i in range(links):
        q, s = weights(n, k, g, seed=40 + i)
        p = prepare_w4a8(q.to(DEV), s.to(DEV).bfloat16(), g, packed=False)
        layers.append((p.weight, p.scales))
    norm = torch.rand(k, generator=torch.Generator().manual_seed(3)).add(0.5).bfloat16().to(DEV)
    cfg = launch.GemvConfig(16, 512, split_k=split, fused=True)
    x = activations(1, k, torch.bfloat16, seed=41).to(DEV)
    r = activations(1, k, torch.bfloat16, seed=42).to(DEV)
    counter = new_counter(DEV)

    def chain():
        y, res = x, r
        for w, sw in layers:
            out = torch.empty_like(res)
            y = launch.w4a8_linear_pre(y, launch.Norm(norm, 1e-5, res, out), w, sw, None, n, k, g, config=cfg,
                                       counter=counter)
            res = out
        return y, res

    results = {}
    try:
        for pdl in (False, True):
            launch.set_pdl(pdl)
            assert launch.gemv_launch(cfg, n, k, g, x, *[None] * 9)[2].get("launch_pdl", False) is pdl
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                chain()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = chain()
            torch.cuda.current_stream().wait_stream(stream)
            got = []
            for seed in (43, 44, 45):
                x.copy_(activations(1, k, torch.bfloat16, seed=seed).to(DEV))
                graph.replay()
                got.append(tuple(t.clone() for t in outs))
            torch.cuda.synchronize()
            results[pdl] = got
    finally:
        launch.set_pdl(True)
    for plain, pdl in zip(results[False], results[True]):
        assert all(torch.equal(a, b) for a, b in zip(plain, pdl))
    assert counter.cell[0].tolist() == [2 * 4 * links, 2 * 4 * links]  # eager + 3 replays, PDL off and on
    assert not launch._locks(DEV).any()


def test_reference_route_and_wrong_route_on_cuda() -> None:
    n, k, g = 17, 576, 64
    q, s = weights(n, k, g, seed=8)
    x = activations(3, k, torch.float32, seed=9)
    ref = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False, route="reference")
    assert ref.route.kernel == "reference" and ref.weight.is_cuda
    xq, sx = quantize_activations_ref(x)
    assert_close(w4a8_linear(x.to(DEV), ref), w4a8_linear_ref(xq, sx, q, s, None, out_dtype=torch.float64))
    with pytest.raises(NoKernelRoute, match="CPU route"):
        OPS.w4a8_linear(x.to(DEV), ref.weight, ref.scales, None, n, k, g, routes.get("avx2").code, None)


def test_device_counter_counts_every_graph_replay() -> None:
    """The coverage counter is bumped by the GEMM launch itself: a CUDA graph captured once counts each replay
    (at the slot read at replay time), the capture counts nothing, and the tuner's timing launches count nothing."""
    n, k, g = 100, 2048, 128
    q, s = weights(n, k, g, seed=12)
    p = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False)
    counter = new_counter(DEV)
    x = activations(5, k, torch.bfloat16, seed=13).to(DEV)
    launch.clear_tuning()
    with hooks.observing(lambda layer, tokens: counter):
        w4a8_linear(x, p, layer_id=0)  # eager, tunes first: one count
        torch.cuda.synchronize()
        assert counter.cell.tolist() == [[1, 5], [0, 0], [0, 0]]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w4a8_linear(x, p, layer_id=0)
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert counter.cell.tolist() == [[1, 5], [0, 0], [0, 0]]  # captured, not run
    counter.slot.fill_(hooks.SLOTS.index("decode"))
    for _ in range(3):
        graph.replay()
    counter.slot.fill_(hooks.SLOTS.index("prefill"))
    graph.replay()
    torch.cuda.synchronize()
    assert counter.cell.tolist() == [[1, 5], [1, 5], [3, 15]]
    w4a8_linear(x, p)  # no observer: no count
    torch.cuda.synchronize()
    assert counter.cell.tolist() == [[1, 5], [1, 5], [3, 15]]


def test_tuning_at_load_is_cached_on_disk_and_calls_never_time(tmp_path, monkeypatch) -> None:
    """prepare (mode "load") decides every M bucket of the shape at load and writes the disk cache; a fresh process
    state reads it back without timing; a call of an untuned shape runs the default config, untimed."""
    from anychip.kernels.gpu import tuning
    from anychip.kernels.policy import KernelPolicy

    n, k, g = 48, 1024, 128
    q, s = weights(n, k, g, seed=21)
    launch.clear_tuning()
    policy = KernelPolicy(gpu_tuning="load", tuning_dir=tmp_path)
    p = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False, policy=policy)
    chosen = {b: launch.config_for(m, n, k, g, DEV) for b, m in tuning.BUCKETS}
    assert all(cfg is not None for cfg in chosen.values())
    doc = (tmp_path / f"{tuning.gpu_slug(DEV)}.json").read_text()
    assert all(tuning.entry_key(b, n, k, g) in doc for b, _ in tuning.BUCKETS)

    launch.clear_tuning()
    tuning._files.clear()
    monkeypatch.setattr(tuning, "_time_candidates", lambda *a: pytest.fail("timed a shape the cache knows"))
    prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False, policy=policy)
    assert {b: launch.config_for(m, n, k, g, DEV) for b, m in tuning.BUCKETS} == chosen

    launch.clear_tuning()
    x = activations(5, k, torch.bfloat16, seed=22).to(DEV)
    xq, sx = quantize_activations_ref(x.cpu())
    assert_close(w4a8_linear(x, p), w4a8_linear_ref(xq, sx, q, s, None, out_dtype=torch.float64))
    assert launch.config_for(5, n, k, g, DEV) is None  # the call used the default and tuned nothing


def test_precompile_leaves_no_compile_to_the_first_launches() -> None:
    """Once a shape's configs are settled, precompile.py compiles its launches in the background; the plugin's
    launches at M = 1, 2, 16, 24, 120, 128 (each bucket, each way Triton specializes M) then compile nothing."""
    from anychip.kernels.gpu import precompile, tuning
    from anychip.kernels.gpu import triton_w4a8 as kern
    from anychip.kernels.policy import KernelPolicy

    n, k, g = 272, 1280, 128  # a shape no other test launches
    q, s = weights(n, k, g, seed=23)
    launch.clear_tuning()
    p = prepare_w4a8(q.to(DEV), s.to(DEV), g, packed=False, policy=KernelPolicy(gpu_tuning="off",
                                                                                     gpu_precompile=4))
    assert precompile.drain(timeout=300)
    counter = new_counter(DEV)
    index = torch.cuda.current_device()
    kernels = (kern._w4a8_gemm_kernel, kern._w4a8_gemv_kernel, kern._quantize_rows_kernel,
               kern._quantize_words_kernel)
    caches = [kernel.device_caches[index][0] for kernel in kernels]
    before = [len(c) for c in caches]
    specs = precompile.gemm_specs(n, k, g, DEV, [b for b, _ in tuning.BUCKETS], p.scales.dtype)
    assert any(kernel is kern._w4a8_gemv_kernel for kernel, _ in specs)  # M = 1 is the GEMV's by default
    assert before[0] + before[1] >= len(specs)
    with hooks.observing(lambda layer, tokens: counter):
        for m in (1, 2, 16, 24, 120, 128):
            x = activations(m, k, torch.bfloat16, seed=m).to(DEV)
            y = w4a8_linear(x, p, layer_id=0)
            xq, sx = quantize_activations_ref(x.cpu())
            assert_close(y, w4a8_linear_ref(xq, sx, q, s, None, out_dtype=torch.float64))
    assert [len(c) for c in caches] == before, "a launch compiled a kernel the precompile should have made"
    assert precompile.submit(n, k, g, DEV, ["decode"], p.scales.dtype, 4) == 0  # once a shape
