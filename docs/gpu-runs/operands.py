"""Random operands of one W4A8 GEMM for the GPU experiment scripts (prefill-fcvt/ab.py, decode-sweep/sweep.py):
INT8 activations and their scales, packed INT4 weights with bf16 group scales, and BF16 operands of the same shape
for cuBLAS, drawn in this order from `gen` (a caller may draw more from it after)."""
import torch


def operands(m: int, n: int, kk: int, g: int, gen: torch.Generator, dev: torch.device):
    xq = torch.randint(-127, 128, (m, kk), dtype=torch.int8, device=dev, generator=gen)
    sx = torch.rand((m,), device=dev, generator=gen) / 100 + 1e-4
    w = torch.randint(-128, 128, (n, kk // 2), dtype=torch.int8, device=dev, generator=gen)
    s = (torch.rand((kk // g, n), device=dev, generator=gen) / 50 + 1e-3).bfloat16()
    xb = torch.randn((m, kk), device=dev, generator=gen).bfloat16()
    wb = torch.randn((n, kk), device=dev, generator=gen).bfloat16()
    return xq, sx, w, s, xb, wb
