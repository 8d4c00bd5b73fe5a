"""Call observation for the coverage report.

The ops' Python implementation calls `notify(layer_id, tokens)` at run time (inside the opaque custom op, so it
also runs under torch.compile); the vLLM plugin installs the observer that turns these calls into per-layer,
per-phase counts.

The C++ CPU routes run no Python per call: their ops count in a `KernelCounts` table that the plugin installs with
`install_kernel_counts` (the same (layers, phase slots, [calls, tokens]) layout as the CUDA counters below, and the
same slot tensor written before each model step), and never call `notify`.

Under CUDA graphs the op's Python runs once, at capture, and never at replay, so a count kept in Python is
wrong. An observer that wants replays counted returns a `DeviceCounter` from the call; a route whose kernel can
count itself (`counts_on_device`) takes it with `take_device_counter` and bumps it inside its own launch: every
eager run and every replay counts, at no extra launch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from anychip.kernels import cpu_ext

#: Phase slots of a DeviceCounter, in order.
SLOTS = ("warmup", "prefill", "decode")


@dataclass(frozen=True)
class DeviceCounter:
    """Where one layer's kernel launch counts itself, on the layer's device.

    cell: (len(SLOTS), 2) int64, [calls, tokens] per phase slot (tokens: the rows the kernel ran, CUDA-graph
    padding included); slot: (1,) int32, the slot of the forward pass now running, written before each pass.
    """

    cell: torch.Tensor
    slot: torch.Tensor


Observer = Callable[[int, int], "DeviceCounter | None"]
_observer: Observer | None = None
_pending = threading.local()  # the DeviceCounter of the call being made, between notify and the kernel


def notify(layer_id: int, tokens: int) -> None:
    counter = None
    if _observer is not None and layer_id >= 0:
        counter = _observer(layer_id, tokens)
    _pending.counter = counter


_fused: dict[int, set[str]] = {}  # layer id -> what ran inside its kernels ahead of it ("rms_norm", "silu_and_mul")


def note_fused(layer_id: int, what: str) -> None:
    """The linear `layer_id` was called with `what` (vLLM's computation ahead of it) inside its kernels: through
    anychip::w4a8_linear_norm or w4a8_linear_silu_mul on a route that computes it. A flag, not a count: Python
    running only at CUDA-graph capture still sets it."""
    if layer_id >= 0:
        _fused.setdefault(layer_id, set()).add(what)


_FUSED_BITS = {1: "rms_norm", 2: "silu_and_mul"}  # csrc/call_counts.h kFusedNorm, kFusedSiluMul


def fused_layers() -> dict[int, frozenset[str]]:
    """Per layer id, what ran inside its kernels: noted from Python (note_fused) and by the C++ CPU ops, which
    flag their layers themselves (csrc/call_counts.h), when the extension is loaded."""
    fused = {layer: set(what) for layer, what in list(_fused.items())}
    if cpu_ext.loaded() is not None:
        for layer, bits in cpu_ext.loaded().fused_layers():
            fused.setdefault(layer, set()).update(name for bit, name in _FUSED_BITS.items() if bits & bit)
    return {layer: frozenset(what) for layer, what in fused.items()}


def take_device_counter(device: torch.device) -> DeviceCounter | None:
    """The counter the observer handed out for the call in progress (once), if it lives on `device`."""
    counter = getattr(_pending, "counter", None)
    _pending.counter = None
    if counter is None or counter.cell.device != device:
        return None
    return counter


def install(observer: Observer | None) -> Observer | None:
    """Install an observer for the process lifetime (the engine's); returns the previous one."""
    global _observer
    previous, _observer = _observer, observer
    return previous


@contextmanager
def observing(observer: Observer) -> Iterator[None]:
    previous = install(observer)
    try:
        yield
    finally:
        install(previous)


@dataclass(frozen=True)
class KernelCounts:
    """The table the C++ CPU ops count in (csrc/call_counts.h).

    counts: (layers, len(SLOTS), 2) int64 CPU, [calls, tokens] per layer id and phase slot; slot: (1,) int32 CPU,
    the slot of the model step now running. Calls of layer ids outside the table (or -1) are not counted.
    """

    counts: torch.Tensor
    slot: torch.Tensor

    @classmethod
    def zeros(cls, layers: int) -> KernelCounts:
        with torch.inference_mode(False):  # written from outside vLLM's inference mode too (step hook, reports)
            return cls(torch.zeros((layers, len(SLOTS), 2), dtype=torch.int64), torch.zeros(1, dtype=torch.int32))


def install_kernel_counts(table: KernelCounts | None) -> KernelCounts | None:
    """Make the C++ ops count into `table` (None: count nowhere) for the process lifetime (the engine's); returns
    the previous table. Loads (builds, the first time) the CPU extension."""
    counts, slot = cpu_ext.load().set_call_counts(*((table.counts, table.slot) if table is not None else (None, None)))
    return None if counts is None else KernelCounts(counts, slot)


@contextmanager
def counting_in_kernels(table: KernelCounts) -> Iterator[KernelCounts]:
    previous = install_kernel_counts(table)
    try:
        yield table
    finally:
        install_kernel_counts(previous)
