"""Triton kernels compiled for sm_90 on any machine (Triton's CUDA backend and its ptxas need no GPU): the helpers
of the tests that read the compiled code (test_gpu_pdl_ptx.py, test_gpu_compile_sm90.py)."""

from __future__ import annotations

import pytest
import torch
import triton

from anychip.kernels.gpu import launch

_TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64",
          torch.int8: "*i8"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "enable_fp_fusion")


def ptx(kernel, args: tuple, options: dict) -> str:
    """sm_90 PTX of `kernel` for launch arguments given as dtypes (tensors), numbers and None (an unused pointer),
    as precompile.py gives them."""
    signature, constexprs = {}, {}
    for name, arg in zip([p.name for p in kernel.params], args):
        if arg is None:  # a pointer the kernel does not touch under these options: any pointer type compiles it
            signature[name] = "*i32"
        elif isinstance(arg, torch.dtype):
            signature[name] = _TYPES[arg]
        else:
            signature[name] = "fp32" if isinstance(arg, float) else "i32"
    for param in kernel.params[len(args):]:  # the constexprs: the launch's options, else their defaults
        signature[param.name] = "constexpr"
        constexprs[param.name] = options.get(param.name, param.default)
    compile_options = {k: v for k, v in options.items() if k in _LAUNCH_OPTIONS}
    compiled = _compile_sm90(kernel, signature, constexprs, compile_options)
    assert compiled.metadata.launch_pdl == options.get("launch_pdl", False)
    return compiled.asm["ptx"]


def _compile_sm90(kernel, signature: dict, constexprs: dict, options: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)


@triton.jit
def _probe(x_ptr):
    triton.language.store(x_ptr, triton.language.load(x_ptr) + 1.0)


def require_sm90() -> None:
    """Skips (visibly) where this Triton cannot compile for sm_90 at all (no CUDA backend or ptxas); where it can,
    a kernel of ours that fails to compile fails its test."""
    try:
        _compile_sm90(_probe, {"x_ptr": "*fp32"}, {}, dict(launch.FP_FUSION))
    except Exception as exc:
        pytest.skip(f"Triton cannot compile for sm_90 here: {exc!r}"[:300])
