"""The Gluon W4A8 GEMM compiled for sm_90 without a GPU: the overlap it exists for is in the code.

The kernel's point is that group g's wgmma runs while group g - 1's sums are rescaled. Two things in the compiled
code decide whether that happens, and neither shows in its results: each group's wait must leave that group's own
two wgmma in flight (`wgmma.wait_group 2`, not 0), and ptxas must not serialize the wgmma (its C7514 warning, which
a running accumulator crossing a loop's back edge, or a copy of one, brings; `gluon_w4a8.py`). Compiled here with
the installed Triton and its own ptxas, as tests/test_gpu_pdl_ptx.py compiles the GEMV. Skipped where this Triton
has no Gluon or cannot compile for sm_90.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: pip install triton (`make test` does)")

from anychip.kernels.gpu import gluon_w4a8 as gw  # noqa: E402

if gw.gluon is None:
    pytest.skip(gw.GLUON_ERROR, allow_module_level=True)


def _compile(cfg: gw.WgmmaConfig, kk: int, g: int):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    xs = torch.zeros(cfg.block_m, kk, dtype=torch.int8)
    _, args, options = gw.launch_spec(cfg, xs, 512, 4096, kk, g, torch.float32, torch.int8, torch.bfloat16, None,
                                      torch.bfloat16, torch.int64, torch.int32)
    kernel = gw._w4a8_wgmma_kernel
    names = [p.name for p in kernel.params]
    signature = {"a_desc": mangle_type(args[0]), "w_ptr": "*i8", "s_ptr": "*bf16", "sx_ptr": "*fp32",
                 "bias_ptr": "*fp32", "out_ptr": "*bf16", "count_ptr": "*i64", "slot_ptr": "*i32", "M": "i32",
                 "N": "i32", "K": "i32", "stride_om": "i32"}
    constexprs = {name: options[name] for name in names if name not in signature}
    signature.update({name: "constexpr" for name in constexprs})
    # what the JIT knows of a launch: 16-byte aligned pointers, N, K and the row stride multiples of 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("w_ptr", "s_ptr", "sx_ptr", "bias_ptr", "out_ptr",
                                                                     "N", "K", "stride_om")}
    compile_options = {"num_warps": cfg.num_warps, "enable_fp_fusion": True}
    try:
        return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=compile_options)
    except Exception as exc:  # noqa: BLE001
        if "ptxas" in repr(exc) or "CUDA" in repr(exc) and "backend" in repr(exc):
            pytest.skip(f"Triton cannot compile for sm_90 here: {exc!r}"[:300])
        raise


@pytest.mark.parametrize("cfg,kk,g", [(gw.WgmmaConfig(128, 64, 8, 4), 2048, 128),
                                      (gw.WgmmaConfig(64, 128, 8, 3, unroll=4), 640, 128),
                                      (gw.WgmmaConfig(128, 64, 8, 4), 576, 64)],
                         ids=["128x64-K2048", "64x128-u4-K640", "128x64-G64"])
def test_each_group_waits_only_for_the_one_before_and_ptxas_keeps_the_pipeline(cfg, kk, g) -> None:
    compiled = _compile(cfg, kk, g)
    ptx = compiled.asm["ptx"]
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)
    unroll = gw.unroll_for(cfg, kk // g)
    assert waits.count("2") == unroll and waits.count("0") == 1, waits  # a trip: its groups, then the drain
    assert len(re.findall(r"wgmma\.commit_group", ptx)) == 2 * unroll
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90).path
    except TypeError:  # Triton 3.6 takes no architecture
        ptxas = get_ptxas().path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "C7514" not in run.stderr and "serialized" not in run.stderr, run.stderr[-2000:]
