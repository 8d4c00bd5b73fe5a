"""Launching the compiled Triton kernels without the JIT's per-call work.

`kernel[grid](*args, **options)` binds every argument by name, specializes each one (its type, a pointer's 16-byte
alignment, an integer equal to 1 or divisible by 16), builds a cache key from all of it and the options, looks the
compiled kernel up, then calls its launcher: 13-30 µs of host time a launch on the H200's host, where the launcher
itself takes about 6 (docs/gpu-notes.md, run 70). An eager W4A8 linear launches two kernels, and a 512-token prefill
that vLLM does not replay from a CUDA graph is bound by host time. Measured gain: 3-7 µs a launch (runs 72, 74).

`Direct` keeps, per (options, specialization of the arguments), the compiled kernel the JIT chose at the first such
launch, and launches it again through its launcher. The specialization is computed here with the JIT's rules; with
`set_check(True)` every direct launch first asks the JIT which kernel it would run (`warmup`, no launch) and
raises if that is not the one about to run (`set_check(True)`: the GPU tests run so). Launch hooks (a profiler's)
get what the JIT would give them. A Triton without the attributes used here, `set_enabled(False)` (the route
prepares with the policy's `gpu_direct_launch`: ANYCHIP_DIRECT_LAUNCH=0), or a CPU tensor (the interpreter) takes
the JIT's path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_INT32 = range(-(2**31), 2**31)
_MAX_ENTRIES = 4096  # specializations a kernel keeps (a bound, not a working set: a model has a few dozen)


def _spec(arg: Any) -> Any:
    """What the JIT specializes an argument on: a tensor's dtype and 16-byte alignment, an integer's being 1,
    divisible by 16 and its width, None, or the Python type of anything else (floats, bools)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if type(arg) is int:
        return arg == 1, arg % 16 == 0, arg in _INT32
    return None if arg is None else type(arg)


_SETTINGS = {"enabled": True, "check": False}  # process-wide, like Triton's own caches


def set_enabled(on: bool) -> None:
    """Direct launches on (the default) or off (every launch through the JIT)."""
    _SETTINGS["enabled"] = bool(on)


def set_check(on: bool) -> None:
    """Check every direct launch against the JIT's choice (tests; costs a JIT lookup a launch)."""
    _SETTINGS["check"] = bool(on)


def check_enabled() -> bool:
    return _SETTINGS["check"]


class Direct:
    """One @triton.jit kernel launched directly.  `options`: its compile-time arguments and compile options
    (num_warps, ...), hashable values; the runtime arguments come first in the kernel's signature, in order, as
    `args` gives them."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._entries: dict[tuple, tuple] = {}  # key -> (compiled kernel, constexpr arguments after the runtime ones)

    def __call__(self, grid: tuple[int, ...], args: tuple, options: dict[str, Any]):
        """Launch on the current CUDA device and stream; returns the compiled kernel (as the JIT's launch does)."""
        api = _launcher_api()
        if api is None:
            return self.kernel[grid](*args, **options)
        device = torch.cuda.current_device()
        key = (device, tuple(options.items()), tuple(map(_spec, args)))
        entry = self._entries.get(key)
        if entry is None:
            return self._first(key, grid, args, options)
        compiled, tail = entry
        if check_enabled():
            self._check(compiled, grid, args, options)
        grid0, grid1, grid2 = (*grid, 1, 1)[:3]
        stream = torch._C._cuda_getCurrentRawStream(device)
        full = args + tail
        enter = _hook(api.runtime.launch_enter_hook)  # a profiler's: it gets the metadata the JIT would give it
        meta = None if enter is None else compiled.launch_metadata(grid, stream, *full)
        compiled.run(grid0, grid1, grid2, stream, compiled.function, compiled.packed_metadata, meta, enter,
                     _hook(api.runtime.launch_exit_hook), *full)
        return compiled

    def _first(self, key: tuple, grid, args: tuple, options: dict[str, Any]):
        """The JIT's launch, which compiles when it must; its kernel is kept for this specialization when the
        signature is the one `Direct` can fill (runtime arguments first, then constexprs)."""
        compiled = self.kernel[grid](*args, **options)
        tail = self._tail(args, options)
        if compiled is not None and tail is not None and hasattr(compiled, "packed_metadata"):
            if len(self._entries) >= _MAX_ENTRIES:
                self._entries.clear()
            self._entries[key] = (compiled, tail)
        return compiled

    def _tail(self, args: tuple, options: dict[str, Any]) -> tuple | None:
        """The arguments after the runtime ones, in signature order: each constexpr's value from `options` or its
        default. None when a runtime parameter is missing or a later parameter is not a constexpr."""
        params = getattr(self.kernel, "params", None)
        if params is None or len(params) < len(args) or any(p.is_constexpr for p in params[:len(args)]):
            return None
        tail = []
        for p in params[len(args):]:
            if not p.is_constexpr:
                return None
            if p.name in options:
                tail.append(options[p.name])
            elif getattr(p, "has_default", False):
                tail.append(p.default)
            else:
                return None
        return tuple(tail)

    def _check(self, compiled, grid, args: tuple, options: dict[str, Any]) -> None:
        chosen = self.kernel.warmup(*args, grid=grid, **options)
        if chosen is not compiled:
            raise RuntimeError(f"anychip: the direct launch of {_name(self.kernel)} "
                               "would run another specialization than Triton's JIT picks for these arguments "
                               f"({[_spec(a) for a in args]}); set ANYCHIP_DIRECT_LAUNCH=0 and report this")


def _hook(hook):
    """A launch hook, or None where there is none to call: Triton 3.6 keeps its hooks in a `HookChain` that is
    never None, and an empty chain would still cost the launch metadata and two calls (about 2-3 µs a launch)."""
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


def _name(kernel) -> str:
    return getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))


def _launcher_api():
    """triton.knobs (the launch hooks the JIT passes to a launcher), or None where this Triton has none or direct
    launches are off (set_enabled)."""
    return _knobs() if _SETTINGS["enabled"] else None


@functools.cache
def _knobs():
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs if hasattr(knobs, "runtime") else None
