"""The kernel policy: which route a caller forces and whether the torch reference may stand in.

Built once at the top (the CLI from its flags, the vLLM plugin from its environment: `anychip.envs.kernel_policy`)
and passed down; nothing under anychip/kernels reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

#: How the output head is served: "bf16" as the checkpoint has it (default), "int8" quantized per channel at load.
HEAD_KINDS = ("bf16", "int8")
#: GPU GEMM configs (kernels/gpu/tuning.py): "load" times the shapes no table or cache knows, once, at load;
#: "off" never times (those shapes run the default config).
GPU_TUNING = ("load", "off")


@dataclass(frozen=True)
class KernelPolicy:
    """route: a route id (or a short alias such as "avx2") every linear must take; None picks the best that
    can serve.  allow_fallback: when no fast route can serve a linear, use the reference route instead of
    refusing.  build_dir: where the C++ extension is compiled and cached (None: ~/.cache/anychip/torch_extensions).
    head: one of HEAD_KINDS, how the output head is served (kernels/routes/head.py).
    gpu_tuning: one of GPU_TUNING; tuning_dir: the disk cache of tuned GPU configs (None: none is read or written).
    gpu_precompile: threads that compile a loaded GPU linear's Triton kernels in the background (0: each compiles
    at its first launch; kernels/gpu/precompile.py).
    gpu_direct_launch: launch the compiled Triton kernels without the JIT's per-call work (kernels/gpu/direct.py);
    the process's setting follows the last policy a GPU linear was prepared with.
    gpu_pdl: launch the batch-one GEMVs as programmatic dependent launches on Hopper and newer, so that one behind
    another streams its first weights while that one finishes (kernels/gpu/launch.py, set_pdl); process-wide as
    gpu_direct_launch.
    gpu_wgmma: let load-time tuning time the Gluon GEMM (kernels/gpu/gluon_w4a8.py, sm_90 only) beside the Triton
    prefill tiles (ANYCHIP_GPU_WGMMA=1; off by default until measured on a GPU); a table entry that names it is
    served either way.
    cpu_amx: whether route cpu.amx_int8 (AMX-INT8 prefill tiles, the same bits as cpu.avx512_vnni) may be picked
    where the CPU has it (False: cpu.avx512_vnni serves; ANYCHIP_CPU_AMX=0); forcing the route overrides it.
    """

    route: str | None = None
    allow_fallback: bool = False
    build_dir: Path | None = None
    head: str = "bf16"
    gpu_tuning: str = "off"
    tuning_dir: Path | None = None
    gpu_precompile: int = 0
    gpu_direct_launch: bool = True
    gpu_pdl: bool = True
    gpu_wgmma: bool = False
    cpu_amx: bool = True

    def __post_init__(self) -> None:
        if self.head not in HEAD_KINDS:
            raise ValueError(f"head={self.head!r} is not one of {HEAD_KINDS}: use --head bf16 or --head int8")
        if self.gpu_tuning not in GPU_TUNING:
            raise ValueError(f"gpu_tuning={self.gpu_tuning!r} is not one of {GPU_TUNING}: set ANYCHIP_GPU_TUNE=load "
                             "or off")
        if not isinstance(self.gpu_precompile, int) or self.gpu_precompile < 0:
            raise ValueError(f"gpu_precompile={self.gpu_precompile!r}: a number of threads, 0 for off "
                             "(ANYCHIP_GPU_PRECOMPILE)")

    def forcing(self, route: str | None) -> KernelPolicy:
        """This policy with `route` forced (None keeps the policy's own)."""
        return self if route is None else replace(self, route=route)
