"""Routes for the output head (logits = x @ W^T over the vocabulary), apart from the W4A8 linear routes.

The head stays as the checkpoint has it (BF16, often tied to the input embedding); a head route only chooses the
GEMV that reads it. Two kinds:
    bf16  weight (N, K) bf16, the checkpoint's tensor itself (no copy); BF16 x BF16 products, FP32 accumulation.
    int8  opt-in (KernelPolicy.head == "int8"): weight quantized per output channel at load, (N, K) int8 and
          (N,) fp32 scales; activations per-token INT8; exact INT32 dots. Not the checkpoint's numerics.
The C++ kernels are csrc/head_cpu.h, called through torch.ops.anychip.head_bf16 / head_int8 (registered in C++).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from anychip.kernels import cpu_ext, machine
from anychip.kernels.policy import HEAD_KINDS, KernelPolicy
from anychip.kernels.reference import head_bf16_ref, head_int8_ref, quantize_head_int8_ref
from anychip.kernels.routes.base import NoKernelRoute


@dataclass
class PreparedHead:
    """A head's tensors in its route's layout: weight (N, K) bf16 or int8; scales (N,) fp32 for int8."""

    weight: torch.Tensor
    scales: torch.Tensor | None
    route: HeadRoute

    def logits(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.route.logits(x, self, bias)


class HeadRoute(ABC):
    id: ClassVar[str]
    kind: ClassVar[str]  # "bf16" | "int8"
    device: ClassVar[str] = "cpu"
    summary: ClassVar[str]
    fallback_only: ClassVar[bool] = False
    #: /proc/cpuinfo flags the path needs (x86 names); empty: any CPU.
    flags: ClassVar[tuple[str, ...]] = ()
    #: HeadIsa code in csrc/head_cpu.h.
    code: ClassVar[int] = 0

    @property
    def isa(self) -> str:
        return self.id.rpartition(".")[2]

    def unavailable(self) -> str | None:
        return machine.lacks_x86_flags(self.flags)

    def prepare(self, weight: torch.Tensor, policy: KernelPolicy) -> PreparedHead:
        """weight: the checkpoint's (N, K) head on the CPU."""
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise NoKernelRoute(f"head route {self.id} wants a (N, K) CPU weight, got {tuple(weight.shape)} on "
                                f"{weight.device}")
        ext = cpu_ext.load(policy.build_dir)  # compile now, at load; the ops are registered by the extension
        if self.kind == "int8":
            wq, sw = quantize_head_int8_ref(weight)
            ext.collapse_huge(wq)
            return PreparedHead(wq, sw, self)
        if weight.dtype != torch.bfloat16:
            raise NoKernelRoute(f"head route {self.id} serves a bf16 head, this one is {weight.dtype}: serve the "
                                "model with --dtype bfloat16")
        weight = weight if weight.is_contiguous() else weight.contiguous()
        # the head is read whole at every decode step: 2 MB pages made the AVX2 GEMV 15-18% faster on the 2-core
        # EPYC (csrc/w4a8_cpu.cpp collapse_huge); in place, so a tied embedding keeps its one copy
        ext.collapse_huge(weight)
        return PreparedHead(weight, None, self)

    @abstractmethod
    def logits(self, x: torch.Tensor, head: PreparedHead, bias: torch.Tensor | None) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype."""

    def describe(self) -> dict[str, object]:
        reason = self.unavailable()
        return {"id": self.id, "device": self.device, "kind": self.kind, "available": reason is None,
                "reason": reason, "fallback_only": self.fallback_only, "summary": self.summary}


class CppHead(HeadRoute):
    def logits(self, x, head, bias):
        if self.kind == "int8":
            return torch.ops.anychip.head_int8(x, head.weight, head.scales, bias, self.code)
        return torch.ops.anychip.head_bf16(x, head.weight, bias, self.code)


class Bf16Avx512(CppHead):
    id = "cpu.head_bf16.avx512_bf16"
    kind = "bf16"
    code = 2
    flags = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
    summary = "C++ vdpbf16ps, 32 bf16 pairs per zmm"


class Bf16Avx2(CppHead):
    id = "cpu.head_bf16.avx2"
    kind = "bf16"
    code = 1
    flags = ("avx2", "fma")
    summary = "C++ bf16 -> fp32 by shift and mask, FMA"


class Bf16Portable(CppHead):
    id = "cpu.head_bf16.portable"
    kind = "bf16"
    code = 0
    summary = "C++ scalar"


class Int8Avx512Vnni(CppHead):
    id = "cpu.head_int8.avx512_vnni"
    kind = "int8"
    code = 3
    flags = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
    summary = "C++ vpdpbusd(w ^ 0x80, x) less 128 * sum(x), per-channel INT8 weights, per-token INT8 x"


class Int8Avx2(CppHead):
    id = "cpu.head_int8.avx2"
    kind = "int8"
    code = 1
    flags = ("avx2", "fma")
    summary = "C++ vpmaddubsw(|w|, sign(x, w)), per-channel INT8 weights, per-token INT8 x"


class Int8Portable(CppHead):
    id = "cpu.head_int8.portable"
    kind = "int8"
    code = 0
    summary = "C++ scalar INT8"


class HeadReference(HeadRoute):
    """The torch oracle of each kind (reference.py); fallback only."""

    fallback_only = True
    summary = "torch oracle, slow: fallback only"

    def logits(self, x, head, bias):
        if self.kind == "int8":
            return head_int8_ref(x, head.weight, head.scales, bias)
        return head_bf16_ref(x, head.weight, bias)

    @property
    def isa(self) -> str:
        return "reference"

    def prepare(self, weight: torch.Tensor, policy: KernelPolicy) -> PreparedHead:
        if self.kind == "int8":
            wq, sw = quantize_head_int8_ref(weight)
            return PreparedHead(wq, sw, self)
        return PreparedHead(weight, None, self)


class Bf16Reference(HeadReference):
    id = "reference.head_bf16"
    kind = "bf16"


class Int8Reference(HeadReference):
    id = "reference.head_int8"
    kind = "int8"


#: Best first within a kind.
HEAD_ROUTES: tuple[HeadRoute, ...] = (
    Bf16Avx512(), Bf16Avx2(), Bf16Portable(), Int8Avx512Vnni(), Int8Avx2(), Int8Portable(), Bf16Reference(),
    Int8Reference(),
)


def select_head(policy: KernelPolicy, device: str = "cpu") -> HeadRoute:
    """The head route for `policy.head` on this machine: the best available one, or, when the policy forces a
    linear route, the head route of the same instruction set (portable for portable, the reference for the
    reference) if there is one."""
    kind = policy.head
    if kind not in HEAD_KINDS:
        raise NoKernelRoute(f"unknown head kind {kind!r}: use one of {HEAD_KINDS}")
    if device != "cpu":
        raise NoKernelRoute(f"the anychip head routes serve CPU tensors, the head is on {device}")
    ours = [r for r in HEAD_ROUTES if r.kind == kind]
    if policy.route is not None:
        forced = policy.route.rpartition(".")[2]
        match = [r for r in ours if r.isa == forced and r.unavailable() is None]
        if match:
            return match[0]
    return next(r for r in ours if not r.fallback_only and r.unavailable() is None)
