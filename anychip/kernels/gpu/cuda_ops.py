"""CUDA implementations of the torch.ops.anychip.* ops (schemas and fake implementations live in ops.py).

`isa` names the route the weights were prepared for: "triton" (layout.py's layout, the Triton kernels) or
"reference" (the torch oracle on the GPU, a fallback). Triton is imported on the first call, not here.
"""

from __future__ import annotations

import torch

from anychip.kernels import hooks
from anychip.kernels.dispatch import NoKernelRoute
from anychip.kernels.reference import group_dot_ref, quantize_activations_ref, w4a8_linear_ref

TRITON_ISA = "triton"


def register(lib: torch.library.Library) -> None:
    """Add the CUDA implementations to the library that defines the ops."""
    lib.impl("quantize_act", _quantize_act, "CUDA")
    lib.impl("w4a8_linear", _w4a8_linear, "CUDA")
    lib.impl("w4a8_linear_q", _w4a8_linear_q, "CUDA")
    lib.impl("w4a8_group_dots", _w4a8_group_dots, "CUDA")


def _launch():
    from anychip.kernels.gpu import launch

    return launch


def _route(isa: str) -> str:
    if isa not in (TRITON_ISA, "reference"):
        raise NoKernelRoute(
            f"these weights were prepared for the CPU route {isa!r} but the input is on a CUDA device: prepare them "
            "from CUDA tensors (prepare_w4a8 then picks the triton route), or move the input to the CPU")
    return isa


def _quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch().quantize_act(x.reshape(-1, x.shape[-1]))


def _w4a8_linear(x, weight, scales, bias, n, k, group_size, isa, layer_id):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    hooks.notify(layer_id, x2.shape[0])
    if _route(isa) == "reference":
        xq, sx = quantize_activations_ref(x2)
        y = w4a8_linear_ref(xq, sx, weight, scales, bias, out_dtype=x.dtype)
    else:
        launch = _launch()
        xq, sx = launch.quantize_act(x2)
        y = launch.w4a8_linear_q(xq, sx, weight, scales, bias, n, k, group_size, x.dtype)
    return y.view(*lead, n)


def _w4a8_linear_q(xq, sx, weight, scales, bias, n, k, group_size, isa, layer_id, out_dtype):
    hooks.notify(layer_id, xq.shape[0])
    if _route(isa) == "reference":
        return w4a8_linear_ref(xq, sx, weight, scales, bias, out_dtype=out_dtype)
    return _launch().w4a8_linear_q(xq, sx, weight, scales, bias, n, k, group_size, out_dtype)


def _w4a8_group_dots(xq, weight, scales, n, k, group_size, isa):
    if _route(isa) == "reference":
        return group_dot_ref(xq, weight, group_size)
    return _launch().group_dots(xq, weight, n, k, group_size)
