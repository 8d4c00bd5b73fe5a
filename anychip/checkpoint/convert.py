"""Re-write a W4A8 checkpoint in the other compressed-tensors format (pack-quantized <-> int-quantized) with the
very same INT4 values and scales, streamed tensor by tensor (no BF16 source needed)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from anychip.checkpoint.io import TensorInfo, read_tensor, read_tensor_infos
from anychip.checkpoint.layout import TensorSpec
from anychip.checkpoint.model_dir import ModelDir
from anychip.checkpoint.rewrite import rewrite_checkpoint
from anychip.checkpoint.scheme import Format
from anychip.formats import FORMATS, PACK_FACTOR, pack_int4, unpack_int4


def convert_format(w4a8_dir: Path, dst: Path, fmt: Format, *, overwrite: bool = False) -> Path:
    """`dst` = `w4a8_dir` in format `fmt` (SHA256SUMS written, contract-verified); `dst` is `w4a8_dir` itself
    when it is in that format already."""
    from anychip.checkpoint.verify import verify_checkpoint

    md = ModelDir.open(w4a8_dir)
    scheme = md.require_scheme()
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: use one of {FORMATS}")
    if scheme.format == fmt:
        return md.path
    infos = read_tensor_infos(md.path)
    qc = copy.deepcopy(md.quantization_config)
    qc["format"] = fmt
    for group in qc["config_groups"].values():
        group["format"] = fmt
    to_int = fmt == "int-quantized"
    plan, values = _unpacking(infos) if to_int else _packing()
    out = rewrite_checkpoint(md.path, Path(dst), f"w4a8-{fmt}", dict(md.config, quantization_config=qc), plan,
                             values, overwrite=overwrite)
    verify_checkpoint(out)
    return out


def _unpacking(infos: dict[str, TensorInfo]) -> tuple[Callable, Callable]:
    def plan(info: TensorInfo) -> list[TensorSpec]:
        if info.name.endswith(".weight_shape"):
            return []
        if info.name.endswith(".weight_packed"):
            return [TensorSpec(info.name.removesuffix("_packed"), torch.int8, packed_weight_shape(infos, info))]
        return [TensorSpec(info.name, info.torch_dtype, info.shape)]

    def values(info: TensorInfo, get: Callable[[str], torch.Tensor]) -> Iterator[torch.Tensor]:
        if info.name.endswith(".weight_shape"):
            return
        t = get(info.name)
        yield unpack_int4(t, k=packed_weight_shape(infos, info)[1]) if info.name.endswith(".weight_packed") else t

    return plan, values


def _packing() -> tuple[Callable, Callable]:
    def is_int4(info: TensorInfo) -> bool:  # int-quantized INT4 weights are the int8 `.weight` tensors
        return info.name.endswith(".weight") and info.torch_dtype == torch.int8

    def plan(info: TensorInfo) -> list[TensorSpec]:
        if is_int4(info):
            n, k = info.shape
            base = info.name.removesuffix(".weight")
            return [TensorSpec(f"{base}.weight_packed", torch.int32, (n, k // PACK_FACTOR)),
                    TensorSpec(f"{base}.weight_shape", torch.int64, (2,))]
        return [TensorSpec(info.name, info.torch_dtype, info.shape)]

    def values(info: TensorInfo, get: Callable[[str], torch.Tensor]) -> Iterator[torch.Tensor]:
        t = get(info.name)
        if is_int4(info):
            yield pack_int4(t)
            yield torch.tensor(list(t.shape), dtype=torch.int64)
        else:
            yield t

    return plan, values


def packed_weight_shape(infos: dict[str, TensorInfo], packed: TensorInfo) -> tuple[int, int]:
    """(N, K) of a pack-quantized weight: its `.weight_shape` tensor, else the packed shape times 8."""
    shape = infos.get(packed.name.replace("weight_packed", "weight_shape"))
    if shape is None:
        n, words = packed.shape
        return n, words * PACK_FACTOR
    n, k = (int(v) for v in read_tensor(shape).tolist())
    return n, k
