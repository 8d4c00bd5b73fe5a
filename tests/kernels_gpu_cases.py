"""Inputs and the tolerance check shared by the Triton kernel tests: compiled on a GPU (test_kernels_gpu.py) and
interpreted on the CPU (test_triton_interpret.py).

Tolerances against the float64 reference:
  fp32 out: |y - ref| <= 1e-5 * |ref| + 1e-5 * max|ref|   (fp32 accumulation over K/G groups)
  bf16 out: |y - ref| <= 2^-7 * |ref| + 1e-5 * max|ref|   (at most one bf16 ulp from the different fp32 sum)
"""

from __future__ import annotations

import torch


def weights(n: int, k: int, g: int, seed: int, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) int8 in [-8, 7] and (N, K/G) fp32 scales, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    if pow2:
        s = 2.0 ** torch.randint(-1, 1, (n, k // g), generator=gen).float()
    else:
        s = torch.rand(n, k // g, generator=gen) * 0.02 + 0.002
    return q, s


def activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 10.0 ** torch.empty(m, 1).uniform_(-3, 3, generator=gen)
    return x.to(dtype)


def assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    rtol = 2.0**-7 if y.dtype in (torch.bfloat16, torch.float16) else 1e-5
    y, ref = y.double().cpu(), ref.double().cpu()
    assert torch.isfinite(y).all()
    bound = rtol * ref.abs() + 1e-5 * ref.abs().max()
    worst = ((y - ref).abs() - bound).max().item()
    assert worst <= 0, f"max excess error {worst:.3g} over the bound (rtol {rtol})"


def config_id(v: object) -> str:
    """A test id for a launch.GemmConfig parameter (tiles, s: swap, p: pipe, f: fcvt, c: cat, k: split-K, w: warps) or a
    GemvConfig (gemv, then block_n x block_k, k, w, f: fused); str otherwise."""
    if hasattr(v, "block_n") and not hasattr(v, "block_m"):
        return f"gemv{v.block_n}x{v.block_k}k{v.split_k}w{v.num_warps}" + ("f" if v.fused else "")
    if hasattr(v, "block_m"):
        flags = ("s" if v.swap else "") + ("p" if v.pipe else "") + ("f" if v.fcvt else "") + (
            "c" if getattr(v, "cat", False) else "")
        return f"{v.block_m}x{v.block_n}x{v.block_k}{flags}k{v.split_k}w{v.num_warps}"
    return str(v)


def new_counter(device: torch.device | str = "cpu", slot: str | None = None):
    """A layer's coverage counter (hooks.DeviceCounter) on `device`, all counts zero, the current slot `slot`
    (a name in hooks.SLOTS; None: slot 0)."""
    from anychip.kernels import hooks

    index = 0 if slot is None else hooks.SLOTS.index(slot)
    return hooks.DeviceCounter(torch.zeros((len(hooks.SLOTS), 2), dtype=torch.int64, device=device),
                               torch.full((1,), index, dtype=torch.int32, device=device))
