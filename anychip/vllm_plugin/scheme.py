"""The anychip linear scheme: vLLM's parameters and weight loaders in, anychip's kernel layout out.

create_weights declares the checkpoint's tensors with vLLM's parameter classes (so merged qkv/gate_up layers
and tensor-parallel shards load through vLLM's own loaders); process_weights_after_loading prepares them once for
the kernel that serves this CPU and records the route; apply_weights calls the opaque anychip op (on a C++ route,
its C++ kernel counts the call for the coverage report: no Python runs below apply_weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch

from anychip import envs
from anychip.coverage import LayerRoute
from anychip.errors import AnychipError
from anychip.formats import GROUP_SIZES
from anychip.kernels import ops, routes  # ops registers torch.ops.anychip.*
from anychip.kernels.prepare import prepare_w4a8
from anychip.kernels.routes.base import CheckpointDataError
from anychip.vllm_plugin import compat
from anychip.vllm_plugin.recorder import EngineRefusal
from anychip.vllm_plugin.tensor_parallel import quantize_over_ranks

if TYPE_CHECKING:
    from anychip.vllm_plugin.recorder import Recorder

class LayerPrepareError(EngineRefusal):
    """A layer (or weight) no route can serve as the checkpoint has it."""


def _channel_group(k: int) -> int | None:
    """Per-channel scales are per-group scales repeated: serve them with the largest kernel group dividing K."""
    return next((g for g in sorted(GROUP_SIZES, reverse=True) if k % g == 0), None)


CHECK_SLICE = 1 << 24  # elements of a weight checked at a time: a 16 MB temporary


def check_float_weights(model: torch.nn.Module) -> None:
    """Every floating-point weight of a loaded W4A8 model is finite (embedding, norms, biases, a BF16 head; the
    scales were checked when their layers were prepared): one NaN in a norm weight is laundered by the INT8
    activations into plausible wrong tokens, not NaN output. What `anychip verify`'s value pass checks in the files,
    checked here for a plain `vllm serve` or `LLM(...)` that never ran it (the load hooks of vLLM's CPU and GPU
    model runners; a few hundred ms for a 1B model on a CPU; in slices, so that the check leaves no large
    temporary in the allocator's cache)."""
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            continue
        flat = param.detach().reshape(-1)
        if any(not bool(torch.isfinite(flat[i:i + CHECK_SLICE]).all()) for i in range(0, flat.numel(), CHECK_SLICE)):
            raise LayerPrepareError(f"{name} holds NaN or inf: one such weight poisons every token that reaches it; "
                                    "the checkpoint is damaged (check it with `anychip verify`) or its BF16 source "
                                    "was; fix the source and re-quantize")


class AnychipW4A8Scheme(compat.CompressedTensorsScheme):
    def __init__(self, weight_quant: Any, checkpoint_format: str, layer_name: str, recorder: "Recorder") -> None:
        strategy = getattr(weight_quant.strategy, "value", weight_quant.strategy)
        self.channelwise = strategy == "channel"
        self.group_size = -1 if self.channelwise else int(weight_quant.group_size)
        self.format = checkpoint_format
        self.layer_name = layer_name
        self.recorder = recorder

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # CPUs report no capability; GPU routes check their own needs when preparing

    def create_weights(self, layer: torch.nn.Module, output_size: int, input_size: int,
                       output_partition_sizes: list[int], input_size_per_partition: int,
                       params_dtype: torch.dtype, weight_loader: Callable, **kwargs: Any) -> None:
        n = sum(output_partition_sizes)
        k = input_size_per_partition
        row_parallel = input_size != input_size_per_partition
        weight_loader = self._checked_loader(weight_loader)
        if not self.channelwise and k % self.group_size:
            groups = input_size // self.group_size
            fits = [t for t in range(1, 17) if groups % t == 0]
            raise LayerPrepareError(
                f"layer {self.layer_name}: its input shard has K={k} columns (of {input_size}), not a multiple of "
                f"group size {self.group_size}: a row-parallel split must fall on a group boundary. Use a tensor "
                f"parallel size that divides its {groups} groups ({', '.join(map(str, fits))}), or re-quantize "
                "with a smaller --group-size.")
        groups = 1 if self.channelwise else k // self.group_size
        scale_data = torch.empty(n, groups, dtype=params_dtype)
        if self.channelwise:
            # one scale per output row, repeated on every rank of a row-parallel split
            scale = compat.ChannelQuantScaleParameter(output_dim=0, weight_loader=weight_loader, data=scale_data)
        else:
            scale = compat.GroupQuantScaleParameter(output_dim=0, input_dim=1, weight_loader=weight_loader,
                                                    data=scale_data)
        if self.format == "pack-quantized":
            if k % 8:
                raise LayerPrepareError(f"layer {self.layer_name}: K={k} is not a multiple of 8 int4 values per "
                                        "int32 word; pack-quantized needs whole words")
            weight = compat.PackedvLLMParameter(
                input_dim=1, output_dim=0, packed_dim=1, packed_factor=Fraction(8), weight_loader=weight_loader,
                data=torch.empty(n, k // 8, dtype=torch.int32))  # (N, K // 8) int32, 8 nibbles per word
            layer.register_parameter("weight_packed", weight)
            layer.register_parameter("weight_shape", compat.BasevLLMParameter(
                data=torch.zeros(2, dtype=torch.int64), weight_loader=weight_loader))  # [0, 0]: not loaded
        else:
            weight = compat.ModelWeightParameter(input_dim=1, output_dim=0, weight_loader=weight_loader,
                                                 data=torch.empty(n, k, dtype=torch.int8))  # (N, K) int8
            layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)
        self.n, self.k, self.row_parallel = n, k, row_parallel
        # the tensors every part of the layer must load (checked after loading: vLLM 0.32 tracks unloaded weights of
        # unquantized models only, so a tensor missing from the files would serve what torch.empty left)
        self._parts = len(output_partition_sizes)
        self._must_load = {id(weight): "weight_packed" if self.format == "pack-quantized" else "weight",
                           id(scale): "weight_scale"}
        self._loaded: dict[int, set] = {}
        # what a pack-quantized weight_shape must say: [N, K] of the whole tensor; a merged layer's parts are
        # loaded into the one parameter in turn, so there only K (the same for every part) is known
        self._declared_shape = (None if len(output_partition_sizes) > 1 else output_size, input_size)
        packed_k = input_size // 8 if self.format == "pack-quantized" else input_size
        self._full_shapes = {id(weight): (output_size, packed_k),
                             id(scale): (output_size, 1 if self.channelwise else input_size // self.group_size)}

    def _checked_loader(self, loader: Callable) -> Callable:
        """vLLM's loader, refusing a checkpoint tensor that does not fit (vLLM would assert deep inside, or copy a
        float into an integer parameter silently) with an error naming the layer."""

        def load(param: torch.Tensor, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            want = param.data.dtype
            fits = (loaded.is_floating_point() if want.is_floating_point else
                    loaded.dtype in (torch.int32, torch.int64) if want == torch.int64 else loaded.dtype == want)
            problem = None if fits else f"dtype {loaded.dtype} where the {self.format} contract has {want}"
            is_scale = self._must_load.get(id(param)) == "weight_scale"
            if problem is None and is_scale and loaded.dtype != torch.bfloat16:
                problem = (f"{loaded.dtype} group scales where the contract has BF16 (converting them would serve "
                           "other numbers than the checkpoint declares)")
            full = self._full_shapes.get(id(param))  # a whole (unmerged) tensor: vLLM would narrow a larger one
            if problem is None and full is not None and not args and not kwargs and tuple(loaded.shape) != full:
                problem = f"shape {tuple(loaded.shape)} where the layer's config implies {full}"
            if problem is None:
                try:
                    result = loader(param, loaded, *args, **kwargs)
                    part = args[0] if args else kwargs.get("loaded_shard_id")
                    self._loaded.setdefault(id(param), set()).add(part)
                    return result
                except (AssertionError, RuntimeError, ValueError, IndexError) as exc:
                    why = str(exc) or type(exc).__name__
                    problem = f"shape {tuple(loaded.shape)} that does not fit {tuple(param.data.shape)} ({why})"
            raise LayerPrepareError(f"layer {self.layer_name}: a checkpoint tensor has {problem}: config.json and the "
                                    "weights disagree; check the checkpoint with `anychip verify`")

        return load

    def _check_weight_shape(self, stored: torch.Tensor) -> None:
        """The kernels take N and K from the packed tensors, not from weight_shape; a weight_shape that disagrees
        with them still means a damaged or hand-edited checkpoint, which strict serving refuses."""
        said = [int(v) for v in stored.reshape(-1).tolist()]
        if not any(said):  # never loaded (vLLM's loaders need not fill a tensor the kernels never read)
            return
        n, k = self._declared_shape
        if len(said) == 2 and said[1] == k and (n is None or said[0] == n):
            return
        want = f"[{n}, {k}]" if n is not None else f"[N, {k}]"
        raise LayerPrepareError(f"layer {self.layer_name}: its weight_shape tensor says {said} where the packed "
                                f"weights are {want}: config.json and the weights disagree; check the checkpoint "
                                "with `anychip verify`")

    def _check_loaded(self, layer: torch.nn.Module) -> None:
        """Every part of the quantized weight and its scales came from the checkpoint: refuse a layer whose files
        lack one (its parameter still holds what torch.empty left there)."""
        for param in layer.parameters(recurse=False):
            name = self._must_load.get(id(param))
            if name is None:
                continue
            parts = self._loaded.get(id(param), set())
            if None in parts or len(parts) >= self._parts:
                continue
            which = (f"only parts {sorted(map(str, parts))} of the {self._parts} merged into it were loaded"
                     if parts else "it was never loaded")
            raise LayerPrepareError(f"layer {self.layer_name}: the checkpoint has no {name} for it ({which}): the "
                                    "checkpoint is incomplete; check it with `anychip verify`")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_loaded(layer)
        packed = self.format == "pack-quantized"
        if packed:
            self._check_weight_shape(layer.weight_shape.data)
        wq = (layer.weight_packed if packed else layer.weight).data
        scales = layer.weight_scale.data
        group = self.group_size
        no_group = None  # why per-channel scales have no kernel group here
        if self.channelwise:
            kernel_group = _channel_group(self.k)
            group = kernel_group or self.k
            scales = scales.expand(self.n, self.k // group).contiguous() if group != self.k else scales
            if kernel_group is None:
                no_group = (f"per-channel scales over K={self.k}: anychip's kernels take them as groups of "
                            f"{GROUP_SIZES}, none of which divides K")
        fallback_reason = None
        policy = self.recorder.policy
        try:
            # the plugin owns the fallback policy: never let prepare degrade silently
            prepared = prepare_w4a8(wq, scales, group, packed=packed,
                                    policy=replace(policy, allow_fallback=False))
            if prepared.route is routes.REFERENCE:
                raise AnychipError(f"{envs.ANYCHIP_KERNEL_ISA}={policy.route} forces the reference route")
        except CheckpointDataError as exc:  # damaged weights: no route serves them, the reference included
            raise LayerPrepareError(f"layer {self.layer_name} (N={self.n}, K={self.k}, G{group}): {exc}. No route "
                                    "can serve damaged weights, so the engine does not start whatever the fallback "
                                    "setting: re-create the checkpoint (anychip quantize) or restore it") from exc
        except AnychipError as exc:
            if no_group is not None:
                exc = AnychipError(no_group)
            if self.recorder.coverage.strict:
                raise LayerPrepareError(
                    f"layer {self.layer_name} (N={self.n}, K={self.k}, G{group}): no fast anychip kernel can serve "
                    f"it on this machine: {exc}. Strict mode refuses to start. To proceed, fix the cause above, or "
                    "allow the torch reference route (anychip serve --allow-fallback, or ANYCHIP_ALLOW_FALLBACK=1): "
                    "slow, and counted as fallback in the coverage report.") from exc
            fallback_reason = str(exc)
            prepared = prepare_w4a8(wq, scales, group, packed=packed, route=routes.REFERENCE.id, policy=policy)
        for name in ("weight_packed", "weight_shape", "weight", "weight_scale"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.anychip_weight = torch.nn.Parameter(prepared.weight, requires_grad=False)
        layer.anychip_scales = torch.nn.Parameter(prepared.scales, requires_grad=False)
        route = prepared.route
        self.route_code, self.group = route.code, prepared.group_size
        self.layer_id = self.recorder.add_layer(LayerRoute(
            name=self.layer_name, route=route.id, kernel=route.kernel, isa=route.isa,
            group_size=-1 if self.channelwise else prepared.group_size,
            n=self.n, k=self.k, checkpoint_format=self.format, fallback=route is routes.REFERENCE,
            reason=fallback_reason, bit_exact=route.bit_exact))
        # the ops take the id as a tensor (a graph input like the weights): every layer's piece is the same graph
        layer.register_buffer("anychip_layer_id", ops.layer_tensor(self.layer_id), persistent=False)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
        if self.row_parallel:  # a K shard: quantize it with the whole token's scale (tensor_parallel.py)
            xq, sx = quantize_over_ranks(x.reshape(-1, self.k))
            y = torch.ops.anychip.w4a8_linear_q.default(xq, sx, layer.anychip_weight, layer.anychip_scales, bias,
                                                        self.n, self.k, self.group, self.route_code,
                                                        layer.anychip_layer_id, x.dtype)
            return y.view(*x.shape[:-1], self.n)
        # the overload itself (as a compiled graph calls it): no overload resolution per call in eager mode
        return torch.ops.anychip.w4a8_linear.default(x, layer.anychip_weight, layer.anychip_scales, bias, self.n,
                                                     self.k, self.group, self.route_code, layer.anychip_layer_id)


class ForeignScheme(compat.CompressedTensorsScheme):
    """A layer vLLM's own scheme serves (only when fallback is allowed); recorded as fallback in coverage."""

    def __init__(self, inner: Any, layer_name: str, reason: str, recorder: "Recorder") -> None:
        self.inner, self.layer_name, self.reason, self.recorder = inner, layer_name, reason, recorder

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        self.inner.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)
        self.recorder.add_layer(LayerRoute(
            name=self.layer_name, route=f"vllm.{type(self.inner).__name__}", kernel=type(self.inner).__name__,
            isa="vllm", group_size=0, n=getattr(layer, "output_size_per_partition", 0),
            k=getattr(layer, "input_size_per_partition", 0), checkpoint_format="?", fallback=True,
            reason=self.reason))

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
        return self.inner.apply_weights(layer, x, bias)
