"""The GPU route's Triton kernels executed without a GPU: Triton's interpreter (TRITON_INTERPRET=1) runs the same
kernel source with numpy on CPU tensors, so CI checks the CUDA route's arithmetic line by line.

Small shapes, the same checks as test_kernels_gpu.py: activation quantization and INT32 group sums bit-exact,
whole linears bit-exact with power-of-two scales for every tile config (split-K and swapped tiles included), the
coverage counter the GEMM bumps, and bf16 outputs within kernels_gpu_cases.py's tolerance. What the interpreter
cannot show: timing, races between programs (it runs them one after another) and the compiled code's rounding
of anything but IEEE-exact operations. Skipped, visibly, when the triton package is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed: pip install triton (`make test` does)")
if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):
    # seen on an H200 host (triton 3.6, numpy 2.5): its interpreter cannot run `range` over a kernel argument
    pytest.skip(f"triton {triton.__version__}: the interpreter cases are checked with triton >= 3.9 (3.6's "
                "interpreter fails under numpy 2.5)", allow_module_level=True)

CASES = Path(__file__).with_name("triton_interpret_cases.py")


def test_kernels_interpreted_match_the_reference() -> None:
    """Triton reads TRITON_INTERPRET when @triton.jit runs, its own library's functions included, so it must be set
    before triton is first imported: the cases run in a fresh process that sets it."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=1200,
                          cwd=CASES.parents[1], check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


def test_direct_launch_passes_no_empty_hook() -> None:
    """A direct launch hands the launcher a launch hook only when there is one to call: Triton's HookChain (never
    None since 3.6) counts as none while empty, and as itself once a profiler adds to it."""
    from triton.knobs import HookChain

    from anychip.kernels.gpu.direct import _hook

    def probe(meta) -> None:
        del meta

    chain = HookChain()
    assert _hook(None) is None and _hook(chain) is None
    chain.add(probe)
    assert _hook(chain) is chain and _hook(probe) is probe
    chain.remove(probe)
    assert _hook(chain) is None
