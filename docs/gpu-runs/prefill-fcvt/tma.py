"""Experimental: the W4A8 prefill GEMM with TMA loads (host tensor descriptors) instead of pointer loads; the same
main loop as anychip's _w4a8_gemm_kernel without split-K, bias or counters (non-swap tiles only)."""
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from anychip.kernels.gpu.triton_w4a8 import _epilogue, _rescale_add, _tile_of, _widen_nibbles


@triton.jit
def _gemm_tma_kernel(x_desc, sx_ptr, w_desc, s_ptr, out_ptr, M, N, K, stride_om,
                     G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                     ASM: tl.constexpr, FCVT: tl.constexpr):
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, K // G):
        x = x_desc.load([pid_m * BM, g * G])
        wp = w_desc.load([pid_n * BN, g * (G // 2)])
        lo, hi = _widen_nibbles(wp, ASM)
        w = tl.reshape(tl.join(lo, hi), (BN, G))
        d = tl.dot(x, tl.trans(w), out_dtype=tl.int32)
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32) * 0.0625
        acc = _rescale_add(acc, d, s, False, FCVT)
    _epilogue(acc, offs_m, offs_n, mask_m, mask_n, sx_ptr, out_ptr, out_ptr, stride_om, False)


def launch(xq, sx, w, s, out, g, bm, bn, num_warps, num_stages, fcvt, asm=True):
    m, kk = xq.shape
    n = w.shape[0]
    xd = TensorDescriptor.from_tensor(xq, [bm, g])
    wd = TensorDescriptor.from_tensor(w, [bn, g // 2])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    return _gemm_tma_kernel[grid](xd, sx, wd, s, out, m, n, kk, out.stride(0), G=g, BM=bm, BN=bn, GROUP_M=8,
                                  ASM=asm, FCVT=fcvt, num_warps=num_warps, num_stages=num_stages)
