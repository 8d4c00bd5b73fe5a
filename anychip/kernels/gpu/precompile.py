"""Compile the Triton kernels a linear will launch before its first launch, on background threads.

Right after load vLLM runs a warm-up and captures CUDA graphs at some fifty batch sizes. Each first launch of a
(config, specialization) pair compiles a Triton kernel on the capturing thread, one after another: 25 s of a 2B
model's engine start on an H200, against 2 s of graph capture for BF16. Once a shape's configs are known
(tuning.tune_linear, at load), `submit` queues the compiles of every M bucket's config, in each form Triton
specializes the token count into (M = 1, a multiple of 16, neither), on a thread pool, so that they overlap the
rest of loading and torch.compile (Triton's compiler passes and ptxas run outside the GIL); the batch-one bucket's
GEMV config (and the activation packing, when it is not fused) compiles in the one form it is launched in. A launch
that comes before its compile has finished compiles the kernel itself, as it always did; a failed precompile is
logged and changes nothing else. Activations are assumed BF16 (the models vLLM serves here); other dtypes compile
at first launch.

How many threads: KernelPolicy.gpu_precompile (the plugin's from ANYCHIP_GPU_PRECOMPILE: default min(8, CPUs);
0 turns precompiling off).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from anychip.kernels.gpu import gluon_w4a8 as gw
from anychip.kernels.gpu import launch
from anychip.kernels.gpu import triton_w4a8 as kern

_pool: ThreadPoolExecutor | None = None
_futures: list[Future] = []
_done: set[tuple] = set()  # (N, K, G, device) already submitted
_lock = threading.Lock()


def token_counts(bucket: str | int) -> tuple[int, ...]:
    """Token counts that stand for a config bucket's specializations of M: 1, a multiple of 16, neither."""
    if bucket == "gemv":
        return (1,)
    if bucket == "decode":
        return (2, launch.DECODE_M)
    if bucket == "mid":
        return (launch.DECODE_M + 8, 2 * launch.DECODE_M)
    return (int(bucket) - 8, int(bucket))


def gemm_specs(n: int, kk: int, g: int, device: torch.device, buckets: Iterable[str | int],
               scales_dtype: torch.dtype) -> list[tuple[object, tuple[tuple[int, int], tuple, dict]]]:
    """(kernel, (grid, arguments, options)) of every launch form the buckets' configs will take, with dtypes for
    the tensors, as the plugin launches them (counting on the device, no bias; split-K scratch where it splits;
    the GEMV on the activation words of one token, or on its bf16 row when fused)."""
    f32, i8, i32, bf16 = torch.float32, torch.int8, torch.int32, torch.bfloat16
    seen, specs = set(), []
    for bucket in buckets:
        for m in token_counts(bucket):
            cfg = launch.serving_config(m, n, kk, g, device)
            if isinstance(cfg, launch.WgmmaConfig):
                kernel = gw._w4a8_wgmma_kernel
                xs = torch.empty((cfg.block_m, kk), dtype=i8, device=device)  # the TMA descriptor's type
                spec = gw.launch_spec(cfg, xs, m, n, kk, g, f32, i8, scales_dtype, None, bf16, torch.int64, i32)
                key = (cfg, m == 1, m % 16 == 0)
            elif isinstance(cfg, launch.GemvConfig):
                split = launch.gemv_split(cfg, n)
                kernel = kern._w4a8_gemv_kernel
                spec = launch.gemv_launch(cfg, n, kk, g, bf16 if cfg.fused else i32, None if cfg.fused else f32,
                                          i32, scales_dtype, None, bf16, f32 if split > 1 else None,
                                          i32 if split > 1 else None, torch.int64, i32,
                                          pdl=launch.gemv_pdl(device))
                key = (cfg, split)
            else:
                split = launch.split_of(cfg, m, n)
                kernel = kern._w4a8_gemm_kernel
                spec = launch.gemm_launch(cfg, m, n, kk, g, i8, f32, i8, scales_dtype, None, bf16,
                                          f32 if split > 1 else None, i32 if split > 1 else None, torch.int64, i32,
                                          kk, n)
                key = (cfg, split, m == 1, m % 16 == 0)
            if key not in seen:
                seen.add(key)
                specs.append((kernel, spec))
    return specs


def submit(n: int, kk: int, g: int, device: torch.device, buckets: Iterable[str | int],
           scales_dtype: torch.dtype, count: int) -> int:
    """Queue the compiles of one linear shape's kernels on `count` threads (once a shape and device; the pool is
    made by the first call); returns how many were queued."""
    if count == 0 or device.type != "cuda":  # (under Triton's interpreter the tensors are on the CPU)
        return 0
    device = launch.indexed(device)
    key = (n, kk, g, str(device))
    with _lock:
        if key in _done:
            return 0
        _done.add(key)
    jobs = gemm_specs(n, kk, g, device, buckets, scales_dtype)
    jobs.append((kern._quantize_rows_kernel, ((1,), (torch.bfloat16, torch.int8, torch.float32, kk, kk, kk),
                                              launch.quantize_options(kk))))
    if any(kernel is gw._w4a8_wgmma_kernel for kernel, _ in jobs):  # its activations in split order
        jobs.append((kern._quantize_rows_kernel, ((1,), (torch.bfloat16, torch.int8, torch.float32, kk, kk, kk),
                                                  launch.quantize_options(kk, split=g))))
    if any(kernel is kern._w4a8_gemv_kernel and not spec[2].get("FUSED") for kernel, spec in jobs):
        jobs.append((kern._quantize_words_kernel, ((1,), (torch.bfloat16, torch.int32, torch.float32, kk, kk // 8,
                                                          kk), launch.quantize_words_options(kk))))
    with torch.cuda.device(device):  # each kernel's binder made here, on the loading thread: workers never race
        index = torch.cuda.current_device()  # for its creation (Triton keys them by device index)
        for kernel in {kernel for kernel, _ in jobs}:
            if hasattr(kernel, "device_caches"):
                kernel.device_caches[index]
    start = time.perf_counter()
    pool = _executor(count)
    futures = [pool.submit(_compile, kernel, spec, device) for kernel, spec in jobs]
    group = threading.Thread(target=_report, args=(futures, n, kk, g, count, start), daemon=True)
    group.start()
    with _lock:
        _futures.extend(futures)
    return len(jobs)


def drain(timeout: float | None = None) -> bool:
    """Wait for every queued compile (tests; a caller that wants them done); True when none is left running."""
    with _lock:
        pending = list(_futures)
    return not wait(pending, timeout=timeout).not_done


def _executor(count: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="anychip-precompile")
        return _pool


def _compile(kernel, spec: tuple[tuple[int, int], tuple, dict], device: torch.device) -> None:
    grid, args, options = spec
    with torch.cuda.device(device):  # the CUDA current device is per thread
        kernel.warmup(*args, grid=grid, **options)


def _report(futures: list[Future], n: int, kk: int, g: int, count: int, start: float) -> None:
    wait(futures)
    failed = [f.exception() for f in futures if f.exception() is not None]
    took = time.perf_counter() - start
    line = (f"anychip: precompiled {len(futures) - len(failed)} Triton kernels for N={n} K={kk} G{g} in {took:.1f} s "
            f"({count} threads)")
    if failed:
        line += f"; {len(failed)} failed and compile at first launch instead: {failed[0]!r}"
    print(line, file=sys.stderr, flush=True)
