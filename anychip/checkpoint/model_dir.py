"""What is in a model folder, answered in one place: its config, its W4A8 scheme (or none), its kind, where its
BF16 source is, and its weight shards. serve, eval, bench, verify and prepare all ask this type."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from anychip.checkpoint.scheme import ContractError, W4A8Scheme, scheme_from_config

Kind = Literal["w4a8", "synthetic", "bf16", "other"]
CONFIG = "config.json"
#: config.json key `anychip prepare --synthetic` writes: the weights are random (noise, not a model).
SYNTHETIC_MARKER = "anychip_synthetic"


class ModelDirError(ContractError):
    """A folder is not a model directory, or lacks what a command needs; the message says how to fix it."""


#: config.json fields that make two models the same shape (a BF16 source must agree with its W4A8 checkpoint;
#: not tie_word_embeddings, which `quantize --rotate` turns off).
SHAPE_KEYS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def weight_files_stamp(path: Path) -> list[list[Any]]:
    """[name, size, mtime_ns] of each *.safetensors file of a model directory: what `anychip quantize` records
    of its source, so that a later comparison can tell whether the source still holds the same weights."""
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(path.glob("*.safetensors"))]


@dataclass(frozen=True, eq=False)
class ModelDir:
    """A Hugging Face model folder as anychip sees it. Open it with `ModelDir.open(path)`.

    kind: "w4a8" (an anychip W4A8 checkpoint of real weights), "synthetic" (W4A8 with random weights, from
    `anychip prepare --synthetic`), "bf16" (unquantized weights), "other" (quantized some other way).
    """

    path: Path
    config: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> ModelDir:
        path = Path(path)
        file = path / CONFIG
        if path.is_file():
            raise ModelDirError(f"{path} is a file; pass the model's directory"
                                + (f" ({path.parent})" if path.name == CONFIG else ""))
        if not path.exists():
            raise ModelDirError(f"{path} does not exist; pass a Hugging Face model directory (for the default "
                                "model: `anychip prepare` prints it)")
        if not file.is_file():
            raise ModelDirError(f"{path}: no {CONFIG}; pass a Hugging Face model directory (for the default model: "
                                "`anychip prepare` prints it)")
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
            raise ModelDirError(f"{file}: not readable JSON ({exc}): re-create the checkpoint") from None
        if not isinstance(config, dict):
            raise ModelDirError(f"{file}: a JSON object was expected, found {type(config).__name__}")
        return cls(path, config)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        qc = self.config.get("quantization_config")
        return qc if isinstance(qc, dict) and qc else None

    @cached_property
    def scheme(self) -> W4A8Scheme | None:
        """The W4A8 scheme config.json declares, or None when it declares none (or another quantization)."""
        if self.quantization_config is None:
            return None
        try:
            return scheme_from_config(self.config)
        except (ContractError, TypeError, ValueError):
            return None

    def require_scheme(self) -> W4A8Scheme:
        """The W4A8 scheme, or the contract error that says why this is not a W4A8 checkpoint."""
        try:
            return scheme_from_config(self.config)
        except ContractError as exc:
            raise ContractError(f"{self.path / CONFIG}: {exc}") from None

    @property
    def provenance(self) -> dict[str, Any]:
        """What `anychip quantize` (or `prepare --synthetic`) recorded about where the weights came from."""
        qc = self.quantization_config or {}
        prov = qc.get("anychip")
        return dict(prov) if isinstance(prov, dict) else {}

    @property
    def made_by_anychip(self) -> bool:
        """config.json carries anychip's provenance block (`anychip quantize` or `prepare` wrote it), whatever the
        rest of its quantization_config says now."""
        return isinstance((self.quantization_config or {}).get("anychip"), dict)

    @property
    def verifiable(self) -> bool:
        """A W4A8 checkpoint, or one anychip made whatever its config now says (the contract then names what was
        changed): what serve, eval and bench verify before they run it."""
        return self.scheme is not None or self.made_by_anychip

    @property
    def is_synthetic(self) -> bool:
        prov = self.provenance
        return SYNTHETIC_MARKER in self.config or prov.get("method") == "random" or prov.get("source") == "synthetic"

    @property
    def kind(self) -> Kind:
        if self.scheme is not None:
            return "synthetic" if self.is_synthetic else "w4a8"
        return "bf16" if self.quantization_config is None else "other"

    @property
    def quant_method(self) -> str | None:
        qc = self.quantization_config
        return str(qc.get("quant_method")) if qc and qc.get("quant_method") else None

    def bf16_source(self, given: Path | None = None) -> Path:
        """The BF16 directory this checkpoint was quantized from; ModelDirError saying why not otherwise. given: the
        user's word for where it is now (moved or copied; `anychip eval --bf16 DIR`): checked to be the same model
        by its shape and its safetensors files' names and sizes (a copy's times may differ)."""
        if given is not None:
            path = Path(given)
            if not (path / CONFIG).is_file():
                raise ModelDirError(f"--bf16 {path}: no model directory there (no {CONFIG})")
        elif self.quantization_config is None:
            raise ModelDirError(f"{self.path} is not quantized (no quantization_config): it has no BF16 source; "
                                "pass the W4A8 directory instead")
        if self.is_synthetic:
            raise ModelDirError(f"{self.name} has random weights (anychip prepare --synthetic): no BF16 source")
        if given is None:
            src = self.provenance.get("source")
            if not src:
                raise ModelDirError(f"{self.path / CONFIG} records no source model (quantization_config.anychip."
                                    "source): re-create it with `anychip quantize SRC DST`, or name it with --bf16")
            path = Path(src)
            if not (path / CONFIG).is_file():
                raise ModelDirError(f"the BF16 source {path} recorded in {self.path / CONFIG} is gone: re-run "
                                    "`anychip prepare` or `anychip quantize`, or name where it is now with --bf16")
        source = ModelDir.open(path)
        differ = [f"{key} {source.get(key)!r} (this checkpoint: {self.get(key)!r})" for key in SHAPE_KEYS
                  if source.get(key) != self.get(key)]
        if differ and given is not None:
            raise ModelDirError(f"--bf16 {path}: another model than the one {self.path} was quantized from: "
                                f"{'; '.join(differ)}")
        if differ:
            raise ModelDirError(f"the BF16 source {path} recorded in {self.path / CONFIG} is another model now: "
                                f"{'; '.join(differ)}. Point quantization_config.anychip.source at the model it "
                                "was quantized from, or re-quantize")
        recorded = self.provenance.get("source_files")
        if given is not None:
            if recorded is not None and [r[:2] for r in recorded] != [r[:2] for r in weight_files_stamp(path)]:
                raise ModelDirError(f"--bf16 {path}: its safetensors files' names or sizes differ from those of the "
                                    f"source recorded in {self.path / CONFIG}: not the weights this checkpoint was "
                                    "made from")
            return path
        if recorded is not None and recorded != weight_files_stamp(path):
            raise ModelDirError(f"the BF16 source {path} recorded in {self.path / CONFIG} has changed since this "
                                "checkpoint was made (its safetensors files' names, sizes or times differ from the "
                                "record): a comparison would be against other weights. Re-quantize from it, or "
                                "restore the source")
        return path

    @property
    def shards(self) -> list[Path]:
        """The *.safetensors files, sorted."""
        return sorted(self.path.glob("*.safetensors"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)
