"""Shared fixtures: the prepared default model (cached across tests and runs) and tiny random Llama (and other
family) checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Tests never download: transformers and huggingface_hub read these before their first hub call.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def model_cache() -> Path:
    """$ANYCHIP_CACHE (the Makefile sets it to the repo's .cache/models for tests), else that same folder."""
    return Path(os.environ.get("ANYCHIP_CACHE") or ROOT / ".cache" / "models")


@pytest.fixture(scope="session")
def default_model():
    """The default model (SmolLM2-135M-Instruct) as BF16 + verified W4A8: `.bf16_dir`, `.w4a8_dir`, `.report`.
    Prepared once into the model cache and reused by later runs; treat the directories as read-only."""
    from anychip.checkpoint.prepare import prepare_default

    return prepare_default(cache=model_cache())


def ct_decompress(directory: Path) -> dict:
    """{linear prefix: BF16 weight} for every quantized linear of a W4A8 directory, dequantized by compressed-tensors'
    own compressor for the format config.json declares (the library's reading of our files, not ours)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    qc = QuantizationConfig.model_validate(json.loads((directory / "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    params = compressor.compression_param_names(scheme)
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(path)
    out = {}
    for prefix in {n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")}:
        state = {p: tensors[f"{prefix}.{p}"] for p in params}
        out[prefix] = compressor.decompress(state, scheme)["weight"]
    return out


TINY_DEFAULTS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True, max_position_embeddings=256)


def _tiny_tokenizer(directory: Path, size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size - 1)} | {"<unk>": size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="w0",
                            eos_token="w1").save_pretrained(directory)


def write_tiny_llama(directory: Path, seed: int = 0, tokenizer_size: int = 100,
                     architecture: str = "LlamaForCausalLM", **overrides) -> Path:
    """A random BF16 decoder (LlamaForCausalLM unless `architecture` names another transformers class, e.g.
    Qwen2ForCausalLM) saved with transformers (safetensors) plus a word-level tokenizer."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cls = getattr(transformers, architecture)
    model = cls(cls.config_class(**(TINY_DEFAULTS | overrides))).to(torch.bfloat16)
    with torch.no_grad():  # init std 0.02 is uniform across layers; vary it so groups differ in scale
        for name, p in model.named_parameters():
            p.mul_(torch.empty_like(p).uniform_(0.5, 2.0))
            if name.endswith("norm.weight") and not p.any():  # Gemma's norms apply 1 + w, initialized w = 0
                p.uniform_(-0.5, 0.5)
            if name.endswith(".bias") and not p.any():  # initialized 0: a bias dropped anywhere would not show
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(directory)
    _tiny_tokenizer(directory, tokenizer_size)
    return directory


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Callable[..., Path]:
    """Factory: tiny_llama(**LlamaConfig overrides) -> a BF16 directory, built once per distinct shape.
    Treat it as read-only; copy it (shutil.copytree) before changing it."""
    made: dict[str, Path] = {}

    def make(**overrides) -> Path:
        key = json.dumps(overrides, sort_keys=True)
        if key not in made:
            made[key] = write_tiny_llama(tmp_path_factory.mktemp("tiny-bf16"), **overrides)
        return made[key]

    return make


@pytest.fixture
def copy_dir(tmp_path) -> Callable[[Path], Path]:
    """copy_dir(src) -> a private copy under tmp_path that a test may damage."""

    def copy(src: Path) -> Path:
        dst = tmp_path / f"copy-{src.name}"
        shutil.copytree(src, dst)
        return dst

    return copy


def pytest_collection_modifyitems(config, items) -> None:
    """A test that needs the prepared default model is slow whether or not it says so (`make test-fast` runs
    `-m "not slow"`)."""
    for item in items:
        if "default_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter) -> None:
    """The machine the suite ran on, beside the results (CI shows the end of its log): the kernels and vLLM dispatch
    on these flags, so a failure seen on one kind of machine can be told apart from one seen on another."""
    from anychip.coverage import platform_summary
    from anychip.kernels.machine import describe

    cpu, info = platform_summary(), describe()  # the coverage report's machine, and `anychip routes`' flags
    terminalreporter.write_line(f"machine: {cpu['cpu'] or cpu['machine']}, {os.cpu_count()} CPUs, "
                                f"flags {' '.join(info['cpu_flags']) or 'none of note'}, torch {info['torch']}")
