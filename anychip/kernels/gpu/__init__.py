"""The Triton kernels behind the `cuda.triton` route (routes/cuda_triton.py): INT8 tensor-core dots on INT4
weights unpacked in registers.

    layout.py        the weight layout the route prepares
    launch.py        tile configs, split-K and the small tuner around the kernels
    triton_w4a8.py   the kernels (imports triton; loaded on the first CUDA call only)

Nothing here imports triton at import time, so `import anychip.kernels` works on machines without it.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

#: Lowest compute capability served: INT8 mma.sync (m16n8k32) needs Ampere; Hopper adds INT8 wgmma.
MIN_CAPABILITY = (8, 0)


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def unavailable_reason(device: torch.device) -> str | None:
    """None when the Triton route can serve tensors on `device`, else why not (and how to fix it)."""
    if device.type != "cuda":
        return f"the Triton route serves CUDA tensors, these are on {device}"
    if not triton_installed():
        return "triton is not installed: pip install triton (it ships with CUDA builds of torch)"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"GPU {torch.cuda.get_device_name(device)} has compute capability {capability}; the Triton W4A8 "
                f"kernels need {MIN_CAPABILITY} or newer (INT8 tensor-core dots)")
    return None
