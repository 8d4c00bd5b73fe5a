"""`anychip verify`'s value pass and header layout: damage that SHA256SUMS cannot see (it is rewritten after the
damage, as a buggy quantizer or a hand edit would) is caught with the file, tensor and first bad index."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from anychip.checkpoint import values
from anychip.checkpoint.io import CheckpointFileError, read_tensor_infos
from anychip.checkpoint.manifest import write_manifest
from anychip.checkpoint.quantize import quantize_checkpoint
from anychip.checkpoint.scheme import ContractError, W4A8Scheme
from anychip.checkpoint.values import check_values, rule_for
from anychip.formats import bad_scales
from anychip.checkpoint.verify import verify_checkpoint
from anychip.cli import main

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
SCALE = "model.layers.1.mlp.down_proj.weight_scale"  # (128, 4) BF16 at G64


@pytest.fixture(scope="module")
def packed(tiny_llama, tmp_path_factory) -> Path:
    return quantize_checkpoint(tiny_llama(**SHAPE), tmp_path_factory.mktemp("values") / "w4a8", W4A8Scheme(64))


@pytest.fixture(scope="module")
def unpacked(tiny_llama, tmp_path_factory) -> Path:
    return quantize_checkpoint(tiny_llama(**SHAPE), tmp_path_factory.mktemp("values") / "w4a8-int",
                               W4A8Scheme(64, format="int-quantized"))


def poke(directory: Path, name: str, index: tuple[int, ...], value: float | int) -> None:
    """Overwrite one element of a stored tensor in place, then rewrite SHA256SUMS over the damage."""
    info = read_tensor_infos(directory)[name]
    dtype = info.torch_dtype
    flat = 0
    for i, d in zip(index, info.shape):
        flat = flat * d + i
    raw = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
    with open(info.file, "r+b") as f:
        f.seek(info.start + flat * len(raw))
        f.write(raw)
    write_manifest(directory)


def rewrite_header(directory: Path, edit) -> None:
    """Apply `edit(header dict)` to model.safetensors' header (data bytes unchanged), then rehash."""
    path = directory / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header = edit(header) or header
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    write_manifest(directory)


def edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    write_manifest(directory)


def test_good_checkpoints_pass_with_values_read(packed, unpacked):
    for d in (packed, unpacked):
        report = verify_checkpoint(d)
        assert report.value_bytes and report.value_bytes < report.total_bytes
        assert "scales normal, > 0 and 8 s finite" in report.summary()
    # int-quantized weights are read (one int8 per weight), pack-quantized words are not: the byte counts say so
    assert verify_checkpoint(unpacked).value_bytes > verify_checkpoint(packed).value_bytes
    assert verify_checkpoint(packed, values=False).value_bytes is None


# NaN, inf, zero, negative; a subnormal (a zeroed group) and BF16's largest finite value (8 s overflows)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -0.01, 1e-40, 3.3895e38])
def test_bad_group_scale(packed, copy_dir, bad):
    d = copy_dir(packed)
    poke(d, SCALE, (77, 2), bad)
    verify_checkpoint(d, values=False)  # checksums and headers are fine: only the value pass can see it
    with pytest.raises(ContractError) as exc:
        verify_checkpoint(d)
    msg = str(exc.value)
    assert str(d / "model.safetensors") in msg and f"{SCALE}[77, 2]" in msg
    assert "positive normal numbers" in msg and "anychip quantize" in msg


def test_int_quantized_weight_out_of_range(unpacked, copy_dir):
    name = "model.layers.0.self_attn.o_proj.weight"
    d = copy_dir(unpacked)
    poke(d, name, (5, 100), 9)
    poke(d, name, (6, 0), -9)  # a later one: the first is reported
    verify_checkpoint(d, values=False)
    with pytest.raises(ContractError, match=rf"{name}\[5, 100\] = 9: int-quantized weights must lie in \[-8, 7\]"):
        verify_checkpoint(d)


def test_nan_row_in_embedding(packed, copy_dir):
    d = copy_dir(packed)
    for col in range(3, 128):
        poke(d, "model.embed_tokens.weight", (40, col), float("nan"))
    verify_checkpoint(d, values=False)
    with pytest.raises(ContractError, match=r"model\.embed_tokens\.weight\[40, 3\] = nan: BF16 tensors must be "
                                            r"finite"):
        verify_checkpoint(d)


def test_inf_in_a_norm(packed, copy_dir):
    d = copy_dir(packed)
    poke(d, "model.norm.weight", (127,), float("inf"))
    with pytest.raises(ContractError, match=r"model\.norm\.weight\[127\] = inf"):
        verify_checkpoint(d)


def test_cli_fast_skips_the_value_pass(packed, copy_dir, capsys):
    d = copy_dir(packed)
    poke(d, SCALE, (0, 0), float("nan"))
    assert main(["verify", str(d), "--fast"]) == 0
    assert "values           not checked (--fast)" in capsys.readouterr().out
    assert main(["verify", str(d)]) == 2
    assert f"{SCALE}[0, 0] = nan" in capsys.readouterr().err


def test_first_bad_index_across_chunks(packed, copy_dir, monkeypatch):
    """Small chunks report the same first bad element as one big chunk, and never hand torch more than a chunk."""
    d = copy_dir(packed)
    name = "model.embed_tokens.weight"  # (128, 128) BF16: 32 KiB
    poke(d, name, (100, 5), float("nan"))
    poke(d, name, (90, 7), float("inf"))
    info = read_tensor_infos(d)[name]
    seen = []
    real = torch.frombuffer

    def spy(buffer, dtype):
        seen.append(len(buffer))
        return real(buffer, dtype=dtype)

    monkeypatch.setattr(values.torch, "frombuffer", spy)
    for chunk in (1 << 20, 1000, 64, 6):
        seen.clear()
        with pytest.raises(ContractError, match=rf"{name}\[90, 7\] = inf"):
            check_values([(info, rule_for(name, torch.bfloat16))], chunk_bytes=chunk)
        assert max(seen) <= max(chunk, 8) and sum(seen) >= 90 * 128 * 2


def test_bf16_rules_match_their_float_definitions_on_every_bit_pattern():
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    f = x.float()
    assert torch.equal(values.FINITE.bad(x), ~torch.isfinite(f))
    assert torch.equal(values.SCALE.bad(x), ~(torch.isfinite(f) & (f >= torch.finfo(torch.float32).tiny)
                                              & torch.isfinite(8 * f)))
    assert torch.equal(values.SCALE.bad(x), bad_scales(x))  # the kernels' prepare applies the same rule
    q = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    assert torch.equal(values.INT4.bad(q), (q.int() < -8) | (q.int() > 7))
    # The reduction-only fast path agrees with the mask, chunk by chunk (one bad entry or none).
    for rule, chunk in ((values.FINITE, x), (values.SCALE, x), (values.INT4, q)):
        for i in range(0, chunk.numel(), 1009):
            one = chunk[i:i + 1]
            clean = chunk[~rule.bad(chunk)][:50]
            for c in (one, clean, torch.cat([clean, one])):
                assert rule.any_bad(c) == bool(rule.bad(c).any()), (rule.what, c)


def test_header_overlap_is_caught(packed, copy_dir):
    d = copy_dir(packed)

    def overlap(h):  # two same-size norms pointed at the same bytes; the second one's bytes become a gap
        h["model.layers.1.input_layernorm.weight"]["data_offsets"] = h["model.layers.0.input_layernorm.weight"][
            "data_offsets"]

    rewrite_header(d, overlap)
    with pytest.raises(CheckpointFileError, match=r"model\.safetensors: header offsets of .* overlaps "):
        verify_checkpoint(d)


def test_header_gap_is_caught(packed, copy_dir):
    d = copy_dir(packed)
    rewrite_header(d, lambda h: h.pop("model.layers.0.post_attention_layernorm.weight") and None)
    with pytest.raises(CheckpointFileError, match=r"leaves a gap of 256 bytes after "):
        verify_checkpoint(d)


def test_a_header_the_safetensors_library_refuses_is_refused(packed, copy_dir):
    """probe 49: a header starting with a UTF-8 byte-order mark passed verify (json.loads skips it) while the
    safetensors library, which vLLM loads with, refuses the file."""
    from safetensors import safe_open

    d = copy_dir(packed)
    path = d / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    raw = b"\xef\xbb\xbf" + data[8:8 + n]
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    write_manifest(d)
    with pytest.raises(Exception):
        safe_open(str(path), framework="pt")
    with pytest.raises(CheckpointFileError, match="does not start with '{'"):
        verify_checkpoint(d)


def test_header_in_another_key_order_passes(packed, copy_dir):
    """safetensors does not order the JSON keys: only the byte ranges must tile the data."""
    d = copy_dir(packed)
    rewrite_header(d, lambda h: dict(reversed(list(h.items()))))
    assert verify_checkpoint(d).num_linears == 14


@pytest.mark.parametrize("edit, match", [
    (lambda qc: qc.update(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), r"ignore=.*keeps exactly \['lm_head'\]"),
    (lambda qc: qc.update(ignore=[]), r"quantization_config\.ignore=\[\]"),
    (lambda qc: qc["config_groups"]["group_0"].update(targets=["re:.*q_proj"]), r"targets=\['re:\.\*q_proj'\]"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme is set"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size="64"), "group_size='64' is not an int"),
    (lambda qc: qc.update(config_groups=[1]), "config_groups must be an object"),
])
def test_quantization_scope(packed, copy_dir, edit, match):
    d = copy_dir(packed)
    edit_config(d, lambda c: edit(c["quantization_config"]))
    with pytest.raises(ContractError, match=match) as exc:
        verify_checkpoint(d)
    assert "config.json" in str(exc.value)


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("hidden_size", -128), ("vocab_size", "128"),
                                        ("num_hidden_layers", 10 ** 12), ("head_dim", 0)])
def test_config_fields(packed, copy_dir, key, value):
    d = copy_dir(packed)
    edit_config(d, lambda c: c.update({key: value}))
    with pytest.raises(ContractError, match=r"config\.json: ") as exc:
        verify_checkpoint(d)
    assert key in str(exc.value)
