"""Facts about the machine that decide which routes can run: architecture and CPU feature flags."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from pathlib import Path


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (`flags` on x86, `Features` on aarch64); empty if unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def is_arm() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


def lacks_x86_flags(flags: tuple[str, ...]) -> str | None:
    """Why a path that needs these x86 /proc/cpuinfo flags cannot run here, or None (no flags: any CPU)."""
    if not flags:
        return None
    if not is_x86():
        return "not an x86 CPU"
    missing = [f for f in flags if f not in cpu_flags()]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


@functools.cache
def request_amx_tiles() -> bool:
    """Ask Linux, once a process, for the AMX tile state where the CPU has AMX (arch_prctl ARCH_REQ_XCOMP_PERM,
    through torch's own call); True when granted. vLLM CPU 0.32's attention runs AMX tile instructions on such CPUs
    without asking, unless something else in the process (oneDNN's own AMX GEMMs) asked first: a model whose
    linears are anychip's then dies with SIGILL in its first attention (seen on an Intel Xeon with amx_tile)."""
    if not is_x86() or "amx_tile" not in cpu_flags():
        return False
    import torch

    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    granted = bool(init()) if init is not None else False
    if not granted:
        print("anychip: this CPU has AMX, but Linux did not grant its tile state to this process: vLLM's AMX "
              "attention may stop with SIGILL", file=sys.stderr)
    return granted


def resident_bytes(statm: Path = Path("/proc/self/statm")) -> int | None:
    """This process's resident memory in bytes (Linux), else None."""
    try:
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def trim_heap() -> int | None:
    """Hand the C heap's freed memory back to the OS (glibc's malloc_trim(0)); the resident bytes that returned,
    or None without glibc. Loading churns through large temporaries (checkpoint tensors converted to the kernels'
    layout, then freed); glibc keeps much of that freed memory mapped: 320-430 MiB of a llama-1b-shape CPU engine's
    2.6 GiB (docs/kernels-cpu.md, "Resident memory")."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return None
    before = resident_bytes()
    trim(0)
    after = resident_bytes()
    return max(0, before - after) if before is not None and after is not None else 0


def inductor_simd() -> str | None:
    """The SIMD ISA Inductor's C++ code is generated for in this process ("avx512 avx512_vnni amx_tile", "avx2",
    ..., "INVALID_VEC_ISA" for scalar code), or None while Inductor has not picked one. Inductor probes each ISA once
    a process by building and loading a test library, and falls back to a narrower one, or to scalar code, without
    a word when a probe fails: slower graphs, and other bits. Starts no probe and imports nothing: a process that
    never loaded Inductor's ISA module has no answer."""
    cpu_vec_isa = sys.modules.get("torch._inductor.cpu_vec_isa")
    if cpu_vec_isa is None:
        return None
    probed = getattr(cpu_vec_isa.valid_vec_isa_list, "cache_info", None)
    if probed is None or not probed().currsize:
        return None
    return str(cpu_vec_isa.pick_vec_isa())


def describe() -> dict[str, object]:
    """What `anychip routes` prints about this machine."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpu_flags": sorted(cpu_flags() & _INTERESTING),
        "torch": torch.__version__,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    }


_INTERESTING = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_int8",
                          "asimd", "asimddp", "i8mm", "sve", "sve2", "bf16"})
