"""The W4A8 checkpoint contract, as typed config: what `quantize` writes into config.json and what `verify`
and the vLLM plugin read back. Format: compressed-tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from anychip.errors import AnychipError
from anychip.formats import FORMATS, GROUP_SIZES

Format = Literal["pack-quantized", "int-quantized"]
#: Linear modules of a Llama decoder layer that carry INT4 weights.
DECODER_LINEARS: tuple[str, ...] = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
#: Kept in BF16 and listed in `ignore`.
IGNORED: tuple[str, ...] = ("lm_head",)


class ContractError(AnychipError, ValueError):
    """A checkpoint or config breaks the W4A8 contract; the message says where and how to fix it."""


@dataclass(frozen=True)
class W4A8Scheme:
    """INT4 symmetric per-group weights, dynamic per-token symmetric INT8 activations.

    group_size: input channels per weight scale (32, 64 or 128); K of every quantized linear must divide by it.
    format: "pack-quantized" (int32 words, 8 nibbles each) or "int-quantized" (one int8 per weight).
    """

    group_size: int = 128
    format: Format = "pack-quantized"
    ignore: tuple[str, ...] = field(default=IGNORED)

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise ContractError(f"group size {self.group_size} is not supported: use one of {GROUP_SIZES}")
        if self.format not in FORMATS:
            raise ContractError(f"format {self.format!r} is not supported: use one of {FORMATS}")

    def quantization_config(self, source: dict[str, Any] | None = None) -> dict[str, Any]:
        """The `quantization_config` block of config.json, in compressed-tensors form."""
        cfg: dict[str, Any] = {
            "quant_method": "compressed-tensors",
            "format": self.format,
            "quantization_status": "compressed",
            "global_compression_ratio": None,
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "format": self.format,
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": self.group_size,
                        "dynamic": False,
                        "actorder": None,
                        "observer": "minmax",
                        "observer_kwargs": {},
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "token",
                        "dynamic": True,
                        "group_size": None,
                        "observer": None,
                        "observer_kwargs": {},
                    },
                    "output_activations": None,
                }
            },
            "ignore": list(self.ignore),
            "kv_cache_scheme": None,
        }
        if source is not None:
            # anychip's own provenance (which BF16 model, which method); compressed-tensors ignores unknown keys.
            cfg["anychip"] = source
        return cfg


def _require_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ContractError(f"{where} is a JSON {type(value).__name__}, not an object: config.json is damaged")
    return value


def scheme_from_config(config: dict[str, Any]) -> W4A8Scheme:
    """Read the W4A8 scheme back from a model's config.json dict; ContractError if it is not W4A8."""
    qc = config.get("quantization_config")
    if not qc:
        raise ContractError("config.json has no quantization_config: this is not a W4A8 checkpoint "
                            "(make one with `anychip quantize SRC DST`)")
    _require_object(qc, "quantization_config")
    if qc.get("quant_method") != "compressed-tensors":
        raise ContractError(f"quant_method is {qc.get('quant_method')!r}, expected 'compressed-tensors'")
    groups = _require_object(qc.get("config_groups") or {}, "quantization_config.config_groups")
    if len(groups) != 1:
        raise ContractError(f"expected one config group, found {len(groups)}")
    ((name, group),) = groups.items()
    _require_object(group, f"config_groups.{name}")
    w = _require_object(group.get("weights") or {}, f"config_groups.{name}.weights")
    a = _require_object(group.get("input_activations") or {}, f"config_groups.{name}.input_activations")
    if type(w.get("group_size")) is not int:
        raise ContractError(f"quantization_config is not W4A8: weights group_size={w.get('group_size')!r}, "
                            "expected a whole number (32, 64 or 128)")
    checks = [
        (w.get("num_bits") == 4, f"weights num_bits={w.get('num_bits')}, expected 4"),
        (w.get("type") == "int", f"weights type={w.get('type')!r}, expected 'int'"),
        (w.get("symmetric") is True, "weights must be symmetric"),
        (w.get("strategy") == "group", f"weights strategy={w.get('strategy')!r}, expected 'group'"),
        (a.get("num_bits") == 8 and a.get("type") == "int", "input activations must be int8"),
        (a.get("dynamic") is True and a.get("strategy") == "token", "input activations must be dynamic per-token"),
        (a.get("symmetric") is True, "input activations must be symmetric"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ContractError(f"quantization_config is not W4A8: {msg}")
    fmt = group.get("format") or qc.get("format")
    return W4A8Scheme(group_size=int(w.get("group_size")), format=fmt, ignore=tuple(qc.get("ignore") or ()))
