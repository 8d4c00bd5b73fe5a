"""`anychip bench kernels --decode-only --model DIR`: the decode step's shapes come from the model's config.json,
not from the default model's constants. No test asserts a timing."""

from __future__ import annotations

import json

import pytest

from anychip.bench import kernels
from anychip.checkpoint.scheme import W4A8Scheme
from anychip.checkpoint.synthetic import PRESETS, _config
from anychip.cli import main
from anychip.errors import AnychipError


def _synthetic_config(name: str, group: int) -> dict:
    return _config(PRESETS[name], {}, W4A8Scheme(group_size=group), seed=0)


def test_step_of_the_llama_2b_shape_config() -> None:
    step = kernels.DecodeStep.of_config(_synthetic_config("llama-2b", 128), "llama-2b")
    assert (step.layers, step.group, step.head) == (42, 128, (73448, 2048))
    assert step.linears == (("qkv_proj", 2048, 4096), ("o_proj", 2048, 2048), ("gate_up_proj", 2048, 12288),
                            ("down_proj", 6144, 2048))
    assert step.decode_shapes()[0] == ("llama-2b", "qkv_proj", 2048, 4096)


def test_step_of_a_bf16_config_picks_a_group_that_divides_every_k() -> None:
    config = _synthetic_config("llama-1b", 128)
    del config["quantization_config"]
    config["intermediate_size"] = 8000  # 8000 = 64 * 125: 128 does not divide the down_proj's K
    step = kernels.DecodeStep.of_config(config, "odd")
    assert step.group == 64 and step.linears[3] == ("down_proj", 8000, 2048)
    assert step.head == (128256, 2048) and step.layers == 16


def test_the_default_step_is_the_default_models_shapes() -> None:
    smol = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
            "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
            "quantization_config": {"config_groups": {"group_0": {"weights": {"group_size": 32}}}}}
    assert kernels.DecodeStep.of_config(smol, "smollm2-135m") == kernels.DEFAULT_STEP


def test_a_small_step_runs_through_the_routes() -> None:
    step = kernels.DecodeStep("t", 2, 32, (("qkv_proj", 64, 96), ("down_proj", 128, 64)), (256, 64))
    out = kernels.bench_decode_step(2, step=step)
    assert (out["model"], out["group_size"], out["layers"], out["linears"]["calls"]) == ("t", 32, 2, 4)
    assert out["head"]["shape"] == [256, 64] and out["linears"]["min_ms"] > 0
    assert out["head"]["bytes"] == 256 * 64 * 2


def test_model_without_a_config_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(AnychipError, match="cannot read"):
        kernels.DecodeStep.of_model(tmp_path)
    assert main(["bench", "kernels", "--decode-only", "--model", str(tmp_path)]) == 2
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert main(["bench", "kernels", "--decode-only", "--model", str(tmp_path)]) == 2


def test_a_model_of_another_architecture_is_not_timed_as_a_dense_llama(tmp_path) -> None:
    config = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(AnychipError, match=r"architectures \['MixtralForCausalLM'\]"):
        kernels.DecodeStep.of_model(tmp_path)


def test_a_k_no_group_size_divides_says_so() -> None:
    import torch

    from anychip.kernels.prepare import prepare_w4a8

    wq = torch.zeros(16, 200, dtype=torch.int8)
    with pytest.raises(AnychipError, match=r"no supported group size \(32, 64, 128\) divides K=200"):
        prepare_w4a8(wq, torch.ones(16, 6, dtype=torch.bfloat16), 32, packed=False)
    with pytest.raises(AnychipError, match=r"K=192 is not divisible by group size 128: quantize with group size "
                                           r"32 or 64"):
        prepare_w4a8(torch.zeros(16, 192, dtype=torch.int8), torch.ones(16, 1, dtype=torch.bfloat16), 128,
                     packed=False)


def test_a_decode_row_is_timed_at_the_models_group_size() -> None:
    row = kernels.bench_decode_shape("t", "qkv_proj", 256, 64, 1 << 20, 0.01, 40.0, group=32)
    assert (row["G"], row["K"], row["N"], row["M"]) == (32, 256, 64, 1)
    assert row["weight_bytes"] == 64 * 256 // 2 + 64 * (256 // 32) * 2  # int4 codes + one bf16 scale a group
    default = kernels.bench_shape(1, 576, 64, 1 << 20, 0.01, 0, peers=())
    assert default["G"] == 64  # no group given: GROUP_SIZE, or 64 where 128 does not divide K
    bandwidth = {"read_gbs": 40.0, "probe_gbs": 40.0, "torch_sum_gbs": 30.0}
    text = kernels.markdown_run({"title": "t", "bandwidth": bandwidth, "load_before": 0, "load_after": 0, "rows": [],
                                 "decode_rows": [row], "targets": []})
    assert "| t | qkv_proj | 256 | 64 | 32 |" in "\n".join(text)
