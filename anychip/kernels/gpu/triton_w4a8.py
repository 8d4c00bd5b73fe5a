"""Triton kernels for W4A8: per-token INT8 activation quantization and the INT4-weight x INT8-activation GEMM.

    y[m, n] = sx[m] * sum_g sw[g, n] * sum_{k in g} xq[m, k] * w[n, k]  (+ bias[n])

Weights arrive in layout.py's layout: (N, K/2) int8, two two's-complement nibbles a byte. The main loop runs
one group of G input channels at a time: load (BM, G) int8 activations and (BN, G/2) packed bytes, widen each
nibble to an int8 holding 16 * w (`b << 4` and `b & 0xF0`: two integer ops a byte, no sign extension), one
INT8 x INT8 -> INT32 tensor-core dot (mma.sync m16n8k32 for small tiles, wgmma on Hopper for 64+ rows),
then acc += float(dot) * (sw / 16): exact, since dot = 16 * the group sum and both 16 and the int32 -> fp32
conversion are exact (|16 * group sum| <= 16 * 128 * 127 * 8 < 2^24).
"""

from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, SPLIT: tl.constexpr = 0):
    """One program per token: sx = amax / 127, q = rint(x / sx), both IEEE round-to-nearest-even like torch.
    SPLIT = G: each group's columns stored even ones first, then odd ones (the Gluon GEMM's order)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    _quantize_row(x_row, x_row, x_row, x_row, q_ptr + row * stride_q, s_ptr + row, K, 0.0, False, BLOCK, 0, SPLIT)


@triton.jit
def _quantize_row(x_row, r_row, rout_row, nw_ptr, q_row, s_at, K, eps, write, BLOCK: tl.constexpr,
                  PRE: tl.constexpr, SPLIT: tl.constexpr = 0):
    """One token's INT8 row at q_row and its scale at s_at: of the row itself (PRE 0), or of what vLLM computes
    ahead of a linear (_pre_values, PRE 1-3; PRE 2 and `write`: the new residual stored at rout_row).  SPLIT = G:
    column k of a group stored at (k even) k / 2, (k odd) G / 2 + k // 2 of it (gluon_w4a8.split_groups)."""
    rstd, scale, safe = _pre_stats(x_row, r_row, rout_row, nw_ptr, K, eps, write, BLOCK, PRE)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        v = _pre_values(x_row, r_row, nw_ptr, offs, K, rstd, PRE)
        if SPLIT:
            dst = offs - offs % SPLIT + (offs % 2) * (SPLIT // 2) + (offs % SPLIT) // 2
        else:
            dst = offs
        tl.store(q_row + dst, _round_q(v, safe).to(tl.int8), mask=offs < K)
    tl.store(s_at, scale)


@triton.jit
def _row_scale(x_row, K, BLOCK: tl.constexpr):
    """(scale, safe) of one token's row of K: scale = amax / 127 (IEEE division), safe = scale, or 1 for a zero
    row (whose q are then 0)."""
    _, scale, safe = _pre_stats(x_row, x_row, x_row, x_row, K, 0.0, False, BLOCK, 0)
    return scale, safe


@triton.jit
def _scale_of(amax):
    """(scale, safe) of a token whose largest |x| is amax (_amax: NaN when the row holds one): scale = amax / 127
    (IEEE division), safe = scale, or 1 for a zero row (whose q are then 0). A row holding NaN or inf gets a NaN
    scale, so each of its outputs is NaN, as the reference's (its NaN or inf scale makes every product NaN) rather
    than finite values from codes clamped to -127."""
    scale = tl.math.div_rn(amax, 127.0)
    scale = tl.where(scale < float("inf"), scale, float("nan"))  # NaN compares false: NaN stays NaN
    # safe: inf for a NaN scale, so that every q of the row is 0 (_round_q makes NaN quotients 0), as the reference
    return scale, tl.where(scale > 0.0, scale, tl.where(scale == scale, 1.0, float("inf")))


@triton.jit
def _max_nan(a, b):
    """max that keeps NaN (tl.maximum's default, maxNum, drops it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax(v):
    """The largest of fp32 v's magnitudes, NaN when one is NaN."""
    return tl.reduce(tl.abs(v), 0, _max_nan)


@triton.jit
def _round_q(v, safe):
    """rint(v / safe) clamped to [-127, 127] (NaN to 0), as fp32 (v fp32).  Plain `/` is div.full.f32 (not correctly
    rounded); adding and removing 1.5 * 2^23 rounds |v| < 2^22 to an integer, half to even, in IEEE fp32
    arithmetic (libdevice.rint would too, but not interpreted)."""
    q = (tl.math.div_rn(v, safe) + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(tl.where(q == q, q, 0.0), -127.0), 127.0)


@triton.jit
def _group_dot16(x_ptrs, w_ptrs, x_mask, w_mask, BN: tl.constexpr, G: tl.constexpr, SWAP: tl.constexpr,
                 ASM: tl.constexpr, CAT: tl.constexpr = False):
    """16 x one group's integer dot products: (BM, BN) int32, or (BN, BM) when SWAP (weights as the MMA's A).
    CAT: the group's activations are in split order (gluon_w4a8.split_groups: even columns, then odd), so the
    weight tile is the low nibbles' half then the high ones' (no byte interleaving); the same integer sums."""
    x = tl.load(x_ptrs, mask=x_mask, other=0)  # (BM, G) int8
    wp = tl.load(w_ptrs, mask=w_mask, other=0)  # (BN, G/2) int8, two nibbles a byte
    lo, hi = _widen_nibbles(wp, ASM)
    if CAT:
        w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BN, G))  # (BN, G): k = 2b for b < G/2, then 2b + 1
    else:
        w = tl.reshape(tl.join(lo, hi), (BN, G))  # (BN, G), k = 2b + {0, 1}
    if SWAP:
        d = tl.dot(w, tl.trans(x), out_dtype=tl.int32)
    else:
        d = tl.dot(x, tl.trans(w), out_dtype=tl.int32)
    return d


@triton.jit
def _widen_nibbles(wp, ASM: tl.constexpr):
    """(16 * low nibble, 16 * high nibble) of every int8 byte of wp, each as an int8: `b << 4` and `b & 0xF0`.
    ASM (compiled): on four bytes a register at once (shl + and, and one and), where the int8 operators compile
    to a byte extract, mask and re-pack per byte (the main loop's largest instruction count); both are bytewise,
    so the result does not depend on which bytes the compiler packs together."""
    if ASM:
        lo = tl.inline_asm_elementwise("{ .reg .b32 t; shl.b32 t, $1, 4; and.b32 $0, t, 0xF0F0F0F0; }", "=r,r",
                                       [wp], dtype=tl.int8, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise("and.b32 $0, $1, 0xF0F0F0F0;", "=r,r", [wp], dtype=tl.int8, is_pure=True,
                                       pack=4)
    else:
        lo = wp << 4  # int8 arithmetic: the scalar does not widen the type
        hi = wp & -16
    return lo, hi


@triton.jit
def _w4a8_gemm_kernel(
    x_ptr, sx_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, count_ptr, slot_ptr,
    M, N, K, stride_xm, stride_om, stride_split,
    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, COUNT: tl.constexpr,
    PIPE: tl.constexpr = False, ASM: tl.constexpr = False, FCVT: tl.constexpr = False, CAT: tl.constexpr = False,
):
    """out (M, N) = the W4A8 linear.  SPLIT_K > 1: part (SPLIT_K, M, N) fp32 scratch, lock (>= tiles) int32 zeros.
    COUNT: count (slots, 2) int64 [calls, rows] of this layer, bumped at slot[0] by one program (hooks.py).
    PIPE: rescale group g-1's integer sums while group g's dot runs (the dot's result
    is first read one step later, so the tensor cores need not wait for the rescale); the fp32 sum adds the
    same terms in the same order, so the result is the same bits.  FCVT: _rescale_add's conversion without I2F
    (same bits).  ASM: widen nibbles with inline PTX (compiled only; the interpreter runs the int8 operators).
    CAT: x holds each group's columns in split order (quantize_act(x, split=G)); see _group_dot16."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    if COUNT:
        if (pid == 0) & (pid_k == 0):  # once a launch, so a CUDA-graph replay counts too
            at = count_ptr + tl.load(slot_ptr).to(tl.int64) * 2
            tl.atomic_add(at, 1)
            tl.atomic_add(at + 1, tl.cast(M, tl.int64))
    pid_m, pid_n = _tile_of(pid, M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N

    groups = K // G
    per_split = tl.cdiv(groups, SPLIT_K)
    g_begin = pid_k * per_split
    g_end = tl.minimum(g_begin + per_split, groups)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + tl.arange(0, G)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * (K // 2) + tl.arange(0, G // 2)[None, :]
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    if PIPE:
        d_prev = tl.zeros(acc.shape, dtype=tl.int32)
        s_prev = tl.zeros((BN,), dtype=tl.float32)
    for g0 in range(g_begin, g_end, BK // G):
        for j in tl.static_range(BK // G):
            g = g0 + j
            if BK == G:  # one group a step: always inside the split, masks loop-invariant
                x_mask = mask_m[:, None]
                w_mask = mask_n[:, None]
                s_mask = mask_n
            else:
                # a (1,) block rather than a scalar: the interpreter (TRITON_INTERPRET=1, Triton 3.9) types a
                # scalar comparison as int32 and then refuses it as a load mask; compiled: a uniform predicate
                live = tl.full((1,), g, tl.int32) < g_end
                x_mask = mask_m[:, None] & live[None, :]
                w_mask = mask_n[:, None] & live[None, :]
                s_mask = mask_n & live
            d = _group_dot16(x_ptrs + g * G, w_ptrs + g * (G // 2), x_mask, w_mask, BN, G, SWAP, ASM, CAT)
            s = tl.load(s_ptr + g * N + offs_n, mask=s_mask, other=0.0).to(tl.float32) * 0.0625
            if PIPE:
                acc = _rescale_add(acc, d_prev, s_prev, SWAP, FCVT)
                d_prev = d
                s_prev = s
            else:
                acc = _rescale_add(acc, d, s, SWAP, FCVT)
    if PIPE:
        acc = _rescale_add(acc, d_prev, s_prev, SWAP, FCVT)
    if SWAP:
        acc = tl.trans(acc)

    if SPLIT_K == 1:
        _epilogue(acc, offs_m, offs_n, mask_m, mask_n, sx_ptr, bias_ptr, out_ptr, stride_om, HAS_BIAS)
    else:
        offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        total, last = _split_k_sum(acc, part_ptr, lock_ptr + pid, pid_k.to(tl.int64) * stride_split, stride_split,
                                   offs, mask_m[:, None] & mask_n[None, :], SPLIT_K)
        if last:
            _epilogue(total, offs_m, offs_n, mask_m, mask_n, sx_ptr, bias_ptr, out_ptr, stride_om, HAS_BIAS)


@triton.jit
def _tile_of(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid`: GROUP_M row tiles sweep the columns together, so a weight tile
    is reused from L2."""
    grid_m = tl.cdiv(M, BM)
    width = GROUP_M * tl.cdiv(N, BN)
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.jit
def _split_k_sum(acc, part_ptr, lock, at, stride_split, offs, mask, SPLIT_K: tl.constexpr):
    """Split-K, the GEMM's and the GEMV's: each split stores its fp32 partial at part + at + offs; the last to
    arrive at the tile's semaphore `lock` sums all of them in split order (deterministic) and re-arms the
    semaphore for the next launch.  Returns (the sum, whether this program is the last, which writes it)."""
    tl.store(part_ptr + at + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the release below
    arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = tl.zeros(acc.shape, dtype=tl.float32)
    if last:
        for s in tl.static_range(SPLIT_K):
            total += tl.load(part_ptr + s * stride_split + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(lock, 0)
    return total, last


@triton.jit
def _rescale_add(acc, d, s, SWAP: tl.constexpr, FCVT: tl.constexpr = False):
    """acc + float(d) * s, s along the weight (N) side of the tile.  FCVT: float(d) as
    bits(d + bits(1.5 * 2^23)) - 1.5 * 2^23, an integer add and an exact fp32 subtraction (|d| < 2^22) instead of
    the int32 -> fp32 conversion, which NVIDIA's throughput tables put at a quarter of the FMA rate or less."""
    if FCVT:
        f = (d + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    else:
        f = d.to(tl.float32)
    if SWAP:
        return acc + f * s[:, None]
    else:
        return acc + f * s[None, :]


@triton.jit
def _epilogue(acc, offs_m, offs_n, mask_m, mask_n, sx_ptr, bias_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr):
    """out[m, n] = sx[m] * acc[m, n] (+ bias[n]) in out's dtype."""
    y = acc * tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _group_dots_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm,
    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr,
):
    """Debug: out (M, N, K/G) int32 = the exact per-group sums, through the GEMM's own _group_dot16."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    g = tl.program_id(2)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + g * G + tl.arange(0, G)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * (K // 2) + g * (G // 2) + tl.arange(0, G // 2)[None, :]
    d = _group_dot16(x_ptrs, w_ptrs, mask_m[:, None], mask_n[:, None], BN, G, SWAP, ASM) >> 4
    if SWAP:
        d = tl.trans(d)
    groups = K // G
    out_ptrs = out_ptr + (offs_m[:, None].to(tl.int64) * N + offs_n[None, :]) * groups + g
    tl.store(out_ptrs, d, mask=mask_m[:, None] & mask_n[None, :])


# --- batch one: a GEMV on the CUDA cores, on activations packed into words ------------------------------------------

@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + the dot product of a's and b's four signed bytes, elementwise over int32 tensors of one shape: one
    dp4a instruction a word when ASM (compiled), the same sum spelled out in shifts otherwise (the interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        for i in tl.static_range(4):
            c += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return c


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _pack_words(x_ptr, offs, K, safe, W: tl.constexpr):
    """The 8W channels `offs` of a token (8W contiguous, from a multiple of 8), quantized with the scale `safe`
    exactly as _quantize_rows_kernel does, as two (W,) int32 tensors of words: word j of the first holds
    k = 8j + {0, 2, 4, 6} in bytes 0..3, of the second k = 8j + {1, 3, 5, 7}: the channels a weight word's low and
    high nibbles hold.  Contiguous (coalesced) loads; the bytes are placed by shifts and joined by an OR."""
    return _pack_values(_pre_values(x_ptr, x_ptr, x_ptr, offs, K, 1.0, 0), safe, W)


@triton.jit
def _pack_values(v, safe, W: tl.constexpr):
    """_pack_words of 8W channels' fp32 values already in registers."""
    q = _round_q(v, safe).to(tl.int32) & 255
    even, odd = tl.split(tl.reshape(q, (W, 4, 2)))  # [j, b] = k 8j + 2b (+ 1)
    shifts = (8 * tl.arange(0, 4))[None, :]
    return tl.reduce(even << shifts, 1, _or), tl.reduce(odd << shifts, 1, _or)


@triton.jit
def _quantize_words_kernel(x_ptr, xw_ptr, s_ptr, K, words, stride_x, BLOCK: tl.constexpr, WBLOCK: tl.constexpr,
                           ONE_PASS: tl.constexpr):
    """One program per token: the same scale and INT8 values as _quantize_rows_kernel, written as the GEMV reads
    them: xw (M, 2, K/8) int32, [even channels' words, odd channels' words] (see _pack_words).  ONE_PASS
    (8 * WBLOCK >= K): the row is read once, for its scale and its words."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out = xw_ptr + row * 2 * words
    if ONE_PASS:
        offs = tl.arange(0, 8 * WBLOCK)
        scale, safe = _scale_of(_amax(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
        offs_w = tl.arange(0, WBLOCK)
        even, odd = _pack_words(x_row, offs, K, safe, WBLOCK)  # the same addresses: served from L1
        tl.store(out + offs_w, even, mask=offs_w < words)
        tl.store(out + words + offs_w, odd, mask=offs_w < words)
    else:
        scale, safe = _row_scale(x_row, K, BLOCK)
        for w0 in range(0, words, WBLOCK):
            offs_w = w0 + tl.arange(0, WBLOCK)
            even, odd = _pack_words(x_row, w0 * 8 + tl.arange(0, 8 * WBLOCK), K, safe, WBLOCK)
            tl.store(out + offs_w, even, mask=offs_w < words)
            tl.store(out + words + offs_w, odd, mask=offs_w < words)
    tl.store(s_ptr + row, scale)


@triton.jit
def _pre_values(x_row, r_row, nw_ptr, offs, K, rstd, PRE: tl.constexpr):
    """fp32 values (in x's dtype) at channels offs of what vLLM computes ahead of a linear, as a W4A8 kernel
    computes it inside (PRE): 0 nothing (x itself); 1 rms_norm, 2 fused_add_rms_norm, as vLLM's IR ops define them:
    h = x (+ r) in fp32, y = ((h * rstd) as the weight's dtype) * weight, in x's dtype (the weight's dtype must be
    x's: the fusion pass checks); 3 SiluAndMul of a row of 2K: silu(x[k]) in fp32, rounded to x's dtype, times
    x[K + k], rounded."""
    mask = offs < K
    if PRE == 0:
        return tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    elif PRE == 3:
        g = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + K + offs, mask=mask, other=0.0).to(tl.float32)
        silu = tl.math.div_rn(g, 1.0 + tl.exp(-g))
        return _rounded(_rounded(silu, x_row.dtype.element_ty) * u, x_row.dtype.element_ty)
    else:
        h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if PRE == 2:
            h += tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + offs, mask=mask, other=0.0)
        y = _rounded(h * rstd, w.dtype) * w.to(tl.float32)
        return _rounded(y, x_row.dtype.element_ty)


@triton.jit
def _rounded(v, dtype: tl.constexpr):
    """fp32 v rounded to `dtype` (nearest, ties to even) and back to fp32. bf16 by integer arithmetic on the bits:
    compiled, `.to(tl.bfloat16)` rounds to nearest, but the interpreter truncates (Triton 3.9)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # finite v: ties to even
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))  # the GPU's NaN 0x7FFFFFFF would carry to -0
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _pre_stats(x_row, r_row, rout_row, nw_ptr, K, eps, write, XBLOCK: tl.constexpr, PRE: tl.constexpr):
    """(rstd, scale, safe) of one token: for a norm (PRE 1, 2) rstd = rsqrt(mean(h^2) + eps) over fp32 h = x (+ r)
    (PRE 2 and `write`, a runtime predicate: also the new residual h, rounded to x's dtype, stored at rout_row);
    then the INT8 scale of _pre_values' output: scale = amax / 127 (IEEE division), safe = scale, or 1 for a zero
    row (whose q are then 0)."""
    rstd = tl.full((), 1.0, tl.float32)  # unused without a norm (PRE 0, 3)
    if PRE == 1 or PRE == 2:
        sq = tl.zeros([XBLOCK], tl.float32)
        for k0 in range(0, K, XBLOCK):
            offs = k0 + tl.arange(0, XBLOCK)
            h = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            if PRE == 2:
                h += tl.load(r_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                if write:
                    tl.store(rout_row + offs, _rounded(h, rout_row.dtype.element_ty).to(rout_row.dtype.element_ty),
                             mask=offs < K)
            sq += h * h
        mean = tl.math.div_rn(tl.sum(sq, axis=0), K.to(tl.float32))
        rstd = tl.math.rsqrt(mean + eps)
    amax = tl.zeros([XBLOCK], tl.float32)
    for k0 in range(0, K, XBLOCK):
        v = _pre_values(x_row, r_row, nw_ptr, k0 + tl.arange(0, XBLOCK), K, rstd, PRE)
        amax = tl.maximum(amax, tl.abs(v), propagate_nan=tl.PropagateNan.ALL)
    scale, safe = _scale_of(_amax(amax))
    return rstd, scale, safe


@triton.jit
def _pre_quantize_rows_kernel(x_ptr, r_ptr, nw_ptr, rout_ptr, q_ptr, s_ptr, K, eps, stride_x, stride_r, stride_ro,
                              stride_q, BLOCK: tl.constexpr, PRE: tl.constexpr, SPLIT: tl.constexpr = 0):
    """One program per token: what vLLM computes ahead of a linear (_pre_values: its RMSNorm, writing the new
    residual to rout for PRE 2, or SiluAndMul), quantized per token as _quantize_rows_kernel quantizes a row: the
    W4A8 linear's INT8 input in one pass over the activations instead of vLLM's kernel's and the quantization's."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if PRE == 2:
        r_row = r_ptr + row * stride_r
        rout_row = rout_ptr + row * stride_ro
    else:
        r_row = r_ptr
        rout_row = rout_ptr
    _quantize_row(x_row, r_row, rout_row, nw_ptr, q_ptr + row * stride_q, s_ptr + row, K, eps, row >= 0, BLOCK, PRE,
                  SPLIT)


@triton.jit
def _w4a8_gemv_kernel(
    xw_ptr, sx_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, count_ptr, slot_ptr,
    N, K, words, r_ptr, nw_ptr, rout_ptr, eps,
    G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    COUNT: tl.constexpr, ASM: tl.constexpr, FUSED: tl.constexpr = False, XBLOCK: tl.constexpr = 0,
    AHEAD: tl.constexpr = 1, PRE: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """out (1, N) = the W4A8 linear of one token, on the CUDA cores: the weights as int32 words of eight nibbles,
    each word's low and high nibbles widened in place to bytes holding 16 * w (two integer ops a word), then one
    dp4a each against four INT8 activations; the words of a group summed exactly in INT32, rescaled in fp32. A step
    (BK channels) is one (BN, BK/8) block of words, and the next step's block is loaded while this one computes.
    xw (2, K/8) int32: the token's INT8 activations as _quantize_words_kernel packs them, sx (1,) its scale.
    w (N, K/8) int32: layout.py's bytes read as little-endian words; words = K / 8, an argument of its own so that
    Triton sees its divisibility (16-byte row starts: vector loads). SPLIT_K > 1: part (SPLIT_K, N) fp32 scratch
    and lock (>= N/BN) int32 zeros, as in _w4a8_gemm_kernel.
    FUSED: xw is the token's (1, K) float row itself and sx is unused: every program takes the row's amax (blocks of
    XBLOCK channels; one block when XBLOCK >= K) and packs each group's words as it goes, with _quantize_words_kernel's
    scale and rounding (the same bits), so batch one is one launch instead of two.
    AHEAD (1 or 2): main-loop steps whose weight words are in flight beyond the one being computed; 2 suits
    programs that walk many steps (fewer, longer programs).
    PRE (FUSED only; 1: rms_norm, 2: fused_add_rms_norm, 3: SiluAndMul): xw is the input of what vLLM computes ahead
    of the linear: the norm's x, with r the residual (PRE 2) and nw the norm's weight, or SiluAndMul's row of 2K.
    Every program computes it (_pre_values) as it packs, so it is no launch of its own; program (0, 0) writes the
    new residual x + r to rout (PRE 2).
    PDL (compiled, sm_90+, launched with launch_pdl): programmatic dependent launch. The next kernel, when it is
    launched so too, may start as soon as every program here has begun (launch_dependents, first thing); each
    program requests its first steps' weight words, which no kernel writes, then waits for the kernel ahead of it
    to have finished and flushed (griddepcontrol.wait) before it reads or writes anything else: the token, the
    residual, the counters, the split-K scratch and semaphores, the output. So a GEMV behind another one streams
    its first weights while that one finishes, instead of after."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    groups = K // G
    steps = tl.cdiv(K, BK)
    per_split = tl.cdiv(steps, SPLIT_K)
    s_begin = pid_k * per_split
    s_end = tl.minimum(s_begin + per_split, steps)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * words
    W: tl.constexpr = BK // 8  # weight words a step
    NG: tl.constexpr = BK // G  # groups a step
    # the first step's weights are requested before the activations' amax: their HBM latency overlaps it
    w = _gemv_step_words(rows, s_begin, s_end, words, mask_n, W)
    if AHEAD == 2:
        w_after = _gemv_step_words(rows, s_begin + 1, s_end, words, mask_n, W)
    if PDL:  # nothing but the weights before the kernel ahead has finished
        tl.extra.cuda.gdc_wait()
    if COUNT:
        if (pid_n == 0) & (pid_k == 0):
            at = count_ptr + tl.load(slot_ptr).to(tl.int64) * 2
            tl.atomic_add(at, 1)
            tl.atomic_add(at + 1, 1)
    if FUSED:  # PRE 0: the token's row itself
        rstd, scale, safe = _pre_stats(xw_ptr, r_ptr, rout_ptr, nw_ptr, K, eps, (pid_n == 0) & (pid_k == 0),
                                       XBLOCK, PRE)
    acc = tl.zeros((BN,), dtype=tl.float32)
    for st in range(s_begin, s_end):
        if AHEAD == 2:  # two steps in flight while this one computes
            w_next = w_after
            w_after = _gemv_step_words(rows, st + 2, s_end, words, mask_n, W)
        else:
            w_next = _gemv_step_words(rows, st + 1, s_end, words, mask_n, W)  # in flight while this step computes
        if FUSED:  # the step's channels of the row, or of the norm's or SiluAndMul's output, packed (from L1/L2)
            xe, xo = _pack_values(_pre_values(xw_ptr, r_ptr, nw_ptr, st * BK + tl.arange(0, BK), K, rstd, PRE),
                                  safe, W)
        else:
            offs_w = st * W + tl.arange(0, W)
            xe = tl.load(xw_ptr + offs_w, mask=offs_w < words, other=0)
            xo = tl.load(xw_ptr + words + offs_w, mask=offs_w < words, other=0)
        lo = (w << 4) & -252645136  # 0xF0F0F0F0: bytes 16 * w[8j + 2b]
        hi = w & -252645136  # bytes 16 * w[8j + 2b + 1]
        zero = tl.zeros(w.shape, tl.int32)
        d = _dp4a(lo, tl.broadcast_to(xe[None, :], w.shape),
                  _dp4a(hi, tl.broadcast_to(xo[None, :], w.shape), zero, ASM), ASM)  # (BN, W): 16 * a word's sum
        dg = tl.sum(tl.reshape(d, (BN, NG, G // 8)), axis=2)  # (BN, NG): 16 * the group sums, exact in INT32
        offs_g = st * NG + tl.arange(0, NG)
        s = tl.load(s_ptr + offs_g[None, :] * N + offs_n[:, None], mask=mask_n[:, None] & (offs_g < groups)[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(dg.to(tl.float32) * (s * 0.0625), axis=1)  # |16 * group sum| < 2^24: exact in fp32
        w = w_next
    if not FUSED:
        scale = tl.load(sx_ptr)
    if SPLIT_K == 1:
        _gemv_epilogue(acc, offs_n, mask_n, scale, bias_ptr, out_ptr, HAS_BIAS)
    else:
        total, last = _split_k_sum(acc, part_ptr, lock_ptr + pid_n, pid_k * N, N, offs_n, mask_n, SPLIT_K)
        if last:
            _gemv_epilogue(total, offs_n, mask_n, scale, bias_ptr, out_ptr, HAS_BIAS)


@triton.jit
def _gemv_step_words(rows, st, s_end, words, mask_n, W: tl.constexpr):
    """(BN, W) int32: the weight words of main-loop step `st`, zeros (no memory traffic) once st >= s_end."""
    offs_w = st * W + tl.arange(0, W)
    live = tl.full((1,), st, tl.int32) < s_end  # (1,): see _w4a8_gemm_kernel
    return tl.load(rows + offs_w[None, :], mask=mask_n[:, None] & (offs_w < words)[None, :] & live[None, :], other=0)


@triton.jit
def _gemv_epilogue(acc, offs_n, mask_n, scale, bias_ptr, out_ptr, HAS_BIAS: tl.constexpr):
    y = acc * scale
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)
