"""Call observation for the coverage report.

The ops call `notify(layer_id, tokens)` at run time (inside the opaque custom op, so it also runs under
torch.compile); the vLLM plugin installs the observer that turns these calls into per-layer, per-phase counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

Observer = Callable[[int, int], None]
_observer: Observer | None = None


def notify(layer_id: int, tokens: int) -> None:
    if _observer is not None and layer_id >= 0:
        _observer(layer_id, tokens)


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
