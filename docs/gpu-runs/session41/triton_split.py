"""Session 41: the shipped Triton GEMM's main loop with fewer instructions a group (its sm_90 SASS: 379 a warp a
group, of which 144 the rescale, about 130 address and mask arithmetic of the pointer loads, 24 byte permutes
joining the low and high nibbles). Here the activations come in `split_groups` order (each group's even columns,
then its odd ones, as the quantize kernels' SPLIT writes them), so a group is two dots, low nibbles against the
even columns and high against the odd, with no join; TMA: the activation and weight tiles through tensor
descriptors (no per-element addresses; rows past M or N read zeros). Same integer sums and the same fp32 terms in
the same order as `_w4a8_gemm_kernel`: the same bits."""
import triton
import triton.language as tl

from anychip.kernels.gpu.triton_w4a8 import _epilogue, _rescale_add, _tile_of, _widen_nibbles


@triton.jit
def gemm_split_kernel(x_desc, x_ptr, w_desc, w_ptr, s_ptr, sx_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                      G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
                      ASM: tl.constexpr, CAT: tl.constexpr = False):
    HALF: tl.constexpr = G // 2
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_of(pid, M, N, BM, BN, GROUP_M)
    off_m = pid_m * BM
    off_n = pid_n * BN
    offs_m = off_m + tl.arange(0, BM)
    offs_n = off_n + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    XW: tl.constexpr = G if CAT else HALF
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + tl.arange(0, XW)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * (K // 2) + tl.arange(0, HALF)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, K // G):
        if CAT:  # one dot of K = G: the low nibbles' tile, then the high ones', against the split-order group
            if TMA:
                xg = x_desc.load([off_m, g * G])
                wp = w_desc.load([off_n, g * HALF])
            else:
                xg = tl.load(x_ptrs + g * G, mask=mask_m[:, None], other=0)
                wp = tl.load(w_ptrs + g * HALF, mask=mask_n[:, None], other=0)
            lo, hi = _widen_nibbles(wp, ASM)
            w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BN, G))
            d = tl.dot(xg, tl.trans(w), out_dtype=tl.int32)
        elif TMA:
            xe = x_desc.load([off_m, g * G])
            xo = x_desc.load([off_m, g * G + HALF])
            wp = w_desc.load([off_n, g * HALF])
        else:
            xe = tl.load(x_ptrs + g * G, mask=mask_m[:, None], other=0)
            xo = tl.load(x_ptrs + g * G + HALF, mask=mask_m[:, None], other=0)
            wp = tl.load(w_ptrs + g * HALF, mask=mask_n[:, None], other=0)
        if not CAT:
            lo, hi = _widen_nibbles(wp, ASM)
            d = tl.dot(xe, tl.trans(lo), out_dtype=tl.int32)
            d = tl.dot(xo, tl.trans(hi), d, out_dtype=tl.int32)
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32) * 0.0625
        acc = _rescale_add(acc, d, s, False)
    _epilogue(acc, offs_m, offs_n, mask_m, mask_n, sx_ptr, sx_ptr, out_ptr, stride_om, False)


def run(xs, sx, weight, scales, n, kk, g, out, bm=128, bn=64, warps=4, stages=4, tma=True, group_m=8, cat=False,
        asm=True):
    from triton.tools.tensor_descriptor import TensorDescriptor
    m = xs.shape[0]
    x_desc = TensorDescriptor.from_tensor(xs, [bm, g if cat else g // 2]) if tma else xs
    w_desc = TensorDescriptor.from_tensor(weight, [bn, g // 2]) if tma else weight
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    return gemm_split_kernel[grid](x_desc, xs, w_desc, weight, scales, sx, out, m, n, kk, xs.stride(0),
                                   out.stride(0), G=g, BM=bm, BN=bn, GROUP_M=group_m, TMA=tma, ASM=asm, CAT=cat,
                                   num_warps=warps, num_stages=stages, enable_fp_fusion=True)
