"""Which implementation serves which device and instruction set.

    device  isa           kernel      implementation
    cpu     avx512_vnni   w4a8_cpu    csrc/w4a8_cpu.cpp, vpdpbusd on u4 (w+8) x s8, 16 rows per zmm
    cpu     avx2          w4a8_cpu    csrc/w4a8_cpu.cpp, vpmaddubsw + vpmaddwd, 8 rows per ymm
    cpu     portable      w4a8_cpu    csrc/w4a8_cpu.cpp, plain C++ (any CPU the compiler targets)
    cpu     kleidiai      kleidiai    torch.ops.aten._dyn_quant_matmul_4bit (aarch64 with KleidiAI only)
    cpu     reference     reference   reference.py in torch: only when the caller allows fallback
    cuda    triton        triton      gpu/triton_w4a8.py, INT8 tensor-core dots on INT4 unpacked in registers

CUDA tensors take the triton route (gpu/prepare.py; the reference on the GPU only as a fallback).

x86 picks the best of avx512_vnni > avx2 > portable; aarch64 picks kleidiai where its constraints hold, else
portable.  ANYCHIP_KERNEL_ISA forces one (tests use it).

The aarch64 route (KleidiAI through torch) has constraints that our own kernels do not:
  - torch built with KleidiAI (torch.backends.kleidiai.is_available()), CPU with dot-product (asimddp; i8mm
    makes it faster);
  - group size a multiple of 32 dividing K (or G == K, channel-wise), group scales stored as BF16;
  - group-wise activations must be fp32 (bf16/fp16 inputs are upcast per call);
  - KleidiAI quantizes activations per token *asymmetrically* and rounds the scales to BF16, so results match
    the reference only within tolerance, not bit-exactly as the x86 kernels do.
It has not been exercised: the machine this was written on is x86 (AVX512-VNNI).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch

from anychip import envs
from anychip.errors import AnychipError

X86_ISAS: tuple[str, ...] = ("avx512_vnni", "avx2", "portable")
ARM_ISAS: tuple[str, ...] = ("kleidiai", "portable")
#: Every value ANYCHIP_KERNEL_ISA (or the `isa` argument) accepts.
ISAS: tuple[str, ...] = ("avx512_vnni", "avx2", "kleidiai", "portable", "triton", "reference")
GROUP_SIZES: tuple[int, ...] = (32, 64, 128)

_X86_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512_vnni": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "avx2": ("avx2", "fma"),
}


class NoKernelRoute(AnychipError, ValueError):
    """No implementation can serve a linear; the message says why and how to proceed."""


@dataclass(frozen=True)
class Implementation:
    """One row of the dispatch table."""

    device: str
    isa: str
    kernel: str
    summary: str


TABLE: tuple[Implementation, ...] = (
    Implementation("cpu", "avx512_vnni", "w4a8_cpu", "C++ vpdpbusd u4 x s8, 16 rows per zmm"),
    Implementation("cpu", "avx2", "w4a8_cpu", "C++ vpmaddubsw + vpmaddwd, 8 rows per ymm"),
    Implementation("cpu", "portable", "w4a8_cpu", "C++ scalar, any CPU"),
    Implementation("cpu", "kleidiai", "kleidiai", "torch aten._dyn_quant_matmul_4bit (aarch64 KleidiAI)"),
    Implementation("cpu", "reference", "reference", "torch oracle from reference.py (fallback only)"),
    Implementation("cuda", "triton", "triton", "Triton INT8 tensor-core dots, INT4 unpacked in registers"),
)


def implementation(isa: str) -> Implementation:
    for row in TABLE:
        if row.isa == isa:
            return row
    raise NoKernelRoute(f"unknown kernel ISA {isa!r}: use one of {ISAS} (e.g. {envs.ANYCHIP_KERNEL_ISA}=avx2)")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (`flags` on x86, `Features` on aarch64); empty if unreadable."""
    try:
        text = open("/proc/cpuinfo").read()
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


def kleidiai_usable() -> bool:
    kleidiai = getattr(torch.backends, "kleidiai", None)
    return (
        is_arm()
        and kleidiai is not None
        and kleidiai.is_available()
        and "asimddp" in cpu_flags()
        and hasattr(torch.ops.aten, "_dyn_quant_matmul_4bit")
    )


@functools.cache
def available_isas() -> tuple[str, ...]:
    """The fast routes this machine can run, best first (the reference route is never listed)."""
    if is_x86():
        flags = cpu_flags()
        return tuple(isa for isa in X86_ISAS if all(f in flags for f in _X86_FLAGS.get(isa, ())))
    if kleidiai_usable():
        return ARM_ISAS
    return ("portable",)


def best_isa() -> str:
    return available_isas()[0]


def kleidiai_accepts(k: int, group_size: int) -> str | None:
    """None when KleidiAI's group-wise kernel can take this shape, else the reason it cannot."""
    if group_size % 32 or k % group_size:
        return f"KleidiAI needs a group size that is a multiple of 32 dividing K (K={k}, G={group_size})"
    return None


def select_isa(isa: str | None, k: int, group_size: int) -> str:
    """The route for a linear: `isa` if given, else $ANYCHIP_KERNEL_ISA, else the best available.

    A forced route that this machine cannot run is an error (never a silent downgrade)."""
    forced = isa or envs.forced_isa()
    if forced is not None:
        implementation(forced)  # validates the name
        if forced == "reference":
            return forced
        if forced not in available_isas():
            raise NoKernelRoute(
                f"kernel ISA {forced!r} is not available on this CPU (available: {available_isas()}): "
                f"unset {envs.ANYCHIP_KERNEL_ISA} or set it to one of those"
            )
        if forced == "kleidiai" and (why := kleidiai_accepts(k, group_size)):
            raise NoKernelRoute(f"{why}: force {envs.ANYCHIP_KERNEL_ISA}=portable instead")
        return forced
    for candidate in available_isas():
        if candidate != "kleidiai" or kleidiai_accepts(k, group_size) is None:
            return candidate
    return "portable"
