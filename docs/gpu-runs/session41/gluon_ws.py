"""Session 41: a warp-specialized Gluon W4A8 GEMM (sketch for the next device run, compiled on the CPU only).

Partitions of one program (a BM x BN output tile, K in groups of G, activations in `split_groups` order):
  - load (1 warp): TMA of each group's two activation half-tiles and its packed weight tile into a stage ring;
  - widen (4 warps): each group's packed weights from shared memory to registers, widened to the low- and
    high-nibble int8 tiles, stored as the wgmma's B operands;
  - default (the consumers, num_warps): the group's two wgmma issued asynchronously; the previous group's retired,
    its stage released to the load and widen partitions, its sums rescaled while the current group's run.
No CTA-wide barrier in the main loop: the partitions hand stages over through mbarriers. Same integer sums and the
same fp32 terms in the same order as `_w4a8_gemm_kernel`, so the same bits (to be checked on a GPU)."""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from anychip.kernels.gpu import gluon_w4a8 as gw

_tma_load = gw._tma_load


@gluon.jit
def _load_part(a_desc, w_desc, a_lo, a_hi, w_s, a_ready, a_empty, w_ready, w_empty, off_m, off_n, groups,
               G: gl.constexpr):
    HALF: gl.constexpr = G // 2
    stages: gl.constexpr = a_lo.type.shape[0]
    for g in range(groups):
        s = g % stages
        phase = (g // stages) & 1
        mbarrier.wait(a_empty.index(s), phase ^ 1)  # the consumers retired group g - stages
        mbarrier.expect(a_ready.index(s), 2 * a_desc.block_type.nbytes)
        _tma_load(a_desc, [off_m, g * G], a_ready.index(s), a_lo.index(s))
        _tma_load(a_desc, [off_m, g * G + HALF], a_ready.index(s), a_hi.index(s))
        mbarrier.wait(w_empty.index(s), phase ^ 1)  # the widen partition read group g - stages' bytes
        mbarrier.expect(w_ready.index(s), w_desc.block_type.nbytes)
        _tma_load(w_desc, [off_n, g * HALF], w_ready.index(s), w_s.index(s))


@gluon.jit
def _widen_part(a_desc, w_desc, a_lo, a_hi, w_s, a_ready, a_empty, w_ready, w_empty, off_m, off_n, groups,
                G: gl.constexpr):
    # called with the B tiles and their ready barrier in the activation tiles' places (the kernel's call)
    HALF: gl.constexpr = G // 2
    stages: gl.constexpr = a_lo.type.shape[0]
    BN: gl.constexpr = w_s.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // HALF, HALF // 16], [4, 1], [1, 0])
    for g in range(groups):
        s = g % stages
        phase = (g // stages) & 1
        mbarrier.wait(w_ready.index(s), phase)
        wp = w_s.index(s).load(layout)
        fence_async_shared()  # the generic read before the TMA that refills the buffer
        mbarrier.arrive(w_empty.index(s), count=1)
        lo, hi = gw._widen(wp, True)
        mbarrier.wait(a_empty.index(s), phase ^ 1)  # the consumers retired the B tiles of group g - stages
        a_lo.index(s).store(lo)
        a_hi.index(s).store(hi)
        fence_async_shared()
        mbarrier.arrive(a_ready.index(s), count=1)


@gluon.jit
def _consume(a_lo, a_hi, b_lo, b_hi, a_ready, b_ready, empty, s_ptr, offs_on, N, groups, padded, BM: gl.constexpr,
             BN: gl.constexpr, UNROLL: gl.constexpr, mma: gl.constexpr):
    """Trips of UNROLL groups, unrolled, drained at the trip's end: a wgmma accumulator live across a loop's back
    edge makes ptxas serialize every wgmma (C7514; gluon_w4a8.py)."""
    stages: gl.constexpr = a_lo.type.shape[0]
    acc = gl.zeros([BM, BN], gl.float32, mma)
    spare = gl.zeros([BM, BN], gl.int32, mma)
    for c in range(0, padded, UNROLL):
        prev = warpgroup_mma_init(gl.zeros([BM, BN], gl.int32, mma))
        s_prev = gl.zeros([BN], s_ptr.dtype.element_ty, gl.SliceLayout(0, mma))
        for j in gl.static_range(UNROLL):
            g = c + j
            st = g % stages
            phase = (g // stages) & 1
            mbarrier.wait(a_ready.index(st), phase)
            mbarrier.wait(b_ready.index(st), phase)
            d = warpgroup_mma(a_lo.index(st), b_lo.index(st).permute((1, 0)), spare, use_acc=False, is_async=True)
            d = warpgroup_mma(a_hi.index(st), b_hi.index(st).permute((1, 0)), d, is_async=True)
            s = gw._scales(s_ptr, offs_on, g, groups, N)
            done = warpgroup_mma_wait(num_outstanding=2, deps=(prev,))
            if j > 0:  # group g - 1 retired: its stage back to the producers, its sums rescaled
                mbarrier.arrive(empty.index((g + stages - 1) % stages), count=1)
                acc = gw._rescale(acc, done, s_prev)
            acc = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=gl.float32, is_pure=False,
                                            pack=1)
            spare = done
            prev = d
            s_prev = s
        done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
        mbarrier.arrive(empty.index((c + UNROLL - 1) % stages), count=1)
        acc = gw._rescale(acc, done, s_prev)
        acc = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=gl.float32, is_pure=False, pack=1)
        spare = done
    return (acc,)  # a partition's results come back as a tuple


@gluon.jit
def ws_kernel(a_desc, w_desc, s_ptr, sx_ptr, out_ptr, M, N, K, stride_om, G: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, UNROLL: gl.constexpr,
              num_warps: gl.constexpr):
    HALF: gl.constexpr = G // 2
    pid = gl.program_id(0)
    off_m, off_n = gw._tile_offsets(pid, M, N, BM, BN, GROUP_M)
    WM: gl.constexpr = num_warps if BM >= 16 * num_warps else 4
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, num_warps // WM],
                                                  instr_shape=[16, BN // (num_warps // WM), 32])
    b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=HALF, element_bitwidth=8, rank=2)
    a_lo = gl.allocate_shared_memory(gl.int8, [STAGES, BM, HALF], a_desc.layout)
    a_hi = gl.allocate_shared_memory(gl.int8, [STAGES, BM, HALF], a_desc.layout)
    w_s = gl.allocate_shared_memory(gl.int8, [STAGES, BN, HALF], w_desc.layout)
    b_lo = gl.allocate_shared_memory(gl.int8, [STAGES, BN, HALF], b_layout)
    b_hi = gl.allocate_shared_memory(gl.int8, [STAGES, BN, HALF], b_layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=1)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    groups = K // G
    padded = gl.cdiv(groups, UNROLL) * UNROLL  # groups past K read zeros (TMA) and add nothing
    offs_on = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    # the stage's `empty` barrier frees both its activation tiles (load partition) and its B tiles (widen)
    (acc,) = gl.warp_specialize([
        (_consume, (a_lo, a_hi, b_lo, b_hi, a_ready, b_ready, empty, s_ptr, offs_on, N, groups, padded, BM, BN,
                    UNROLL, mma)),
        (_load_part, (a_desc, w_desc, a_lo, a_hi, w_s, a_ready, empty, w_ready, w_empty, off_m, off_n, padded, G)),
        (_widen_part, (a_desc, w_desc, b_lo, b_hi, w_s, b_ready, empty, w_ready, w_empty, off_m, off_n, padded, G)),
    ], [1, 4], [24, 64])
    offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    mask_m = offs_m < M
    y = acc * gl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    out_ptrs = out_ptr + offs_m[:, None].to(gl.int64) * stride_om + offs_on[None, :]
    gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_on < N)[None, :])


def run(xs, sx, weight, scales, n, kk, g, out, bm=128, bn=64, warps=8, stages=4, unroll=4, maxnreg=128):
    half = g // 2
    layout = gl.NVMMASharedLayout(swizzle_byte_width=half, element_bitwidth=8, rank=2)
    a_desc = TensorDescriptor(xs, list(xs.shape), [kk, 1], [bm, half], layout)
    w_desc = TensorDescriptor(weight, list(weight.shape), [kk // 2, 1], [bn, half], layout)
    m = xs.shape[0]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    # 16 warps in all (8 consumers, 4 widening, the TMA warp's warpgroup): 128 registers a thread at launch; the
    # compiler's setmaxnreg then gives the consumers 208 inside the partitioned loop (2 x 208 + 64 + 24 <= 512)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    return ws_kernel[grid](a_desc, w_desc, scales, sx, out, m, n, kk, out.stride(0), G=g, BM=bm, BN=bn,
                           STAGES=stages, GROUP_M=8, UNROLL=min(unroll, kk // g + (kk // g) % 2), num_warps=warps,
                           **extra)
