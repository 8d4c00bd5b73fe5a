"""The llama.cpp peers' GGUF conversion for a Llama model that ships no GGUF (anychip/bench/gguf_peers.py): the
metadata and vocabulary come from config.json and the model's own tokenizer. A tiny random Llama with a byte-level
BPE tokenizer trained here; the read-back runs everywhere (the `gguf` package), llama.cpp's own load and logits
only where llama-cpp-python is installed (measured here: max |logit difference| 1.3e-4 against transformers in
fp32, logits up to 1.25)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def bpe_llama(tmp_path_factory) -> Path:
    """A random BF16 Llama (vocab 320) with a 300-token byte-level BPE tokenizer: 20 embedding rows no token uses."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("bpe") / "bf16"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = (Path(__file__).resolve().parents[1] / "anychip" / "data" / "kjv_mark.txt").read_text()[:20000]
    tok.train_from_iterator([text], trainer)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320, tie_word_embeddings=True, max_position_embeddings=256,
                         rope_theta=50000.0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=BOS).save_pretrained(directory)
    return directory


def test_a_model_without_a_shipped_gguf_converts_from_its_config_and_tokenizer(bpe_llama):
    import gguf
    from safetensors.torch import load_file

    from anychip.bench.gguf_peers import f32_gguf, rotary_rows

    path = f32_gguf(bpe_llama)
    reader = gguf.GGUFReader(str(path))

    def value(key: str):
        return reader.fields[key].contents()

    assert value("general.architecture") == "llama"
    assert (value("llama.block_count"), value("llama.embedding_length"), value("llama.feed_forward_length"),
            value("llama.attention.head_count"), value("llama.attention.head_count_kv")) == (2, 64, 128, 4, 2)
    assert value("llama.rope.freq_base") == pytest.approx(50000.0)
    tokens = value("tokenizer.ggml.tokens")
    assert value("tokenizer.ggml.model") == "gpt2" and len(tokens) == 320  # padded to the embedding's rows
    assert tokens[:300].count(BOS) == 1 and tokens[319] == "[PAD319]"
    assert value("tokenizer.ggml.bos_token_id") == tokens.index(BOS) and value("tokenizer.ggml.merges")
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors and len(tensors) == 1 + 1 + 2 * 9  # tied: no output tensor
    source = load_file(str(bpe_llama / "model.safetensors"))
    q = source["model.layers.1.self_attn.q_proj.weight"].float().numpy()
    stored = np.asarray(tensors["blk.1.attn_q.weight"].data).reshape(q.shape)
    assert np.array_equal(stored, rotary_rows(q, 4))  # F32, in llama.cpp's rotary row order


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed (the bench's llama.cpp peers)")
def test_llama_cpp_reads_the_converted_model_like_transformers(bpe_llama):
    import llama_cpp
    from transformers import LlamaForCausalLM

    from anychip.bench.gguf_peers import f32_gguf, llama_cpp_quantized

    ids = [(i * 37) % 320 for i in range(40)]  # the unused rows too
    llm = llama_cpp.Llama(model_path=str(f32_gguf(bpe_llama)), n_ctx=256, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)])
    with torch.no_grad():
        ours = LlamaForCausalLM.from_pretrained(bpe_llama, dtype=torch.float32)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(theirs - ours).max() < 2e-3 * max(1.0, np.abs(ours).max())
    assert llama_cpp_quantized(bpe_llama, "Q4_0").stat().st_size > 0  # llama.cpp's quantizer takes it
