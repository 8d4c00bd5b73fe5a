"""The W4A8 GEMM for Hopper (sm_90) in Gluon: group g's integer dots run on the tensor cores (async wgmma) while
group g - 1's sums are rescaled on the vector units.

Why a second GEMM: in plain Triton every dot whose result is rescaled is followed by `wgmma.wait_group 0`, so a
program's tensor cores idle while it rescales (`docs/gpu-notes.md`, runs 83 and 85). Gluon issues the wgmma
asynchronously and waits only for the previous group's, so the rescale of group g - 1, the widening of group g + 1's
nibbles and the loads overlap group g's dots.

Same arithmetic as `triton_w4a8._w4a8_gemm_kernel`, so the same bits: per group the exact int32 sum of
16 * int4 weight times int8 activation (the nibbles widened as `b << 4 & 0xF0` and `b & 0xF0`), then
acc = fma(float(sum), scale * 1/16, acc) in group order, then acc * sx (+ bias) rounded once to the output dtype.

Layout of the operands, per group of G columns:
  - the packed weights (N, K/2) as the Triton route keeps them (`layout.triton_layout`): byte j of a group's row
    holds w[2j] (low nibble) and w[2j + 1] (high); the kernel widens the low nibbles into one shared-memory tile
    (even k) and the high nibbles into another (odd k), so no byte shuffling is needed;
  - the activations with each group's columns split the same way (`split_groups`): the G/2 even columns, then the
    G/2 odd ones. An integer dot does not depend on the order of its terms, so the sums are the same integers.

Gluon is compiled only (no interpreter): the route that calls this kernel exists where Triton has Gluon and the
device is sm_90; tests compare it bit for bit with the Triton kernel on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:  # Gluon ships with Triton >= 3.5; anything else (no Triton, an older one) leaves the route unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.6 (the GPU hosts' torch 2.11) names the TMA load async_copy_global_to_shared; 3.9 async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.6 / 3.9 names of bar.sync
    GLUON_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - any import failure means: no Gluon here
    gluon = None
    GLUON_ERROR = f"Gluon is not importable: {exc!r}"[:200]


@dataclass(frozen=True)
class WgmmaConfig:
    """One launch shape of the Gluon GEMM: a (block_m, block_n) output tile a program; `stages` activation tiles
    in flight (TMA); GROUP_M row tiles sweep the columns together (L2 reuse of the weight tiles); `unroll` groups
    a main-loop trip (unrolled; more: fewer drains, longer compiles)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    stages: int = 4
    group_m: int = 8
    unroll: int = 8

    def __post_init__(self) -> None:
        if self.num_warps not in (4, 8) or self.block_m % 64:
            raise ValueError(f"block_m={self.block_m} (a multiple of 64) or num_warps={self.num_warps} (4, 8)")
        if self.block_n not in (64, 128, 256) or self.stages < 3 or self.unroll < 2 or self.unroll % 2:
            raise ValueError(f"block_n {self.block_n} (64, 128, 256), stages {self.stages} (>= 3) or unroll "
                             f"{self.unroll} (even) not supported")


def unroll_for(cfg: WgmmaConfig, groups: int) -> int:
    """Groups a main-loop trip: the config's, or all of K's (rounded up to even) where that is fewer."""
    return min(cfg.unroll, groups + groups % 2)


def split_groups(xq: torch.Tensor, g: int) -> torch.Tensor:
    """(M, K) int8 -> (M, K) int8 with each group's G columns reordered: the even ones, then the odd ones."""
    m, kk = xq.shape
    return xq.view(m, kk // g, g // 2, 2).transpose(2, 3).reshape(m, kk)


if gluon is not None:

    @gluon.jit
    def _widen(wp, ASM: gl.constexpr):
        """(16 * low nibble, 16 * high nibble) of every byte, as int8 (see triton_w4a8._widen_nibbles)."""
        if ASM:
            lo = gl.inline_asm_elementwise("{ .reg .b32 t; shl.b32 t, $1, 4; and.b32 $0, t, 0xF0F0F0F0; }", "=r,r",
                                           [wp], dtype=gl.int8, is_pure=True, pack=4)
            hi = gl.inline_asm_elementwise("and.b32 $0, $1, 0xF0F0F0F0;", "=r,r", [wp], dtype=gl.int8,
                                           is_pure=True, pack=4)
        else:
            lo = wp << 4
            hi = wp & -16
        return lo, hi

    @gluon.jit
    def _tile_offsets(pid, M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
        """(first row, first column) of program pid's output tile: GROUP_M row tiles sweep the columns together
        (L2 reuse of the weight tiles), as triton_w4a8._tile_of orders them."""
        grid_m = gl.cdiv(M, BM)
        width = GROUP_M * gl.cdiv(N, BN)
        first_m = (pid // width) * GROUP_M
        rows = gl.minimum(grid_m - first_m, GROUP_M)
        return (first_m + (pid % width) % rows) * BM, ((pid % width) // rows) * BN

    @gluon.jit
    def _scales(s_ptr, offs_on, g, groups, N):
        """Group g's scales (bf16 as stored) of the tile's columns, zeros for a g past the last group; columns past
        N read zeros (masked: with N a multiple of 16, as the JIT specializes it, the loads are pairs of columns)."""
        return gl.load(s_ptr + gl.minimum(g, groups - 1) * N + offs_on, mask=(offs_on < N) & (g < groups), other=0.0)

    @gluon.jit
    def _rescale(acc, done, s):
        """acc + float(a group's sums) * its scales s / 16, as one fma (s zero: a group that adds nothing)."""
        return gl.fma(done.to(gl.float32), (s.to(gl.float32) * 0.0625)[None, :], acc)

    @gluon.jit
    def _group_step(g, d_prev, s_prev, spare, acc, wp, a_desc, a_lo, a_hi, b_lo, b_hi, bars, w_ptrs, s_ptr, offs_on,
                    off_m, N, groups, padded, G: gl.constexpr, STAGES: gl.constexpr, ASM: gl.constexpr,
                    FIRST: gl.constexpr):
        """Group g: its B tiles from the prefetched nibbles, its dots issued; then group g - 1's dots retired and
        rescaled into acc with its scales s_prev (FIRST: d_prev is an empty accumulator, its group already added).
        `spare`: a retired accumulator (already added), whose registers group g's dots take over (use_acc=False), so
        no zero tile stays live beside the three that work. Returns (group g's running accumulator and scales, group
        g - 1's retired accumulator, acc, group g + 1's nibbles)."""
        HALF: gl.constexpr = G // 2
        bs = g % 3  # a B stage is rewritten two groups after the wait that retired its reader
        lo, hi = _widen(wp, ASM)
        b_lo.index(bs).store(lo)
        b_hi.index(bs).store(hi)
        fence_async_shared()
        _cta_barrier()  # every warp's share of the B tiles is written; every warp retired group g - 2
        refill = g + STAGES - 2
        live = (g >= 2) & (refill < padded)
        rs = refill % STAGES
        mbarrier.expect(bars.index(rs), 2 * a_desc.block_type.nbytes, pred=live)
        _tma_load(a_desc, [off_m, refill * G], bars.index(rs), a_lo.index(rs), pred=live)
        _tma_load(a_desc, [off_m, refill * G + HALF], bars.index(rs), a_hi.index(rs),
                                        pred=live)
        wp = gl.load(w_ptrs + gl.minimum(g + 1, groups - 1) * HALF)  # past the last group: a harmless re-read
        s = _scales(s_ptr, offs_on, g, groups, N)  # loaded a group ahead of its use
        st = g % STAGES
        mbarrier.wait(bars.index(st), (g // STAGES) & 1)
        d = warpgroup_mma(a_lo.index(st), b_lo.index(bs).permute((1, 0)), spare, use_acc=False, is_async=True)
        d = warpgroup_mma(a_hi.index(st), b_hi.index(bs).permute((1, 0)), d, is_async=True)
        done = warpgroup_mma_wait(num_outstanding=2, deps=(d_prev,))  # group g - 1's two are done
        if not FIRST:
            acc = _rescale(acc, done, s_prev)
        # a side-effecting copy: the compiler may not move the rescale (its reads of `done`) below the next
        # group's wgmma, which takes over done's registers; moved, it copies a running accumulator at the loop's
        # back edge, and ptxas then serializes every wgmma (C7514)
        acc = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=gl.float32, is_pure=False, pack=1)
        return d, s, done, acc, wp

    @gluon.jit
    def _w4a8_wgmma_kernel(
        a_desc, w_ptr, s_ptr, sx_ptr, bias_ptr, out_ptr, count_ptr, slot_ptr, M, N, K, stride_om,
        G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
        HAS_BIAS: gl.constexpr, COUNT: gl.constexpr, ASM: gl.constexpr, UNROLL: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """out (M, N) = the W4A8 linear (module docstring); UNROLL (even) groups a main-loop trip.  COUNT: count
        (slots, 2) int64 [calls, rows] of this layer, bumped at slot[0] by program 0, as the Triton GEMM does."""
        HALF: gl.constexpr = G // 2
        B_STAGES: gl.constexpr = 3  # see _group_step
        pid = gl.program_id(0)
        if COUNT:
            if pid == 0:  # once a launch, so a CUDA-graph replay counts too
                at = count_ptr + gl.load(slot_ptr).to(gl.int64) * 2
                gl.atomic_add(at, 1)
                gl.atomic_add(at + 1, M.to(gl.int64))
        off_m, off_n = _tile_offsets(pid, M, N, BM, BN, GROUP_M)

        WM: gl.constexpr = num_warps if BM >= 16 * num_warps else 4  # warps along M (a warpgroup: 4 x 16 rows)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, num_warps // WM],
                                                      instr_shape=[16, BN // (num_warps // WM), 32])
        b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=HALF, element_bitwidth=8, rank=2)
        w_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // HALF, HALF // 16], [num_warps, 1], [1, 0])

        a_lo = gl.allocate_shared_memory(gl.int8, [STAGES, BM, HALF], a_desc.layout)
        a_hi = gl.allocate_shared_memory(gl.int8, [STAGES, BM, HALF], a_desc.layout)
        b_lo = gl.allocate_shared_memory(gl.int8, [B_STAGES, BN, HALF], b_layout)
        b_hi = gl.allocate_shared_memory(gl.int8, [B_STAGES, BN, HALF], b_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        groups = K // G
        padded = gl.cdiv(groups, UNROLL) * UNROLL
        for i in gl.static_range(STAGES):  # fill every stage (an empty group past K reads zeros)
            live = i < padded
            mbarrier.expect(bars.index(i), 2 * a_desc.block_type.nbytes, pred=live)
            _tma_load(a_desc, [off_m, i * G], bars.index(i), a_lo.index(i), pred=live)
            _tma_load(a_desc, [off_m, i * G + HALF], bars.index(i), a_hi.index(i), pred=live)

        offs_wn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, w_layout))
        offs_wk = gl.arange(0, HALF, layout=gl.SliceLayout(0, w_layout))
        # rows past N re-read row N - 1 (their columns are not stored): no masks in the main loop
        w_ptrs = w_ptr + gl.minimum(offs_wn, N - 1)[:, None].to(gl.int64) * (K // 2) + offs_wk[None, :]
        offs_on = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        mask_on = offs_on < N

        wp = gl.load(w_ptrs)
        acc = gl.zeros([BM, BN], gl.float32, mma)
        spare = gl.zeros([BM, BN], gl.int32, mma)
        # UNROLL groups a trip, unrolled, two accumulators taking turns: group g's dots run while group g - 1's
        # sums are rescaled. Nothing runs across the loop's back edge (ptxas serializes every wgmma of a loop
        # whose running accumulators cross it: C7514), so a trip's first group is rescaled after its last one is
        # drained. Groups past K // G (to a whole trip) read zero activations and add nothing, bit for bit.
        for c in range(0, padded, UNROLL):
            d_b = warpgroup_mma_init(gl.zeros([BM, BN], gl.int32, mma))
            s_b = gl.zeros([BN], s_ptr.dtype.element_ty, gl.SliceLayout(0, mma))
            for j in gl.static_range(0, UNROLL, 2):
                d_a, s_a, spare, acc, wp = _group_step(c + j, d_b, s_b, spare, acc, wp, a_desc, a_lo, a_hi, b_lo,
                                                       b_hi, bars, w_ptrs, s_ptr, offs_on, off_m, N, groups, padded,
                                                       G, STAGES, ASM, j == 0)
                d_b, s_b, spare, acc, wp = _group_step(c + j + 1, d_a, s_a, spare, acc, wp, a_desc, a_lo, a_hi, b_lo,
                                                       b_hi, bars, w_ptrs, s_ptr, offs_on, off_m, N, groups, padded,
                                                       G, STAGES, ASM, False)
            done = warpgroup_mma_wait(num_outstanding=0, deps=(d_b,))
            acc = _rescale(acc, done, s_b)
            acc = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=gl.float32, is_pure=False,
                                            pack=1)
            spare = done
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        mask_m = offs_m < M
        y = acc * gl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
        if HAS_BIAS:
            y += gl.load(bias_ptr + offs_on, mask=mask_on, other=0.0).to(gl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(gl.int64) * stride_om + offs_on[None, :]
        gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_on[None, :])


@functools.lru_cache(maxsize=64)
def _a_layout(block_m: int, half: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=half, element_bitwidth=8, rank=2)


def wgmma_fits(m: int, n: int, kk: int, g: int) -> str | None:
    """Why the Gluon GEMM cannot take this shape (None if it can)."""
    if gluon is None:
        return GLUON_ERROR
    if g not in (64, 128) or kk % g:
        return f"group size {g} (64 or 128, dividing K={kk}) needed"
    if kk % 16:
        return f"K={kk}: TMA rows must be multiples of 16 bytes"
    return None


def w4a8_gemm_wgmma(xs: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None, n: int, kk: int, g: int, out: torch.Tensor,
                    cfg: WgmmaConfig = WgmmaConfig(), asm: bool = True, counter=None):
    """out (M, N) = the W4A8 linear of xs (M, K) int8 in `split_groups` order, sx (M,) or (M, 1) fp32, the Triton
    route's packed weight (N, K/2) and scales (K/G, N). Returns the compiled kernel."""
    cell, slot = (counter.cell, counter.slot) if counter is not None else (None, None)
    grid, args, options = launch_spec(cfg, xs, xs.shape[0], n, kk, g, sx, weight, scales, bias, out, cell, slot,
                                      asm)
    return _w4a8_wgmma_kernel[grid](*args, **options)


def launch_spec(cfg: WgmmaConfig, xs: torch.Tensor, m: int, n: int, kk: int, g: int, sx, weight, scales, bias, out,
                cell, slot, asm: bool = True) -> tuple[tuple[int], tuple, dict]:
    """(grid, arguments, compile-time options) of one launch, for the launch and for precompile.py (which passes
    dtypes for the other tensors and a small int8 tensor for xs: the TMA descriptor's type depends only on its
    dtype, block and layout)."""
    half = g // 2
    if xs.stride() != (kk, 1):
        raise ValueError(f"the Gluon GEMM reads contiguous (M, K={kk}) activations, got strides {xs.stride()}")
    a_desc = TensorDescriptor(xs, [xs.shape[0], kk], [kk, 1], [cfg.block_m, half], _a_layout(cfg.block_m, half))
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n),)
    args = (a_desc, weight, scales, sx, bias if bias is not None else sx, out, cell if cell is not None else sx,
            slot if slot is not None else sx, m, n, kk, out.stride(0) if isinstance(out, torch.Tensor) else n)
    options = dict(G=g, BM=cfg.block_m, BN=cfg.block_n, STAGES=cfg.stages, GROUP_M=cfg.group_m,
                   HAS_BIAS=bias is not None, COUNT=cell is not None, ASM=asm, UNROLL=unroll_for(cfg, kk // g),
                   num_warps=cfg.num_warps,
                   enable_fp_fusion=True)
    return grid, args, options
