"""W4A8 checkpoint writing: int4 packing, RTN, `quantize` end to end, read back through compressed-tensors."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import ct_decompress
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from anychip.checkpoint.io import INDEX, read_tensor_infos
from anychip.checkpoint.model_dir import weight_files_stamp
from anychip.checkpoint.quantize import choose_group_size, quantize_checkpoint
from anychip.checkpoint.rtn import rtn_quantize
from anychip.checkpoint.scheme import DECODER_LINEARS, ContractError, W4A8Scheme, scheme_from_config
from anychip.checkpoint.verify import verify_checkpoint
from anychip.cli import main
from anychip.errors import AnychipError
from anychip.formats import pack_int4, unpack_int4
from anychip.kernels.reference import dequantize_weight_ref

LINEAR_NAMES = [f"model.layers.{i}.{lin}" for i in range(2) for lin in DECODER_LINEARS]


def int4(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), words=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_pack_round_trip_matches_compressed_tensors(n, words, seed):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    q = int4(n, words * 8, seed)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (n, words)
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([n, words * 8])), q)


def test_pack_rejects_out_of_range_and_ragged_k():
    with pytest.raises(ValueError, match="int4 range"):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros((1, 12), dtype=torch.int8))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), groups=st.integers(1, 4), g=st.sampled_from([32, 64, 128]),
       seed=st.integers(0, 2**16), magnitude=st.sampled_from([1e-6, 0.02, 3.0, 1e4]),
       zero_group=st.booleans())
def test_rtn_properties(n, groups, g, seed, magnitude, zero_group):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, groups * g, generator=gen) * magnitude).to(torch.bfloat16)
    if zero_group:
        w[0, :g] = 0
    wq, scales = rtn_quantize(w, g)
    assert wq.dtype == torch.int8 and wq.shape == w.shape
    assert scales.dtype == torch.bfloat16 and scales.shape == (n, groups)
    assert int(wq.min()) >= -8 and int(wq.max()) <= 7
    amax = w.float().view(n, groups, g).abs().amax(dim=2)
    expected = (amax / 7).to(torch.bfloat16)
    assert torch.equal(scales, torch.where(expected > 0, expected, torch.ones_like(expected)))
    if zero_group:  # the contract wants every scale > 0: an all-zero group gets 1 (its q = 0 dequantize to 0)
        assert scales[0, 0] == 1 and not wq[0, :g].any()
    # Round to nearest: every weight is within half a step of its dequantized value (|w| / scale <= 7.03 after
    # BF16 rounding of the scale, so the clamp never costs more than that).
    s = scales.float().repeat_interleave(g, dim=1)
    err = (w.float() - wq.float() * s).abs()
    assert (err <= s * (0.5 + 1e-6)).all()
    assert int(wq.min()) >= -7


def test_rtn_rejects_nonfinite_weights():
    w = torch.zeros(2, 64, dtype=torch.bfloat16)
    w[1, 3] = float("inf")
    with pytest.raises(AnychipError, match="layer.x: weights contain inf"):
        rtn_quantize(w, 32, name="layer.x")


@pytest.mark.parametrize("fmt", ["pack-quantized", "int-quantized"])
@pytest.mark.parametrize("group", [32, 64])
def test_quantize_reads_back_through_compressed_tensors(tiny_llama, tmp_path, fmt, group):
    src = tiny_llama()
    dst = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(group_size=group, format=fmt))
    source = load_file(src / "model.safetensors")
    decompressed = ct_decompress(dst)
    assert sorted(decompressed) == sorted(LINEAR_NAMES)
    for prefix, weight in decompressed.items():
        wq, scales = rtn_quantize(source[f"{prefix}.weight"], group)
        expected = dequantize_weight_ref(wq, scales, torch.bfloat16)
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight, expected), prefix


def test_quantize_layout_config_and_side_files(tiny_llama, tmp_path):
    src = tiny_llama()
    dst = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(group_size=32))
    infos = read_tensor_infos(dst)
    q = infos["model.layers.1.mlp.down_proj.weight_packed"]
    assert (q.dtype, q.shape) == ("I32", (64, 128 // 8))
    assert (infos["model.layers.1.mlp.down_proj.weight_scale"].dtype,
            infos["model.layers.1.mlp.down_proj.weight_scale"].shape) == ("BF16", (64, 4))
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.down_proj.weight_shape").tolist() == [64, 128]
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight_shape").dtype == torch.int64
    # Embedding and norms stay BF16, byte for byte; a tied source gets no lm_head.
    source, out = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(out[name], source[name]) and out[name].dtype == torch.bfloat16
    assert "lm_head.weight" not in out
    assert not any(n.endswith("_proj.weight") for n in out)
    config = json.loads((dst / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    qc = config["quantization_config"]
    assert qc["ignore"] == ["lm_head"] and qc["format"] == "pack-quantized"
    assert qc["anychip"] == {"source": str(src.resolve()), "source_files": weight_files_stamp(src), "method": "rtn",
                             "group_size": 32, "format": "pack-quantized",
                             "anychip_version": qc["anychip"]["anychip_version"]}
    assert scheme_from_config(config) == W4A8Scheme(group_size=32)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    run = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=dst, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    listed = [line.split("  ", 1)[1] for line in (dst / "SHA256SUMS").read_text().splitlines()]
    assert sorted(listed) == sorted(p.name for p in dst.iterdir() if p.name != "SHA256SUMS")
    assert [p.name for p in tmp_path.iterdir()] == ["w4a8"]  # no temporary sibling left behind


def test_untied_source_keeps_bf16_lm_head(tiny_llama, tmp_path):
    src = tiny_llama(tie_word_embeddings=False)
    dst = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(group_size=64))
    out, source = load_file(dst / "model.safetensors"), load_file(src / "model.safetensors")
    assert torch.equal(out["lm_head.weight"], source["lm_head.weight"])
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is False


def test_sharded_output_has_an_index_and_reads_back(tiny_llama, tmp_path):
    src = tiny_llama()
    dst = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(group_size=64), max_shard_bytes=8_000)
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((dst / INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(i.nbytes for i in read_tensor_infos(dst).values())
    single = quantize_checkpoint(src, tmp_path / "single", W4A8Scheme(group_size=64))
    sharded, whole = ct_decompress(dst), ct_decompress(single)
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[p], whole[p]) for p in whole)


def test_k_not_divisible_by_group_size_names_the_layer(tiny_llama, tmp_path):
    src = tiny_llama(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, intermediate_size=192)
    with pytest.raises(ContractError, match=r"model\.layers\.0\.self_attn\.q_proj: K=96 .* group size 64: "
                                            r"quantize with --group-size 32"):
        quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(group_size=64))
    assert list(tmp_path.iterdir()) == []
    assert choose_group_size(src) == 32
    assert choose_group_size(tiny_llama()) == 64  # K in {64, 128}


def test_custom_quantizer_is_called_in_layer_order_and_recorded(tiny_llama, tmp_path):
    calls = []

    def zeros(prefix, w):
        calls.append((prefix, w.dtype, tuple(w.shape)))
        return torch.zeros(w.shape, dtype=torch.int8), torch.ones(w.shape[0], w.shape[1] // 32)

    dst = quantize_checkpoint(tiny_llama(), tmp_path / "w4a8", W4A8Scheme(group_size=32), zeros, method="gptq")
    assert [c[0] for c in calls] == LINEAR_NAMES
    assert all(c[1] == torch.bfloat16 for c in calls)
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["anychip"]["method"] == "gptq"
    bad = lambda prefix, w: (torch.zeros(w.shape, dtype=torch.int8), torch.ones(w.shape[0], 3))  # noqa: E731
    with pytest.raises(AnychipError, match=r"model\.layers\.0\.self_attn\.q_proj: quantizer returned scales"):
        quantize_checkpoint(tiny_llama(), tmp_path / "bad", W4A8Scheme(group_size=32), bad)
    assert not (tmp_path / "bad").exists()
    for value in (-0.5, 0.0, float("nan")):  # e.g. the accuracy sweep's signed scales: not the contract's
        scales = lambda prefix, w, v=value: (torch.zeros(w.shape, dtype=torch.int8),  # noqa: E731
                                             torch.full((w.shape[0], w.shape[1] // 32), v))
        for fmt in ("int-quantized", "pack-quantized"):
            with pytest.raises(AnychipError, match=rf"q_proj: quantizer returned group scale {value:.4g} at \[0, 0\]"
                                                   r".*positive normal"):
                quantize_checkpoint(tiny_llama(), tmp_path / "bad", W4A8Scheme(group_size=32, format=fmt), scales)
            assert not (tmp_path / "bad").exists()


def test_cli_quantize(tiny_llama, tmp_path, capsys):
    dst = tmp_path / "out"
    assert main(["quantize", str(tiny_llama()), str(dst), "--group-size", "32", "--format", "int-quantized"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == str(dst.absolute())
    assert any("format int-quantized" in line for line in out)
    assert main(["quantize", str(tiny_llama()), str(dst), "--group-size", "32"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["quantize", str(tiny_llama()), str(tmp_path / "g128")]) == 2
    assert capsys.readouterr().err.strip() == ("anychip quantize: error: model.layers.0.self_attn.q_proj: K=64 is not "
                                               "divisible by group size 128: quantize with --group-size 64 (or 32)")


def test_an_fp16_source_gives_a_checkpoint_that_declares_bf16(tiny_llama, copy_dir, tmp_path):
    """Every float tensor of the output is BF16, so config.json says so (vLLM refuses float16 for the scheme: a
    probe's FP16 source quantized and verified, then plain LLM(...) refused it); verify names a float16 one."""
    import transformers

    src = copy_dir(tiny_llama())
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16)
    model.save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    assert "float16" in (config.get("dtype"), config.get("torch_dtype"))
    dst = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(group_size=32))
    out = json.loads((dst / "config.json").read_text())
    assert out["torch_dtype"] == "bfloat16" and out.get("dtype", "bfloat16") == "bfloat16"
    assert {info.dtype for info in read_tensor_infos(dst).values()} <= {"BF16", "I32", "I64"}
    (dst / "config.json").write_text(json.dumps(dict(out, torch_dtype="float16")))
    with pytest.raises(ContractError, match="declares dtype float16, which vLLM refuses"):
        verify_checkpoint(dst, checksums=False)


def test_quantize_refuses_before_any_work_what_it_could_only_fail_on_later(tiny_llama, copy_dir, tmp_path, capsys):
    """An output path under a file, or where no folder can be made, and a source with no tokenizer or a
    non-float tensor are refused at once naming the path (they failed after calibration, or named a deleted
    temporary folder); archives and backup copies of weights are not carried into the output."""
    from safetensors.torch import save_file

    src = tiny_llama()
    (tmp_path / "afile").write_text("x")
    assert main(["quantize", str(src), str(tmp_path / "afile" / "w4a8")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["quantize", str(src), "/proc/anychip-w4a8"]) == 2
    assert "cannot create a folder in /proc" in capsys.readouterr().err
    notok = copy_dir(src)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (notok / name).unlink(missing_ok=True)
    assert main(["quantize", str(notok), str(tmp_path / "n"), "--group-size", "32"]) == 2
    assert f"{notok}: no tokenizer" in capsys.readouterr().err and not (tmp_path / "n").exists()
    ints = Path(shutil.copytree(src, tmp_path / "ints"))
    tensors = load_file(ints / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int8)
    save_file(tensors, ints / "model.safetensors", metadata={"format": "pt"})
    assert main(["quantize", str(ints), str(tmp_path / "i"), "--group-size", "32"]) == 2
    assert "model.norm.weight is I8, where a BF16, FP16 or FP32 decoder's tensors are floating point" in \
        capsys.readouterr().err
    for what, change in (("int8 weight", lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight",
                                                                  t["model.layers.0.self_attn.q_proj.weight"].to(
                                                                      torch.int8))),
                         ("fp8 weight", lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight",
                                                                 t["model.layers.1.mlp.up_proj.weight"].to(
                                                                     torch.float8_e4m3fn))),
                         ("packed", lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight_packed",
                                                             torch.zeros(4, 4, dtype=torch.int32)))):
        q = Path(shutil.copytree(src, tmp_path / what.replace(" ", "-")))  # a config without quantization_config
        tensors = load_file(q / "model.safetensors")
        change(tensors)
        save_file(tensors, q / "model.safetensors", metadata={"format": "pt"})
        assert main(["quantize", str(q), str(tmp_path / "q"), "--group-size", "32"]) == 2, what
        assert "holds quantized weights" in capsys.readouterr().err, what
    pickled = Path(shutil.copytree(src, tmp_path / "pickled"))  # a .bin-only source: named, with the way out
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    assert main(["quantize", str(pickled), str(tmp_path / "p"), "--group-size", "32"]) == 2
    assert "PyTorch pickles (pytorch_model.bin)" in capsys.readouterr().err
    extras = Path(shutil.copytree(src, tmp_path / "extras"))
    for name in ("pytorch_model.bin.bak", "model.safetensors.old", "weights.zip", "notes~"):
        (extras / name).write_bytes(b"x")
    (extras / "onnx").mkdir()  # a subfolder and the model card are not carried either, and quantize says so
    (extras / "README.md").write_text("# the BF16 model")
    (extras / "additional_chat_templates").mkdir()  # but named chat templates are the tokenizer's: carried
    (extras / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    capsys.readouterr()
    dst = quantize_checkpoint(extras, tmp_path / "e", W4A8Scheme(group_size=32))
    assert (dst / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ messages }}"
    assert verify_checkpoint(dst).checksums_verified
    assert not {"pytorch_model.bin.bak", "model.safetensors.old", "weights.zip", "notes~", "onnx", "README.md"} & {
        p.name for p in dst.iterdir()}
    said = capsys.readouterr().err
    assert "not carried into e" in said and "README.md" in said and "onnx/" in said and "weights.zip" in said
    assert "additional_chat_templates" not in said
    mistral = Path(shutil.copytree(src, tmp_path / "mistral"))  # a repo in Mistral's own format too
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, mistral / "consolidated.safetensors")
    (mistral / "params.json").write_text('{"dim": 64}')
    dst = quantize_checkpoint(mistral, tmp_path / "m", W4A8Scheme(group_size=32))
    assert not {"params.json", "consolidated.safetensors"} & {p.name for p in dst.iterdir()}
    said = capsys.readouterr().err
    assert "params.json" in said and "--config-format hf --load-format safetensors --tokenizer-mode hf" in said


def test_cli_gptq_dispatches_to_gptq_quantizer(tiny_llama, tmp_path, monkeypatch, capsys):
    seen = {}

    def gptq_quantizer(src, scheme, **options):
        seen.update(src=src, scheme=scheme, **options)
        return lambda prefix, w: rtn_quantize(w, scheme.group_size)

    monkeypatch.setitem(sys.modules, "anychip.checkpoint.gptq", types.SimpleNamespace(gptq_quantizer=gptq_quantizer))
    src, dst = tiny_llama(), tmp_path / "gptq"
    rc = main(["quantize", str(src), str(dst), "--method", "gptq", "--group-size", "64", "--samples", "4",
               "--seq-len", "16", "--damp", "0.05", "--calibration", "calib.txt", "--refit", "2"])
    assert rc == 0
    assert seen == dict(src=src, scheme=W4A8Scheme(group_size=64), calibration="calib.txt", samples=4, seq_len=16,
                        damp=0.05, refit=2, tune_steps=None, asymmetric=None, e2e_steps=None)
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["anychip"]["method"] == "gptq"


def test_rtn_all_zero_group_gets_a_positive_scale():
    """The contract (and verify) want every scale > 0; an all-zero group still dequantizes to exact zeros."""
    w = torch.randn(3, 64, dtype=torch.bfloat16)
    w[1, 32:] = 0
    wq, scales = rtn_quantize(w, 32)
    assert (scales > 0).all() and scales[1, 1].item() == 1.0 and not wq[1, 32:].any()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_full_or_read_only_disk_is_one_line_not_a_traceback(monkeypatch, capsys, code):
    import anychip.cli as cli

    def fails(args):
        raise OSError(code, os.strerror(code), "/data/w4a8/.w4a8.tmp-1/model.safetensors")

    monkeypatch.setattr(cli, "_handler", lambda target: fails)
    assert cli.main(["verify", "/data/w4a8"]) == 1
    assert capsys.readouterr().err == (f"anychip verify: error: {os.strerror(code)}: "
                                       "/data/w4a8/.w4a8.tmp-1/model.safetensors\n")


def test_other_os_errors_keep_their_traceback(monkeypatch):
    import anychip.cli as cli

    def fails(args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cli, "_handler", lambda target: fails)
    with pytest.raises(OSError):
        cli.main(["verify", "/data/w4a8"])


def test_a_file_or_a_missing_path_given_as_the_model_is_named_as_such(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert main(["quantize", str(tmp_path / "m" / "config.json"), str(tmp_path / "out")]) == 2
    assert f"is a file; pass the model's directory ({tmp_path / 'm'})" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_fused_projections_under_another_architecture_are_refused_before_any_work(tmp_path):
    """Phi-3's fused qkv_proj relabelled as LlamaForCausalLM: named from the source's own tensors, not as a
    missing tensor of the output after the whole quantization."""
    import shutil

    from conftest import write_tiny_llama
    from safetensors.torch import save_file

    src = shutil.copytree(write_tiny_llama(tmp_path / "tiny"), tmp_path / "fused")
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        tensors[f"{p}.qkv_proj.weight"] = torch.cat([tensors.pop(f"{p}.{n}_proj.weight") for n in "qkv"])
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ContractError, match=r"layer 0's weights have no self_attn\.q_proj, self_attn\.k_proj, "
                                            r"self_attn\.v_proj \(they hold .*self_attn\.qkv_proj\.weight"):
        quantize_checkpoint(src, tmp_path / "out", W4A8Scheme(32))
    assert not (tmp_path / "out").exists()


def test_a_torchvision_of_another_torch_is_named_with_its_fix(monkeypatch, capsys):
    import anychip.cli as cli

    def fails(args):
        raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.setattr(cli, "_handler", lambda target: fails)
    assert cli.main(["eval", "/data/w4a8"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("anychip eval: error: torchvision is installed but was built for another torch")
    assert "pip uninstall -y torchvision torchaudio torchcodec" in err


def test_gptq_settings_with_rtn_are_refused_not_ignored(tmp_path, capsys):
    from conftest import write_tiny_llama

    src = write_tiny_llama(tmp_path / "bf16")
    assert main(["quantize", str(src), str(tmp_path / "out"), "--group-size", "32", "--samples", "3",
                 "--refit", "2"]) == 2
    assert "--samples 3, --refit 2: GPTQ's calibration settings, which --method rtn would ignore" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_a_nan_in_a_source_linear_is_refused_not_zeroed(tiny_llama, tmp_path, capsys, method):
    """probe 49: a NaN in a linear's BF16 weight gave its group scale 1 and codes 0, and the checkpoint verified."""
    from safetensors.torch import load_file, save_file

    from anychip.cli import main

    src = Path(shutil.copytree(tiny_llama(), tmp_path / "nan"))
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    text = tmp_path / "calib.txt"  # the tiny tokenizer's words
    text.write_text(" ".join(f"w{(i * 7) % 97}" for i in range(400)))
    extra = ["--samples", "2", "--seq-len", "16", "--calibration", str(text)] if method == "gptq" else []
    capsys.readouterr()
    assert main(["quantize", str(src), str(tmp_path / "q"), "--group-size", "32", "--method", method, *extra]) == 2
    assert "model.layers.1.mlp.up_proj.weight of the source holds nan at [3, 5]" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("key, value", [("hidden_size", "64"), ("hidden_size", 64.0), ("num_attention_heads", 0),
                                        ("num_hidden_layers", -1), ("quantization_config", "gptq"),
                                        ("quantization_config", [1])])
def test_a_damaged_source_config_is_named_before_any_work(tiny_llama, tmp_path, capsys, key, value):
    """probe 49: these gave a ZeroDivisionError or AttributeError traceback, or an error after every tensor was
    written naming the deleted temporary folder."""
    import json

    from anychip.cli import main

    src = Path(shutil.copytree(tiny_llama(), tmp_path / "src"))
    config = json.loads((src / "config.json").read_text())
    config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["quantize", str(src), str(tmp_path / "q"), "--group-size", "32"]) == 2
    err = capsys.readouterr().err
    assert (key in err or "already quantized" in err) and "Traceback" not in err and ".tmp" not in err, err
    assert not (tmp_path / "q").exists()


def test_a_group_too_small_for_a_normal_scale_is_named_with_its_place(tiny_llama, tmp_path, capsys):
    """probe 49: weights of 1e-38 give a subnormal BF16 scale; the error said "zero, negative or not finite" with
    no place. It names the group, the scale and the weights' magnitude there."""
    from safetensors.torch import load_file, save_file

    from anychip.cli import main

    src = Path(shutil.copytree(tiny_llama(), tmp_path / "tiny"))
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][2, :32] = 1e-38
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["quantize", str(src), str(tmp_path / "q"), "--group-size", "32"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.up_proj: quantizer returned group scale" in err and "at [2, 0]" in err, err
    assert "subnormal" in err
