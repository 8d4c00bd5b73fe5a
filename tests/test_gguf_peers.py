"""The llama.cpp peers' GGUF conversion for a model that ships no GGUF (anychip/bench/gguf_peers.py): the metadata
and vocabulary come from config.json and the model's own tokenizer. Tiny random models of every family anychip
quantizes (Llama, a Llama with llama3 rope scaling, Mistral, Qwen2 with biases, Qwen3 with q/k norms, Granite,
Gemma 1-3) with a byte-level BPE tokenizer trained here; the read-back runs everywhere (the `gguf` package),
llama.cpp's own load and logits only where llama-cpp-python is installed (measured here: max |logit difference|
4e-5 to 5.2e-4 against transformers in fp32, 1.1e-3 / 2.7e-3 for Gemma 3 / 2; with Q/K rows in the other rotary
order, 0.14-0.61)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
BOS = "<|endoftext|>"


FAMILIES = {"LlamaForCausalLM": {}, "MistralForCausalLM": {}, "Qwen2ForCausalLM": {},
            # Llama 3.1's rope scaling (a rope_freqs tensor), strong here: most frequencies divided by 4
            "Llama3-rope": {"architecture": "LlamaForCausalLM", "head_dim": 16,
                            "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 2.0, "original_max_position_embeddings": 8}},
            "Qwen3ForCausalLM": {"head_dim": 32},
            "GraniteForCausalLM": {"embedding_multiplier": 6.0, "residual_multiplier": 0.3,
                                   "attention_multiplier": 0.05, "logits_scaling": 4.0},
            # Gemma: the layer types, window and attention scale llama.cpp assumes (every 2nd / 6th layer global)
            "GemmaForCausalLM": {"head_dim": 16},
            "Gemma2ForCausalLM": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                  "layer_types": ["sliding_attention", "full_attention"]},
            "Gemma3ForCausalLM": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                  "num_hidden_layers": 6,
                                  "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def bpe_llama(request, tmp_path_factory) -> Path:
    """A random BF16 model of the family (vocab 320) with a 300-token byte-level BPE tokenizer: 20 embedding rows
    no token uses."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp(request.param) / "bf16"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = (Path(__file__).resolve().parents[1] / "anychip" / "data" / "kjv_mark.txt").read_text()[:20000]
    tok.train_from_iterator([text], trainer)
    torch.manual_seed(0)
    spec = dict(FAMILIES[request.param])
    cls = getattr(transformers, spec.pop("architecture", request.param))
    config = cls.config_class(**(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                      tie_word_embeddings=True, max_position_embeddings=256, rope_theta=50000.0)
                                 | spec))
    model = cls(config)
    with torch.no_grad():  # biases and norms start at 0 / 1: give them values a misplaced tensor would show
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.add_(torch.randn_like(p) * 0.5)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)  # peaked attention, where Q/K rows in the wrong rotary order move logits by ~0.6
    model.to(torch.bfloat16).save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=BOS).save_pretrained(directory)
    return directory


def test_a_model_without_a_shipped_gguf_converts_from_its_config_and_tokenizer(bpe_llama):
    import gguf
    from safetensors.torch import load_file

    from anychip.bench.gguf_peers import GGUF_ARCHITECTURES, f32_gguf, rotary_rows
    from anychip.checkpoint.model_dir import ModelDir

    path = f32_gguf(bpe_llama)
    reader = gguf.GGUFReader(str(path))
    config = ModelDir.open(bpe_llama).config
    arch, interleave = GGUF_ARCHITECTURES[config["model_type"]]

    def value(key: str):
        return reader.fields[key.replace("ARCH", arch)].contents()

    assert value("general.architecture") == arch
    assert (value("ARCH.block_count"), value("ARCH.embedding_length"), value("ARCH.feed_forward_length"),
            value("ARCH.attention.head_count"), value("ARCH.attention.head_count_kv")) == (
                config["num_hidden_layers"], 64, 128, 4, 2)
    assert value("ARCH.rope.freq_base") == pytest.approx(50000.0)
    tokens = value("tokenizer.ggml.tokens")
    assert value("tokenizer.ggml.model") == "gpt2" and len(tokens) == 320  # padded to the embedding's rows
    assert tokens[:300].count(BOS) == 1 and tokens[319] == "[PAD319]"
    assert value("tokenizer.ggml.bos_token_id") == tokens.index(BOS) and value("tokenizer.ggml.merges")
    tensors = {t.name: t for t in reader.tensors}
    source = load_file(str(bpe_llama / "model.safetensors"))
    assert "output.weight" not in tensors  # tied: no output tensor
    assert len(tensors) == len(source) + ("rope_freqs.weight" in tensors)
    if (config.get("rope_parameters") or {}).get("rope_type") == "llama3":  # frequencies over 4 but the highest
        factors = np.asarray(tensors["rope_freqs.weight"].data)
        assert factors.shape == (8,) and factors[0] < 4 and np.allclose(factors[1:], 4.0)
    q = source["model.layers.1.self_attn.q_proj.weight"].float().numpy()
    stored = np.asarray(tensors["blk.1.attn_q.weight"].data).reshape(q.shape)
    assert np.array_equal(stored, rotary_rows(q, 4) if interleave else q)  # F32, in llama.cpp's rotary order
    norm = source["model.layers.1.post_attention_layernorm.weight"].float().numpy()
    if arch.startswith("gemma"):  # llama.cpp multiplies by the weight, Gemma by 1 + w
        name = "post_attention_norm" if arch != "gemma" else "ffn_norm"
        assert np.array_equal(np.asarray(tensors[f"blk.1.{name}.weight"].data), norm + 1)
    else:
        assert np.array_equal(np.asarray(tensors["blk.1.ffn_norm.weight"].data), norm)


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed (the bench's llama.cpp peers)")
def test_llama_cpp_reads_the_converted_model_like_transformers(bpe_llama):
    import llama_cpp
    from transformers import AutoModelForCausalLM

    from anychip.bench.gguf_peers import f32_gguf, llama_cpp_quantized

    ids = [(i * 37) % 320 for i in range(40)]  # the unused rows too
    llm = llama_cpp.Llama(model_path=str(f32_gguf(bpe_llama)), n_ctx=256, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)])
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(bpe_llama, dtype=torch.float32)
        ours = model(torch.tensor([ids])).logits[0].numpy()
    print(f"max |logit difference| {np.abs(theirs - ours).max():.2e}, logits up to {np.abs(ours).max():.2f}")
    # llama.cpp keeps K and V in F16; Gemma 2 / 3 normalize each attention output (scale-free, so its relative
    # F16 error reaches the residual stream): measured 1.1e-3 and 2.7e-3 on logits up to 0.7 there, 4e-5 to 5e-4
    # for the other families; a norm stored without Gemma's + 1 or under another norm's name moves them by tenths
    sandwich = json.loads((bpe_llama / "config.json").read_text())["model_type"] in ("gemma2", "gemma3_text")
    assert np.abs(theirs - ours).max() < (5e-3 if sandwich else 2e-3) * max(1.0, np.abs(ours).max())
    assert llama_cpp_quantized(bpe_llama, "Q4_0").stat().st_size > 0  # llama.cpp's quantizer takes it


def test_a_model_llama_cpp_would_run_differently_is_refused(tiny_llama, copy_dir, tmp_path):
    """llama.cpp's Gemma 2 / 3 fix which layers slide and how attention is scaled: a model that differs (here a
    global layer where llama.cpp has a sliding one, and a query_pre_attn_scalar of 256 with head size 32) is
    refused with the reason (the bench then shows a skipped llama.cpp row), nothing written."""
    from anychip.bench.gguf_peers import make_f32_gguf
    from anychip.bench.peers import PeerUnavailable

    src = copy_dir(tiny_llama(architecture="Gemma3ForCausalLM", hidden_size=128, head_dim=32, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"]))
    config = json.loads((src / "config.json").read_text())
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(PeerUnavailable, match="query_pre_attn_scalar 256"):
        make_f32_gguf(src, None, out / "model.F32.gguf")
    (src / "config.json").write_text(json.dumps(config | {"query_pre_attn_scalar": 32}))
    with pytest.raises(PeerUnavailable, match="every 6th layer global"):
        make_f32_gguf(src, None, out / "model.F32.gguf")
    assert not list(out.iterdir())


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed (the bench's llama.cpp peers)")
@pytest.mark.parametrize("bpe_llama", ["LlamaForCausalLM"], indirect=True)
def test_interleaved_systems_take_turns_with_their_engines_loaded(bpe_llama, tmp_path):
    """`bench latency --interleave` with two real runner processes (llama.cpp Q4_0 and Q8_0 of one model) and one
    that fails to start: every repetition of round k ends before any of round k + 1 starts, the two alternate
    (the order rotated each round), each row keeps its own timings, and the failed system is a failed row that
    says why while the others are measured."""
    import argparse

    from anychip.bench import latency
    from anychip.bench.gguf_peers import llama_cpp_quantized

    def gguf(kind: str):
        return lambda: llama_cpp_quantized(bpe_llama, kind)

    systems = [latency.System("llama.cpp-q4_0", "llama.cpp", "Q4_0", build=gguf("Q4_0")),
               latency.System("llama.cpp-q4_1", "llama.cpp", "broken", build=lambda: tmp_path / "missing.gguf"),
               latency.System("llama.cpp-q8_0", "llama.cpp", "Q8_0", build=gguf("Q8_0"))]
    args = argparse.Namespace(pp=16, tg=4, reps=3, threads=1, eager=False, budget_s=60.0, device="cpu", batch=0,
                              wait_idle=0, compile_cache="shared")
    probed = []
    rows = latency.run_interleaved(systems, args, tmp_path, after_rounds=lambda: probed.append(True))
    assert probed == [True]
    q4, broken, q8 = rows
    assert broken["status"] == "failed" and "missing.gguf" in broken["error"], broken
    for row in (q4, q8):
        assert row["status"] == "ok" and row["reps"] == 3 and len(row["timings"]) == 3, row
        assert row["interleaved_run"] == tmp_path.name
    windows = sorted([(*w, row["system"], k) for row in (q4, q8) for k, w in enumerate(row["rep_windows"])])
    assert [k for *_, k in windows] == [0, 0, 1, 1, 2, 2]  # round by round
    assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:]))  # one at a time
    assert [name for *_, name, _ in windows] == ["llama.cpp-q4_0", "llama.cpp-q8_0", "llama.cpp-q8_0",
                                                 "llama.cpp-q4_0", "llama.cpp-q4_0", "llama.cpp-q8_0"]


def test_gguf_names_of_layer_tensors():
    """Each decoder tensor's llama.cpp name from its layer index and module; anything else is refused by name."""
    from anychip.bench.gguf_peers import gguf_name
    from anychip.bench.peers import PeerUnavailable

    assert gguf_name("model.layers.12.self_attn.q_proj.weight") == "blk.12.attn_q.weight"
    assert gguf_name("model.layers.0.self_attn.k_proj.bias") == "blk.0.attn_k.bias"
    assert gguf_name("model.layers.3.post_attention_layernorm.weight") == "blk.3.ffn_norm.weight"
    sandwich = gguf_name("model.layers.3.post_attention_layernorm.weight", sandwich=True)
    assert sandwich == "blk.3.post_attention_norm.weight"
    assert gguf_name("lm_head.weight") == "output.weight"
    for name in ("model.layers.3.self_attn.q_proj.weight_packed", "model.layers.3.mlp.router.weight",
                 "model.layers.x.mlp.up_proj.weight", "model.layers.3.weight", "model.rotary.inv_freq"):
        with pytest.raises(PeerUnavailable, match="no llama.cpp name"):
            gguf_name(name)
