"""The C++ extension's routes for Arm CPUs: NEON dotprod (SDOT) and i8mm (SMMLA), bit-exact with the reference.

They compute the checkpoint's numerics (symmetric per-token INT8 activations, fp32 group scales, exact INT32 group
sums), so on aarch64 they come before arm.kleidiai, which matches the reference only within a tolerance.  The
CPU's support is read from /proc/cpuinfo here and checked again in C++ with getauxval (csrc/cpu_common.h).

Layouts (csrc/w4a8_arm.h reads them):
    arm.dotprod  the blocked layout of the x86 routes (cpu_x86.blocked_layout): each 16-byte quarter of a chunk
                 holds 4 rows x 4 k per nibble plane, the operand of SDOT by element.
    arm.i8mm     the pair layout, the same size: weight (NB, K/16, 128) uint8, NB = ceil(N/16); in chunk c of 16 k,
                 byte 16q + 8i + j holds w[2q+i, 16c+j] + 8 in its low nibble and w[2q+i, 16c+8+j] + 8 in its high
                 nibble (row pair q = 0..7 of the block), so each nibble plane is a 2 x 8 SMMLA operand.
    scales       (NB, K/G, 16) for both: bf16 or fp32 (cpu_x86.blocked_layout).
"""

from __future__ import annotations


import torch

from anychip.kernels import machine
from anychip.kernels.policy import KernelPolicy
from anychip.kernels.routes.base import CheckpointWeights, LinearProblem, NoKernelRoute
from anychip.kernels.routes.cpu_x86 import ROWS, CppRoute


def pair_layout(blocked: torch.Tensor) -> torch.Tensor:
    """Blocked weight (NB, K/8, 64) uint8 -> pair weight (NB, K/16, 128) uint8 (same nibbles, SMMLA order)."""
    nb, chunks, width = blocked.shape
    if width != 4 * ROWS or chunks % 2:
        raise NoKernelRoute(f"pair_layout wants a blocked (NB, K/8, 64) weight with K a multiple of 16, got "
                            f"{tuple(blocked.shape)}")
    b = blocked.view(nb, chunks // 2, 2, ROWS, 4)  # [block, 16-k chunk, 8-k half, row, j]
    nib = torch.stack((b & 0x0F, b >> 4), dim=4).view(nb, chunks // 2, 2, ROWS, 8)  # [.., half, row, k in half]
    return (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(nb, chunks // 2, 8 * ROWS).contiguous()


class ArmCppRoute(CppRoute):
    """A NEON path of the C++ extension; `flags` are /proc/cpuinfo Features (aarch64 names)."""

    # The fused ops run here (csrc/pre_ops.h), but their RMSNorm and SiluAndMul are scalar on Arm and no Arm CPU has
    # timed them against Inductor's NEON kernels: the graph pass leaves vLLM's in place.
    fuses_norm = False
    fuses_silu_mul = False
    fuse_silu_by_default = False

    def unavailable(self) -> str | None:
        if not machine.is_arm():
            return "not an aarch64 CPU"
        missing = [f for f in self.flags if f not in machine.cpu_flags()]
        return f"this CPU lacks {', '.join(missing)} (/proc/cpuinfo Features)" if missing else None


class ArmDotprod(ArmCppRoute):
    id = "arm.dotprod"
    aliases = ("dotprod",)
    code = 3
    flags = ("asimddp",)
    summary = "C++ NEON sdot by element, u4 x s8, 4 rows x 4 k per instruction (blocked layout)"


class ArmI8mm(ArmCppRoute):
    id = "arm.i8mm"
    aliases = ("i8mm",)
    code = 4
    flags = ("asimddp", "i8mm")
    summary = "C++ NEON smmla, 2 tokens x 2 rows x 8 k per instruction (pair layout)"

    def rejects(self, problem: LinearProblem) -> str | None:
        if why := super().rejects(problem):
            return why
        return f"K={problem.k} is not a multiple of 16" if problem.k % 16 else None

    def prepare(self, weights: CheckpointWeights, policy: KernelPolicy) -> tuple[torch.Tensor, torch.Tensor]:
        blocked, scales = super().prepare(weights, policy)
        return pair_layout(blocked), scales

