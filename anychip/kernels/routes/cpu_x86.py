"""The C++ extension's routes for x86 CPUs (AVX512-VNNI, AVX2) and its portable path (any CPU).

Layout (csrc/w4a8_cpu.cpp reads it):
    weight (NB, K/8, 64) uint8, NB = ceil(N/16) blocks of 16 output rows; byte r*4+j of chunk c holds
           w[r, 8c+j] + 8 in its low nibble and w[r, 8c+4+j] + 8 in its high nibble; padded rows are zero.
    scales (NB, K/G, 16) bf16 where the checkpoint's scales are bf16 (a decode step reads 10% fewer bytes at
           G = 32; the kernels widen them exactly), else fp32.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import ClassVar

import torch

from anychip.kernels import cpu_ext, machine
from anychip.kernels.policy import KernelPolicy
from anychip.kernels.routes.base import CheckpointWeights, LinearProblem, NoKernelRoute, Route

ROWS = 16  # output rows per weight block


def blocked_layout(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) int8, (N, K/G) -> weight (NB, K/8, 64) uint8, scales (NB, K/G, 16), NB = ceil(N/16); the scales
    stay bf16 if they are bf16 and are fp32 otherwise (every value exact either way)."""
    n, k = q.shape
    if k % 8:
        raise NoKernelRoute(f"K={k} is not a multiple of 8: the CPU kernels read 8 input channels per vector")
    nb = -(-n // ROWS)
    pad = nb * ROWS - n
    u = torch.nn.functional.pad(q, (0, 0, 0, pad)).to(torch.int16).add_(8).to(torch.uint8)
    u = u.view(nb, ROWS, k // 8, 2, 4)  # [block, row, chunk, lo/hi, j]
    byte = u[:, :, :, 0, :] | (u[:, :, :, 1, :] << 4)  # (NB, 16, K/8, 4)
    weight = byte.permute(0, 2, 1, 3).reshape(nb, k // 8, 64).contiguous()
    dtype = torch.bfloat16 if scales.dtype == torch.bfloat16 else torch.float32
    s = torch.nn.functional.pad(scales.to(dtype), (0, 0, 0, pad))
    sw = s.view(nb, ROWS, -1).permute(0, 2, 1).contiguous()
    return weight, sw


class HugePageArena:
    """Prepared weights of many linears side by side in slabs of memory backed by 2 MB pages (csrc huge_empty).

    A decode step streams every weight once; with 4 KB pages every page is a TLB miss and a point where the
    hardware prefetchers stop. A small model's linears are far below 2 MB each (SmolLM2-135M: 0.2-1.1 MB), so they
    share slabs: a tensor is a view of its slab, and a slab is freed with the last tensor that views it. Memory is
    only resident where touched, so a slab's unused tail costs at most one 2 MB page. Process-wide, as an allocator
    is: one per process, kept by this module (ARENA)."""

    def __init__(self, slab_bytes: int = 32 << 20):
        self.slab_bytes = slab_bytes
        self._slab: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def copy_of(self, t: torch.Tensor, build_dir: Path | None = None) -> torch.Tensor:
        """A contiguous copy of the CPU tensor t in the arena (64-byte aligned)."""
        nbytes = t.numel() * t.element_size()
        with self._lock:
            if self._slab is None or self._used + nbytes > self._slab.numel():
                size = max(self.slab_bytes, nbytes)
                self._slab, self._used = cpu_ext.load(build_dir).huge_empty(size), 0
            view = self._slab[self._used:self._used + nbytes]
            self._used += -(-nbytes // 64) * 64
        return view.view(t.dtype).view(t.shape).copy_(t)


ARENA = HugePageArena()


class CppRoute(Route):
    """A path of the C++ extension; `code` is its value in the C++ `Isa` enum (csrc/cpu_common.h)."""

    device = "cpu"
    kernel = "w4a8_cpu"
    bit_exact = True
    #: The ops count this route's calls in C++ (hooks.install_kernel_counts), not through hooks.notify.
    counts_in_kernel = True
    #: anychip::w4a8_linear_norm / w4a8_linear_silu_mul compute vLLM's RMSNorm or SiluAndMul while they quantize the
    #: linear's input (csrc/pre_ops.h): no pass of Inductor's ahead of the linear, no intermediate tensor.
    fuses_norm = True
    fuses_silu_mul = True
    fuse_silu_by_default = True
    #: /proc/cpuinfo flags the path needs (x86 names).
    flags: ClassVar[tuple[str, ...]] = ()

    def unavailable(self) -> str | None:
        return machine.lacks_x86_flags(self.flags)

    def rejects(self, problem: LinearProblem) -> str | None:
        if why := super().rejects(problem):
            return why
        return f"K={problem.k} is not a multiple of 8" if problem.k % 8 else None

    def prepare(self, weights: CheckpointWeights, policy: KernelPolicy) -> tuple[torch.Tensor, torch.Tensor]:
        cpu_ext.load(policy.build_dir)  # compile now, at load, not on the first request
        weight, scales = blocked_layout(weights.int8().cpu(), weights.scales.cpu())
        return ARENA.copy_of(weight, policy.build_dir), ARENA.copy_of(scales, policy.build_dir)

    # The ops' C++ CPU kernels (csrc/w4a8_cpu.cpp) serve this route's code without calling these; they are the route's
    # calls for Python callers.
    def linear(self, x, weight, scales, bias, n, k, group_size):
        cpu_ext.load()
        return torch.ops.anychip.w4a8_linear(x, weight, scales, bias, n, k, group_size, self.code, None)

    def linear_q(self, xq, sx, weight, scales, bias, n, k, group_size, out_dtype):
        cpu_ext.load()
        return torch.ops.anychip.w4a8_linear_q(xq, sx, weight, scales, bias, n, k, group_size, self.code, None,
                                               out_dtype)

    def linear_norm(self, x, norm_weight, eps, residual, residual_out, weight, scales, bias, n, k, group_size):
        cpu_ext.load()
        y, rout = torch.ops.anychip.w4a8_linear_norm(x, residual, norm_weight, eps, weight, scales, bias, n, k,
                                                     group_size, self.code, None)
        if residual_out is not None:
            residual_out.copy_(rout)
        return y

    def linear_silu_mul(self, x, weight, scales, bias, n, k, group_size):
        cpu_ext.load()
        return torch.ops.anychip.w4a8_linear_silu_mul(x, weight, scales, bias, n, k, group_size, self.code, None)

    def group_dots(self, xq, weight, scales, n, k, group_size):
        cpu_ext.load()
        return torch.ops.anychip.w4a8_group_dots(xq, weight, scales, n, k, group_size, self.code)


class Avx512Vnni(CppRoute):
    id = "cpu.avx512_vnni"
    aliases = ("avx512_vnni",)
    code = 2
    flags = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
    summary = "C++ vpdpbusd u4 x s8, 16 rows per zmm"


class AmxInt8(Avx512Vnni):
    """cpu.avx512_vnni with the calls of 32 tokens and more (prefill) on AMX-INT8 tiles (`tdpbssd`,
    csrc/w4a8_amx.h): the same layout and the same bits; fewer tokens (decode) take AVX512-VNNI's kernels."""

    id = "cpu.amx_int8"
    aliases = ("amx_int8",)
    code = 5
    flags = (*Avx512Vnni.flags, "amx_tile", "amx_int8")
    summary = "C++ AMX-INT8 tdpbssd tiles from 32 tokens (prefill), cpu.avx512_vnni's kernels below"

    def unavailable(self) -> str | None:
        if why := super().unavailable():
            return why
        if not machine.request_amx_tiles():  # the same request the extension makes (csrc/cpu_common.h amx_usable)
            return "the OS did not grant this process the AMX tile state (Linux arch_prctl ARCH_REQ_XCOMP_PERM)"
        return None

    def off_by(self, policy: KernelPolicy) -> str | None:
        return None if policy.cpu_amx else "turned off by the kernel policy (ANYCHIP_CPU_AMX=0)"


class Avx2(CppRoute):
    id = "cpu.avx2"
    aliases = ("avx2",)
    code = 1
    flags = ("avx2", "fma")
    summary = "C++ vpmaddubsw + vpmaddwd, 8 rows per ymm"


class Portable(CppRoute):
    id = "cpu.portable"
    aliases = ("portable",)
    code = 0
    summary = "C++ scalar, any CPU the compiler targets"
