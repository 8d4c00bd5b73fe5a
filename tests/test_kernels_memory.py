"""Memory safety of the CPU kernels: every M from 1 to 40 (each tile size and tail) and large M, every ISA path,
in a child process whose allocator checks its heap (MALLOC_CHECK_=3 aborts on a corrupted chunk). Output values
are compared elsewhere (test_kernels.py); a tile that writes past M corrupts memory without changing them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from anychip.kernels import routes

CHILD = r"""
import sys, torch
import anychip.kernels.ops  # noqa: F401
from anychip.kernels.prepare import prepare_w4a8
isa = sys.argv[1]
torch.manual_seed(0)
for k, n, g in [(576, 960, 64), (1536, 200, 128), (256, 17, 32)]:
    p = prepare_w4a8(torch.randint(-8, 8, (n, k), dtype=torch.int8), torch.rand(n, k // g), g, packed=False, route=isa)
    for m in list(range(1, 41)) + [63, 64, 65, 127, 300, 513]:
        for x in (torch.randn(m, k, dtype=torch.bfloat16), torch.randn(m, 2 * k)[:, :k]):
            torch.ops.anychip.w4a8_linear(x, p.weight, p.scales, None, n, k, g, p.route.code, None)
print("ok")
"""


@pytest.mark.parametrize("isa", [r.id for r in routes.available("cpu") if r.kernel == "w4a8_cpu"])
def test_no_heap_corruption_over_all_tile_sizes(isa):
    env = {**os.environ, "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"}
    proc = subprocess.run([sys.executable, "-c", CHILD, isa], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
