"""The quantization config that claims W4A8 compressed-tensors checkpoints.

A subclass of vLLM's own compressed-tensors config: vLLM's target matching, ignore list, merged and sharded
loading stay vLLM's; only scheme selection changes, handing W4A8 int layers to AnychipW4A8Scheme.
"""

from __future__ import annotations

from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs

from anychip.formats import FORMATS
from anychip.vllm_plugin import compat, cpu_attention
from anychip.vllm_plugin.head import head_method
from anychip.vllm_plugin.recorder import EngineRefusal, get_recorder
from anychip.vllm_plugin.scheme import AnychipW4A8Scheme, ForeignScheme

NAME = "anychip-w4a8"


class UnsupportedFeature(EngineRefusal):
    """A vLLM feature the W4A8 model cannot run with, refused when the model is built (not at its first use)."""


class StrictModeError(EngineRefusal):
    """Strict mode refuses a layer no anychip kernel serves."""


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


def w4a8_mismatches(weight: QuantizationArgs | dict | None, activation: QuantizationArgs | dict | None) -> list[str]:
    """What keeps a scheme from being W4A8 int (INT4 symmetric group/channel weights with INT8 dynamic symmetric
    per-token activations), in the checkpoint's words; empty when it is."""
    if not weight or not activation:
        return [f"{'weights' if not weight else 'input_activations'} are not quantized"]
    def get(a: Any, k: str) -> Any:
        return _value(a.get(k) if isinstance(a, dict) else getattr(a, k, None))
    wants = [
        (weight, "weights", "num_bits", 4), (weight, "weights", "type", "int"), (weight, "weights", "symmetric", True),
        (weight, "weights", "dynamic", False), (activation, "input_activations", "num_bits", 8),
        (activation, "input_activations", "type", "int"), (activation, "input_activations", "symmetric", True),
        (activation, "input_activations", "dynamic", True), (activation, "input_activations", "strategy", "token")]
    found = [f"{where}.{key}={get(args, key)!r} (W4A8 has {want!r})" for args, where, key, want in wants
             if (bool(get(args, key)) if isinstance(want, bool) else get(args, key)) != want]
    if get(weight, "strategy") not in ("group", "channel"):
        found.append(f"weights.strategy={get(weight, 'strategy')!r} (W4A8 has 'group' or 'channel')")
    return found


def is_w4a8_int(weight: QuantizationArgs | dict | None, activation: QuantizationArgs | dict | None) -> bool:
    """INT4 symmetric group/channel weights with INT8 dynamic symmetric per-token activations."""
    return not w4a8_mismatches(weight, activation)


@compat.register_quantization_config(NAME)
class AnychipW4A8Config(compat.CompressedTensorsConfig):
    def get_name(self) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        """BF16 only, the checkpoint's own activation and head dtype: vLLM then refuses float16 / float32 when the
        engine is configured, instead of after the whole model has loaded (where the head route refused it)."""
        return [torch.bfloat16]

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """Claim compressed-tensors checkpoints with at least one W4A8 int group, and those anychip made (their
        `anychip` provenance block) whatever their groups now say: a layer the scheme no longer matches is then
        refused by name in strict mode (_get_scheme_from_parts) instead of served by vLLM's own routes from a
        config edited after anychip wrote it. The rest stays vLLM's."""
        if user_quant not in (None, "compressed-tensors", NAME):
            return None
        if hf_quant_cfg.get("quant_method") != "compressed-tensors":
            return None
        if isinstance(hf_quant_cfg.get("anychip"), dict):
            return NAME
        groups = (hf_quant_cfg.get("config_groups") or {}).values()
        fmt = hf_quant_cfg.get("format")
        claimed = any(is_w4a8_int(g.get("weights"), g.get("input_activations"))
                      and (g.get("format") or fmt) in FORMATS for g in groups)
        return NAME if claimed else None

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        engine = compat.current_vllm_config()
        if getattr(engine, "lora_config", None) is not None:
            get_recorder()  # the refusal goes into this engine's report
            raise UnsupportedFeature("LoRA adapters (enable_lora) on an anychip W4A8 model: vLLM's LoRA layers "
                                     "wrap its own linear weights, which the anychip kernels' layout replaces; "
                                     "serve the adapter on the BF16 model, or merge it into the BF16 weights and "
                                     "quantize that (`anychip quantize`)")
        method = super().get_quant_method(layer, prefix)
        if isinstance(layer, compat.Attention):
            cpu_attention.check_head_size(layer, prefix)
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
        mismatches = w4a8_mismatches(weight_quant, input_quant)
        if fmt not in FORMATS:
            mismatches.append(f"format={fmt!r} (W4A8 has one of {FORMATS})")
        if output_quant is not None:
            mismatches.append("output activations are quantized (W4A8 leaves them)")
        if not mismatches:
            return AnychipW4A8Scheme(weight_quant, fmt, layer_name or "?", recorder)
        reason = f"its scheme is not W4A8 int: {'; '.join(mismatches)}"
        if recorder.coverage.strict:
            raise StrictModeError(
                f"layer {layer_name}: no anychip kernel serves it ({reason}). Strict mode refuses to start rather "
                "than let vLLM's own route serve it silently. To proceed, re-quantize it as W4A8 (anychip "
                "quantize), add it to the checkpoint's ignore list, or allow fallback (anychip serve "
                "--allow-fallback, or ANYCHIP_ALLOW_FALLBACK=1), which the coverage report then counts.")
        inner = super()._get_scheme_from_parts(weight_quant, input_quant, output_quant, format, layer_name)
        return ForeignScheme(inner, layer_name or "?", reason, recorder)
