"""Session 42: the shipped Triton GEMM with GemmConfig.cat (split-order activations: a group's weight tile is the
low nibbles' half, then the high ones', so no byte interleaving), with and without swap, beside the shipped serving
config and cuBLAS BF16, in one process (session 41's A/B harness). Compiled for sm_90a on the CPU (Triton 3.6's
ptxas; `.cache`-free: `docs/gpu-runs/session41/sass_counts.py`'s method), the main loop's instructions a warp a group
of 128: shipped 128 x 64 (4 warps) 379; with cat 368; swap 128 x 128 (8 warps) 350, with cat 264 (the 74 byte
permutes that lay the widened weights into the wgmma's register operand are gone).

python docs/gpu-runs/session42/cat_ab.py OUT.json   (PYTHONPATH=$PWD; no vLLM)
"""
import sys
from dataclasses import replace
from pathlib import Path

import torch

from anychip.kernels.gpu import launch
from anychip.kernels.gpu.launch import GemmConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "session41"))
import ab  # noqa: E402

_COLUMNS: dict = {}


def _column_order(xs: torch.Tensor, g: int) -> torch.Tensor:
    """xs (split order) back in column order, once per activation tensor (the first, untimed call makes it)."""
    key = (xs.data_ptr(), tuple(xs.shape))
    if key not in _COLUMNS:
        m, kk = xs.shape
        _COLUMNS[key] = xs.view(m, kk // g, 2, g // 2).transpose(2, 3).reshape(m, kk).contiguous()
    return _COLUMNS[key]


def _run(xs, sx, weight, scales, n, k, g, out, cfg: GemmConfig):
    x = xs if cfg.cat else _column_order(xs, g)
    return launch.launch_config(cfg, x, sx, weight, scales, None, n, k, g, out)


BASE = {
    "t128x64": GemmConfig(128, 64, 128, num_warps=4, num_stages=4),
    "t128x64p": GemmConfig(128, 64, 128, num_warps=4, num_stages=4, pipe=True),
    "swap128x128w8": GemmConfig(128, 128, 128, swap=True, num_warps=8, num_stages=3),
    "swap128x128w8p": GemmConfig(128, 128, 128, swap=True, num_warps=8, num_stages=3, pipe=True),
    "swap128x64w4": GemmConfig(128, 64, 128, swap=True, num_warps=4, num_stages=4),
    "swap64x128w4": GemmConfig(64, 128, 128, swap=True, num_warps=4, num_stages=4),
    "swap64x256w8": GemmConfig(64, 256, 128, swap=True, num_warps=8, num_stages=3),
}
VARIANTS = {}
for name, cfg in BASE.items():
    if name != "t128x64":
        VARIANTS[name] = (_run, {"cfg": cfg}, True)
    VARIANTS[name + "_cat"] = (_run, {"cfg": replace(cfg, cat=True)}, True)
VARIANTS["swap256x64w8_cat"] = (_run, {"cfg": GemmConfig(256, 64, 128, swap=True, num_warps=8, num_stages=3,
                                                          cat=True)}, True)
VARIANTS["swap128x128w8s4_cat"] = (_run, {"cfg": GemmConfig(128, 128, 128, swap=True, num_warps=8, num_stages=4,
                                                            cat=True)}, True)

if __name__ == "__main__":
    ab.run(sys.argv[1], [(4096, 2048, (512, 4096)), (2048, 6144, (512, 4096)), (12288, 2048, (512, 4096)),
                         (2048, 2048, (512, 2048))], VARIANTS)
