"""Timing GPU kernels as they run in a served model: calls captured in one CUDA graph (as vLLM captures decode
steps, so no Python launch cost hides a short kernel), rotating through weight copies that together exceed the L2
cache (so weights stream from HBM as in a model whose layers do not fit in L2). Used by the tuner and the kernel
benchmark alike."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

DEFAULT_L2_BYTES = 60 * 2**20  # the H200's, where the device does not say
MAX_COPIES = 32


def rotation(nbytes: int, device: torch.device | None = None) -> int:
    """Copies of an operand of `nbytes` that together exceed three times the device's L2 cache."""
    l2 = DEFAULT_L2_BYTES
    if device is not None and device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or l2
    return max(1, min(MAX_COPIES, -(-3 * l2 // max(1, nbytes))))


def graph_ms(calls: list[Callable[[], object]], replays: int = 10, samples: int = 7) -> float:
    """Median time per call (ms) of `calls` captured in one CUDA graph, replayed `replays` times per sample."""
    for fn in calls:  # compile, tune, create cuBLAS handles outside the capture
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (replays * len(calls)))
    del graph
    return statistics.median(times)
