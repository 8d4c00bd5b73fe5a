"""The residual-stream rotation (anychip/checkpoint/rotate.py): orthogonal, and the rotated checkpoint computes the
same function as its source, up to the BF16 rounding of the rotated tensors."""

from __future__ import annotations

import json

import pytest
import torch

from anychip.checkpoint.rotate import orthogonal, rotate_llama
from anychip.errors import AnychipError
from conftest import write_tiny_llama


@pytest.mark.parametrize("d", [1, 7, 8, 96, 576])
def test_orthogonal_is_orthogonal_and_seeded(d: int) -> None:
    q = orthogonal(d, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, orthogonal(d, seed=3))
    if d > 1:
        assert not torch.equal(q, orthogonal(d, seed=4))


def _logprobs(directory, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.double(), -1)


@pytest.mark.parametrize("tied", [True, False])
def test_rotated_llama_computes_the_same_function(tiny_llama, tmp_path, tied: bool) -> None:
    src = tiny_llama(tie_word_embeddings=tied)
    dst = rotate_llama(src, tmp_path / "rotated", seed=1)
    config = json.loads((dst / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and (dst / "tokenizer.json").is_file()
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    want, got = _logprobs(src, ids), _logprobs(dst, ids)
    # BF16 rounding of the rotated weights (relative 2^-9 each) is all that differs: far below a changed model's
    # distance (another seed's weights, below), which the test must be able to tell apart.
    assert (got - want).abs().max() < 0.02  # measured 0.005
    other = _logprobs(write_tiny_llama(tmp_path / "other", seed=5, tie_word_embeddings=tied), ids)
    assert (other - want).abs().max() > 0.5
    with pytest.raises(FileExistsError):
        rotate_llama(src, dst, seed=1)


def test_rotation_refuses_other_architectures(tmp_path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(AnychipError, match="LlamaForCausalLM"):
        rotate_llama(tmp_path / "src", tmp_path / "dst")


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantize_cli_rotate(tmp_path, method: str) -> None:
    """`anychip quantize --rotate SEED`: a verified W4A8 checkpoint with an untied BF16 head, ones for norms, the
    rotation and the original source in its provenance, GPTQ without smoothing, no rotated folder left behind."""
    from anychip.checkpoint.verify import verify_checkpoint
    from anychip.cli import main

    src = write_tiny_llama(tmp_path / "bf16", num_hidden_layers=1)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{(i * 7) % 97}" for i in range(2000)))
    dst = tmp_path / "out" / "w4a8-rot"
    extra = ["--calibration", str(text), "--samples", "4", "--seq-len", "32"] if method == "gptq" else []
    assert main(["quantize", str(src), str(dst), "--method", method, "--group-size", "32", "--rotate", "7",
                 *extra]) == 0
    verify_checkpoint(dst)
    config = json.loads((dst / "config.json").read_text())
    prov = config["quantization_config"]["anychip"]
    assert config["tie_word_embeddings"] is False and prov["rotation"]["seed"] == 7
    assert prov["source"] == str(src.resolve())
    from anychip.checkpoint.model_dir import ModelDir

    assert ModelDir.open(dst).bf16_source() == src.resolve()  # the untied head and the record of the source agree
    if method == "gptq":
        assert prov["recipe"]["gptq"]["smooth"] == []
    assert [p.name for p in dst.parent.iterdir()] == [dst.name]
    from safetensors import safe_open

    with safe_open(str(next(dst.glob("*.safetensors"))), framework="pt") as h:
        assert "lm_head.weight" in h.keys()
        assert torch.equal(h.get_tensor("model.norm.weight"), torch.ones(64, dtype=torch.bfloat16))
