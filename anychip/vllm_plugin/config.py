"""The quantization config that claims W4A8 compressed-tensors checkpoints.

A subclass of vLLM's own compressed-tensors config: vLLM's target matching, ignore list, merged and sharded
loading stay vLLM's; only scheme selection changes, handing W4A8 int layers to AnychipW4A8Scheme.
"""

from __future__ import annotations

from typing import Any

from compressed_tensors.quantization import QuantizationArgs

from anychip.errors import AnychipError
from anychip.formats import FORMATS
from anychip.vllm_plugin import compat, cpu_attention
from anychip.vllm_plugin.head import head_method
from anychip.vllm_plugin.recorder import get_recorder
from anychip.vllm_plugin.scheme import AnychipW4A8Scheme, ForeignScheme

NAME = "anychip-w4a8"


class StrictModeError(AnychipError, RuntimeError):
    pass


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


def is_w4a8_int(weight: QuantizationArgs | dict | None, activation: QuantizationArgs | dict | None) -> bool:
    """INT4 symmetric group/channel weights with INT8 dynamic symmetric per-token activations."""
    if not weight or not activation:
        return False
    get = (lambda a, k: a.get(k)) if isinstance(weight, dict) else (lambda a, k: getattr(a, k, None))
    return (
        get(weight, "num_bits") == 4 and _value(get(weight, "type")) == "int" and bool(get(weight, "symmetric"))
        and _value(get(weight, "strategy")) in ("group", "channel") and not get(weight, "dynamic")
        and get(activation, "num_bits") == 8 and _value(get(activation, "type")) == "int"
        and bool(get(activation, "symmetric")) and bool(get(activation, "dynamic"))
        and _value(get(activation, "strategy")) == "token"
    )


@compat.register_quantization_config(NAME)
class AnychipW4A8Config(compat.CompressedTensorsConfig):
    def get_name(self) -> str:
        return NAME

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """Claim compressed-tensors checkpoints with at least one W4A8 int group; leave the rest to vLLM."""
        if user_quant not in (None, "compressed-tensors", NAME):
            return None
        if hf_quant_cfg.get("quant_method") != "compressed-tensors":
            return None
        groups = (hf_quant_cfg.get("config_groups") or {}).values()
        fmt = hf_quant_cfg.get("format")
        claimed = any(is_w4a8_int(g.get("weights"), g.get("input_activations"))
                      and (g.get("format") or fmt) in FORMATS for g in groups)
        return NAME if claimed else None

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        method = super().get_quant_method(layer, prefix)
        if isinstance(layer, compat.Attention):
            cpu_attention.note_attention_layer(layer)
        if isinstance(layer, compat.LinearBase) and isinstance(method, compat.UnquantizedLinearMethod):
            # a linear the checkpoint leaves unquantized: listed too, so the report covers every linear
            ignored = compat.should_ignore_layer(prefix, ignore=self.ignore,
                                                 fused_mapping=self.packed_modules_mapping)
            get_recorder().note_unquantized_linear(prefix, layer, ignored)
        if isinstance(layer, compat.VocabParallelEmbedding):
            recorder = get_recorder()
            recorder.note_embedding(prefix, layer, is_head=prefix.split(".")[-1] == "lm_head")
            if method is None:  # an unquantized head: an anychip head route serves it on the CPU
                method = head_method(layer, prefix, recorder.policy)
        return method

    def _get_scheme_from_parts(self, weight_quant: QuantizationArgs, input_quant: QuantizationArgs,
                               output_quant: QuantizationArgs | None = None, format: str | None = None,
                               layer_name: str | None = None) -> Any:
        fmt = format if format is not None else self.quant_format
        recorder = get_recorder()
        if is_w4a8_int(weight_quant, input_quant) and fmt in FORMATS and output_quant is None:
            return AnychipW4A8Scheme(weight_quant, fmt, layer_name or "?", recorder)
        reason = (f"scheme weights={weight_quant}, input_activations={input_quant}, format={fmt} is not W4A8 int "
                  f"in {FORMATS}")
        if recorder.coverage.strict:
            raise StrictModeError(
                f"layer {layer_name}: no anychip kernel serves it ({reason}). Strict mode refuses to start rather "
                "than let vLLM's own route serve it silently. To proceed, re-quantize it as W4A8 (anychip "
                "quantize), add it to the checkpoint's ignore list, or allow fallback (anychip serve "
                "--allow-fallback, or ANYCHIP_ALLOW_FALLBACK=1), which the coverage report then counts.")
        inner = super()._get_scheme_from_parts(weight_quant, input_quant, output_quant, format, layer_name)
        return ForeignScheme(inner, layer_name or "?", reason, recorder)
