"""The W4A8 ops as torch.library custom ops (namespace "anychip"), with fake implementations so that vLLM's
torch.compile traces them as opaque calls.

    anychip::quantize_act(Tensor x) -> (Tensor xq, Tensor sx)
    anychip::w4a8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n, int k, int group_size,
                         str route, int layer_id) -> Tensor
    anychip::w4a8_linear_q(Tensor xq, Tensor sx, Tensor weight, Tensor scales, Tensor? bias, int n, int k,
                           int group_size, str route, int layer_id, ScalarType out_dtype) -> Tensor
    anychip::w4a8_group_dots(Tensor xq, Tensor weight, Tensor scales, int n, int k, int group_size, str route)
                             -> Tensor   (debug: the exact (M, N, K/G) int32 group sums)

`route` is the id of the route the weights were prepared for (prepare.prepare_w4a8); the op hands the call to
that route object. w4a8_linear quantizes its input once inside, so a merged qkv or gate_up layer quantizes its
input once; it calls hooks.notify(layer_id, tokens) at run time, also under torch.compile.
"""

from __future__ import annotations

import torch

from anychip.kernels import cpu_ext, hooks, routes
from anychip.kernels.routes.base import NoKernelRoute, Route

_SCHEMAS = {
    "quantize_act": "(Tensor x) -> (Tensor, Tensor)",
    "w4a8_linear": "(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n, int k, int group_size, "
    "str route, int layer_id) -> Tensor",
    "w4a8_linear_q": "(Tensor xq, Tensor sx, Tensor weight, Tensor scales, Tensor? bias, int n, int k, "
    "int group_size, str route, int layer_id, ScalarType out_dtype) -> Tensor",
    "w4a8_group_dots": "(Tensor xq, Tensor weight, Tensor scales, int n, int k, int group_size, str route) -> Tensor",
}

_LIB = torch.library.Library("anychip", "FRAGMENT")  # process lifetime, like every torch op registry
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema)


def _route(route_id: str, device: torch.device) -> Route:
    route = routes.get(route_id)
    if route.device not in ("any", device.type):
        raise NoKernelRoute(f"these weights were prepared for the {route.device.upper()} route {route.id} but the "
                            f"input is on {device}: prepare them from {device.type} tensors, or move the input")
    return route


def _w4a8_linear(x, weight, scales, bias, n, k, group_size, route, layer_id):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    hooks.notify(layer_id, x2.shape[0])
    y = _route(route, x.device).linear(x2, weight, scales, bias, n, k, group_size)
    return y.view(*lead, n)


def _w4a8_linear_q(xq, sx, weight, scales, bias, n, k, group_size, route, layer_id, out_dtype):
    hooks.notify(layer_id, xq.shape[0])
    return _route(route, xq.device).linear_q(xq, sx, weight, scales, bias, n, k, group_size, out_dtype)


def _w4a8_group_dots(xq, weight, scales, n, k, group_size, route):
    return _route(route, xq.device).group_dots(xq, weight, scales, n, k, group_size)


def _quantize_act_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_ext.load().quantize_act(x.reshape(-1, x.shape[-1]))


def _quantize_act_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from anychip.kernels.gpu import launch  # imports triton: only on the first CUDA call

    return launch.quantize_act(x.reshape(-1, x.shape[-1]))


for _device in ("CPU", "CUDA"):
    _LIB.impl("w4a8_linear", _w4a8_linear, _device)
    _LIB.impl("w4a8_linear_q", _w4a8_linear_q, _device)
    _LIB.impl("w4a8_group_dots", _w4a8_group_dots, _device)
_LIB.impl("quantize_act", _quantize_act_cpu, "CPU")
_LIB.impl("quantize_act", _quantize_act_cuda, "CUDA")


@torch.library.register_fake("anychip::quantize_act", lib=_LIB)
def _quantize_act_fake(x):
    m = x.numel() // x.shape[-1]
    return x.new_empty((m, x.shape[-1]), dtype=torch.int8), x.new_empty((m, 1), dtype=torch.float32)


@torch.library.register_fake("anychip::w4a8_linear", lib=_LIB)
def _w4a8_linear_fake(x, weight, scales, bias, n, k, group_size, route, layer_id):
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("anychip::w4a8_linear_q", lib=_LIB)
def _w4a8_linear_q_fake(xq, sx, weight, scales, bias, n, k, group_size, route, layer_id, out_dtype):
    return xq.new_empty((xq.shape[0], n), dtype=out_dtype)


@torch.library.register_fake("anychip::w4a8_group_dots", lib=_LIB)
def _w4a8_group_dots_fake(xq, weight, scales, n, k, group_size, route):
    return xq.new_empty((xq.shape[0], n, k // group_size), dtype=torch.int32)
