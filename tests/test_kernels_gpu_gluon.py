"""The Gluon W4A8 GEMM (gluon_w4a8.py, Hopper only) against the Triton GEMM, bit for bit, and the torch oracle.

Both kernels add the same fp32 terms in the same order, so their outputs must be the same bits for any inputs:
random weights and scales, rows and columns that do not fill a tile, group counts that do not fill a main-loop trip,
bias, bf16 and fp32 outputs. Skipped without an sm_90 GPU or without Gluon in the installed Triton.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the Gluon W4A8 GEMM runs on sm_90 (Hopper) only", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch ship it)")

from anychip.kernels.gpu import gluon_w4a8 as gw  # noqa: E402
from anychip.kernels.gpu import launch  # noqa: E402
from anychip.kernels.prepare import prepare_w4a8  # noqa: E402
from anychip.kernels.reference import w4a8_linear_ref  # noqa: E402
from kernels_gpu_cases import assert_close, weights  # noqa: E402

if gw.gluon is None:
    pytest.skip(gw.GLUON_ERROR, allow_module_level=True)

DEV = torch.device("cuda")
CONFIGS = [gw.WgmmaConfig(128, 64, 8, 4), gw.WgmmaConfig(64, 128, 8, 3, unroll=4),
           gw.WgmmaConfig(128, 64, 8, 4, unroll=64)]
CASES = [  # m, n, k, g, bias, out dtype
    (1, 17, 640, 128, False, torch.bfloat16),  # one row, 5 groups (padding groups), a partial column tile
    (300, 200, 2048, 128, True, torch.bfloat16),  # row and column tails, bias
    (512, 1024, 2048, 128, False, torch.bfloat16),
    (129, 576, 576, 64, True, torch.float32),  # G64: 9 groups
    (64, 256, 6144, 128, False, torch.float32),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.stages}u{c.unroll}")
@pytest.mark.parametrize("m,n,k,g,bias,dtype", CASES)
def test_same_bits_as_triton_gemm(m, n, k, g, bias, dtype, cfg) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    q, s = weights(n, k, g, seed=m + k)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen).to(DEV)
    sx = (torch.rand(m, 1, generator=gen) * 1e-2).to(DEV)
    b = torch.randn(n, generator=gen).to(DEV) if bias else None
    p = prepare_w4a8(q.to(DEV), s.to(torch.bfloat16).to(DEV), g, packed=False)
    want = torch.empty(m, n, dtype=dtype, device=DEV)
    launch.launch_config(launch.GemmConfig(64, 64, 128), xq, sx, p.weight, p.scales, b, n, k, g, want)
    got = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    gw.w4a8_gemm_wgmma(gw.split_groups(xq, g).contiguous(), sx, p.weight, p.scales, b, n, k, g, got, cfg)
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert_close(got, w4a8_linear_ref(xq.cpu(), sx.cpu(), q, s.to(torch.bfloat16).float(),
                                      b.cpu() if bias else None, out_dtype=dtype))


def test_split_groups_keeps_each_group_s_values() -> None:
    x = torch.arange(2 * 256, dtype=torch.int32).view(2, 256).to(torch.int8)
    y = gw.split_groups(x, 128)
    assert torch.equal(y[:, :64], x[:, 0:128:2]) and torch.equal(y[:, 64:128], x[:, 1:128:2])
    assert torch.equal(y[:, 128:192], x[:, 128:256:2]) and torch.equal(y[:, 192:], x[:, 129:256:2])
