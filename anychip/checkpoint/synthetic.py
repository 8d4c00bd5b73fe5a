"""`anychip prepare --synthetic SHAPE`: a random-weight W4A8 Llama for throughput-only runs at large shapes.

NOT A MODEL: its output is noise. It is labelled so in config.json (`anychip_synthetic`), in its directory
name and in a README inside it. The tokenizer, chat template and generation config are the default model's
(or those of `--tokenizer DIR`, for a host without the default model's package), so vLLM loads it like any
checkpoint. Where the shape's vocabulary is larger than the tokenizer's, the copied tokenizer gets a placeholder
token for every id above its own (`<|synthetic_ID|>`, never produced by encoding text): random weights sample
those ids, and a server's detokenizer that meets an id its tokenizer lacks decodes the whole prompt again at every
such step (tokenizers' DecodeStream), which made the API process, not the engine, the bottleneck of long-input
serving runs. Tensors are generated and written one at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from anychip import __version__
from anychip.checkpoint.cache import cache_lock, clear_done, is_done, mark_done
from anychip.checkpoint.default_bf16 import prepare_bf16
from anychip.checkpoint.io import ShardedWriter, atomic_directory, copy_side_files
from anychip.checkpoint.layout import (
    DecoderDims,
    TensorSpec,
    bf16_tensor_specs,
    linear_prefix,
    linear_tensor_specs,
    tensor_order,
)
from anychip.checkpoint.manifest import sha256_file, write_manifest
from anychip.checkpoint.scheme import DECODER_LINEARS, FORMATS, GROUP_SIZES, ContractError, Format, W4A8Scheme
from anychip.checkpoint.verify import VerifyReport, tokenizer_json_size, tokenizer_size, verify_checkpoint
from anychip.envs import cache_dir

_NOTICE = "random weights: NOT A MODEL, its output is noise; for throughput measurements only"


@dataclass(frozen=True)
class SyntheticShape:
    """A Llama shape. head_dim None means hidden // heads; max_position fits the article's 32k-in, 1k-out run."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    group: int = 128
    head_dim: int | None = None
    tied: bool = True
    format: Format = "pack-quantized"
    max_position: int = 32768 + 1024
    name: str | None = None  # the preset's name; None for a custom shape

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "max_position"):
            if getattr(self, f) <= 0:
                raise ContractError(f"--synthetic: {f}={getattr(self, f)} must be positive")
        if self.heads % self.kv_heads:
            raise ContractError(f"--synthetic: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ContractError(f"--synthetic: hidden={self.hidden} is not divisible by heads={self.heads}: "
                                "give head_dim=")
        if self.group not in GROUP_SIZES:
            raise ContractError(f"--synthetic: group={self.group}: use one of {GROUP_SIZES}")
        if self.format not in FORMATS:
            raise ContractError(f"--synthetic: format={self.format!r}: use one of {FORMATS}")
        d = self.dims
        for what, k in (("hidden", d.hidden), ("heads*head_dim", d.heads * d.head_dim),
                        ("intermediate", d.intermediate)):
            if k % self.group:
                fits = [g for g in GROUP_SIZES if k % g == 0]
                fix = f"use group={max(fits)}" if fits else f"make it a multiple of {min(GROUP_SIZES)}"
                raise ContractError(f"--synthetic: K={k} ({what}) is not divisible by group={self.group}: {fix}")

    @property
    def dims(self) -> DecoderDims:
        return DecoderDims(layers=self.layers, hidden=self.hidden, intermediate=self.intermediate, heads=self.heads,
                           kv_heads=self.kv_heads, head_dim=self.head_dim or self.hidden // self.heads,
                           vocab=self.vocab, tied=self.tied)

    @property
    def dirname(self) -> str:
        slug = self.name or (f"l{self.layers}-h{self.hidden}-i{self.intermediate}-a{self.heads}-kv{self.kv_heads}"
                             f"-v{self.vocab}" + (f"-hd{self.head_dim}" if self.head_dim else "")
                             + ("" if self.tied else "-untied") + ("" if self.format == "pack-quantized" else "-int"))
        return f"{slug}-w4a8-g{self.group}-random-not-a-model"


PRESETS: dict[str, SyntheticShape] = {
    "llama-2b": SyntheticShape(layers=42, hidden=2048, intermediate=6144, heads=16, kv_heads=8, vocab=73448,
                               group=128, name="llama-2b"),
    "llama-1b": SyntheticShape(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256,
                               group=128, head_dim=64, tied=True, name="llama-1b"),
    "tiny": SyntheticShape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=49152, group=64,
                           max_position=4096, name="tiny"),
}
_INT_KEYS = {"layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "group", "head_dim", "max_position"}


def parse_shape(text: str) -> SyntheticShape:
    """'llama-2b', 'llama-2b,layers=4' or 'layers=42,hidden=2048,intermediate=6144,heads=16,kv_heads=8,vocab=73448'."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    base: dict[str, object] = {}
    if parts and "=" not in parts[0]:
        preset = PRESETS.get(parts[0])
        if preset is None:
            raise ContractError(f"--synthetic {parts[0]!r}: unknown preset; use one of {', '.join(PRESETS)} or "
                                "key=value pairs")
        base, parts = asdict(preset), parts[1:]
    fields = {f.name for f in dataclasses.fields(SyntheticShape)} - {"name"}
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ContractError(f"--synthetic: {part!r} is not key=value with key one of {', '.join(sorted(fields))}")
        try:
            base[key] = int(value) if key in _INT_KEYS else (value.strip() not in ("0", "false", "no")
                                                             if key == "tied" else value.strip())
        except ValueError:
            raise ContractError(f"--synthetic: {key}={value!r} is not an integer") from None
        base["name"] = None  # an edited preset is a custom shape
    missing = {"layers", "hidden", "intermediate", "heads", "vocab"} - set(base)
    if missing:
        raise ContractError(f"--synthetic {text!r}: missing {', '.join(sorted(missing))}")
    base.setdefault("kv_heads", base["heads"])
    return SyntheticShape(**base)  # type: ignore[arg-type]


def _random_linear(n: int, k: int, scheme: W4A8Scheme, gen: torch.Generator) -> list[torch.Tensor]:
    # Scales put the weights' std near 1/sqrt(K) (uniform int4 has std ~4.6), so activations stay finite.
    base = 1.0 / (math.sqrt(k) * 4.6)
    scales = (base * (1 + 0.1 * torch.randn(n, k // scheme.group_size, generator=gen)).abs()).to(torch.bfloat16)
    if scheme.format == "pack-quantized":
        # Uniform random bytes are uniform int4 nibbles, already packed: (N, K // 8) int32.
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen).view(torch.int32)
        return [packed, scales, torch.tensor([n, k], dtype=torch.int64)]
    return [torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen), scales]


def _random_bf16(spec: TensorSpec, gen: torch.Generator) -> list[torch.Tensor]:
    if spec.name.endswith("norm.weight"):
        return [torch.ones(spec.shape, dtype=torch.bfloat16)]
    return [(torch.randn(spec.shape, generator=gen) * 0.02).to(torch.bfloat16)]


def _items(shape: SyntheticShape, scheme: W4A8Scheme,
           gen: torch.Generator) -> list[tuple[list[TensorSpec], Callable[[], list[torch.Tensor]]]]:
    dims = shape.dims
    items = [([spec], partial(_random_bf16, spec, gen)) for spec in bf16_tensor_specs(dims)]
    for i in range(dims.layers):
        for linear, (n, k) in dims.linear_shapes().items():
            specs = linear_tensor_specs(linear_prefix(i, linear), n, k, scheme)
            items.append((specs, partial(_random_linear, n, k, scheme, gen)))
    assert len(dims.linear_shapes()) == len(DECODER_LINEARS)
    return sorted(items, key=lambda item: tensor_order(item[0][0].name))


def _config(shape: SyntheticShape, template: dict, scheme: W4A8Scheme, seed: int) -> dict:
    d = shape.dims
    config = {k: v for k, v in template.items() if not k.startswith("_") and k != "quantization_config"}
    config.update(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=d.hidden, intermediate_size=d.intermediate,
        num_hidden_layers=d.layers, num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, head_dim=d.head_dim,
        vocab_size=d.vocab, tie_word_embeddings=d.tied, max_position_embeddings=shape.max_position, dtype="bfloat16",
        anychip_synthetic={"notice": _NOTICE, "shape": asdict(shape), "seed": seed},
    )
    provenance = {"source": "synthetic", "method": "random", "group_size": scheme.group_size,
                  "format": scheme.format, "seed": seed, "anychip_version": __version__}
    config["quantization_config"] = scheme.quantization_config(source=provenance)
    return config


def _tokenizer_dir(path: Path) -> Path:
    path = path.expanduser().absolute()
    if not (path / "tokenizer.json").is_file():
        raise ContractError(f"--tokenizer {path}: no tokenizer.json there: give a Hugging Face model or tokenizer "
                            "directory")
    return path


def _tokenizer_id(tokenizer_dir: Path, given: Path | None) -> dict[str, str]:
    """What the recipe records of the tokenizer: the default model's manifest, or a given one's tokenizer.json."""
    if given is None:
        return {"tokenizer_manifest_sha256": sha256_file(tokenizer_dir / "SHA256SUMS")}
    return {"tokenizer_json_sha256": sha256_file(tokenizer_dir / "tokenizer.json")}


SYNTHETIC_TOKEN = "<|synthetic_{}|>"


def cover_vocab(tokenizer_json: Path, vocab: int) -> int:
    """Rewrite tokenizer_json so that every id below `vocab` decodes to text: the ids from the tokenizer's size up
    become placeholder tokens. Returns how many were added. They join the model's own vocabulary where it is a map
    (BPE, WordPiece, WordLevel) or a list that ends at the last id (Unigram, lowest score), else the added tokens
    (slower to load in transformers); no merge or text produces them."""
    if not tokenizer_json.is_file():
        return 0
    tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    size = tokenizer_json_size(tok, tokenizer_json)
    if size >= vocab:
        return 0
    names = [SYNTHETIC_TOKEN.format(i) for i in range(size, vocab)]
    model_vocab = tok["model"].get("vocab")
    taken = set(model_vocab if isinstance(model_vocab, dict) else (p[0] for p in model_vocab or ()))
    taken |= {a.get("content") for a in tok.get("added_tokens") or ()}
    if taken.intersection(names):
        raise ContractError(f"{tokenizer_json}: already has tokens named like anychip's placeholders "
                            f"({SYNTHETIC_TOKEN.format('ID')}); give a tokenizer whose size covers vocab={vocab}")
    if isinstance(model_vocab, dict):
        model_vocab.update(zip(names, range(size, vocab)))
    elif isinstance(model_vocab, list) and len(model_vocab) == size:
        low = min((float(p[1]) for p in model_vocab), default=0.0) - 10.0
        model_vocab.extend([name, low] for name in names)
    else:
        tok.setdefault("added_tokens", []).extend(
            {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": False} for i, name in zip(range(size, vocab), names))
    tokenizer_json.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    return len(names)


def _readme(shape: SyntheticShape, placeholders: int = 0) -> str:
    extra = (f"The tokenizer's last {placeholders} ids are placeholders ({SYNTHETIC_TOKEN.format('ID')}) so that "
             "every id of the vocabulary decodes.\n\n") if placeholders else ""
    return (f"# {shape.dirname}\n\nTHIS IS NOT A MODEL. Every weight is random ({_NOTICE}).\n\n"
            "It has the shape of a Llama and the W4A8 compressed-tensors layout, so vLLM and anychip serve it at the "
            "speed a real model of this shape would run; its text is meaningless. Made by "
            f"`anychip prepare --synthetic` (anychip {__version__}).\n\n{extra}```json\n"
            f"{json.dumps(asdict(shape), indent=2)}\n```\n")


def make_synthetic(shape: SyntheticShape, cache: Path | None = None, force: bool = False,
                   seed: int = 0, tokenizer: Path | None = None) -> VerifyReport:
    """Build (or reuse) `<cache>/synthetic/<shape.dirname>` and return its verification report. tokenizer: a
    Hugging Face model directory whose tokenizer files (and config.json, when it has one, as the template of
    the fields a shape leaves open) the model takes instead of the default model's."""
    cache = (cache or cache_dir()).expanduser().absolute()
    tokenizer_dir = _tokenizer_dir(tokenizer) if tokenizer is not None else prepare_bf16(cache)
    tok = tokenizer_size(tokenizer_dir)
    if tok is not None and shape.vocab < tok:
        raise ContractError(f"--synthetic: vocab={shape.vocab} is smaller than the tokenizer ({tok} tokens): "
                            f"use vocab>={tok}")
    scheme = W4A8Scheme(group_size=shape.group, format=shape.format)
    root = cache / "synthetic"
    dst = root / shape.dirname
    recipe = {"step": "synthetic", **asdict(shape), "seed": seed, **_tokenizer_id(tokenizer_dir, tokenizer),
              "tokenizer_covers_vocab": True}
    reports: list[VerifyReport] = []
    with cache_lock(root):
        if force or not is_done(dst, recipe, lambda d: reports.append(verify_checkpoint(d))):
            clear_done(dst)
            items = _items(shape, scheme, torch.Generator().manual_seed(seed))
            config_path = tokenizer_dir / "config.json"
            template = json.loads(config_path.read_text()) if config_path.is_file() else {}
            with atomic_directory(dst, overwrite=True) as tmp:
                with ShardedWriter(tmp, [s for specs, _ in items for s in specs]) as writer:
                    for specs, make in tqdm(items, desc=f"synthetic {shape.dirname}", unit="tensor"):
                        for spec, tensor in zip(specs, make()):
                            writer.write(spec.name, tensor)
                (tmp / "config.json").write_text(json.dumps(_config(shape, template, scheme, seed), indent=2) + "\n")
                copy_side_files(tokenizer_dir, tmp)
                (tmp / "README.md").write_text(_readme(shape, cover_vocab(tmp / "tokenizer.json", shape.vocab)))
                write_manifest(tmp)
                verify_checkpoint(tmp, checksums=False)
            reports.append(verify_checkpoint(dst))
            mark_done(dst, recipe)
    return reports[-1]
