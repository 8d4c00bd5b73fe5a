"""coverage check on reports built with the recorder's own types: every linear listed, quantized or not."""

from __future__ import annotations

import pytest
import torch

from anychip.coverage import Coverage, LayerRoute, check


def _report(*unquantized: tuple[str, bool]) -> dict:
    cov = Coverage(strict=True, fallback_allowed=False, platform_info={})
    cov.vllm_version = "test"
    for i, name in enumerate(("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj")):
        layer = cov.add_layer(LayerRoute(name=name, route="cpu.avx2", kernel="w4a8_cpu", isa="avx2", group_size=32,
                                         n=64, k=64, checkpoint_format="pack-quantized", bit_exact=True))
        for phase in ("prefill", "decode"):
            cov.record(layer, phase, 3, 3 if i == 0 else None)
    for name, ignored in unquantized:
        cov.add_layer(LayerRoute(name=name, route="vllm.unquantized", kernel="UnquantizedLinearMethod", isa="vllm",
                                 group_size=0, n=64, k=64, checkpoint_format="unquantized", quantized=False,
                                 ignored=ignored, reason="test"))
    cov.head_route = {"route": "cpu.head_bf16.avx2"}
    return cov.snapshot()


def test_all_quantized_passes():
    doc = _report()
    assert check(doc, expect_linears=2, group_size=32) == []
    assert doc["route_stats"]["unquantized_linears"] == 0


def test_an_unquantized_linear_the_ignore_list_names_passes_and_is_listed():
    doc = _report(("model.layers.1.mlp.down_proj", True))
    assert check(doc, expect_linears=2, group_size=32) == []
    assert doc["route_stats"]["prepared_linears"] == 2 and doc["route_stats"]["unquantized_linears"] == 1
    assert doc["layers"]["model.layers.1.mlp.down_proj"]["quantized"] is False
    assert "vllm.unquantized" not in doc["route_stats"]["by_route"]


def test_an_unquantized_linear_not_in_ignore_fails():
    doc = _report(("model.layers.1.mlp.down_proj", False), ("model.layers.1.self_attn.o_proj", True))
    problems = check(doc, expect_linears=2)
    assert len(problems) == 1 and "1 linears run unquantized" in problems[0]
    assert "model.layers.1.mlp.down_proj" in problems[0] and "ignore" in problems[0]


def _partly_quantized(tiny_llama, tmp_path):
    """A W4A8 checkpoint whose layer 1 stays BF16 and is named in `ignore`."""
    import json

    from safetensors.torch import load_file, save_file

    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import DECODER_LINEARS, W4A8Scheme

    # head_dim 64: vLLM's CPU attention has no kernel for the smallest tiny shape's 16
    src = tiny_llama(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    w4a8 = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(group_size=32))
    tensors = {}
    for shard in sorted(w4a8.glob("*.safetensors")):
        tensors |= load_file(shard)
        shard.unlink()
    dense = load_file(src / "model.safetensors")
    ignore = []
    for linear in DECODER_LINEARS:
        prefix = f"model.layers.1.{linear}"
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            tensors.pop(f"{prefix}.{suffix}", None)
        tensors[f"{prefix}.weight"] = dense[f"{prefix}.weight"]
        ignore.append(prefix)
    (w4a8 / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, w4a8 / "model.safetensors")
    config = json.loads((w4a8 / "config.json").read_text())
    config["quantization_config"]["ignore"] += ignore
    (w4a8 / "config.json").write_text(json.dumps(config))
    return w4a8



@pytest.mark.slow
def test_engine_lists_the_linears_it_leaves_unquantized(tiny_llama, tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    model = _partly_quantized(tiny_llama, tmp_path)
    cov = tmp_path / "coverage.json"
    runner = Path(__file__).parent / "vllm_runner.py"
    proc = subprocess.run([sys.executable, str(runner), str(model), str(tmp_path / "out.json"), "--max-tokens", "4",
                           "--max-model-len", "256", "--prompt", "w1 w2 w3 w4"],
                          env={**os.environ, "ANYCHIP_COVERAGE": str(cov)}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(cov.read_text())
    unquantized = {n: v for n, v in doc["layers"].items() if v["quantized"] is False}
    assert sorted(unquantized) == ["model.layers.1.mlp.down_proj", "model.layers.1.mlp.gate_up_proj",
                                   "model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.qkv_proj"]
    assert all(v["ignored"] and v["route"] == "vllm.unquantized" for v in unquantized.values())
    assert doc["route_stats"]["prepared_linears"] == 4 and doc["route_stats"]["unquantized_linears"] == 4
    assert check(doc, expect_linears=4) == []
    for layer in unquantized.values():  # the same report without the ignore list's word for them fails
        layer["ignored"] = False
    assert any("4 linears run unquantized" in p for p in check(doc, expect_linears=4))


def test_report_names_the_gpu_gemm_of_each_shape_and_bucket() -> None:
    """For the cuda.triton route the report says which GEMM each shape's M buckets run (the Triton tiles, the GEMV,
    or the Gluon GEMM) with its config; no such field for other routes."""
    pytest.importorskip("triton")
    import torch

    from anychip.kernels.gpu import launch
    from anychip.kernels.gpu.gluon_w4a8 import WgmmaConfig

    cov = Coverage(strict=True, fallback_allowed=False, platform_info={})
    cov.add_layer(LayerRoute(name="l.qkv", route="cpu.avx2", kernel="w4a8_cpu", isa="avx2", group_size=128, n=4096,
                             k=2048, checkpoint_format="pack-quantized"))
    assert cov.snapshot()["gpu_gemm_configs"] is None
    cov.add_layer(LayerRoute(name="l.o", route="cuda.triton", kernel="triton", isa="sm_90", group_size=128, n=2048,
                             k=2048, checkpoint_format="pack-quantized"))
    launch.clear_tuning()
    cpu = torch.device("cpu")
    launch.remember(1, 2048, 2048, 128, cpu, launch.GemvConfig(64, 512))
    launch.remember(512, 2048, 2048, 128, cpu, WgmmaConfig(128, 64, 8, 4))
    launch.remember(2048, 2048, 2048, 128, cpu, launch.GemmConfig(128, 64, 128))
    try:
        got = cov.snapshot()["gpu_gemm_configs"]["2048:2048:128"]
    finally:
        launch.clear_tuning()
    assert got["gemv"].startswith("gemv ") and got["512"].startswith("wgmma WgmmaConfig(")
    assert got["2048"].startswith("gemm GemmConfig(") and set(got) == {"gemv", "512", "2048"}


@pytest.mark.parametrize("content, says", [(None, "is a folder"), ("{not json", "not JSON"),
                                           ("[1, 2]", "JSON list, not an object"), ("\udcff", "not JSON")],
                         ids=["folder", "broken", "list", "binary"])
def test_check_names_a_file_that_is_not_a_report(tmp_path, capsys, content, says):
    from anychip.cli import main

    path = tmp_path / "report.json"
    if content is None:
        path.mkdir()
    elif content == "\udcff":
        path.write_bytes(b"\xff\xfe\x00garbage")
    else:
        path.write_text(content)
    assert main(["coverage", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anychip coverage: error: ") and says in err and "Traceback" not in err


@pytest.mark.slow  # two vLLM engines on a tiny model: about a minute on 2 cores
def test_a_pooling_runner_embeds_with_the_kernels_and_reports_no_head(tiny_llama, tmp_path):
    """runner="pooling" loads no output head (vLLM leaves it on the meta device): strict mode serves the linears
    on anychip's kernels, the report says the head is unused, and the embeddings are the BF16 model's within
    W4A8's error."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme

    src = tiny_llama(num_attention_heads=2, num_key_value_heads=1)  # head dim 32: vLLM's CPU attention takes it
    w4a8 = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(32))
    runner = Path(__file__).parent / "vllm_runner.py"
    got = {}
    for name, model in (("bf16", src), ("w4a8", w4a8)):
        cov = tmp_path / f"coverage-{name}.json"
        proc = subprocess.run([sys.executable, str(runner), str(model), str(tmp_path / f"{name}.json"), "--embed",
                               "--max-model-len", "256", "--prompt", "w1 w2 w3 w4", "--prompt", "w5 w6"],
                              env={**os.environ, "ANYCHIP_COVERAGE": str(cov)}, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        got[name] = torch.tensor(json.loads((tmp_path / f"{name}.json").read_text())["embeddings"])
    doc = json.loads((tmp_path / "coverage-w4a8.json").read_text())
    assert doc["head_route"]["head"] == "unused" and doc["head_route"]["route"] is None
    assert doc["route_stats"]["fallback_linears"] == 0 and doc["strict"] is True
    assert check(doc, expect_linears=8) == []
    assert got["w4a8"].shape == got["bf16"].shape == (2, 64)
    assert torch.nn.functional.cosine_similarity(got["w4a8"], got["bf16"]).min() > 0.9


def test_a_pooling_report_needs_no_decode_and_no_head_route():
    cov = Coverage(strict=True, fallback_allowed=False, platform_info={})
    cov.vllm_version = "test"
    layer = cov.add_layer(LayerRoute(name="model.layers.0.mlp.down_proj", route="cpu.avx2", kernel="k", isa="avx2",
                                     group_size=32, n=128, k=256, checkpoint_format="pack-quantized"))
    cov.record(layer, "prefill", 4, 4)
    cov.head_route = {"layer": "lm_head", "route": None, "head": "unused"}
    assert check(cov.snapshot()) == []
    cov.head_route = {"layer": "lm_head", "route": None, "head": "bf16"}
    problems = check(cov.snapshot())
    assert any("phase 'decode' was never observed" in p for p in problems)
    assert any("names no route" in p for p in problems)


def test_check_fails_hand_edited_reports_that_passed_on_their_stats(tmp_path, capsys):
    """probe46: a report with layers deleted, a layer on the reference or vLLM's scheme without the fallback mark,
    an unknown route, by_route or prepared_linears that the layers do not add up to, a reference head, fewer calls
    than passes or no tokens passed the check; wrongly typed counts crashed it."""
    import copy
    import json

    from anychip.cli import main

    good = _report()
    assert check(good, expect_linears=2) == []

    def problems(edit) -> list[str]:
        doc = copy.deepcopy(good)
        edit(doc)
        return check(doc, expect_linears=2)

    qkv = "model.layers.0.self_attn.qkv_proj"
    cases = {
        "1 quantized linears in the report, expected 2 (the report counts the linears vLLM runs":
            lambda d: d["layers"].pop("model.layers.0.mlp.down_proj"),
        "reference route or vLLM's own scheme": lambda d: d["layers"][qkv].update(route="reference"),
        "vllm.compressed_tensors": lambda d: d["layers"][qkv].update(route="vllm.compressed_tensors"),
        "name no known route": lambda d: d["layers"][qkv].update(route=None),
        "by_route": lambda d: d["route_stats"].update(by_route={"cpu.avx512_vnni": 2}),
        "prepared_linears": lambda d: d["route_stats"].update(prepared_linears=3),
        "the reference, in a strict report": lambda d: d["head_route"].update(route="reference.head_bf16"),
        "which ran 2 forward passes": lambda d: d["phases"]["decode"].update(forward_passes=2),
        "took 0 tokens": lambda d: d["layers"][qkv]["tokens"].update(prefill=0),
        "'phases' holds entries that are not objects": lambda d: d["phases"].update(prefill=5),
        "not objects of whole numbers": lambda d: d["layers"][qkv].update(calls=[1, 3]),
        "head_route names no known route ('cpu.head_bogus'": lambda d: d["head_route"].update(route="cpu.head_bogus"),
        "the engine refused to start: (no reason given)": lambda d: d.update(refused=""),  # probe49: passed
    }
    for says, edit in cases.items():
        found = problems(edit)
        assert any(says in p for p in found), (says, found)
    doc = copy.deepcopy(good)
    doc["phases"]["prefill"] = 5
    path = tmp_path / "cov.json"
    path.write_text(json.dumps(doc))
    assert main(["coverage", "check", str(path)]) == 1
    assert "not objects" in capsys.readouterr().out


def test_a_fallback_report_passes_with_allow_fallback_and_its_count():
    cov = Coverage(strict=False, fallback_allowed=True, platform_info={})
    cov.vllm_version = "test"
    layer = cov.add_layer(LayerRoute(name="model.layers.0.mlp.down_proj", route="reference", kernel="torch",
                                     isa="none", group_size=32, n=64, k=64, checkpoint_format="pack-quantized",
                                     bit_exact=True, fallback=True, reason="forced"))
    for phase in ("prefill", "decode"):
        cov.record(layer, phase, 3, 3)
    cov.head_route = {"route": "cpu.head_bf16.avx2"}
    doc = cov.snapshot()
    assert check(doc, expect_linears=1, allow_fallback=True) == []
    assert any("reference route" in p for p in check(doc, expect_linears=1))


def test_the_passed_line_counts_the_fallback_linears_too(tmp_path, capsys):
    """probe 49: a report whose linears all ran on the reference passed with "0 linears on reference"."""
    import json

    from anychip.cli import main

    cov = Coverage(strict=False, fallback_allowed=True, platform_info={})
    cov.vllm_version = "test"
    for i in range(2):
        layer = cov.add_layer(LayerRoute(name=f"model.layers.{i}.mlp.down_proj", route="reference", kernel="torch",
                                         isa="none", group_size=32, n=64, k=64, checkpoint_format="pack-quantized",
                                         bit_exact=True, fallback=True, reason="forced"))
        for phase in ("prefill", "decode"):
            cov.record(layer, phase, 3, 3 if i == 0 else None)  # one forward pass of each phase
    cov.head_route = {"route": "reference.head_bf16"}
    path = tmp_path / "cov.json"
    path.write_text(json.dumps(cov.snapshot()))
    assert main(["coverage", "check", str(path), "--allow-fallback", "--expect-linears", "2"]) == 0
    assert "PASSED" in (out := capsys.readouterr().out) and "2 linears on reference (2 as fallback)" in out, out
