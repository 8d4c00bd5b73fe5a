"""The plugin's decisions without an engine: which checkpoints it claims, sharding checks, strict refusal."""

from __future__ import annotations

import pytest
import torch

from anychip.checkpoint.scheme import W4A8Scheme

config_mod = pytest.importorskip("anychip.vllm_plugin.config")


def _qc(fmt: str = "pack-quantized", **weights) -> dict:
    qc = W4A8Scheme(group_size=64, format=fmt).quantization_config()
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


@pytest.mark.parametrize("fmt", ["pack-quantized", "int-quantized"])
def test_claims_w4a8_in_both_formats(fmt):
    claim = config_mod.AnychipW4A8Config.override_quantization_method
    assert claim(_qc(fmt), None) == "anychip-w4a8"
    assert claim(_qc(fmt), "compressed-tensors") == "anychip-w4a8"


def test_leaves_other_checkpoints_to_vllm():
    claim = config_mod.AnychipW4A8Config.override_quantization_method
    assert claim(_qc(num_bits=8), None) is None  # W8A8
    assert claim(_qc(symmetric=False), None) is None  # asymmetric INT4
    w4a16 = _qc()
    w4a16["config_groups"]["group_0"]["input_activations"] = None
    assert claim(w4a16, None) is None
    assert claim({"quant_method": "gptq", "bits": 4}, None) is None
    assert claim(_qc(), "awq") is None  # the user asked for something else
    other_format = _qc()
    other_format["format"] = other_format["config_groups"]["group_0"]["format"] = "marlin-24"
    assert claim(other_format, None) is None


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    """vLLM's parameter classes ask the tensor-parallel group for rank and size: one rank, no engine."""
    import vllm.model_executor.parameter as parameter

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)


def _scheme(group_size: int = 64, strategy: str = "group"):
    from compressed_tensors.quantization import QuantizationArgs

    from anychip.vllm_plugin.recorder import get_recorder
    from anychip.vllm_plugin.scheme import AnychipW4A8Scheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy=strategy,
                            group_size=group_size if strategy == "group" else None)
    return AnychipW4A8Scheme(args, "pack-quantized", "model.layers.7.mlp.down_proj", get_recorder())


def test_row_parallel_split_must_fall_on_a_group_boundary():
    from anychip.vllm_plugin.scheme import LayerPrepareError

    layer = torch.nn.Module()
    # K=1536 over 3 ranks: 512 columns a rank, 8 groups of 64: fine
    _scheme().create_weights(layer, 576, 1536, [576], 512, torch.bfloat16, weight_loader=lambda *a: None)
    assert tuple(layer.weight_packed.shape) == (576, 64) and tuple(layer.weight_scale.shape) == (576, 8)
    # K=1536 over 16 ranks: 96 columns, one and a half groups: refused, naming the layer and the fix
    with pytest.raises(LayerPrepareError, match=r"model.layers.7.mlp.down_proj.*K=96 .*group boundary"):
        _scheme().create_weights(torch.nn.Module(), 576, 1536, [576], 96, torch.bfloat16,
                                 weight_loader=lambda *a: None)


def test_channelwise_scales_are_served_as_repeated_groups():
    from anychip.kernels.reference import w4a8_linear_dynamic_ref

    layer = torch.nn.Module()
    scheme = _scheme(strategy="channel")
    scheme.create_weights(layer, 48, 256, [48], 256, torch.bfloat16, weight_loader=lambda *a: None)
    from anychip.formats import pack_int4

    wq = torch.randint(-8, 8, (48, 256), dtype=torch.int8)
    scale = torch.rand(48, 1, dtype=torch.bfloat16)
    layer.weight_packed.data.copy_(pack_int4(wq))
    layer.weight_scale.data.copy_(scale)
    scheme.process_weights_after_loading(layer)
    x = torch.randn(3, 256, dtype=torch.float32)
    y = scheme.apply_weights(layer, x)
    ref = w4a8_linear_dynamic_ref(x, wq, scale.float().expand(48, 2).contiguous())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
