"""`anychip verify`: a good checkpoint passes; every kind of damage is caught with a message naming the cause."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import pytest

from anychip.checkpoint.io import CheckpointFileError
from anychip.checkpoint.manifest import MANIFEST, ManifestError, sha256_file, write_manifest
from anychip.checkpoint.quantize import quantize_checkpoint
from anychip.checkpoint.scheme import ContractError, W4A8Scheme
from anychip.checkpoint.verify import verify_checkpoint
from anychip.cli import main

# K in {128, 256}: quantized at G64, a config that declares G128 is plausible and only the scales disagree.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def good(tiny_llama, tmp_path_factory) -> Path:
    return quantize_checkpoint(tiny_llama(**SHAPE), tmp_path_factory.mktemp("verify") / "w4a8", W4A8Scheme(64))


def rehash(directory: Path) -> None:
    """Rewrite SHA256SUMS so that only the contract check can catch the damage."""
    write_manifest(directory)


def test_good_checkpoint_report(good):
    report = verify_checkpoint(good)
    assert report.num_layers == 2 and report.linears_by_group_size == {64: 14} and report.format == "pack-quantized"
    assert report.dims.tied and report.tokenizer_size == 100 and report.checksums_verified
    assert set(report.bytes_by_dtype) == {"BF16", "I32", "I64"}
    assert report.total_bytes == sum(p.stat().st_size for p in good.iterdir())
    text = report.summary()
    assert "layers           2" in text and "14 at G64" in text and "every sha256 matches" in text
    assert len(text.splitlines()) <= 12


def test_cli_verify_and_expected_digests(good, capsys):
    digest = sha256_file(good / "model.safetensors")
    assert main(["verify", str(good), "--expect-sha256", f"model.safetensors={digest}"]) == 0
    assert "14 at G64" in capsys.readouterr().out
    assert main(["verify", str(good), "--expect-sha256", f"model.safetensors={'0' * 64}"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "0" * 64 in err and "was expected" in err


def test_flipped_byte_in_weights(good, copy_dir):
    d = copy_dir(good)
    path = d / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"model\.safetensors: sha256 [0-9a-f]{64} does not match SHA256SUMS"):
        verify_checkpoint(d)
    assert subprocess.run(["sha256sum", "-c", MANIFEST], cwd=d, capture_output=True).returncode != 0


def test_missing_file(good, copy_dir):
    d = copy_dir(good)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ManifestError, match=r"tokenizer\.json is listed in SHA256SUMS but missing"):
        verify_checkpoint(d)
    rehash(d)  # even with the manifest rewritten, a W4A8 directory needs its tokenizer
    with pytest.raises(ContractError, match="no tokenizer"):
        verify_checkpoint(d)


def test_unlisted_file(good, copy_dir):
    d = copy_dir(good)
    (d / "notes.txt").write_text("added later")
    with pytest.raises(ManifestError, match=r"notes\.txt is not listed in SHA256SUMS"):
        verify_checkpoint(d)



def test_a_stray_safetensors_file_that_vllm_would_load_is_refused(good, copy_dir):
    """probe 49: with no index vLLM loads every *.safetensors of the folder; one beside model.safetensors (listed
    in a rewritten SHA256SUMS) passed verify while vLLM would have served its tensors too."""
    import shutil

    d = copy_dir(good)
    shutil.copyfile(d / "model.safetensors", d / "model-extra.safetensors")
    rehash(d)
    with pytest.raises(CheckpointFileError, match="model-extra.safetensors beside model.safetensors, with no "
                                                  "index: vLLM would load every"):
        verify_checkpoint(d)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")  # shards without their index
    rehash(d)
    with pytest.raises(CheckpointFileError, match="without the index that names the shards"):
        verify_checkpoint(d)


def test_download_and_vcs_metadata_is_neither_listed_nor_required(good, copy_dir):
    """`hf download --local-dir` writes .cache/huggingface/, the Hub adds .gitattributes to every repo, a git clone
    has .git/, Finder leaves .DS_Store: a pristine checkpoint fetched those ways still verifies."""
    d = copy_dir(good)
    for rel in (".cache/huggingface/.gitignore", ".cache/huggingface/download/config.json.metadata",
                ".gitattributes", ".git/HEAD", ".DS_Store"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text("tool metadata\n")
    verify_checkpoint(d)
    write_manifest(d)
    assert ".gitattributes" not in (d / MANIFEST).read_text()
    verify_checkpoint(d)


def test_a_listed_gitattributes_is_still_checked(good, copy_dir):
    d = copy_dir(good)
    (d / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    digest = sha256_file(d / ".gitattributes")
    with open(d / MANIFEST, "a") as f:
        f.write(f"{digest}  .gitattributes\n")
    verify_checkpoint(d)
    (d / ".gitattributes").write_text("changed\n")
    with pytest.raises(ManifestError, match=r"\.gitattributes: sha256 .* does not match"):
        verify_checkpoint(d)
    (d / ".gitattributes").unlink()
    with pytest.raises(ManifestError, match=r"\.gitattributes is listed in SHA256SUMS but missing"):
        verify_checkpoint(d)


def test_sha256sum_formats_that_sha256sum_accepts(good, copy_dir):
    """Blank lines, # comments and ./ names (`find . -type f -exec sha256sum {} +`) pass `sha256sum -c`: verify
    accepts them too. Two lines for one file do not: sha256sum fails if either is wrong, verify refuses both."""
    d = copy_dir(good)
    lines = (d / MANIFEST).read_text().splitlines()
    (d / MANIFEST).write_text("# checksums of this release\n\n"
                              + "".join(f"{h}  ./{name}\n" for h, _, name in (ln.partition("  ") for ln in lines)))
    assert subprocess.run(["sha256sum", "-c", MANIFEST], cwd=d, capture_output=True).returncode == 0
    verify_checkpoint(d)
    (d / MANIFEST).write_text(f"{'f' * 64}  {lines[0].partition('  ')[2]}\n" + "\n".join(lines) + "\n")
    with pytest.raises(ManifestError, match=r"SHA256SUMS:2: .* is listed twice"):
        verify_checkpoint(d)

def test_missing_manifest(good, copy_dir):
    d = copy_dir(good)
    (d / MANIFEST).unlink()
    with pytest.raises(ManifestError, match="SHA256SUMS is missing"):
        verify_checkpoint(d)


def test_a_bf16_model_is_named_as_unquantized_before_its_missing_checksums(tiny_llama):
    """A BF16 model directory has no SHA256SUMS to check: verify says it is not a W4A8 checkpoint, not that its
    checksums are missing (which `--write-sums` could not fix)."""
    with pytest.raises(ContractError, match="no quantization_config: this is not a W4A8 checkpoint"):
        verify_checkpoint(tiny_llama())


def test_a_strategy_other_than_group_is_named(good, copy_dir):
    d = copy_dir(good)
    config = json.loads((d / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.update(strategy="channel", group_size=None)
    (d / "config.json").write_text(json.dumps(config))
    rehash(d)
    with pytest.raises(ContractError, match=r"weights\.strategy='channel': anychip's checkpoint contract has 'group'"):
        verify_checkpoint(d)


def test_config_from_another_checkpoint(good, copy_dir, tiny_llama, tmp_path):
    other = quantize_checkpoint(tiny_llama(), tmp_path / "other", W4A8Scheme(64))  # hidden 64, not 128
    d = copy_dir(good)
    (d / "config.json").write_bytes((other / "config.json").read_bytes())
    rehash(d)
    with pytest.raises(ContractError, match=r"model\.embed_tokens\.weight: stored BF16\[128, 128\], the contract "
                                            r"wants BF16\[128, 64\]"):
        verify_checkpoint(d)


def test_weights_from_another_checkpoint(good, copy_dir, tiny_llama, tmp_path):
    other = quantize_checkpoint(tiny_llama(**SHAPE, num_hidden_layers=3), tmp_path / "deeper", W4A8Scheme(64))
    d = copy_dir(good)
    (d / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    rehash(d)
    with pytest.raises(ContractError, match=r"unexpected tensor model\.layers\.2\..* num_hidden_layers=2"):
        verify_checkpoint(d)


def test_tokenizer_from_a_bigger_model(good, copy_dir, tiny_llama):
    d = copy_dir(good)
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 200, "content": "<extra>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (d / "tokenizer.json").write_text(json.dumps(tok))
    rehash(d)
    with pytest.raises(ContractError, match="ids up to 200 but vocab_size is 128"):
        verify_checkpoint(d)


def test_truncated_safetensors(good, copy_dir):
    d = copy_dir(good)
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ManifestError, match="model.safetensors"):
        verify_checkpoint(d)
    rehash(d)
    with pytest.raises(CheckpointFileError, match=r"model\.safetensors: header describes \d+ bytes but the file "
                                                  r"has \d+: truncated"):
        verify_checkpoint(d)


def test_index_with_an_empty_weight_map(tiny_llama, tmp_path):
    """A sharded checkpoint whose index lists no tensors: refused naming the index (found by the fuzzer: it was
    reported as a config.json that belongs to another model)."""
    d = quantize_checkpoint(tiny_llama(**SHAPE), tmp_path / "sharded", W4A8Scheme(64), max_shard_bytes=24_000)
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps(json.loads(index.read_text()) | {"weight_map": {}}))
    rehash(d)
    with pytest.raises(CheckpointFileError, match=r"model\.safetensors\.index\.json: weight_map is empty"):
        verify_checkpoint(d)


def test_config_declares_g128_over_g64_scales(good, copy_dir):
    d = copy_dir(good)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    (d / "config.json").write_text(json.dumps(config))
    rehash(d)
    with pytest.raises(ContractError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight_scale: 2 scale columns "
                                            r"for K=128 means group size 64, but config\.json declares group size 128"):
        verify_checkpoint(d)


def test_unquantized_weights_under_a_w4a8_config(good, tiny_llama, copy_dir):
    d = copy_dir(good)
    (d / "model.safetensors").write_bytes((tiny_llama(**SHAPE) / "model.safetensors").read_bytes())
    rehash(d)
    with pytest.raises(ContractError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight_packed is missing"):
        verify_checkpoint(d)


def test_weight_shape_disagrees_with_config(good, copy_dir):
    from anychip.checkpoint.io import read_tensor_infos

    d = copy_dir(good)
    info = read_tensor_infos(d)["model.layers.1.mlp.up_proj.weight_shape"]
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(info.start)
        f.write(struct.pack("<qq", 256, 64))
    rehash(d)
    with pytest.raises(ContractError, match=r"model\.layers\.1\.mlp\.up_proj\.weight_shape says \[256, 64\], "
                                            r"config\.json implies \[256, 128\]"):
        verify_checkpoint(d)


def test_wrong_architecture(good, copy_dir):
    d = copy_dir(good)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"architectures": ["Phi3ForCausalLM"]}))
    rehash(d)
    with pytest.raises(ContractError, match=r"Phi3ForCausalLM.*one of LlamaForCausalLM, MistralForCausalLM"):
        verify_checkpoint(d)
    # Gemma 2's two norms around each block's output are missing
    (d / "config.json").write_text(json.dumps(config | {"architectures": ["Gemma2ForCausalLM"]}))
    rehash(d)
    with pytest.raises(ContractError, match=r"model\.layers\.0\.pre_feedforward_layernorm\.weight is missing"):
        verify_checkpoint(d)
    # a supported family whose tensors the weights do not have: Qwen2's q/k/v biases are missing
    (d / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen2ForCausalLM"]}))
    rehash(d)
    with pytest.raises(ContractError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias is missing"):
        verify_checkpoint(d)


def test_cli_verify_failure_exits_nonzero(good, copy_dir, capsys):
    d = copy_dir(good)
    (d / MANIFEST).unlink()
    assert main(["verify", str(d)]) == 2
    assert "SHA256SUMS is missing" in capsys.readouterr().err
    assert main(["verify", str(d / "nope")]) == 2


@pytest.mark.parametrize("edit", [
    lambda qc: qc.update(config_groups=[qc["config_groups"]["group_0"]]),
    lambda qc: qc["config_groups"].update(group_0="W4A8"),
    lambda qc: qc["config_groups"]["group_0"].update(weights="int4"),
    lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=None),
], ids=["groups-list", "group-string", "weights-string", "group-size-null"])
def test_a_malformed_quantization_config_is_an_error_not_a_traceback(good, copy_dir, capsys, edit):
    """probe 49: verify named these, but routes, serve --dry-run and eval died with AttributeError / TypeError."""
    d = copy_dir(good)
    config = json.loads((d / "config.json").read_text())
    edit(config["quantization_config"])
    (d / "config.json").write_text(json.dumps(config))
    rehash(d)
    for argv in (["verify", str(d)], ["routes", str(d)], ["serve", str(d), "--dry-run"]):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc != 0 and "Traceback" not in err and "error:" in err, (argv, err)
