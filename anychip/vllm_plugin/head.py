"""The output head through an anychip head route (kernels/routes/head.py) instead of vLLM's unquantized GEMM.

vLLM's LogitsProcessor calls `lm_head.quant_method.apply(lm_head, hidden_states, bias)`; AnychipHeadMethod is
vLLM's UnquantizedEmbeddingMethod (same weights, same tying, same embedding lookup) with its own load step and
apply. A tied head shares the input embedding's tensor: the BF16 route reads that tensor as it is (no copy);
`--head int8` keeps an INT8 copy beside it (the embedding lookup still needs the BF16 rows).
"""

from __future__ import annotations

from typing import Any

import torch

from anychip.kernels.policy import KernelPolicy
from anychip.kernels.routes.head import HeadRoute, PreparedHead, select_head
from anychip.vllm_plugin import compat

#: The attribute of the head layer that holds its PreparedHead (the recorder reads the route from it).
PREPARED = "anychip_head"


class AnychipHeadMethod(compat.UnquantizedEmbeddingMethod):
    def __init__(self, route: HeadRoute, policy: KernelPolicy, prefix: str) -> None:
        super().__init__()
        self.route, self.policy, self.prefix = route, policy, prefix

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if is_unloaded(layer):  # a pooling runner loads no head: nothing computes logits, nothing to prepare
            return
        # not vLLM's CPU GEMM dispatch: it would pack a second copy of the weight for a GEMM we never call
        setattr(layer, PREPARED, self.route.prepare(layer.weight.data, self.policy))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        head: PreparedHead | None = getattr(layer, PREPARED, None)
        if head is None:
            raise RuntimeError(f"{self.prefix}: the anychip head was not prepared (process_weights_after_loading "
                               "did not run for it): report this with the model name and vLLM version")
        return head.logits(x, bias)


def is_unloaded(layer: Any) -> bool:
    """The head's weight was never loaded: vLLM's pooling runners (`runner="pooling"`) skip `lm_head` and leave
    it on the meta device."""
    weight = getattr(layer, "weight", None)
    return weight is not None and weight.device.type == "meta"


def head_method(layer: Any, prefix: str, policy: KernelPolicy) -> AnychipHeadMethod | None:
    """Our method for an unquantized CPU output head; None leaves the layer to vLLM (an input embedding, a
    quantized or non-CPU head)."""
    if not isinstance(layer, compat.ParallelLMHead) or not compat.on_cpu():
        return None
    return AnychipHeadMethod(select_head(policy), policy, prefix)


def adopt_head(layer: Any, policy: KernelPolicy) -> bool:
    """Serve with an anychip head route an unquantized CPU head that vLLM built without asking the quantization
    config, so head_method never saw it (vLLM 0.32's Gemma 2 computes its logits with the input embedding, made
    with no quantization config). Called (compat.install_logits_hook) when vLLM first computes logits with the
    layer: with vLLM 0.32 on the CPU that is the first request's first step (engine start computes none), which
    then also pays the route's preparation (the BF16 route reads the weight in place; `--head int8` quantizes
    it). True when it took the layer over."""
    if not compat.on_cpu() or type(getattr(layer, "quant_method", None)) is not compat.UnquantizedEmbeddingMethod:
        return False  # not a CPU engine, already ours, or a quantized head
    method = AnychipHeadMethod(select_head(policy), policy, "lm_head")
    method.process_weights_after_loading(layer)
    compat.release_cpu_gemm(layer)
    layer.quant_method = method
    return True
