"""Every Triton kernel the cuda.triton route launches, compiled for sm_90 on any machine (tests/sm90.py): the
quantize kernels with each prologue, the fused GEMV with each prologue, and every GEMM and GEMV config tuning may
pick at a decode, mid and prefill token count. CI has no GPU, and the interpreter (tests/test_triton_interpret.py)
runs the kernels' Python, not what Triton and ptxas make of it: a kernel that no longer compiles (an option a
candidate config sets, inline PTX, a language feature the interpreter accepts) fails here instead of on the first
GPU that tunes it. The kernels that take a token's amax keep NaN (propagate_nan): the PTX holds max.NaN.f32, where
the default maximum (max.f32, maxNum) drops a NaN and turned a poisoned token into finite garbage (session 47).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install triton (`make test` does)")

from anychip.kernels.gpu import launch  # noqa: E402
from anychip.kernels.gpu import triton_w4a8 as kern  # noqa: E402
from sm90 import ptx, require_sm90  # noqa: E402

_BF16, _F32, _I8, _I32, _I64 = torch.bfloat16, torch.float32, torch.int8, torch.int32, torch.int64


@pytest.fixture(scope="module", autouse=True)
def _sm90() -> None:
    require_sm90()


@pytest.mark.parametrize("kk, split", [(576, 0), (2048, 0), (6144, 0), (8192, 0), (2048, 128)])
def test_quantize_rows_compiles_and_keeps_nan(kk: int, split: int) -> None:
    code = ptx(kern._quantize_rows_kernel, (_BF16, _I8, _F32, kk, kk, kk), launch.quantize_options(kk, split=split))
    assert "max.NaN.f32" in code


@pytest.mark.parametrize("pre", [1, 2, 3])
@pytest.mark.parametrize("kk", [576, 6144])
def test_pre_quantize_rows_compiles_and_keeps_nan(pre: int, kk: int) -> None:
    args = (_BF16, _BF16 if pre == 2 else None, _BF16 if pre != 3 else None, _BF16 if pre == 2 else None, _I8, _F32,
            kk, 1e-5, kk * (2 if pre == 3 else 1), kk, kk, kk)
    assert "max.NaN.f32" in ptx(kern._pre_quantize_rows_kernel, args, launch.quantize_options(kk, pre))


def test_quantize_words_compiles_and_keeps_nan() -> None:
    kk = 2048
    code = ptx(kern._quantize_words_kernel, (_BF16, _I32, _F32, kk, kk // 8, kk), launch.quantize_words_options(kk))
    assert "max.NaN.f32" in code


def _specs(m: int, n: int, kk: int, g: int) -> list[tuple[str, object, tuple, dict]]:
    """(config, kernel, arguments as dtypes, options) of every candidate at M tokens, launched as the plugin launches
    them (counting on the device, no bias, split-K scratch where the config splits)."""
    out = []
    for cfg in launch.candidates(m, n, kk, g):
        if isinstance(cfg, launch.GemvConfig):
            split = launch.gemv_split(cfg, n)
            _, args, options = launch.gemv_launch(cfg, n, kk, g, _BF16 if cfg.fused else _I32,
                                                  None if cfg.fused else _F32, _I32, _BF16, None, _BF16,
                                                  _F32 if split > 1 else None, _I32 if split > 1 else None, _I64,
                                                  _I32, pdl=True)
            out.append((str(cfg), kern._w4a8_gemv_kernel, args, options))
        elif isinstance(cfg, launch.GemmConfig):
            split = launch.split_of(cfg, m, n)
            _, args, options = launch.gemm_launch(cfg, m, n, kk, g, _I8, _F32, _I8, _BF16, None, _BF16,
                                                  _F32 if split > 1 else None, _I32 if split > 1 else None, _I64,
                                                  _I32, kk, n)
            out.append((str(cfg), kern._w4a8_gemm_kernel, args, options))
    return out


@pytest.mark.parametrize("m", [1, 16, 64, 512])
@pytest.mark.parametrize("n, kk, g", [(6144, 2048, 128), (576, 1536, 32)])
def test_every_candidate_config_compiles(m: int, n: int, kk: int, g: int) -> None:
    specs = _specs(m, n, kk, g)
    assert specs
    for name, kernel, args, options in specs:
        code = ptx(kernel, args, options)
        assert ".entry" in code, name
        if kernel is kern._w4a8_gemv_kernel and options.get("FUSED"):  # it quantizes the token itself
            assert "max.NaN.f32" in code, name
