"""Property-based: checkpoint tensors that break the contract, loaded through the plugin's scheme the way vLLM's
loaders do, end in an AnychipError naming the layer, never a crash from deep inside or a layer served with
wrong values. (Corruptions of the files themselves are fuzzed through verify in test_verify_fuzz.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anychip.errors import AnychipError
from anychip.formats import pack_int4

pytest.importorskip("anychip.vllm_plugin.config")
N, K, G = 48, 256, 32
LAYER = "model.layers.2.mlp.down_proj"
TRIED: list[str] = []


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    import vllm.model_executor.parameter as parameter

    from anychip.kernels import hooks

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    previous = hooks.install(None)
    hooks.install(previous)
    yield
    hooks.install(previous)


def _good(fmt: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=gen)
    scales = (torch.rand(N, K // G, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    if fmt == "pack-quantized":
        return {"weight_packed": pack_int4(q), "weight_shape": torch.tensor([N, K]), "weight_scale": scales}
    return {"weight": q, "weight_scale": scales}


@st.composite
def corruption(draw) -> tuple[str, str, str]:
    fmt = draw(st.sampled_from(["pack-quantized", "int-quantized"]))
    tensors = ["weight_packed", "weight_shape"] if fmt == "pack-quantized" else ["weight"]
    tensor = draw(st.sampled_from(tensors + ["weight_scale"]))
    if tensor == "weight_shape":
        return fmt, tensor, draw(st.sampled_from(["n", "k", "swap"]))
    kinds = ["dtype", "rows", "cols", "rank"]
    if tensor == "weight_scale":
        kinds += ["nan", "inf", "zero", "negative"]
    elif fmt == "int-quantized":
        kinds += ["range"]
    return fmt, tensor, draw(st.sampled_from(kinds))


def _corrupt(t: torch.Tensor, kind: str, data) -> torch.Tensor:
    if t.shape == (2,) and kind in ("n", "k", "swap"):  # weight_shape: [N, K] with a wrong value
        n, k = t.tolist()
        delta = data.draw(st.sampled_from([-8, 8, 128]))
        return torch.tensor({"n": [n + delta, k], "k": [n, k + delta], "swap": [k, n]}[kind])
    if kind == "dtype":
        options = [d for d in (torch.float32, torch.bfloat16, torch.int8, torch.int32, torch.int64, torch.uint8)
                   if d != t.dtype and not (t.is_floating_point() and d.is_floating_point)]
        return t.to(data.draw(st.sampled_from(options)))
    if kind in ("rows", "cols"):
        dim = 0 if kind == "rows" else 1
        delta = data.draw(st.sampled_from([-1, 1, 7]))
        shape = list(t.shape)
        shape[dim] = max(1, shape[dim] + delta)
        return torch.zeros(shape, dtype=t.dtype)
    if kind == "rank":
        return t.reshape(-1)
    t = t.clone()
    i, j = data.draw(st.integers(0, t.shape[0] - 1)), data.draw(st.integers(0, t.shape[1] - 1))
    t[i, j] = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0, "negative": -0.01,
               "range": data.draw(st.sampled_from([-9, 8, 100, -128]))}[kind]
    return t


def _load(fmt: str, tensors: dict[str, torch.Tensor]) -> None:
    from compressed_tensors.quantization import QuantizationArgs

    from anychip.vllm_plugin.recorder import get_recorder
    from anychip.vllm_plugin.scheme import AnychipW4A8Scheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=G)
    scheme = AnychipW4A8Scheme(args, fmt, LAYER, get_recorder())
    layer = torch.nn.Module()

    def vllm_like_loader(param, loaded):  # what LinearBase.weight_loader_v2 does for one unsharded rank
        param.load_column_parallel_weight(loaded_weight=loaded)

    scheme.create_weights(layer, N, K, [N], K, torch.bfloat16, weight_loader=vllm_like_loader)
    for name, value in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, value)
    scheme.process_weights_after_loading(layer)
    scheme.apply_weights(layer, torch.randn(2, K, dtype=torch.bfloat16))


def test_the_uncorrupted_tensors_load_and_serve():
    for fmt in ("pack-quantized", "int-quantized"):
        _load(fmt, _good(fmt))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=corruption(), data=st.data())
def test_every_corruption_is_a_clear_error(case, data):
    fmt, name, kind = case
    tensors = _good(fmt)
    tensors[name] = _corrupt(tensors[name], kind, data)
    TRIED.append(f"{fmt}/{name}/{kind}")
    with pytest.raises(AnychipError) as err:
        _load(fmt, tensors)
    assert LAYER in str(err.value) or "scale" in str(err.value), str(err.value)
