"""Re-write a W4A8 checkpoint in the other compressed-tensors format (pack-quantized <-> int-quantized) with the
very same INT4 values and scales: the quantize pipeline, fed the stored weights instead of a quantizer."""

from __future__ import annotations

import json
from pathlib import Path

from anychip.checkpoint.quantize import WeightQuantizer, quantize_checkpoint
from anychip.checkpoint.scheme import Format, W4A8Scheme, scheme_from_config
from anychip.checkpoint.torch_model import read_quantized_linears
from anychip.errors import AnychipError


def stored_quantizer(w4a8_dir: Path) -> WeightQuantizer:
    """A WeightQuantizer that returns the (wq, scales) already stored in `w4a8_dir`."""
    linears, _ = read_quantized_linears(w4a8_dir)

    def quantize(prefix: str, weight):
        if prefix not in linears:
            raise AnychipError(f"{w4a8_dir} has no quantized weights for {prefix}")
        return linears[prefix]

    return quantize


def convert_format(w4a8_dir: Path, dst: Path, fmt: Format) -> Path:
    """`dst` = `w4a8_dir` in format `fmt`; needs the BF16 source recorded in its provenance (for the unquantized
    tensors and side files, which quantize copies)."""
    w4a8_dir = Path(w4a8_dir)
    qc = json.loads((w4a8_dir / "config.json").read_text())
    scheme = scheme_from_config(qc)
    provenance = qc["quantization_config"].get("anychip") or {}
    source = provenance.get("source")
    if not source or not Path(source).exists():
        raise AnychipError(f"{w4a8_dir}: its BF16 source {source!r} (quantization_config.anychip.source) is not "
                           "available; convert needs it for the unquantized tensors")
    target = W4A8Scheme(group_size=scheme.group_size, format=fmt, ignore=scheme.ignore)
    return quantize_checkpoint(Path(source), dst, target, stored_quantizer(w4a8_dir),
                               method=provenance.get("method", "rtn"))
