"""What a kernel route is: one object that knows its constraints, its weight layout and its call.

A route serves the W4A8 linear  y = sx * sum_g sw[n, g] * sum_{k in g} xq[m, k] * wq[n, k]  (+ bias) on one device.
`can_serve(problem)` says whether it can take a linear here (None) or why not; `prepare(weights, policy)` converts
the checkpoint's tensors to its layout once, at load; `linear` / `linear_q` / `group_dots` are its calls (the
torch.ops.anychip.* ops look the route up by id and call these, except for the C++ routes, whose ids the ops' C++
kernels serve themselves).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from anychip.errors import AnychipError
from anychip.formats import GROUP_SIZES, PACK_FACTOR, SCALE_MAX, bad_scales, unpack_int4
from anychip.kernels.policy import KernelPolicy


class NoKernelRoute(AnychipError, ValueError):
    """No route can serve a linear, or the one asked for cannot; the message says why and how to proceed."""


class CheckpointDataError(NoKernelRoute):
    """The weights themselves are damaged (a NaN or non-positive scale, INT4 values out of range): no route, the
    reference included, can serve them."""


@dataclass(frozen=True)
class LinearProblem:
    """One quantized linear as a route sees it: (N, K) INT4 weights in groups of G, on a device type."""

    n: int
    k: int
    group_size: int
    device: str = "cpu"  # torch device type: "cpu" | "cuda"


class CheckpointWeights:
    """A linear's checkpoint tensors, validated once for every route.

    wq: (N, K/8) int32 pack-quantized words (packed=True) or (N, K) int8 in [-8, 7] (packed=False);
    scales: (N, K/G) float.
    """

    def __init__(self, wq: torch.Tensor, scales: torch.Tensor, group_size: int, *, packed: bool) -> None:
        if packed and (wq.dtype != torch.int32 or wq.dim() != 2):
            raise NoKernelRoute(
                f"packed=True wants (N, K/{PACK_FACTOR}) int32 words (pack-quantized), got {wq.dtype} "
                f"{tuple(wq.shape)}: pass packed=False for int-quantized int8 weights")
        if not packed and (wq.dtype != torch.int8 or wq.dim() != 2):
            raise NoKernelRoute(
                f"packed=False wants (N, K) int8 (int-quantized), got {wq.dtype} {tuple(wq.shape)}: pass "
                "packed=True for pack-quantized int32 words")
        n = wq.shape[0]
        k = wq.shape[1] * PACK_FACTOR if packed else wq.shape[1]
        if group_size <= 0 or k % group_size:
            fits = [g for g in GROUP_SIZES if k % g == 0]
            fix = (f"quantize with group size {' or '.join(map(str, fits))}" if fits else
                   f"no supported group size ({', '.join(map(str, GROUP_SIZES))}) divides K={k}: pad the layer's K "
                   f"to a multiple of {min(GROUP_SIZES)} or leave it unquantized")
            raise NoKernelRoute(f"K={k} is not divisible by group size {group_size}: {fix}")
        if scales.dim() != 2 or tuple(scales.shape) != (n, k // group_size) or not scales.is_floating_point():
            raise NoKernelRoute(f"scales must be a float (N={n}, K/G={k // group_size}) tensor, got {scales.dtype} "
                                f"{tuple(scales.shape)}")
        if not packed and wq.numel() and (int(wq.min()) < -8 or int(wq.max()) > 7):
            raise CheckpointDataError("int-quantized weights hold values outside [-8, 7]: this is not an INT4 "
                                      "checkpoint")
        bad = bad_scales(scales)  # one pass at load: a NaN, <= 0, subnormal or huge scale serves garbage
        if bool(bad.any()):
            row, group = (int(i) for i in bad.nonzero()[0])
            raise CheckpointDataError(f"scale [{row}, {group}] is {scales[row, group].item()}: group scales must be "
                                      f"positive normal numbers up to {SCALE_MAX:.3g} (8 s finite); the checkpoint "
                                      "is damaged (check it with `anychip verify`) or was written by a broken "
                                      "quantizer")
        self.wq, self.scales, self.group_size, self.packed = wq, scales, group_size, packed
        self.n, self.k = n, k
        self._int8: torch.Tensor | None = None

    @property
    def problem(self) -> LinearProblem:
        return LinearProblem(self.n, self.k, self.group_size, self.wq.device.type)

    def int8(self) -> torch.Tensor:
        """(N, K) int8 in [-8, 7], on the weights' device."""
        if self._int8 is None:
            self._int8 = unpack_int4(self.wq) if self.packed else self.wq.contiguous()
        return self._int8


class Route(ABC):
    """One kernel route. Subclasses set the class attributes and implement the layout and the calls."""

    #: Stable id used by the coverage report, ANYCHIP_KERNEL_ISA and the docs, e.g. "cpu.avx2".
    id: ClassVar[str]
    #: The route as the ops' `route` argument (an int, so that Inductor's C++ wrapper calls the ops through its C
    #: shim rather than boxing a string into an IValue stack, whose code compiles 2.8x slower). The C++
    #: extension's routes use their `Isa` code (csrc/cpu_common.h, 0-63); routes it never implements use 64 and up.
    code: ClassVar[int]
    #: torch device type the route computes on ("cpu" | "cuda"); "any" for the reference.
    device: ClassVar[str]
    #: Kernel family the coverage report names (routes sharing one layout and binary share it).
    kernel: ClassVar[str]
    #: Whether its INT32 group sums and outputs equal the torch reference's exactly (the checkpoint's numerics).
    bit_exact: ClassVar[bool]
    summary: ClassVar[str]
    #: Group sizes the route has kernels for.
    group_sizes: ClassVar[tuple[int, ...]] = GROUP_SIZES
    #: Only taken when the policy allows fallback (or the route is forced).
    fallback_only: ClassVar[bool] = False
    #: Short names accepted for the id (older ANYCHIP_KERNEL_ISA values).
    aliases: ClassVar[tuple[str, ...]] = ()
    #: Whether the ops' compiled kernels count this route's calls in the kernels' coverage table
    #: (hooks.install_kernel_counts) instead of calling hooks.notify from Python.
    counts_in_kernel: ClassVar[bool] = False
    #: Whether the route computes an RMSNorm ahead of the linear inside its own kernels (`linear_norm`); the
    #: plugin's graph pass fuses vLLM's norm into the linear only for such routes.
    fuses_norm: ClassVar[bool] = False
    #: The same for vLLM's SiluAndMul ahead of the linear (`linear_silu_mul`).
    fuses_silu_mul: ClassVar[bool] = False
    #: Whether the pass fuses SiluAndMul into this route's linears when ANYCHIP_FUSE_SILU is unset (measured faster).
    fuse_silu_by_default: ClassVar[bool] = False

    @property
    def isa(self) -> str:
        """The instruction-set part of the id ("avx2" for "cpu.avx2")."""
        return self.id.rpartition(".")[2]

    def unavailable(self) -> str | None:
        """None when this machine can run the route at all, else why not (and how to fix it)."""
        return None

    def rejects(self, problem: LinearProblem) -> str | None:
        """None when the route's kernels can take this shape, else why not. Subclasses add their own limits."""
        if self.device != "any" and problem.device != self.device:
            return f"serves {self.device} tensors, these are on {problem.device}"
        if problem.group_size not in self.group_sizes:
            return f"group size {problem.group_size} has no kernel here: re-quantize with one of {self.group_sizes}"
        return None

    def can_serve(self, problem: LinearProblem) -> str | None:
        return self.unavailable() or self.rejects(problem)

    def off_by(self, policy: KernelPolicy) -> str | None:
        """None unless the policy keeps this route from being picked (it can still be forced), and why."""
        del policy
        return None

    @abstractmethod
    def prepare(self, weights: CheckpointWeights, policy: KernelPolicy) -> tuple[torch.Tensor, torch.Tensor]:
        """The route's (weight, scales) layout of one linear."""

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
               n: int, k: int, group_size: int) -> torch.Tensor:
        """x (M, K) bf16/fp16/fp32 -> (M, N) in x's dtype, quantizing x per token inside."""

    @abstractmethod
    def linear_q(self, xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None, n: int, k: int, group_size: int, out_dtype: torch.dtype) -> torch.Tensor:
        """xq (M, K) int8, sx (M, 1) fp32 -> (M, N) out_dtype."""

    def linear_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                    residual_out: torch.Tensor | None, weight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None, n: int, k: int, group_size: int) -> torch.Tensor:
        """linear(rms_norm(x)) with the norm inside the kernels (routes with fuses_norm): x (M, K); residual given:
        fused_add_rms_norm, x + residual written to residual_out (M, K)."""
        raise NotImplementedError(f"route {self.id} does not fuse the RMSNorm into its kernels")

    def linear_silu_mul(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                        n: int, k: int, group_size: int) -> torch.Tensor:
        """linear(silu(x[:, :K]) * x[:, K:]) with SiluAndMul inside the kernels (routes with fuses_silu_mul): x
        (M, 2K)."""
        raise NotImplementedError(f"route {self.id} does not fuse SiluAndMul into its kernels")

    @abstractmethod
    def group_dots(self, xq: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, n: int, k: int,
                   group_size: int) -> torch.Tensor:
        """Debug: the exact (M, N, K/G) int32 group sums."""

    def describe(self, problem: LinearProblem | None = None) -> dict[str, object]:
        reason = self.unavailable() if problem is None else self.can_serve(problem)
        return {"id": self.id, "device": self.device, "available": reason is None, "reason": reason,
                "bit_exact": self.bit_exact, "fallback_only": self.fallback_only, "summary": self.summary}


@dataclass
class PreparedW4A8:
    """A linear's weights in its route's layout (the route's docstring gives the shapes)."""

    weight: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    group_size: int
    route: Route
