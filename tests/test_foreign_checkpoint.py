"""W4A8 checkpoints that another tool wrote: compressed-tensors' own compressor (what llm-compressor saves with), with
its default int-quantized format, pack-quantized, and activation ordering. `anychip verify` points such a directory
(no SHA256SUMS) at `--write-sums`, which checks the contract and every value before it records checksums; group
activation ordering (a g_idx per column) is refused by name; the served checkpoint runs strict on anychip's kernels."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anychip.checkpoint.manifest import MANIFEST, ManifestError
from anychip.checkpoint.scheme import ContractError
from anychip.checkpoint.verify import adopt_checkpoint, check_quantization_scope, verify_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def write_ct_w4a8(src: Path, dst: Path, *, fmt: str, actorder: str | None, group_size: int) -> Path:
    """Quantize the BF16 model in `src` as compressed-tensors does it for llm-compressor's W4A8 scheme (INT4
    symmetric group weights, dynamic per-token INT8 activations, lm_head ignored): its QuantizationConfig applied
    to the model, min-max group scales set on the modules, its ModelCompressor compressing and writing config.json.
    For actorder "group" each linear gets a random column order, stored as g_idx, as GPTQ's act-order makes it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
                                 actorder=actorder, observer="minmax"),
        input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True,
                                           observer=None))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                        quantization_status=QuantizationStatus.INITIALIZED))
    gen = torch.Generator().manual_seed(0)
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data.float()
        n, k = w.shape
        g_idx = (torch.arange(k) // group_size).to(torch.int32)
        if actorder == "group":
            g_idx = torch.empty_like(g_idx)
            g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // group_size).to(torch.int32)
            module.weight_g_idx.data.copy_(g_idx)
        amax = torch.zeros(n, k // group_size).scatter_reduce_(1, g_idx.long().expand(n, k), w.abs(), reduce="amax")
        module.weight_scale.data.copy_((amax / 7.5).clamp(min=1e-8).to(torch.bfloat16))
        module.weight_zero_point.data.zero_()
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def _weights_args(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]


@pytest.mark.parametrize("fmt, actorder", [("int-quantized", None), ("pack-quantized", "static"),
                                           ("pack-quantized", "weight")])
def test_written_by_compressed_tensors_adopted_then_verified(tiny_llama, tmp_path, fmt, actorder):
    ckpt = write_ct_w4a8(tiny_llama(), tmp_path / "ct", fmt=fmt, actorder=actorder, group_size=32)
    group = _weights_args(ckpt)
    assert group["format"] == fmt and group["weights"]["actorder"] == actorder  # the library wrote what we asked
    with pytest.raises(ManifestError, match="--write-sums"):
        verify_checkpoint(ckpt)
    report = adopt_checkpoint(ckpt)
    assert report.value_bytes and report.num_linears == 7 * 2 and report.group_size == 32
    assert (ckpt / MANIFEST).is_file()
    again = verify_checkpoint(ckpt)  # now one of ours: checksums, contract, values
    assert again.checksums_verified and again.format == fmt
    with pytest.raises(ManifestError, match="exists"):
        adopt_checkpoint(ckpt)
    weights = next(ckpt.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="does not match"):
        verify_checkpoint(ckpt)


def test_group_activation_order_refused_by_name(tiny_llama, tmp_path):
    ckpt = write_ct_w4a8(tiny_llama(), tmp_path / "ct", fmt="pack-quantized", actorder="group", group_size=32)
    with pytest.raises(ContractError, match="actorder='group'.*g_idx"):
        adopt_checkpoint(ckpt)
    assert not (ckpt / MANIFEST).exists()  # nothing recorded for a checkpoint that failed


def test_bad_value_is_found_before_checksums_are_written(tiny_llama, tmp_path):
    ckpt = write_ct_w4a8(tiny_llama(), tmp_path / "ct", fmt="int-quantized", actorder=None, group_size=32)
    from safetensors.torch import load_file, save_file

    path = next(ckpt.glob("*.safetensors"))
    tensors = load_file(path)
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    tensors[name][0, 0] = 8  # int-quantized stores INT4 values as int8: 8 is outside [-8, 7]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ContractError, match="down_proj"):
        adopt_checkpoint(ckpt)
    assert not (ckpt / MANIFEST).exists()


@pytest.mark.parametrize("ignore, ok", [
    (["lm_head"], True),
    (["re:.*lm_head"], True),  # llm-compressor recipes' regex form
    (["re:lm_head$"], True),
    ([], False),  # the head would be quantized: the contract keeps it BF16
    (["re:.*"], False),  # also every decoder linear
    (["lm_head", "re:.*down_proj"], False),
    (["re:.*mlp.*"], False),
    (["re:[lm_head"], False),  # does not compile
])
def test_ignore_list_forms(tiny_llama, tmp_path, ignore, ok):
    qc = json.loads((write_ct_w4a8(tiny_llama(), tmp_path / "ct", fmt="pack-quantized", actorder=None,
                                   group_size=32) / "config.json").read_text())["quantization_config"]
    qc["ignore"] = ignore
    if ok:
        check_quantization_scope(qc, "config.json")
    else:
        with pytest.raises(ContractError, match="ignore"):
            check_quantization_scope(qc, "config.json")


def test_cli_write_sums(tiny_llama, tmp_path):
    ckpt = write_ct_w4a8(tiny_llama(), tmp_path / "ct", fmt="pack-quantized", actorder="static", group_size=32)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "anychip.cli", "verify", *args], capture_output=True, text=True)

    refused = cli(str(ckpt))
    assert refused.returncode != 0 and "--write-sums" in refused.stderr
    assert cli("--write-sums", "--fast", str(ckpt)).returncode != 0
    adopted = cli("--write-sums", str(ckpt))
    assert adopted.returncode == 0 and "wrote" in adopted.stdout, adopted.stdout + adopted.stderr
    verified = cli(str(ckpt))
    assert verified.returncode == 0 and "every sha256 matches" in verified.stdout, verified.stdout + verified.stderr


@pytest.mark.slow
def test_served_strict_on_anychip_kernels(default_model, tmp_path):
    """The default model's BF16 weights quantized by compressed-tensors (its inferred int-quantized format, static
    activation order, G64), adopted, then served through vLLM with strict coverage: every linear on a CPU kernel
    route, and the greedy tokens those of the torch reference reading the same files."""
    from anychip.checkpoint.torch_model import load_reference_model
    from anychip.coverage import check

    ckpt = write_ct_w4a8(default_model.bf16_dir, tmp_path / "ct", fmt="int-quantized", actorder="static",
                         group_size=64)
    adopt_checkpoint(ckpt)
    out, cov = tmp_path / "out.json", tmp_path / "coverage.json"
    prompt = "The capital of France is"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_runner.py"), str(ckpt), str(out),
                           "--max-tokens", "8", "--prompt", prompt],
                          env={**os.environ, "ANYCHIP_COVERAGE": str(cov)}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(cov.read_text())
    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    assert check(doc, expect_linears=4 * layers, group_size=64) == []
    assert doc["strict"] is True and all(r.startswith("cpu.") for r in doc["route_stats"]["by_route"])
    row = json.loads(out.read_text())["outputs"][0]
    model = load_reference_model(ckpt)
    ids = torch.tensor([row["prompt_token_ids"] + row["token_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    p = len(row["prompt_token_ids"])
    for i, tok in enumerate(row["token_ids"]):  # as test_plugin's reference check: same token or a near tie
        step = logits[p - 1 + i]
        assert int(step.argmax()) == tok or float(step.max() - step[tok]) < 2.0, (i, tok)
