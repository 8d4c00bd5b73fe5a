"""The W4A8 CPU kernels' output bits: a bf16 or fp16 output is exactly the fp32 output rounded once, and no
output depends on the number of threads.

Every route computes the same fp32 value y * sx + bias per output and only then rounds it to the output dtype, so
for the same INT8 activations (`w4a8_linear_q`) the bf16 and fp16 outputs must equal the fp32 output cast by torch
(round to nearest even), bit for bit. This checks the vectorized stores (AVX2: 16 rows packed and permuted into
order; AVX512: masked) against torch's own rounding, full blocks of 16 rows and a partial last block alike.
"""

from __future__ import annotations

import pytest
import torch

from anychip.kernels import routes
from anychip.kernels.prepare import prepare_w4a8
from anychip.kernels.reference import quantize_activations_ref

ISAS = [r.id for r in routes.available("cpu")]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("n", [16, 17, 40, 576])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rounded_outputs_equal_the_fp32_output_rounded(isa: str, m: int, n: int, with_bias: bool) -> None:
    k, g = 576, 32
    gen = torch.Generator().manual_seed(m * 1000 + n)
    wq = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    sw = torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3
    xq, sx = quantize_activations_ref(torch.randn(m, k, generator=gen) * 3)
    bias = torch.randn(n, generator=gen) * 0.1 if with_bias else None
    p = prepare_w4a8(wq, sw, g, packed=False, route=isa)

    def out(dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.anychip.w4a8_linear_q(xq, sx, p.weight, p.scales, bias, n, k, g, p.route.code, None, dtype)

    y32 = out(torch.float32)
    assert y32.abs().max() > 0
    for dtype in (torch.bfloat16, torch.float16):
        y = out(dtype)
        assert y.dtype == dtype and torch.equal(y.view(torch.int16), y32.to(dtype).view(torch.int16)), (
            f"{isa}: {dtype} output differs from the fp32 output rounded, at "
            f"{(y.float() != y32.to(dtype).float()).nonzero()[:4].tolist()}"
        )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 9])
def test_outputs_do_not_depend_on_the_thread_count(isa: str, m: int) -> None:
    """A block is computed whole by one thread, so 1 and 2 threads (or the load guard's fallback to the calling
    thread, csrc/parallel_cpu.h) give the same bits; the chunk split shrinks towards the end of a call."""
    k, n, g = 1536, 1000, 64  # 63 blocks: an odd count, chunks of several sizes
    gen = torch.Generator().manual_seed(m)
    p = prepare_w4a8(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen),
                     torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3, g, packed=False, route=isa)
    x = torch.randn(m, k, generator=gen).bfloat16()
    previous = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(torch.ops.anychip.w4a8_linear(x, p.weight, p.scales, None, n, k, g, p.route.code, None))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
