"""Programmatic dependent launch, checked in the compiled code without a GPU.

A GEMV launched with PDL may start while the kernel ahead of it still runs; before its griddepcontrol.wait it may
touch only what no kernel writes (the weights). A load of the token, a counter update or a store placed above the
wait would read or clobber data the kernel ahead has not finished with, and the bits would still come out right on
most runs. So the order is checked where it is decided: Triton compiles the GEMV for sm_90 here (its CUDA backend
needs no GPU), with the options its launch uses (`launch.gemv_launch`), and the PTX is read: launch_dependents
first, then only the weight words' loads, then the wait, then everything else. The same compilation shows that the
launches ask for fused multiply-adds by name rather than through Triton's default, which Triton 3.10 is to turn off.
"""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: pip install triton (`make test` does)")

from anychip.kernels.gpu import launch  # noqa: E402
from anychip.kernels.gpu import triton_w4a8 as kern  # noqa: E402
from sm90 import ptx, require_sm90  # noqa: E402

_ptx = ptx


@pytest.fixture(scope="module", autouse=True)
def _sm90() -> None:
    require_sm90()


def _before_and_after_wait(ptx: str) -> tuple[list[str], list[str]]:
    lines = [line.strip() for line in ptx.splitlines()]
    ops = [line for line in lines if re.search(r"griddepcontrol|prefetch|ld\.global|st\.global|atom\.|red\.", line)]
    assert ops and "griddepcontrol.launch_dependents" in ops[0], ops[:3]
    waits = [i for i, op in enumerate(ops) if "griddepcontrol.wait" in op]
    assert len(waits) == 1, waits
    return ops[1:waits[0]], ops[waits[0] + 1:]


_BF16, _F32, _I32, _I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64


@pytest.mark.parametrize("split,pre", [(1, 2), (4, 0)])
def test_gemv_reads_only_weights_before_the_wait(split: int, pre: int) -> None:
    n, k, g = 2048, 2048, 128
    cfg = launch.GemvConfig(16, 512, split_k=split, fused=True)
    pre_obj = launch.Norm(None, 1e-5, _BF16, _BF16) if pre == 2 else None
    grid, args, options = launch.gemv_launch(cfg, n, k, g, _BF16, None, _I32, _BF16, None, _BF16,
                                             _F32 if split > 1 else None, _I32 if split > 1 else None, _I64, _I32,
                                             pre_obj, pdl=True)
    if pre_obj is not None:  # the norm's weight and residuals as dtypes, as the launch passes tensors
        args = args[:13] + (_BF16, _BF16, _BF16, 1e-5)
    before, after = _before_and_after_wait(_ptx(kern._w4a8_gemv_kernel, args, options))
    assert before and all(re.search(r"ld\.global(\.v\d)?\.b32", op) for op in before), before  # the weight words
    assert any("atom." in op for op in after) and any("st.global" in op for op in after)  # counter, output
    plain = _ptx(kern._w4a8_gemv_kernel, args, {k: v for k, v in options.items() if k not in ("PDL", "launch_pdl")})
    assert "griddepcontrol" not in plain


def test_launches_ask_for_fused_multiply_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group rescale (acc + f * s) is one fused multiply-add because the launch options ask for it: with
    Triton's default turned off (as Triton 3.10 is to have it), the GEMV compiled with its launch's options still
    has fp32 FMAs, and compiled without that option has none."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    cfg = launch.GemvConfig(16, 512)
    grid, args, options = launch.gemv_launch(cfg, 2048, 2048, 128, _I32, _F32, _I32, _BF16, None, _BF16, None, None,
                                             _I64, _I32)
    assert options["enable_fp_fusion"] is True
    assert "fma.rn.f32" in _ptx(kern._w4a8_gemv_kernel, args, options)
    unfused = {k: v for k, v in options.items() if k != "enable_fp_fusion"}
    assert "fma.rn.f32" not in _ptx(kern._w4a8_gemv_kernel, args, unfused)
