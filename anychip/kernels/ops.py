"""The W4A8 ops as torch.library custom ops (namespace "anychip"), with fake implementations so that vLLM's
torch.compile traces them as opaque calls.

    anychip::quantize_act(Tensor x) -> (Tensor xq, Tensor sx)
    anychip::w4a8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n, int k, int group_size,
                         int route, Tensor? layer_id) -> Tensor
    anychip::w4a8_linear_q(Tensor xq, Tensor sx, Tensor weight, Tensor scales, Tensor? bias, int n, int k,
                           int group_size, int route, Tensor? layer_id, ScalarType out_dtype) -> Tensor
    anychip::w4a8_linear_norm(Tensor x, Tensor? residual, Tensor norm_weight, float eps, Tensor weight,
                              Tensor scales, Tensor? bias, int n, int k, int group_size, int route,
                              Tensor? layer_id) -> (Tensor y, Tensor residual_out)
        the linear of vLLM's RMSNorm of x (fused_add_rms_norm when a residual is given: residual_out = x + residual,
        else an empty tensor), the norm inside the kernels on routes that fuse it (the plugin's graph pass,
        vllm_plugin/fusion.py, puts it where vLLM's graph has a norm feeding one W4A8 linear)
    anychip::w4a8_linear_silu_mul(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n, int k, int group_size,
                                  int route, Tensor? layer_id) -> Tensor
        the linear of vLLM's SiluAndMul of x (M, 2K), inside the kernels on routes that fuse it
    anychip::w4a8_group_dots(Tensor xq, Tensor weight, Tensor scales, int n, int k, int group_size, int route)
                             -> Tensor   (debug: the exact (M, N, K/G) int32 group sums)

`route` is the op code (Route.code) of the route the weights were prepared for (prepare.prepare_w4a8): an int, not
the route's id, because Inductor's C++ wrapper calls an op whose arguments are all tensors and numbers through its C
shim, and boxes any other into an IValue stack (SmolLM2-135M's wrapper then took 2.8x as long to compile; the same
constant in every layer, so it does not split vLLM's compiled pieces). `layer_id` is the coverage recorder's id of
the layer as a (1,) int64 CPU tensor (`layer_tensor`), or None: not counted. A tensor, not an int: vLLM compiles the
pieces of its piecewise graph once for all layers only when the pieces are the same graph, and an int argument is a
different constant in every layer's piece (each of a 42-layer model's pieces compiled anew).

The schemas live here; the CPU kernels are C++ (csrc/w4a8_cpu.cpp registers them when the extension loads, which
preparing a C++ route does): they run this extension's routes without any Python, count the call in the kernels'
coverage table (hooks.py) and quantize the input inside the GEMV, once for a merged qkv or gate_up layer. Every
other route (the torch reference, arm.kleidiai, cuda.triton) goes through the Python implementation below, which
calls hooks.notify(layer id, tokens) and hands the call to the route object: on CUDA directly, on a CPU through the
op's twin `<op>_torch`, which the C++ kernel calls for a route code it does not implement.
"""

from __future__ import annotations

import torch

from anychip.kernels import cpu_ext, hooks, reference, routes
from anychip.kernels.routes.base import NoKernelRoute, Route

_SCHEMAS = {
    "quantize_act": "(Tensor x) -> (Tensor, Tensor)",
    "w4a8_linear": "(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n, int k, int group_size, "
    "int route, Tensor? layer_id) -> Tensor",
    "w4a8_linear_q": "(Tensor xq, Tensor sx, Tensor weight, Tensor scales, Tensor? bias, int n, int k, "
    "int group_size, int route, Tensor? layer_id, ScalarType out_dtype) -> Tensor",
    "w4a8_linear_norm": "(Tensor x, Tensor? residual, Tensor norm_weight, float eps, Tensor weight, Tensor scales, "
    "Tensor? bias, int n, int k, int group_size, int route, Tensor? layer_id) -> (Tensor, Tensor)",
    "w4a8_linear_silu_mul": "(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n, int k, int group_size, "
    "int route, Tensor? layer_id) -> Tensor",
    "w4a8_group_dots": "(Tensor xq, Tensor weight, Tensor scales, int n, int k, int group_size, int route) -> Tensor",
}
# the ops that take a route code (and have a twin)
ROUTED = ("w4a8_linear", "w4a8_linear_q", "w4a8_linear_norm", "w4a8_linear_silu_mul", "w4a8_group_dots")
TWIN = "_torch"  # anychip::<op>_torch: the route objects' Python implementation (csrc/w4a8_cpu.cpp calls it)

_LIB = torch.library.Library("anychip", "FRAGMENT")  # process lifetime, like every torch op registry
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema)
for _name in ROUTED:
    _LIB.define(_name + TWIN + _SCHEMAS[_name])


def layer_tensor(layer_id: int) -> torch.Tensor:
    """The routed ops' `layer_id` argument for coverage layer `layer_id`: (1,) int64 on the CPU (whatever the
    default device), made outside inference mode so that it can be read from anywhere."""
    with torch.inference_mode(False):
        return torch.tensor([layer_id], dtype=torch.int64, device="cpu")


def _layer_index(layer_id: torch.Tensor | None) -> int:
    return -1 if layer_id is None else int(layer_id.item())


def _route(code: int, device: torch.device) -> Route:
    route = routes.get(code)
    if route.device not in ("any", device.type):
        raise NoKernelRoute(f"these weights were prepared for the {route.device.upper()} route {route.id} but the "
                            f"input is on {device}: prepare them from {device.type} tensors, or move the input")
    return route


def _w4a8_linear(x, weight, scales, bias, n, k, group_size, route, layer_id):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    hooks.notify(_layer_index(layer_id), x2.shape[0])
    y = _route(route, x.device).linear(x2, weight, scales, bias, n, k, group_size)
    return y.view(*lead, n)


def _w4a8_linear_q(xq, sx, weight, scales, bias, n, k, group_size, route, layer_id, out_dtype):
    hooks.notify(_layer_index(layer_id), xq.shape[0])
    return _route(route, xq.device).linear_q(xq, sx, weight, scales, bias, n, k, group_size, out_dtype)


def _w4a8_linear_norm(x, residual, norm_weight, eps, weight, scales, bias, n, k, group_size, route, layer_id):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    r2 = None if residual is None else residual.reshape(-1, k).contiguous()
    target = _route(route, x.device)
    if target.fuses_norm:
        rout = None if r2 is None else torch.empty_like(x2)
        layer = _layer_index(layer_id)
        hooks.notify(layer, x2.shape[0])
        hooks.note_fused(layer, "rms_norm")
        y = target.linear_norm(x2, norm_weight, eps, r2, rout, weight, scales, bias, n, k, group_size)
    else:  # the norm as vLLM defines it, then the linear through its own op (which counts the call)
        normed, rout = reference.rms_norm_ref(x2, norm_weight, eps, r2)
        y = torch.ops.anychip.w4a8_linear.default(normed, weight, scales, bias, n, k, group_size, route, layer_id)
    return y.view(*lead, n), x.new_empty((0,)) if rout is None else rout.view(x.shape)


def _w4a8_linear_silu_mul(x, weight, scales, bias, n, k, group_size, route, layer_id):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, 2 * k)
    target = _route(route, x.device)
    if target.fuses_silu_mul:
        layer = _layer_index(layer_id)
        hooks.notify(layer, x2.shape[0])
        hooks.note_fused(layer, "silu_and_mul")
        y = target.linear_silu_mul(x2, weight, scales, bias, n, k, group_size)
    else:  # SiluAndMul as vLLM's native forward computes it, then the linear through its own op
        y = torch.ops.anychip.w4a8_linear.default(reference.silu_and_mul_ref(x2), weight, scales, bias, n, k,
                                                  group_size, route, layer_id)
    return y.view(*lead, n)


def _w4a8_group_dots(xq, weight, scales, n, k, group_size, route):
    return _route(route, xq.device).group_dots(xq, weight, scales, n, k, group_size)


def _quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.device.type == "cuda":
        from anychip.kernels.gpu import launch  # imports triton: only on the first CUDA call

        return launch.quantize_act(x.reshape(-1, x.shape[-1]))
    if x.device.type != "cpu":
        raise NoKernelRoute(f"anychip quantize_act has kernels for CPU and CUDA tensors, not {x.device}")
    # a CPU call before anything loaded the extension: load it (it registers the CPU kernel) and call that
    cpu_ext.load()
    if not torch._C._dispatch_has_kernel_for_dispatch_key("anychip::quantize_act", "CPU"):
        raise cpu_ext.ExtensionBuildError("the anychip CPU extension loaded without registering its kernels")
    return torch.ops.anychip.quantize_act(x)


# CompositeExplicitAutograd: every device without a kernel of its own (CUDA; a CPU before the extension is loaded)
for _name, _impl in (("w4a8_linear", _w4a8_linear), ("w4a8_linear_q", _w4a8_linear_q),
                     ("w4a8_linear_norm", _w4a8_linear_norm), ("w4a8_linear_silu_mul", _w4a8_linear_silu_mul),
                     ("w4a8_group_dots", _w4a8_group_dots)):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    _LIB.impl(_name + TWIN, _impl, "CompositeExplicitAutograd")
_LIB.impl("quantize_act", _quantize_act, "CompositeExplicitAutograd")


def _quantize_act_fake(x):
    m = x.numel() // x.shape[-1]
    return x.new_empty((m, x.shape[-1]), dtype=torch.int8), x.new_empty((m, 1), dtype=torch.float32)


def _w4a8_linear_fake(x, weight, scales, bias, n, k, group_size, route, layer_id):
    return x.new_empty((*x.shape[:-1], n))


def _w4a8_linear_q_fake(xq, sx, weight, scales, bias, n, k, group_size, route, layer_id, out_dtype):
    return xq.new_empty((xq.shape[0], n), dtype=out_dtype)


def _w4a8_linear_norm_fake(x, residual, norm_weight, eps, weight, scales, bias, n, k, group_size, route, layer_id):
    return x.new_empty((*x.shape[:-1], n)), x.new_empty((0,) if residual is None else x.shape)


def _w4a8_linear_silu_mul_fake(x, weight, scales, bias, n, k, group_size, route, layer_id):
    return x.new_empty((*x.shape[:-1], n))


def _w4a8_group_dots_fake(xq, weight, scales, n, k, group_size, route):
    return xq.new_empty((xq.shape[0], n, k // group_size), dtype=torch.int32)


torch.library.register_fake("anychip::quantize_act", _quantize_act_fake, lib=_LIB)
for _name, _fake in (("w4a8_linear", _w4a8_linear_fake), ("w4a8_linear_q", _w4a8_linear_q_fake),
                     ("w4a8_linear_norm", _w4a8_linear_norm_fake), ("w4a8_linear_silu_mul", _w4a8_linear_silu_mul_fake),
                     ("w4a8_group_dots", _w4a8_group_dots_fake)):
    torch.library.register_fake(f"anychip::{_name}", _fake, lib=_LIB)
    torch.library.register_fake(f"anychip::{_name}{TWIN}", _fake, lib=_LIB)
