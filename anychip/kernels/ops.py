"""The W4A8 ops as torch.library custom ops (namespace "anychip"), with fake implementations so that vLLM's
torch.compile traces them as opaque calls.

    anychip::quantize_act(Tensor x) -> (Tensor xq, Tensor sx)
    anychip::w4a8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n, int k, int group_size,
                         str isa, int layer_id) -> Tensor
    anychip::w4a8_linear_q(Tensor xq, Tensor sx, Tensor weight, Tensor scales, Tensor? bias, int n, int k,
                           int group_size, str isa, int layer_id, ScalarType out_dtype) -> Tensor
    anychip::w4a8_group_dots(Tensor xq, Tensor weight, Tensor scales, int n, int k, int group_size, str isa)
                             -> Tensor   (debug: the exact (M, N, K/G) int32 group sums)

`isa` names the route (dispatch.ISAS); weight/scales are in that route's layout (prepare.PreparedW4A8).
w4a8_linear quantizes its input once inside, so a merged qkv or gate_up layer quantizes its input once; it calls
hooks.notify(layer_id, tokens) at run time, also under torch.compile.
"""

from __future__ import annotations

import torch

from anychip.kernels import cpu_ext, hooks
from anychip.kernels.dispatch import NoKernelRoute
from anychip.kernels.gpu import cuda_ops as gpu_cuda_ops
from anychip.kernels.reference import group_dot_ref, quantize_activations_ref, w4a8_linear_ref

_SCHEMAS = {
    "quantize_act": "(Tensor x) -> (Tensor, Tensor)",
    "w4a8_linear": "(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n, int k, int group_size, str isa, "
    "int layer_id) -> Tensor",
    "w4a8_linear_q": "(Tensor xq, Tensor sx, Tensor weight, Tensor scales, Tensor? bias, int n, int k, "
    "int group_size, str isa, int layer_id, ScalarType out_dtype) -> Tensor",
    "w4a8_group_dots": "(Tensor xq, Tensor weight, Tensor scales, int n, int k, int group_size, str isa) -> Tensor",
}

_LIB = torch.library.Library("anychip", "FRAGMENT")  # process lifetime, like every torch op registry
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema)


def _code(isa: str) -> int:
    try:
        return cpu_ext.ISA_CODES[isa]
    except KeyError:
        raise NoKernelRoute(f"no CPU kernel for isa {isa!r}: prepare the weights with anychip.kernels.prepare") from None


def _quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_ext.load().quantize_act(x.reshape(-1, x.shape[-1]))


def _w4a8_linear(x, weight, scales, bias, n, k, group_size, isa, layer_id):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    hooks.notify(layer_id, x2.shape[0])
    if isa == "reference":
        xq, sx = quantize_activations_ref(x2)
        y = w4a8_linear_ref(xq, sx, weight, scales, bias, out_dtype=x.dtype)
    elif isa == "kleidiai":
        y = torch.ops.aten._dyn_quant_matmul_4bit(x2.float(), weight, group_size, k, n)
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    else:
        y = cpu_ext.load().linear(x2, weight, scales, bias, n, group_size, _code(isa))
    return y.view(*lead, n)


def _w4a8_linear_q(xq, sx, weight, scales, bias, n, k, group_size, isa, layer_id, out_dtype):
    hooks.notify(layer_id, xq.shape[0])
    if isa == "reference":
        return w4a8_linear_ref(xq, sx, weight, scales, bias, out_dtype=out_dtype)
    return cpu_ext.load().linear_q(xq, sx, weight, scales, bias, n, group_size, _code(isa), out_dtype)


def _w4a8_group_dots(xq, weight, scales, n, k, group_size, isa):
    if isa == "reference":
        return group_dot_ref(xq, weight, group_size)
    return cpu_ext.load().group_dots(xq, weight, scales, n, group_size, _code(isa))


_LIB.impl("quantize_act", _quantize_act, "CPU")
_LIB.impl("w4a8_linear", _w4a8_linear, "CPU")
_LIB.impl("w4a8_linear_q", _w4a8_linear_q, "CPU")
_LIB.impl("w4a8_group_dots", _w4a8_group_dots, "CPU")
gpu_cuda_ops.register(_LIB)  # the CUDA implementations (Triton, imported on their first call)


@torch.library.register_fake("anychip::quantize_act", lib=_LIB)
def _quantize_act_fake(x):
    m = x.numel() // x.shape[-1]
    return x.new_empty((m, x.shape[-1]), dtype=torch.int8), x.new_empty((m, 1), dtype=torch.float32)


@torch.library.register_fake("anychip::w4a8_linear", lib=_LIB)
def _w4a8_linear_fake(x, weight, scales, bias, n, k, group_size, isa, layer_id):
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("anychip::w4a8_linear_q", lib=_LIB)
def _w4a8_linear_q_fake(xq, sx, weight, scales, bias, n, k, group_size, isa, layer_id, out_dtype):
    return xq.new_empty((xq.shape[0], n), dtype=out_dtype)


@torch.library.register_fake("anychip::w4a8_group_dots", lib=_LIB)
def _w4a8_group_dots_fake(xq, weight, scales, n, k, group_size, isa):
    return xq.new_empty((xq.shape[0], n, k // group_size), dtype=torch.int32)
