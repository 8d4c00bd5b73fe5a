"""Launchers for the Triton W4A8 kernels: tile configs and split-K.

Four regimes by tokens M: gemv (M = 1: a GEMV on the CUDA cores, dp4a on the weight words, that quantizes the
token into the activation words it needs inside its own programs, or after one small kernel did; the tensor-core
decode tiles compete with it in tuning), decode (M <= 16: memory-bound; 16-row tiles and split-K to put several
programs on every multiprocessor), mid (M <= 64) and prefill (compute-bound; 64-128 row tiles on Hopper's
wgmma). Each regime has a few candidate configs, the first being the default. Which one serves a shape (regime,
or M's octave for prefill; N, K, G) is decided at load by tuning.py (a shipped table, a disk cache, or timing the
candidates once) and remembered here for the process (`remember`, `tuned()`, `clear_tuning()`); a call never
times anything: a shape nobody tuned runs its regime's default config.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from anychip.kernels.gpu import gluon_w4a8 as gw
from anychip.kernels.gpu import triton_w4a8 as k
from anychip.kernels.gpu.direct import Direct
from anychip.kernels.gpu.gluon_w4a8 import WgmmaConfig
from anychip.kernels.hooks import DeviceCounter

DECODE_M = 16
MID_M = 64
MAX_SPLIT_K = 16
LOCKS = 1 << 16  # split-K semaphores a (device, stream): one per output tile
# Every kernel's multiply-then-add (the group rescale acc + f * s, the GEMV's, the quantization's) compiled as one
# fused multiply-add, asked for by name: Triton up to 3.9 fuses by default, and later releases are to stop doing so
# unless asked, which would round those sums twice and change outputs in their last bits.
FP_FUSION = {"enable_fp_fusion": True}


WARPS = (1, 2, 4, 8, 16)  # num_warps a Triton launch takes


@dataclass(frozen=True)
class GemmConfig:
    """One tiling of the GEMM.  block_k: input channels a main-loop step (a multiple of G; smaller means one
    group a step).  swap: compute W @ X^T so the weight tile is the MMA's M side (tokens on its narrow N side).
    split_k: programs along K; the last one to finish a tile sums the partials (no second kernel).
    pipe: rescale a group's integer sums one step later, while the next group's dot runs (same bits).
    fcvt: convert a group's int32 sums to fp32 with an integer add and an exact fp32 subtraction instead of the
    conversion instruction, which NVIDIA's throughput tables put at a quarter of the FMA rate or less (same bits).
    Measured on an H100: 1.5-1.8x faster for 128 x 256 tiles, whose conversions bind, and no gain for the fastest
    (128 x 64), so no candidate below takes it.
    cat: the activations come in split order (quantize_act(x, split=G)), so a group's weight tile is its low
    nibbles' half, then its high ones', with no byte interleaving (same bits; see triton_w4a8._group_dot16)."""

    block_m: int
    block_n: int
    block_k: int
    swap: bool = False
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    pipe: bool = False
    fcvt: bool = False
    cat: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmConfig.{name}={value}: a power of two >= 16")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"GemmConfig.split_k={self.split_k}: 1..{MAX_SPLIT_K}")
        if self.num_stages < 1 or self.group_m < 1 or self.num_warps not in WARPS:
            raise ValueError(f"GemmConfig num_stages={self.num_stages}, group_m={self.group_m} (each at least 1) or "
                             f"num_warps={self.num_warps} (one of {WARPS})")


@dataclass(frozen=True)
class GemvConfig:
    """One tiling of the batch-one GEMV (_w4a8_gemv_kernel): block_n output channels a program, block_k input
    channels a main-loop step (a multiple of G), split_k programs along K (summed by the last, as GemmConfig's).
    fused: the GEMV quantizes the token itself (one launch); else quantize_words runs first (two launches).
    ahead: main-loop steps of weights requested beyond the one computing (1, or 2 for long programs)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    fused: bool = False
    ahead: int = 1

    def __post_init__(self) -> None:
        if self.num_warps not in WARPS:
            raise ValueError(f"GemvConfig.num_warps={self.num_warps}: one of {WARPS}")
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 8 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name}={value}: a power of two >= 8")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"GemvConfig.split_k={self.split_k}: 1..{MAX_SPLIT_K}")
        if self.ahead not in (1, 2):
            raise ValueError(f"GemvConfig.ahead={self.ahead}: 1 or 2")


Config = GemmConfig | GemvConfig | WgmmaConfig
#: A config's kind as tuning tables and the coverage report name it.
CONFIG_KINDS: dict[str, type] = {"gemm": GemmConfig, "gemv": GemvConfig, "wgmma": WgmmaConfig}


def config_kind(cfg: Config) -> str:
    return next(kind for kind, cls in CONFIG_KINDS.items() if isinstance(cfg, cls))


def gemv_fits(kk: int, g: int) -> str | None:
    """None when the GEMV can run this K and G (whole int32 weight words, power-of-two groups), else why not."""
    if kk % 8 or g % 8 or g & (g - 1):
        return f"K={kk}, G={g}: the GEMV reads whole int32 words of eight weights and power-of-two groups"
    return None


# (block_n, block_k, num_warps, programs per multiprocessor that split-K aims for[, steps ahead]); the first is the
# default. Short programs, many in flight: a program's loads are its K steps' words, so split-K keeps HBM busy; the
# narrow 1024-channel steps load a small matrix's whole K stretch at once, with no split to sum. The last three:
# fewer, longer programs (one a multiprocessor or two), each quantizing the token for more rows, with two steps of
# weights in flight (docs/gpu-notes.md, session 8).
_GEMV = ((64, 512, 4, 4), (128, 256, 4, 4), (32, 512, 2, 8), (64, 256, 4, 8), (128, 512, 8, 2), (256, 256, 8, 2),
         (16, 1024, 4, 8), (32, 1024, 4, 8), (64, 256, 4, 1, 2), (128, 256, 8, 1, 2), (32, 512, 4, 2, 2))

# (block_m, block_n, block_k, swap, num_warps, num_stages, programs per multiprocessor that split-K aims for
# [, flags: "p" pipe, "s" the streaming split of split_for]); the first of each regime is its default. Decode aims at
# several programs per multiprocessor, each streaming a short stretch of K: a program's K loop is a chain of memory
# latencies, so short chains and many of them in flight keep HBM busy. The two "s" rows replaced (16, 64, 512,
# False, 4, 2, 4) and (16, 64, 256, True, 4, 3, 4), which neither shipped table ever picked: in a sweep of 43 tiles
# at M = 16 on an H100 (docs/gpu-notes.md, session 35) the best at four of five shapes was 32 or 64 channels wide,
# K steps of 256, 2-4 splits, and took 0.85-0.94x the time of the best of the other rows.
_DECODE = ((16, 32, 512, False, 4, 2, 8), (16, 32, 256, False, 4, 3, 8), (16, 32, 256, False, 4, 3, 4, "s"),
           (16, 64, 256, False, 4, 3, 2, "s"))
_MID = ((64, 64, 128, False, 4, 4, 2), (32, 64, 256, False, 4, 4, 2),  # 64x128 with 4 warps spilled on sm_90
        (64, 64, 128, False, 4, 4, 2, "p"),
        # three stages: the two of a 72-tile sweep at M = 64 that the re-tune then picked, 1.00-1.17x faster on
        # 11 of the 14 shipped shapes (docs/gpu-notes.md, session 15)
        (32, 64, 128, False, 4, 3, 2), (64, 64, 256, False, 4, 3, 1))
_PREFILL = ((128, 64, 128, False, 4, 4, 1), (128, 128, 128, False, 8, 3, 1), (128, 128, 128, True, 8, 3, 1, "c"),
            (64, 128, 128, False, 4, 4, 1), (128, 64, 256, False, 4, 3, 1), (128, 128, 256, True, 8, 3, 1, "c"),
            (128, 64, 128, False, 4, 4, 1, "p"), (128, 128, 128, False, 8, 3, 1, "p"),
            (128, 128, 128, True, 8, 3, 1, "p", "c"), (128, 64, 128, True, 4, 4, 1, "c"))
# "c" (GemmConfig.cat): the swap tiles read split-order activations. On an H100 (session 44, docs/gpu-notes.md)
# swap 128 x 64 on split order was the fastest tile at all seven shapes timed (M 512 to 4,096, K 2,048 / 6,144),
# 1.18-1.28x the 128 x 64 tile the tables picked most, and swap 128 x 128 went 1.13-1.18x faster with it.
# No prefill candidate takes GemmConfig.fcvt: on an H100 (session 34, docs/gpu-notes.md) it made the fastest tile
# (128 x 64, pipe) 0.91-1.01x as fast at 31 shapes, so it would only lengthen tuning at a first start.


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's launch arithmetic: plain integers (triton.cdiv is a ConstexprFunction in recent
    Triton, about 3 us a call, and every eager linear made seven such calls)."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (x >= 1), as triton.next_power_of_2, in plain integers."""
    return 1 << (x - 1).bit_length()


def regime(m: int) -> str:
    return "gemv" if m == 1 else "decode" if m <= DECODE_M else "mid" if m <= MID_M else "prefill"


@functools.cache
def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any plausible GPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_for(m: int, n: int, k: int, g: int, block_m: int, block_n: int, block_k: int, per_sm: int,
              sms: int, streaming: bool = False) -> int:
    """Programs along K: enough for `per_sm` programs a multiprocessor, each with at least one main-loop step, and
    none where the tiles alone make half of that.  streaming: each program at least two steps, and split wherever
    the tiles make fewer than per_sm a multiprocessor (a batched-decode tile streams its weights: on an H100 two
    splits of 448 tiles of 32 channels took 15% less time than three or four; none was not timed)."""
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    steps = cdiv(k // g, max(block_k, g) // g)
    if not streaming and tiles * 2 > per_sm * sms:
        return 1
    return max(1, min(cdiv(per_sm * sms, tiles), steps // 2 if streaming else steps, MAX_SPLIT_K))


# (block_m, block_n, num_warps, stages) of the Gluon GEMM (gluon_w4a8.py), timed beside the prefill tiles on sm_90:
# 64 accumulator registers a thread or fewer (128 x 128 with 8 warps spills)
_WGMMA = ((128, 64, 8, 4), (64, 128, 8, 4), (128, 64, 8, 3))


def candidates(m: int, n: int, k: int, g: int, sms: int = 132, wgmma: bool = False) -> list[Config]:
    """The configs tuning times for M's regime (the first is the default): at M = 1 the GEMV's where the shape
    fits it, then the tensor-core decode tiles; for prefill with `wgmma` (an sm_90 GPU whose Triton has Gluon:
    wgmma_capable), also the Gluon GEMM's tiles where the shape fits them (never the default)."""
    out: list[Config] = []
    if regime(m) == "gemv" and gemv_fits(k, g) is None:
        # fused (one launch): it beat the two-launch GEMV on all 14 shapes of the H200 table, by 1.04-1.41x
        for bn, bk, warps, per_sm, *ahead in _GEMV:
            bk = max(bk, g)
            out.append(GemvConfig(bn, bk, split_for(1, n, k, g, 16, bn, bk, per_sm, sms), warps, fused=True,
                                  ahead=ahead[0] if ahead else 1))
    table = {"gemv": _DECODE, "decode": _DECODE, "mid": _MID, "prefill": _PREFILL}[regime(m)]
    for bm, bn, bk, swap, warps, stages, per_sm, *flags in table:
        bk = max(bk, g)
        split = split_for(m, n, k, g, bm, bn, bk, per_sm, sms, streaming="s" in flags)
        out.append(GemmConfig(bm, bn, bk, swap, split, warps, stages, pipe="p" in flags, cat="c" in flags))
    if wgmma and regime(m) == "prefill" and gw.wgmma_fits(m, n, k, g) is None:
        out += [WgmmaConfig(bm, bn, warps, stages) for bm, bn, warps, stages in _WGMMA]
    return list(dict.fromkeys(out))  # two table rows can give one config at a shape (split-K capped): time it once


@functools.cache
def wgmma_capable(device: torch.device) -> bool:
    """Whether the Gluon GEMM can run on `device`: an sm_90 GPU (wgmma, TMA) and a Triton with Gluon."""
    return (device.type == "cuda" and gw.gluon is not None
            and torch.cuda.get_device_capability(indexed(device)) == (9, 0))


_TUNED: dict[tuple, Config] = {}  # process lifetime, like Triton's own autotune cache


def tuned() -> dict[tuple, Config]:
    return dict(_TUNED)


def clear_tuning() -> None:
    _TUNED.clear()


def quantize_act(x: torch.Tensor, split: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) bf16/fp16/fp32 -> xq (M, K) int8, sx (M, 1) fp32; bit-exact with quantize_activations_ref.
    split = G: each group's columns in gluon_w4a8.split_groups' order (the Gluon GEMM's input)."""
    m, kk = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty((m, kk), dtype=torch.int8, device=x.device)
    sx = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _run(k._quantize_rows_kernel, (m,), (x, xq, sx, kk, x.stride(0), xq.stride(0)),
             quantize_options(kk, split=split))
    return xq, sx


@functools.lru_cache(maxsize=1024)
def quantize_options(kk: int, pre: int = 0, split: int = 0) -> dict[str, int]:
    """The quantization kernels' compile-time options for rows of K (precompile.py compiles the same); pre: the
    prologue's kind (Prologue.kind), 0 for none; split: see quantize_act.  Cached: one dict a shape, which nobody
    mutates."""
    block = min(next_pow2(kk), 4096)
    return {"BLOCK": block, "num_warps": 4 if block <= 1024 else 8, **({"PRE": pre} if pre else {}),
            **({"SPLIT": split} if split else {}), **FP_FUSION}


def _run(kernel, grid: tuple[int, ...], args: tuple, options: dict):
    """Launch `kernel`: directly (direct.py) where its first argument is a CUDA tensor, else through the JIT (the
    interpreter on CPU tensors).  Returns the compiled kernel (None interpreted)."""
    if not args[0].is_cuda:
        return kernel[grid](*args, **options)
    launcher = _DIRECT.get(kernel)
    if launcher is None:
        launcher = _DIRECT[kernel] = Direct(kernel)
    return launcher(grid, args, options)


_DIRECT: dict[object, Direct] = {}


def w4a8_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, n: int, kk: int,
    group_size: int, config: Config | None = None, counter: DeviceCounter | None = None,
) -> torch.Tensor:
    """x (M, K) bf16/fp16/fp32 -> (M, N) in x's dtype: the activations quantized (quantize_act, or for the GEMV
    quantize_words, or inside a fused GEMV), then the GEMM or GEMV. config: the serving config of M's bucket unless
    given."""
    m = x.shape[0]
    if config is None:
        config = serving_config(m, n, kk, group_size, x.device)
    if isinstance(config, GemvConfig):
        _check_gemv(config, m, kk, group_size)
        _check(x, weight, scales, n, kk, group_size, activations=False)
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if n and config.fused:
            launch_gemv(config, x if x.stride(1) == 1 else x.contiguous(), None, weight, scales, bias, n, kk,
                        group_size, out, counter)
        elif n:
            xw, sx = quantize_words(x)
            launch_gemv(config, xw, sx, weight, scales, bias, n, kk, group_size, out, counter)
        return out
    if split_order(config):
        return _split_linear(*quantize_act(x, group_size), weight, scales, bias, n, kk, group_size, x.dtype, config,
                             counter)
    xq, sx = quantize_act(x)
    return w4a8_linear_q(xq, sx, weight, scales, bias, n, kk, group_size, x.dtype, config, counter)


def w4a8_linear_pre(
    x: torch.Tensor, pre: Prologue, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, n: int,
    kk: int, group_size: int, config: Config | None = None, counter: DeviceCounter | None = None,
) -> torch.Tensor:
    """The W4A8 linear of what vLLM computes ahead of it (`pre`: its RMSNorm, or SiluAndMul) on x (M, K) or
    (M, 2K) -> (M, N) in x's dtype, `pre` computed inside the kernels: at one token inside the fused GEMV (one launch
    for it, the quantization and the GEMV), else by one kernel that computes and quantizes each token for the GEMM.
    A fused_add_rms_norm's residual_out receives the new residual x + residual."""
    m = x.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    _check_pre(x, pre, kk)
    if config is None:
        config = serving_config(m, n, kk, group_size, x.device)
    if isinstance(config, GemvConfig) and config.fused:
        _check_gemv(config, m, kk, group_size)
        _check(x[:, :kk], weight, scales, n, kk, group_size, activations=False)
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        launch_gemv(config, x, None, weight, scales, bias, n, kk, group_size, out, counter, pre)
        if n == 0 and pre.kind == 2:  # no GEMV program ran to write the residual
            pre_quantize(x, pre, kk)
        return out
    if split_order(config):
        return _split_linear(*pre_quantize(x, pre, kk, group_size), weight, scales, bias, n, kk, group_size,
                             x.dtype, config, counter)
    xq, sx = pre_quantize(x, pre, kk)
    return w4a8_linear_q(xq, sx, weight, scales, bias, n, kk, group_size, x.dtype, config, counter)


def pre_quantize(x: torch.Tensor, pre: Prologue, kk: int, split: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, pre.k_in(K)) -> the INT8 activations (M, K) and scales (M, 1) of pre(x), writing a fused_add_rms_norm's
    residual_out; split: see quantize_act."""
    m = x.shape[0]
    xq = torch.empty((m, kk), dtype=torch.int8, device=x.device)
    sx = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        r, nw, ro, eps = pre.inputs()
        _run(k._pre_quantize_rows_kernel, (m,), (x, r, nw, ro, xq, sx, kk, eps, x.stride(0),
                                                0 if r is None else r.stride(0), 0 if ro is None else ro.stride(0),
                                                xq.stride(0)), quantize_options(kk, pre.kind, split))
    return xq, sx


def _check_pre(x: torch.Tensor, pre: Prologue, kk: int) -> None:
    width = pre.k_in(kk)
    if not x.dtype.is_floating_point or x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"the input of {type(pre).__name__} must be (M, {width}) floats, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if not isinstance(pre, Norm):
        return
    if pre.weight.dtype != x.dtype or tuple(pre.weight.shape) != (kk,) or not pre.weight.is_contiguous():
        raise ValueError(f"the norm's weight must be ({kk},) {x.dtype} contiguous, got {pre.weight.dtype} "
                         f"{tuple(pre.weight.shape)}")
    for name in ("residual", "residual_out"):
        t = getattr(pre, name)
        if (t is None) != (pre.residual is None) or t is not None and (
                t.dtype != x.dtype or t.shape != x.shape or t.stride(1) != 1):
            raise ValueError(f"norm.{name} must be {'absent' if pre.residual is None else 'like the input'}, "
                             f"got {None if t is None else (t.dtype, tuple(t.shape), t.stride())}")


QUANTIZE_ONE_PASS = 16384  # channels a token up to which _quantize_words_kernel holds the row in registers


def quantize_words(x: torch.Tensor, one_pass_max: int = QUANTIZE_ONE_PASS) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) floats -> xw (M, 2, K/8) int32 (the GEMV's activation words), sx (M,) fp32: the same scale and INT8
    values as quantize_act, packed (K a multiple of 8).  one_pass_max: see quantize_words_options (tests)."""
    m, kk = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    xw = torch.empty((m, 2, kk // 8), dtype=torch.int32, device=x.device)
    sx = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        _run(k._quantize_words_kernel, (m,), (x, xw, sx, kk, kk // 8, x.stride(0)),
             quantize_words_options(kk, one_pass_max))
    return xw, sx


@functools.lru_cache(maxsize=1024)
def quantize_words_options(kk: int, one_pass_max: int = QUANTIZE_ONE_PASS) -> dict[str, int]:
    """_quantize_words_kernel's compile-time options for rows of K (precompile.py compiles the same): the whole row
    in one block up to one_pass_max channels, else blocks of 4096."""
    span = next_pow2(max(kk, 8))
    one = span <= one_pass_max
    block = span if one else min(4096, next_pow2(max(one_pass_max, 8)))
    return {"BLOCK": block, "WBLOCK": block // 8, "ONE_PASS": one, "num_warps": 4 if block <= 2048 else 8,
            **FP_FUSION}


def words_of(xq: torch.Tensor) -> torch.Tensor:
    """(M, K) int8 -> (M, 2, K/8) int32 in quantize_words' order: byte b of word j holds k = 8j + 2b (+ 1 for the
    odd words), little-endian as the GPU reads them."""
    return torch.stack((xq[:, 0::2].contiguous().view(torch.int32), xq[:, 1::2].contiguous().view(torch.int32)), 1)


def w4a8_linear_q(
    xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
    n: int, kk: int, group_size: int, out_dtype: torch.dtype, config: Config | None = None,
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
    if isinstance(config, GemvConfig):
        _check_gemv(config, m, kk, group_size)
        if config.fused:  # the INT8 activations are given: the same GEMV on their words
            config = replace(config, fused=False)
        launch_gemv(config, words_of(xq), sx, weight, scales, bias, n, kk, group_size, out, counter)
    elif split_order(config):  # given in column order: one more pass to reorder them
        launch_config(config, gw.split_groups(xq, group_size).contiguous(), sx, weight, scales, bias, n, kk,
                      group_size, out, counter)
    else:
        launch_config(config, xq, sx, weight, scales, bias, n, kk, group_size, out, counter)
    return out


def split_order(config: Config) -> bool:
    """Whether `config`'s GEMM reads each group's activations in split order (gluon_w4a8.split_groups: even
    columns, then odd): the Gluon GEMM's, and the Triton GEMM's with GemmConfig.cat."""
    return isinstance(config, WgmmaConfig) or isinstance(config, GemmConfig) and config.cat


def _split_linear(xs: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None, n: int, kk: int, g: int, out_dtype: torch.dtype, config: Config,
                  counter: DeviceCounter | None) -> torch.Tensor:
    """A split_order config's GEMM on activations quantized in split order (quantize_act / pre_quantize with
    split=G)."""
    m = xs.shape[0]
    _check(xs, weight, scales, n, kk, g)
    out = torch.empty((m, n), dtype=out_dtype, device=xs.device)
    if m and n:
        launch_config(config, xs, sx.reshape(-1).float().contiguous(), weight, scales, bias, n, kk, g, out, counter)
    return out


def _check_gemv(config: GemvConfig, m: int, kk: int, g: int) -> None:
    if m != 1:
        raise ValueError(f"{config} serves one token, got M={m}")
    if why := gemv_fits(kk, g):
        raise ValueError(f"{config}: {why}")
    if config.block_k % g:
        raise ValueError(f"{config}: block_k is not a multiple of G={g}")


_NO_PROLOGUE = (None, None, None, 0.0)  # the kernels' (residual, norm weight, residual_out, eps) without a prologue


@dataclass(frozen=True)
class Prologue:
    """What vLLM computes ahead of a linear, computed inside its kernels instead (w4a8_linear_pre; the kernels'
    PRE): `Norm` or `SiluMul`."""

    @property
    def kind(self) -> int:
        raise NotImplementedError

    def inputs(self) -> tuple:
        """The kernels' (residual, norm weight, residual_out, eps) arguments."""
        return _NO_PROLOGUE

    def k_in(self, kk: int) -> int:
        """Channels of the input row for a linear of K input channels."""
        return kk


@dataclass(frozen=True)
class Norm(Prologue):
    """vLLM's RMSNorm: weight (K,) in the input's dtype, eps; residual (M, K) for fused_add_rms_norm (None:
    rms_norm), whose sum with the input the kernels write to residual_out."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None

    @property
    def kind(self) -> int:
        return 1 if self.residual is None else 2

    def inputs(self) -> tuple:
        return (self.residual, self.weight, self.residual_out, float(self.eps))


@dataclass(frozen=True)
class SiluMul(Prologue):
    """vLLM's SiluAndMul: the input row is 2K wide, silu(first half) * second half feeds the linear."""

    @property
    def kind(self) -> int:
        return 3

    def k_in(self, kk: int) -> int:
        return 2 * kk


def launch_gemv(cfg: GemvConfig, xw, sx, weight, scales, bias, n, kk, g, out,
                counter: DeviceCounter | None = None, pre: Prologue | None = None):
    """Runs the GEMV with `cfg` into `out` (1, N): xw (1, 2, K/8) the token's activation words and sx its scale,
    or (cfg.fused) xw the token's (1, K) float row and sx None; with `pre` (fused only), the row is the input of
    what vLLM computes ahead of the linear."""
    parts = locks = None
    split = gemv_split(cfg, n)
    if split > 1:
        parts = torch.empty((split, n), dtype=torch.float32, device=xw.device)
        locks = _locks(xw.device)
    cell, slot = (counter.cell, counter.slot) if counter is not None else (None, None)
    sx = None if cfg.fused else sx.reshape(-1).float()
    grid, args, options = gemv_launch(cfg, n, kk, g, xw, sx, weight.view(torch.int32), scales, bias, out, parts,
                                      locks, cell, slot, pre)
    return _run(k._w4a8_gemv_kernel, grid, args, options)


def gemv_split(cfg: GemvConfig, n: int) -> int:
    return cfg.split_k if cdiv(n, cfg.block_n) <= LOCKS else 1


def gemv_launch(cfg: GemvConfig, n, kk, g, xw, sx, weight32, scales, bias, out, parts, locks, cell, slot,
                pre: Prologue | None = None, pdl: bool | None = None) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, arguments, compile-time options) of one GEMV launch (the launch's and precompile.py's). pdl: launch
    it as a programmatic dependent launch (None: where `gemv_pdl` says xw's device can)."""
    split = gemv_split(cfg, n)
    if pdl is None:
        pdl = isinstance(xw, torch.Tensor) and gemv_pdl(xw.device)
    grid = (cdiv(n, cfg.block_n), split)
    pre_args = _NO_PROLOGUE if pre is None else pre.inputs()
    args = (xw, sx, weight32, scales, bias, out, parts, locks, cell, slot, n, kk, kk // 8, *pre_args)
    if pre is not None and not cfg.fused:
        raise ValueError(f"{cfg}: {type(pre).__name__} runs inside the fused GEMV only")
    return grid, args, _gemv_options(cfg, kk, g, split, bias is not None, cell is not None, _compiled(weight32),
                                     0 if pre is None else pre.kind, pdl)


_PDL = {"enabled": True}  # process-wide, as direct.py's settings


def set_pdl(on: bool) -> None:
    """GEMVs launched as programmatic dependent launches where the GPU can (the default) or not (the route applies
    the policy's gpu_pdl: ANYCHIP_GPU_PDL=0)."""
    _PDL["enabled"] = bool(on)


def gemv_pdl(device: torch.device) -> bool:
    """Whether a GEMV on `device` launches with PDL: on a CUDA GPU of compute capability 9.0 or newer (Hopper's
    griddepcontrol), with a Triton that has gdc_wait, unless set_pdl(False)."""
    return _PDL["enabled"] and device.type == "cuda" and _pdl_capable(indexed(device).index)


@functools.cache
def _pdl_capable(index: int) -> bool:
    import triton.language as tl

    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    has = all(hasattr(cuda, name) for name in ("gdc_wait", "gdc_launch_dependents"))
    return has and torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=4096)
def _gemv_options(cfg: GemvConfig, kk: int, g: int, split: int, has_bias: bool, count: bool, asm: bool,
                  pre: int, pdl: bool = False) -> dict:
    """The GEMV's compile-time options (one dict a combination, which nobody mutates). pdl: the kernel's PDL
    branch and Triton's launch_pdl option, which makes its launcher ask for a programmatic dependent launch."""
    options = dict(G=g, BN=cfg.block_n, BK=cfg.block_k, SPLIT_K=split, HAS_BIAS=has_bias, COUNT=count, ASM=asm,
                   num_warps=cfg.num_warps, **FP_FUSION)
    if cfg.fused:  # the amax pass: the whole row in one block up to 1024 channels a warp (32 fp32 a thread)
        options.update(FUSED=True, XBLOCK=min(next_pow2(max(kk, 8)), 1024 * cfg.num_warps))
    if cfg.ahead != 1:
        options["AHEAD"] = cfg.ahead
    if pre:
        options["PRE"] = pre
    if pdl:
        options.update(PDL=True, launch_pdl=True)
    return options


def _compiled(weight) -> bool:
    """Whether a kernel runs compiled (CUDA tensors, or the dtypes precompile.py passes) and so may use inline PTX:
    Triton's interpreter runs on CPU tensors and spells dp4a and the nibble widening out."""
    return not isinstance(weight, torch.Tensor) or weight.is_cuda


def group_dots(xq: torch.Tensor, weight: torch.Tensor, n: int, kk: int, group_size: int,
               swap: bool = False) -> torch.Tensor:
    """Debug: (M, N, K/G) int32 exact group sums through the GEMM's group-dot code."""
    m = xq.shape[0]
    xq = xq if xq.stride(1) == 1 else xq.contiguous()
    out = torch.empty((m, n, kk // group_size), dtype=torch.int32, device=xq.device)
    bm, bn = (16, 64) if swap else (16, 32)
    if out.numel():
        grid = (cdiv(m, bm), cdiv(n, bn), kk // group_size)
        k._group_dots_kernel[grid](xq, weight, out, m, n, kk, xq.stride(0), G=group_size, BM=bm, BN=bn, SWAP=swap,
                                   ASM=_compiled(weight), **FP_FUSION)
    return out


def _check(xq: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, n: int, kk: int, g: int,
           activations: bool = True) -> None:
    """activations: xq must be the INT8 activations; else a float row for the fused GEMV."""
    if activations and (xq.dtype != torch.int8 or xq.dim() != 2 or xq.shape[1] != kk):
        raise ValueError(f"activations must be (M, K={kk}) int8, got {xq.dtype} {tuple(xq.shape)}")
    if not activations and (not xq.dtype.is_floating_point or xq.dim() != 2 or xq.shape[1] != kk):
        raise ValueError(f"activations must be (M, K={kk}) floats, got {xq.dtype} {tuple(xq.shape)}")
    if weight.dtype != torch.int8 or tuple(weight.shape) != (n, kk // 2) or not weight.is_contiguous():
        raise ValueError(f"weight must be the Triton layout (N={n}, K/2={kk // 2}) int8 contiguous, got "
                         f"{weight.dtype} {tuple(weight.shape)}: prepare it with anychip.kernels.prepare.prepare_w4a8")
    if tuple(scales.shape) != (kk // g, n) or not scales.is_contiguous():
        raise ValueError(f"scales must be (K/G={kk // g}, N={n}) contiguous, got {tuple(scales.shape)}: prepare "
                         "them with anychip.kernels.prepare.prepare_w4a8")


def launch_config(cfg: GemmConfig, xq, sx, weight, scales, bias, n, kk, g, out,
                  counter: DeviceCounter | None = None):
    """Runs the GEMM with `cfg` into `out`; returns its compiled kernel (registers, spills, PTX). A WgmmaConfig
    runs the Gluon GEMM; it and a GemmConfig with cat read xq's columns in split order (split_order)."""
    if isinstance(cfg, WgmmaConfig):
        return gw.w4a8_gemm_wgmma(xq, sx, weight, scales, bias, n, kk, g, out, cfg, _compiled(weight), counter)
    m = xq.shape[0]
    split = split_of(cfg, m, n)
    parts = locks = None
    if split > 1:
        parts = torch.empty((split, m, n), dtype=torch.float32, device=xq.device)
        locks = _locks(xq.device)
    cell, slot = (counter.cell, counter.slot) if counter is not None else (None, None)
    grid, args, options = gemm_launch(cfg, m, n, kk, g, xq, sx, weight, scales, bias, out, parts, locks, cell, slot,
                                      xq.stride(0), out.stride(0))
    return _run(k._w4a8_gemm_kernel, grid, args, options)


def split_of(cfg: GemmConfig, m: int, n: int) -> int:
    """The split-K a launch of `cfg` at M tokens runs (1 past the semaphores' reach)."""
    return cfg.split_k if cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n) <= LOCKS else 1


def gemm_launch(cfg: GemmConfig, m, n, kk, g, xq, sx, weight, scales, bias, out, parts, locks, cell, slot,
                stride_x: int, stride_out: int) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, arguments, compile-time options) of one GEMM launch: the one place they are spelled, for the launch
    and for precompile.py (which passes dtypes where the launch passes tensors: Triton compiles the same kernel)."""
    split = split_of(cfg, m, n)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), split)
    args = (xq, sx, weight, scales, bias, out, parts, locks, cell, slot, m, n, kk, stride_x, stride_out, m * n)
    return grid, args, _gemm_options(cfg, g, split, bias is not None, cell is not None, _compiled(weight))


@functools.lru_cache(maxsize=4096)
def _gemm_options(cfg: GemmConfig, g: int, split: int, has_bias: bool, count: bool, asm: bool) -> dict:
    """The GEMM's compile-time options (one dict a combination, which nobody mutates)."""
    return dict(G=g, BM=cfg.block_m, BN=cfg.block_n, BK=max(cfg.block_k, g), SWAP=cfg.swap, SPLIT_K=split,
                GROUP_M=cfg.group_m, HAS_BIAS=has_bias, COUNT=count, PIPE=cfg.pipe, ASM=asm,
                FCVT=cfg.fcvt, CAT=cfg.cat,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_FUSION)


_LOCKS: dict[tuple[str, int], torch.Tensor] = {}


def _locks(device: torch.device) -> torch.Tensor:
    """Zeroed int32 semaphores, one set per (device, stream): kernels on one stream never overlap, and every
    launch leaves its semaphores at zero (also when replayed from a CUDA graph)."""
    stream = torch._C._cuda_getCurrentRawStream(indexed(device).index) if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _LOCKS:
        _LOCKS[key] = torch.zeros(LOCKS, dtype=torch.int32, device=device)
    return _LOCKS[key]


def compile_report(xq, sx, weight, scales, n: int, kk: int, g: int, cfg: Config) -> dict[str, object]:
    """Run one config and read the compiler's resource report: registers, spills, shared memory, MMA kind (dp4a
    for the GEMV)."""
    out = torch.empty((xq.shape[0], n), dtype=torch.bfloat16, device=xq.device)
    if isinstance(cfg, GemvConfig):
        row = xq[:1].to(torch.bfloat16) if cfg.fused else words_of(xq[:1])  # the fused GEMV quantizes a float row
        compiled = launch_gemv(cfg, row, sx[:1], weight, scales, None, n, kk, g, out[:1])
    else:
        compiled = launch_config(cfg, xq, sx.reshape(-1).float().contiguous(), weight, scales, None, n, kk, g, out)
    ptx = compiled.asm.get("ptx", "")
    mma = ("wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "dp4a" if "dp4a" in ptx
           else "none")
    return {"config": str(cfg), "registers": compiled.n_regs, "spills": compiled.n_spills,
            "shared_bytes": compiled.metadata.shared, "mma": mma}


def remember(m: int, n: int, kk: int, g: int, device: torch.device, cfg: Config) -> None:
    """Serve M's bucket of this shape on `device` with `cfg` for the rest of the process (tuning.py)."""
    _TUNED[_key(m, n, kk, g, device)] = cfg


def config_for(m: int, n: int, kk: int, g: int, device: torch.device) -> Config | None:
    """The config tuning.py settled for this shape's M bucket on this GPU, if it has (else calls run the default)."""
    return _TUNED.get(_key(m, n, kk, g, device))


def serving_config(m: int, n: int, kk: int, g: int, device: torch.device) -> Config:
    """The config a call at M tokens runs: the settled one of its bucket, else the regime's default."""
    return config_for(m, n, kk, g, device) or _default_config(m, n, kk, g, multiprocessors(device))


@functools.lru_cache(maxsize=4096)
def _default_config(m: int, n: int, kk: int, g: int, sms: int) -> Config:
    """The regime's default config (the first candidate), built once a shape: untuned serving (gpu_tuning off)
    asks for it at every call."""
    return candidates(m, n, kk, g, sms)[0]


def indexed(device: torch.device) -> torch.device:
    """"cuda" as the GPU it means ("cuda:0" and "cuda" are one GPU); any other device as it is."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _key(m: int, n: int, kk: int, g: int, device: torch.device) -> tuple:
    bucket = regime(m) if m <= MID_M else min(next_pow2(m), 4096)  # prefill: one entry an octave
    return (bucket, n, kk, g, str(indexed(device)))
