"""Session 41: where the Gluon W4A8 GEMM loses to the shipped Triton tile (session 41's first run, H100: 1.3-1.9x
slower, same bits). A copy of `gluon_w4a8._w4a8_wgmma_kernel` with knobs, timed beside the shipped kernel and the
shipped Triton GEMM in one process:
  WTMA     the packed weights come through TMA into the activations' stage ring (and are read from shared memory),
           instead of a register load one group ahead
  RESCALE  0: the group sums are not rescaled (wrong results; timing only: the tensor cores' share)
  WIDEN    0: the B tiles are not rewritten per group (wrong results; timing only: the widening's share)
python docs/gpu-runs/session41/gluon_diag.py OUT.json   (PYTHONPATH=$PWD; no vLLM needed)
"""
import sys
from dataclasses import replace
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from anychip.kernels.gpu import gluon_w4a8 as gw
from anychip.kernels.gpu import launch

sys.path.insert(0, str(Path(__file__).parent))
import ab  # noqa: E402
import triton_split  # noqa: E402

_tma_load, _cta_barrier = gw._tma_load, gw._cta_barrier


@gluon.jit
def _step(g, d_prev, s_prev, spare, acc, wp, a_desc, w_desc, a_lo, a_hi, w_s, b_lo, b_hi, bars, w_ptrs, s_ptr,
          offs_on, off_m, off_n, N, groups, padded, G: gl.constexpr, STAGES: gl.constexpr, FIRST: gl.constexpr,
          WTMA: gl.constexpr, RESCALE: gl.constexpr, WIDEN: gl.constexpr, w_layout: gl.constexpr):
    HALF: gl.constexpr = G // 2
    bs = g % 3
    st = g % STAGES
    if WTMA:
        mbarrier.wait(bars.index(st), (g // STAGES) & 1)
        wp = w_s.index(st).load(w_layout)
    if WIDEN:
        lo, hi = gw._widen(wp, True)
        b_lo.index(bs).store(lo)
        b_hi.index(bs).store(hi)
        fence_async_shared()
    _cta_barrier()
    refill = g + STAGES - 2
    live = (g >= 2) & (refill < padded)
    rs = refill % STAGES
    if WTMA:
        mbarrier.expect(bars.index(rs), 2 * a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=live)
        _tma_load(w_desc, [off_n, refill * HALF], bars.index(rs), w_s.index(rs), pred=live)
    else:
        mbarrier.expect(bars.index(rs), 2 * a_desc.block_type.nbytes, pred=live)
    _tma_load(a_desc, [off_m, refill * G], bars.index(rs), a_lo.index(rs), pred=live)
    _tma_load(a_desc, [off_m, refill * G + HALF], bars.index(rs), a_hi.index(rs), pred=live)
    if not WTMA:
        wp = gl.load(w_ptrs + gl.minimum(g + 1, groups - 1) * HALF)
    s = gw._scales(s_ptr, offs_on, g, groups, N)
    if not WTMA:
        mbarrier.wait(bars.index(st), (g // STAGES) & 1)
    d = warpgroup_mma(a_lo.index(st), b_lo.index(bs).permute((1, 0)), spare, use_acc=False, is_async=True)
    d = warpgroup_mma(a_hi.index(st), b_hi.index(bs).permute((1, 0)), d, is_async=True)
    done = warpgroup_mma_wait(num_outstanding=2, deps=(d_prev,))
    if RESCALE:
        if not FIRST:
            acc = gw._rescale(acc, done, s_prev)
    acc = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=gl.float32, is_pure=False, pack=1)
    return d, s, done, acc, wp


@gluon.jit
def _kernel(a_desc, w_desc, w_ptr, s_ptr, sx_ptr, out_ptr, M, N, K, stride_om, G: gl.constexpr, BM: gl.constexpr,
            BN: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, UNROLL: gl.constexpr,
            WTMA: gl.constexpr, RESCALE: gl.constexpr, WIDEN: gl.constexpr, num_warps: gl.constexpr):
    HALF: gl.constexpr = G // 2
    B_STAGES: gl.constexpr = 3
    pid = gl.program_id(0)
    off_m, off_n = gw._tile_offsets(pid, M, N, BM, BN, GROUP_M)
    WM: gl.constexpr = num_warps if BM >= 16 * num_warps else 4
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, num_warps // WM],
                                                  instr_shape=[16, BN // (num_warps // WM), 32])
    b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=HALF, element_bitwidth=8, rank=2)
    w_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // HALF, HALF // 16], [num_warps, 1], [1, 0])
    a_lo = gl.allocate_shared_memory(gl.int8, [STAGES, BM, HALF], a_desc.layout)
    a_hi = gl.allocate_shared_memory(gl.int8, [STAGES, BM, HALF], a_desc.layout)
    w_s = gl.allocate_shared_memory(gl.int8, [STAGES if WTMA else 1, BN, HALF], w_desc.layout)
    b_lo = gl.allocate_shared_memory(gl.int8, [B_STAGES, BN, HALF], b_layout)
    b_hi = gl.allocate_shared_memory(gl.int8, [B_STAGES, BN, HALF], b_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    groups = K // G
    padded = gl.cdiv(groups, UNROLL) * UNROLL
    for i in gl.static_range(STAGES):
        live = i < padded
        if WTMA:
            mbarrier.expect(bars.index(i), 2 * a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=live)
            _tma_load(w_desc, [off_n, i * HALF], bars.index(i), w_s.index(i), pred=live)
        else:
            mbarrier.expect(bars.index(i), 2 * a_desc.block_type.nbytes, pred=live)
        _tma_load(a_desc, [off_m, i * G], bars.index(i), a_lo.index(i), pred=live)
        _tma_load(a_desc, [off_m, i * G + HALF], bars.index(i), a_hi.index(i), pred=live)
    offs_wn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, w_layout))
    offs_wk = gl.arange(0, HALF, layout=gl.SliceLayout(0, w_layout))
    w_ptrs = w_ptr + gl.minimum(offs_wn, N - 1)[:, None].to(gl.int64) * (K // 2) + offs_wk[None, :]
    offs_on = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    mask_on = offs_on < N
    if WTMA:
        wp = gl.zeros([BN, HALF], gl.int8, w_layout)
    else:
        wp = gl.load(w_ptrs)
    if not WIDEN:  # the B tiles written once (timing variant)
        for i in gl.static_range(B_STAGES):
            b_lo.index(i).store(wp)
            b_hi.index(i).store(wp)
        fence_async_shared()
    acc = gl.zeros([BM, BN], gl.float32, mma)
    spare = gl.zeros([BM, BN], gl.int32, mma)
    for c in range(0, padded, UNROLL):
        d_b = warpgroup_mma_init(gl.zeros([BM, BN], gl.int32, mma))
        s_b = gl.zeros([BN], s_ptr.dtype.element_ty, gl.SliceLayout(0, mma))
        for j in gl.static_range(0, UNROLL, 2):
            d_a, s_a, spare, acc, wp = _step(c + j, d_b, s_b, spare, acc, wp, a_desc, w_desc, a_lo, a_hi, w_s, b_lo,
                                             b_hi, bars, w_ptrs, s_ptr, offs_on, off_m, off_n, N, groups, padded, G,
                                             STAGES, j == 0, WTMA, RESCALE, WIDEN, w_layout)
            d_b, s_b, spare, acc, wp = _step(c + j + 1, d_a, s_a, spare, acc, wp, a_desc, w_desc, a_lo, a_hi, w_s,
                                             b_lo, b_hi, bars, w_ptrs, s_ptr, offs_on, off_m, off_n, N, groups,
                                             padded, G, STAGES, False, WTMA, RESCALE, WIDEN, w_layout)
        done = warpgroup_mma_wait(num_outstanding=0, deps=(d_b,))
        if RESCALE:
            acc = gw._rescale(acc, done, s_b)
        else:
            acc += done.to(gl.float32)
        acc = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=gl.float32, is_pure=False, pack=1)
        spare = done
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    mask_m = offs_m < M
    y = acc * gl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    out_ptrs = out_ptr + offs_m[:, None].to(gl.int64) * stride_om + offs_on[None, :]
    gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_on[None, :])


def run(xs, sx, weight, scales, n, kk, g, out, bm=128, bn=64, warps=8, stages=4, unroll=8, wtma=True, rescale=True,
        widen=True):
    half = g // 2
    a_l = gl.NVMMASharedLayout(swizzle_byte_width=half, element_bitwidth=8, rank=2)
    a_desc = TensorDescriptor(xs, list(xs.shape), [kk, 1], [bm, half], a_l)
    w_desc = TensorDescriptor(weight, list(weight.shape), [kk // 2, 1], [bn, half], a_l)
    m = xs.shape[0]
    grid = (-(-m // bm) * -(-n // bn),)
    return _kernel[grid](a_desc, w_desc, weight, scales, sx, out, m, n, kk, out.stride(0), G=g, BM=bm, BN=bn,
                         STAGES=stages, GROUP_M=8, UNROLL=min(unroll, kk // g + (kk // g) % 2), WTMA=wtma,
                         RESCALE=rescale, WIDEN=widen, num_warps=warps)


VARIANTS = {
    "base": dict(wtma=False),
    "wtma": dict(),
    "wtma_s5": dict(stages=5),
    "wtma_64x128": dict(bm=64, bn=128),
    "wtma_u2": dict(unroll=2),
    "wtma_u4_s5": dict(unroll=4, stages=5),
    "wtma_64x64w4_u2": dict(bm=64, warps=4, unroll=2),
    "wtma_64x64w4_u4": dict(bm=64, warps=4, unroll=4),
    "wtma_norescale": dict(rescale=False),
    "wtma_nowiden": dict(widen=False),
    "wtma_nowiden_norescale": dict(widen=False, rescale=False),
}
TRITON_VARIANTS = {  # the shipped Triton GEMM's loop on split-order activations (triton_split.py)
    "tsplit_ptr": dict(tma=False),
    "tsplit_tma": dict(),
    "tsplit_tma_w8": dict(warps=8),
    "tsplit_tma_128x128w8": dict(bn=128, warps=8),
    "tsplit_tma_s3": dict(stages=3),
    "tsplit_ptr_cat": dict(tma=False, cat=True),
    "tsplit_tma_cat": dict(cat=True),
    "tsplit_tma_cat_w8": dict(cat=True, warps=8),
    "tsplit_tma_cat_128x128w8": dict(cat=True, bn=128, warps=8),
}
CHECKED = tuple(TRITON_VARIANTS) + ("base", "wtma", "wtma_s5", "wtma_64x128", "wtma_u2", "wtma_u4_s5",
                                    "wtma_64x64w4_u2", "wtma_64x64w4_u4")


def _gluon_shipped(xs, sx, weight, scales, n, k, g, out):
    return gw.w4a8_gemm_wgmma(xs, sx, weight, scales, None, n, k, g, out)


def _shipped_cat(xs, sx, weight, scales, n, k, g, out):
    """Session 42: the shipped Triton GEMM with its serving config and GemmConfig.cat (one dot a group against
    split-order activations: no byte interleaving of the nibbles; 368 SASS instructions a warp a group against 379)."""
    cfg = replace(launch.serving_config(xs.shape[0], n, k, g, xs.device), cat=True)
    return launch.launch_config(cfg, xs, sx, weight, scales, None, n, k, g, out)


def main(out_path: str) -> None:
    variants = {"gluon_shipped": (_gluon_shipped, {}, False), "shipped_cat": (_shipped_cat, {}, True)}
    variants.update({name: (run, kw, name in CHECKED) for name, kw in VARIANTS.items()})
    variants.update({name: (triton_split.run, kw, name in CHECKED) for name, kw in TRITON_VARIANTS.items()})
    ab.run(out_path, [(4096, 2048, (512, 4096)), (2048, 6144, (512, 4096)), (12288, 2048, (512, 4096))], variants)


if __name__ == "__main__":
    main(sys.argv[1])
