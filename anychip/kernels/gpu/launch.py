"""Launchers for the Triton W4A8 kernels: tile configs and split-K.

Three regimes by tokens M: decode (M <= 16: memory-bound, a GEMV in disguise; 16-row tiles and split-K to put
several programs on every multiprocessor), mid (M <= 64) and prefill (compute-bound; 64-128 row tiles on Hopper's
wgmma). Each regime has a few candidate configs, the first being the default. Which one serves a shape (regime,
or M's octave for prefill; N, K, G) is decided at load by tuning.py (a shipped table, a disk cache, or timing the
candidates once) and remembered here for the process (`remember`, `tuned()`, `clear_tuning()`); a call never
times anything: a shape nobody tuned runs its regime's default config.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from anychip.kernels.gpu import triton_w4a8 as k
from anychip.kernels.hooks import DeviceCounter

DECODE_M = 16
MID_M = 64
MAX_SPLIT_K = 16
LOCKS = 1 << 16  # split-K semaphores a (device, stream): one per output tile


@dataclass(frozen=True)
class GemmConfig:
    """One tiling of the GEMM.  block_k: input channels a main-loop step (a multiple of G; smaller means one
    group a step).  swap: compute W @ X^T so the weight tile is the MMA's M side (tokens on its narrow N side).
    split_k: programs along K; the last one to finish a tile sums the partials (no second kernel).
    pipe: rescale a group's integer sums one step later, while the next group's dot runs (same bits)."""

    block_m: int
    block_n: int
    block_k: int
    swap: bool = False
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    pipe: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmConfig.{name}={value}: a power of two >= 16")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"GemmConfig.split_k={self.split_k}: 1..{MAX_SPLIT_K}")


# (block_m, block_n, block_k, swap, num_warps, num_stages, programs per multiprocessor that split-K aims for
# [, "p": pipe]); the first of each regime is its default. Decode aims at several programs per
# multiprocessor, each streaming a short stretch of K: a program's K loop is a chain of memory latencies, so short
# chains and many of them in flight keep HBM busy.
_DECODE = ((16, 32, 512, False, 4, 2, 8), (16, 32, 256, False, 4, 3, 8), (16, 64, 512, False, 4, 2, 4),
           (16, 64, 256, True, 4, 3, 4))
_MID = ((64, 64, 128, False, 4, 4, 2), (32, 64, 256, False, 4, 4, 2),  # 64x128 with 4 warps spilled on sm_90
        (64, 64, 128, False, 4, 4, 2, "p"))
_PREFILL = ((128, 64, 128, False, 4, 4, 1), (128, 128, 128, False, 8, 3, 1), (128, 128, 128, True, 8, 3, 1),
            (64, 128, 128, False, 4, 4, 1), (128, 64, 256, False, 4, 3, 1), (128, 128, 256, True, 8, 3, 1),
            (128, 64, 128, False, 4, 4, 1, "p"), (128, 128, 128, False, 8, 3, 1, "p"),
            (128, 128, 128, True, 8, 3, 1, "p"))


def regime(m: int) -> str:
    return "decode" if m <= DECODE_M else "mid" if m <= MID_M else "prefill"


@functools.cache
def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any plausible GPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_for(m: int, n: int, k: int, g: int, block_m: int, block_n: int, block_k: int, per_sm: int,
              sms: int) -> int:
    """Programs along K: enough for `per_sm` programs a multiprocessor, each with at least one main-loop step."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(k // g, max(block_k, g) // g)
    if tiles * 2 > per_sm * sms:
        return 1
    return max(1, min(triton.cdiv(per_sm * sms, tiles), steps, MAX_SPLIT_K))


def candidates(m: int, n: int, k: int, g: int, sms: int = 132) -> list[GemmConfig]:
    table = {"decode": _DECODE, "mid": _MID, "prefill": _PREFILL}[regime(m)]
    out = []
    for bm, bn, bk, swap, warps, stages, per_sm, *flags in table:
        bk = max(bk, g)
        out.append(GemmConfig(bm, bn, bk, swap, split_for(m, n, k, g, bm, bn, bk, per_sm, sms), warps, stages,
                              pipe="p" in flags))
    return out


_TUNED: dict[tuple, GemmConfig] = {}  # process lifetime, like Triton's own autotune cache


def tuned() -> dict[tuple, GemmConfig]:
    return dict(_TUNED)


def clear_tuning() -> None:
    _TUNED.clear()


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) bf16/fp16/fp32 -> xq (M, K) int8, sx (M, 1) fp32; bit-exact with quantize_activations_ref."""
    m, kk = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty((m, kk), dtype=torch.int8, device=x.device)
    sx = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        k._quantize_rows_kernel[(m,)](x, xq, sx, kk, x.stride(0), xq.stride(0), **quantize_options(kk))
    return xq, sx


def quantize_options(kk: int) -> dict[str, int]:
    """The quantization kernel's compile-time options for rows of K (precompile.py compiles the same)."""
    block = min(triton.next_power_of_2(kk), 4096)
    return {"BLOCK": block, "num_warps": 4 if block <= 1024 else 8}


def w4a8_linear_q(
    xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
    n: int, kk: int, group_size: int, out_dtype: torch.dtype, config: GemmConfig | None = None,
    counter: DeviceCounter | None = None,
) -> torch.Tensor:
    """xq (M, K) int8, sx (M, 1) fp32, weight (N, K/2) int8, scales (K/G, N) -> (M, N) out_dtype.
    counter: bumped by the GEMM launch itself (the tuner's timing launches do not count)."""
    m = xq.shape[0]
    _check(xq, weight, scales, n, kk, group_size)
    xq = xq if xq.stride(1) == 1 else xq.contiguous()
    sx = sx.reshape(-1).float().contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if config is None:
        config = serving_config(m, n, kk, group_size, xq.device)
    launch_config(config, xq, sx, weight, scales, bias, n, kk, group_size, out, counter)
    return out


def group_dots(xq: torch.Tensor, weight: torch.Tensor, n: int, kk: int, group_size: int,
               swap: bool = False) -> torch.Tensor:
    """Debug: (M, N, K/G) int32 exact group sums through the GEMM's group-dot code."""
    m = xq.shape[0]
    xq = xq if xq.stride(1) == 1 else xq.contiguous()
    out = torch.empty((m, n, kk // group_size), dtype=torch.int32, device=xq.device)
    bm, bn = (16, 64) if swap else (16, 32)
    if out.numel():
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), kk // group_size)
        k._group_dots_kernel[grid](xq, weight, out, m, n, kk, xq.stride(0), G=group_size, BM=bm, BN=bn, SWAP=swap)
    return out


def _check(xq: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, n: int, kk: int, g: int) -> None:
    if xq.dtype != torch.int8 or xq.dim() != 2 or xq.shape[1] != kk:
        raise ValueError(f"activations must be (M, K={kk}) int8, got {xq.dtype} {tuple(xq.shape)}")
    if weight.dtype != torch.int8 or tuple(weight.shape) != (n, kk // 2) or not weight.is_contiguous():
        raise ValueError(f"weight must be the Triton layout (N={n}, K/2={kk // 2}) int8 contiguous, got "
                         f"{weight.dtype} {tuple(weight.shape)}: prepare it with anychip.kernels.prepare.prepare_w4a8")
    if tuple(scales.shape) != (kk // g, n) or not scales.is_contiguous():
        raise ValueError(f"scales must be (K/G={kk // g}, N={n}) contiguous, got {tuple(scales.shape)}: prepare "
                         "them with anychip.kernels.prepare.prepare_w4a8")


def launch_config(cfg: GemmConfig, xq, sx, weight, scales, bias, n, kk, g, out,
                  counter: DeviceCounter | None = None):
    """Runs the GEMM with `cfg` into `out`; returns its compiled kernel (registers, spills, PTX)."""
    m = xq.shape[0]
    split = split_of(cfg, m, n)
    parts = locks = None
    if split > 1:
        parts = torch.empty((split, m, n), dtype=torch.float32, device=xq.device)
        locks = _locks(xq.device)
    cell, slot = (counter.cell, counter.slot) if counter is not None else (None, None)
    grid, args, options = gemm_launch(cfg, m, n, kk, g, xq, sx, weight, scales, bias, out, parts, locks, cell, slot,
                                      xq.stride(0), out.stride(0))
    return k._w4a8_gemm_kernel[grid](*args, **options)


def split_of(cfg: GemmConfig, m: int, n: int) -> int:
    """The split-K a launch of `cfg` at M tokens runs (1 past the semaphores' reach)."""
    return cfg.split_k if triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) <= LOCKS else 1


def gemm_launch(cfg: GemmConfig, m, n, kk, g, xq, sx, weight, scales, bias, out, parts, locks, cell, slot,
                stride_x: int, stride_out: int) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, arguments, compile-time options) of one GEMM launch: the one place they are spelled, for the launch
    and for precompile.py (which passes dtypes where the launch passes tensors: Triton compiles the same kernel)."""
    split = split_of(cfg, m, n)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    args = (xq, sx, weight, scales, bias, out, parts, locks, cell, slot, m, n, kk, stride_x, stride_out, m * n)
    options = dict(G=g, BM=cfg.block_m, BN=cfg.block_n, BK=max(cfg.block_k, g), SWAP=cfg.swap, SPLIT_K=split,
                   GROUP_M=cfg.group_m, HAS_BIAS=bias is not None, COUNT=cell is not None,
                   PIPE=cfg.pipe, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return grid, args, options


_LOCKS: dict[tuple[str, int], torch.Tensor] = {}


def _locks(device: torch.device) -> torch.Tensor:
    """Zeroed int32 semaphores, one set per (device, stream): kernels on one stream never overlap, and every
    launch leaves its semaphores at zero (also when replayed from a CUDA graph)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _LOCKS:
        _LOCKS[key] = torch.zeros(LOCKS, dtype=torch.int32, device=device)
    return _LOCKS[key]


def compile_report(xq, sx, weight, scales, n: int, kk: int, g: int, cfg: GemmConfig) -> dict[str, object]:
    """Run one config and read the compiler's resource report: registers, spills, shared memory, MMA kind."""
    out = torch.empty((xq.shape[0], n), dtype=torch.bfloat16, device=xq.device)
    compiled = launch_config(cfg, xq, sx.reshape(-1).float().contiguous(), weight, scales, None, n, kk, g, out)
    ptx = compiled.asm.get("ptx", "")
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    return {"config": str(cfg), "registers": compiled.n_regs, "spills": compiled.n_spills,
            "shared_bytes": compiled.metadata.shared, "mma": mma}


def remember(m: int, n: int, kk: int, g: int, device: torch.device, cfg: GemmConfig) -> None:
    """Serve M's bucket of this shape on `device` with `cfg` for the rest of the process (tuning.py)."""
    _TUNED[_key(m, n, kk, g, device)] = cfg


def config_for(m: int, n: int, kk: int, g: int, device: torch.device) -> GemmConfig | None:
    """The config tuning.py settled for this shape's M bucket on this GPU, if it has (else calls run the default)."""
    return _TUNED.get(_key(m, n, kk, g, device))


def serving_config(m: int, n: int, kk: int, g: int, device: torch.device) -> GemmConfig:
    """The config a call at M tokens runs: the settled one of its bucket, else the regime's default."""
    return config_for(m, n, kk, g, device) or candidates(m, n, kk, g, multiprocessors(device))[0]


def indexed(device: torch.device) -> torch.device:
    """"cuda" as the GPU it means ("cuda:0" and "cuda" are one GPU); any other device as it is."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _key(m: int, n: int, kk: int, g: int, device: torch.device) -> tuple:
    bucket = regime(m) if m <= MID_M else min(triton.next_power_of_2(m), 4096)  # prefill: one entry an octave
    return (bucket, n, kk, g, str(indexed(device)))
