"""The plugin's decisions without an engine: which checkpoints it claims, sharding checks, strict refusal."""

from __future__ import annotations

import json
import re
import time

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


def test_claims_what_anychip_made_even_after_its_config_was_edited():
    """A checkpoint with anychip's provenance block whose config was edited (here: asymmetric weights) is the
    plugin's, so strict mode can refuse it by name, instead of vLLM's own compressed-tensors serving INT4 weights
    that carry no zero points as asymmetric ones (garbage, seen in a probe)."""
    claim = config_mod.AnychipW4A8Config.override_quantization_method
    edited = _qc(symmetric=False)
    edited["anychip"] = {"method": "rtn"}
    assert claim(edited, None) == "anychip-w4a8"
    assert claim(edited, "awq") is None  # the user asked for something else


def test_strict_mode_names_what_is_not_w4a8():
    from types import SimpleNamespace

    from compressed_tensors.quantization import QuantizationArgs

    from anychip.vllm_plugin.recorder import get_recorder

    w = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64)
    a = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    assert config_mod.w4a8_mismatches(w, a) == [] and config_mod.is_w4a8_int(w.model_dump(), a.model_dump())
    asym = w.model_copy(update={"symmetric": False})
    static = a.model_copy(update={"dynamic": False})
    assert config_mod.w4a8_mismatches(asym, a) == ["weights.symmetric=False (W4A8 has True)"]
    assert config_mod.w4a8_mismatches(w, static) == ["input_activations.dynamic=False (W4A8 has True)"]
    assert config_mod.w4a8_mismatches(w.model_copy(update={"num_bits": 8}), None) == [
        "input_activations are not quantized"]
    assert get_recorder().coverage.strict
    fake = SimpleNamespace(quant_format="pack-quantized")
    with pytest.raises(config_mod.StrictModeError, match=r"model.layers.0.mlp.up_proj.*weights.symmetric=False"):
        config_mod.AnychipW4A8Config._get_scheme_from_parts(fake, asym, a, layer_name="model.layers.0.mlp.up_proj")


def test_damaged_weights_stop_the_engine_whatever_the_fallback_setting(monkeypatch):
    """A NaN scale is not a missing kernel: the refusal says the checkpoint is damaged and offers no fallback
    (the reference route could not serve it either)."""
    from anychip.formats import pack_int4
    from anychip.vllm_plugin.recorder import get_recorder
    from anychip.vllm_plugin.scheme import LayerPrepareError

    monkeypatch.setattr(get_recorder().coverage, "strict", False)
    layer = torch.nn.Module()
    scheme = _scheme()
    scheme.create_weights(layer, 48, 256, [48], 256, torch.bfloat16, weight_loader=lambda *a: None)
    scales = torch.full((48, 4), 0.01, dtype=torch.bfloat16)
    scales[3, 1] = float("nan")
    load(layer, weight_packed=pack_int4(torch.randint(-8, 8, (48, 256), dtype=torch.int8)), weight_scale=scales)
    with pytest.raises(LayerPrepareError, match=r"model.layers.7.mlp.down_proj.*scale \[3, 1\] is nan.*damaged") as err:
        scheme.process_weights_after_loading(layer)
    assert "allow-fallback" not in str(err.value) and "ALLOW_FALLBACK" not in str(err.value)


def test_per_channel_scales_with_no_kernel_group_say_so():
    from anychip.vllm_plugin.scheme import LayerPrepareError

    layer = torch.nn.Module()
    scheme = _scheme(strategy="channel")
    scheme.create_weights(layer, 16, 1000, [16], 1000, torch.bfloat16, weight_loader=lambda *a: None)
    load(layer, weight_packed=torch.zeros(16, 1000 // 8, dtype=torch.int32),
         weight_scale=torch.full((16, 1), 0.01, dtype=torch.bfloat16))
    with pytest.raises(LayerPrepareError, match=r"per-channel scales over K=1000.*none of which divides K"):
        scheme.process_weights_after_loading(layer)


@pytest.fixture(autouse=True)
def restore_call_observer():
    """The plugin's recorder installs itself as the kernels' call observer and its table as the C++ kernels'
    counts for the process (an engine's lifetime); put back what was there so later tests' calls are not counted
    against these layers."""
    from anychip.kernels import hooks

    previous = hooks.install(None)
    hooks.install(previous)
    counts = hooks.install_kernel_counts(None)
    hooks.install_kernel_counts(counts)
    yield
    hooks.install(previous)
    hooks.install_kernel_counts(counts)


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
    scale = torch.rand(48, 1, dtype=torch.bfloat16) + 0.01  # bf16 rand can be exactly 0: not a valid scale
    load(layer, weight_packed=pack_int4(wq), weight_scale=scale)
    scheme.process_weights_after_loading(layer)
    x = torch.randn(3, 256, dtype=torch.float32)
    y = scheme.apply_weights(layer, x)
    ref = w4a8_linear_dynamic_ref(x, wq, scale.float().expand(48, 2).contiguous())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


def load(layer: torch.nn.Module, **tensors: torch.Tensor) -> None:
    """Load checkpoint tensors into the scheme's parameters the way vLLM does: through each parameter's weight
    loader (the scheme's checked loader, which records what was loaded), here around a loader that only copies."""
    for name, value in tensors.items():
        param = getattr(layer, name)
        param.data.copy_(value)
        param.weight_loader(param, value)


def _prepared_g64_layer(recorder, name: str):
    """A 48 x 256 G64 pack-quantized linear prepared by the plugin's scheme (random weights): (scheme, layer)."""
    from compressed_tensors.quantization import QuantizationArgs

    from anychip.formats import pack_int4
    from anychip.vllm_plugin.scheme import AnychipW4A8Scheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64)
    scheme = AnychipW4A8Scheme(args, "pack-quantized", name, recorder)
    layer = torch.nn.Module()
    scheme.create_weights(layer, 48, 256, [48], 256, torch.bfloat16, weight_loader=lambda *a: None)
    load(layer, weight_packed=pack_int4(torch.randint(-8, 8, (48, 256), dtype=torch.int8)),
         weight_scale=torch.rand(48, 4, dtype=torch.bfloat16) + 0.01)
    scheme.process_weights_after_loading(layer)
    return scheme, layer


def test_recorder_counts_cpp_layers_in_the_kernel_per_phase():
    """A layer on a C++ route is counted by its op in C++ at the slot the step hook sets: no Python per call."""
    from anychip.kernels import hooks, routes
    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin.recorder import Recorder

    recorder = Recorder(None, KernelPolicy())
    name = "model.layers.0.mlp.down_proj"
    scheme, layer = _prepared_g64_layer(recorder, name)
    assert routes.get(scheme.route_code).counts_in_kernel
    notified: list[tuple[int, int]] = []
    hooks.install(lambda layer_id, tokens: notified.append((layer_id, tokens)))
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    scheme.apply_weights(layer, x)  # before any step: warmup
    recorder.on_step("prefill", 3)
    scheme.apply_weights(layer, x)
    recorder.on_step("decode", 1)
    scheme.apply_weights(layer, x[:1])
    scheme.apply_weights(layer, x[:1])
    doc = recorder.document()
    assert notified == []
    assert doc["layers"][name]["calls"] == {"warmup": 1, "prefill": 1, "decode": 2}
    assert doc["layers"][name]["tokens"] == {"warmup": 3, "prefill": 3, "decode": 2}
    assert doc["phases"] == {"prefill": {"forward_passes": 1, "tokens": 3},
                             "decode": {"forward_passes": 1, "tokens": 1}}


def test_the_last_report_keeps_the_head_route_of_a_model_already_freed():
    """The recorder holds the head and embedding by weak references. An engine that exits writes its last report
    after the model may be freed: that report must still name the head's route, read while the model was alive."""
    import gc

    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin.recorder import Recorder

    recorder = Recorder(None, KernelPolicy())
    embed = torch.nn.Module()
    embed.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)
    head = torch.nn.Module()
    head.weight = embed.weight  # tied
    recorder.note_embedding("model.embed_tokens", embed, is_head=False)
    recorder.note_embedding("lm_head", head, is_head=True)
    recorder.on_step("prefill", 3)  # the first step, model alive
    del embed, head
    gc.collect()
    assert recorder.head_route() is None  # what the last report would have read
    route = recorder.document()["head_route"]
    assert route["layer"] == "lm_head" and route["tied_to"] == "model.embed_tokens" and route["route"]


def test_the_last_report_keeps_the_head_route_when_only_the_head_is_freed_first():
    """An engine exiting frees its model piece by piece: with the head that computed the logits gone and the input
    embedding still alive, the last report kept the embedding's GEMM as the head's route (probe46: an anychip head
    reported as vllm.cpu.onednn_mm after exit). The route read while the head lived stands."""
    import gc

    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin.recorder import Recorder

    recorder = Recorder(None, KernelPolicy())
    embed = torch.nn.Module()
    embed.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)
    head = torch.nn.Module()
    head.weight = embed.weight
    recorder.note_embedding("model.embed_tokens", embed, is_head=False)
    recorder.note_embedding("lm_head", head, is_head=True)
    recorder.on_logits(head)
    recorder.on_step("prefill", 3)
    before = recorder.document()["head_route"]
    del head
    gc.collect()
    assert recorder.head_route() is None
    assert recorder.document()["head_route"] == before and before["layer"] == "lm_head"


def test_a_head_that_is_the_input_embedding_is_reported_tied():
    """vLLM 0.26's Qwen2 and Qwen3 build no head layer for tied embeddings (lm_head = embed_tokens): the
    embedding is the only layer the plugin sees, and the report names it as the head's source and its route."""
    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin.recorder import Recorder

    recorder = Recorder(None, KernelPolicy())
    embed = torch.nn.Module()
    embed.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)
    recorder.note_embedding("model.embed_tokens", embed, is_head=False)
    route = recorder.document()["head_route"]
    assert route["layer"] == "lm_head" and route["tied_to"] == "model.embed_tokens" and route["route"]
    assert route["quantized"] is False and route["dtype"] == "bfloat16"


def _tied_model() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(model, model.model.embed_tokens, model.lm_head), the head sharing the embedding's weight."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    embed = model.model.embed_tokens = torch.nn.Module()
    embed.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)
    head = model.lm_head = torch.nn.Module()
    head.weight = embed.weight
    return model, embed, head


def test_a_head_tied_to_an_embedding_the_config_never_saw_is_reported_tied():
    """vLLM 0.32's Gemma builds its input embedding with no quantization config (never noted) and its head with one,
    tied by sharing the embedding's weight: the report names the embedding, found in the served model."""
    from types import SimpleNamespace

    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin.recorder import Recorder

    recorder = Recorder(None, KernelPolicy())
    model, embed, head = _tied_model()
    recorder.note_embedding("lm_head", head, is_head=True)
    recorder.on_logits(head)
    recorder.coverage.attention_backend = "CPUAttentionBackend"  # the stub runner has no vLLM config to read
    recorder.on_step("prefill", 3, SimpleNamespace(get_model=lambda: model))
    assert recorder.document()["head_route"]["tied_to"] == "model.embed_tokens"
    head.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)  # untied
    other = Recorder(None, KernelPolicy())
    other.note_embedding("lm_head", head, is_head=True)
    other.on_logits(head)
    other.coverage.attention_backend = "CPUAttentionBackend"
    other.on_step("prefill", 3, SimpleNamespace(get_model=lambda: model))
    assert other.document()["head_route"]["tied_to"] is None


def test_a_tied_embedding_noted_without_its_full_prefix_is_named_as_the_served_model_names_it():
    """vLLM's Llama hands its input embedding over with no prefix (noted as "embed_tokens"): the report names it
    model.embed_tokens, as a report of another route or family does for the same module (probe 49)."""
    from types import SimpleNamespace

    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin.recorder import Recorder

    recorder = Recorder(None, KernelPolicy())
    model, embed, head = _tied_model()
    recorder.note_embedding("", embed, is_head=False)
    recorder.note_embedding("lm_head", head, is_head=True)
    assert recorder.head_route()["tied_to"] == "embed_tokens"  # before a step names it from the served model
    recorder.on_logits(head)
    recorder.coverage.attention_backend = "CPUAttentionBackend"
    recorder.on_step("prefill", 3, SimpleNamespace(get_model=lambda: model))
    route = recorder.document()["head_route"]
    assert route["tied_to"] == "model.embed_tokens" and route["layer"] == "lm_head"


def test_a_head_tied_by_the_config_is_reported_tied_when_its_weight_is_a_copy():
    """A route that serves the head from a copy of its weight (the reference head) breaks the weights' identity
    that tying shows in: the loaded model's config says tied, and the report names the embedding as the served
    model names it, from the load hook, before any step (probe 49: null or "embed_tokens" on the reference route,
    "model.embed_tokens" on the fast ones)."""
    from types import SimpleNamespace

    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin.recorder import Recorder

    model, embed, head = _tied_model()
    head.weight = torch.nn.Parameter(embed.weight.clone(), requires_grad=False)
    config = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(tie_word_embeddings=True)))
    recorder = Recorder(None, KernelPolicy())
    recorder.note_embedding("", embed, is_head=False)
    recorder.note_embedding("lm_head", head, is_head=True)
    assert recorder.head_route()["tied_to"] is None
    recorder.note_model(model, config)
    assert recorder.head_route()["tied_to"] == "model.embed_tokens"
    untied = Recorder(None, KernelPolicy())
    untied.note_embedding("", embed, is_head=False)
    untied.note_embedding("lm_head", head, is_head=True)
    config.model_config.hf_text_config.tie_word_embeddings = False
    untied.note_model(model, config)
    assert untied.head_route()["tied_to"] is None


def test_a_head_built_without_the_quantization_config_is_served_and_reported():
    """vLLM 0.32's Gemma 2 computes its logits with an input embedding built with no quantization config, so the
    plugin never sees it while the model is built. At the first logits (compat.install_logits_hook) the plugin
    gives it an anychip head route on the CPU, and the report names that route, the head tied to the embedding
    (named from the served model at the next step). A head that is already ours, or quantized, is left alone."""
    from types import SimpleNamespace

    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin import compat
    from anychip.vllm_plugin.head import PREPARED, AnychipHeadMethod
    from anychip.vllm_plugin.recorder import Recorder

    recorder = Recorder(None, KernelPolicy())
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    embed = model.model.embed_tokens = torch.nn.Module()
    embed.weight = torch.nn.Parameter(torch.randn(64, 32).bfloat16(), requires_grad=False)
    embed.quant_method = compat.UnquantizedEmbeddingMethod()
    recorder.on_logits(embed)
    assert isinstance(embed.quant_method, AnychipHeadMethod) and hasattr(embed, PREPARED)
    x = torch.randn(3, 32).bfloat16()
    torch.testing.assert_close(embed.quant_method.apply(embed, x).float(), x.float() @ embed.weight.float().t(),
                               rtol=1e-2, atol=1e-2)
    recorder.coverage.attention_backend = "CPUAttentionBackend"  # the stub runner has no vLLM config to read
    recorder.on_step("decode", 1, SimpleNamespace(get_model=lambda: model))
    route = recorder.document()["head_route"]
    assert route["layer"] == "lm_head" and route["tied_to"] == "model.embed_tokens"
    assert route["route"] == getattr(embed, PREPARED).route.id and route["route"].startswith("cpu.head_bf16")
    ours = embed.quant_method
    recorder.on_logits(embed)
    assert embed.quant_method is ours
    quantized = torch.nn.Module()
    quantized.quant_method = method = object()
    recorder.on_logits(quantized)
    assert quantized.quant_method is method and not hasattr(quantized, PREPARED)


def test_report_never_pairs_a_layer_snapshot_with_counters_of_newer_layers(tmp_path):
    """The report thread writes while the model is still being built: a layer registered between the report's
    snapshot of the layers and its read of the kernel counters must wait for the next report (it once raised
    KeyError there, which ended the report thread and left coverage.json without the prepared layers)."""
    import threading

    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin.recorder import Recorder

    recorder = Recorder(None, KernelPolicy())
    _prepared_g64_layer(recorder, "model.layers.0.mlp.down_proj")  # the C++ routes' table exists from here on
    snapshot = recorder.coverage.snapshot
    builder: list[threading.Thread] = []

    def snapshot_while_a_layer_is_prepared():
        doc = snapshot()
        thread = threading.Thread(target=_prepared_g64_layer, args=(recorder, "model.layers.1.mlp.down_proj"))
        thread.start()
        thread.join(timeout=0.5)  # time for the layer to land inside the report's window, were it open
        builder.append(thread)
        return doc

    recorder.coverage.snapshot = snapshot_while_a_layer_is_prepared
    doc = recorder.document()
    builder[0].join()
    assert list(doc["layers"]) == ["model.layers.0.mlp.down_proj"]
    recorder.coverage.snapshot = snapshot
    assert list(recorder.document()["layers"]) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


def test_a_failed_report_is_retried_and_the_report_thread_lives_on(tmp_path, monkeypatch):
    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin import recorder as recorder_mod

    monkeypatch.setattr(recorder_mod, "FLUSH_SECONDS", 0.05)
    path = tmp_path / "coverage.json"
    recorder = recorder_mod.Recorder(path, KernelPolicy())
    real, failures = recorder.document, []

    def failing_once():
        if not failures:
            failures.append(1)
            raise KeyError("a layer the snapshot does not hold")
        return real()

    recorder.document = failing_once
    deadline = time.time() + 10
    while not path.exists() and time.time() < deadline:
        time.sleep(0.05)
    recorder._stop.set()
    assert failures and path.exists()
    assert json.loads(path.read_text())["layers"] == {}


def test_the_report_is_not_rewritten_while_the_engine_steps(tmp_path):
    """Each write is milliseconds of Python holding the GIL: while model steps keep coming, a pending report waits
    for the engine to go idle, or for BUSY_FLUSH_SECONDS after the last write."""
    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin import recorder as recorder_mod

    recorder = recorder_mod.Recorder(None, KernelPolicy())
    recorder.path = tmp_path / "coverage.json"  # no report thread: the test decides when to write
    recorder.flush()
    recorder.on_step("decode", 1)
    started = recorder._last_step
    assert not recorder.write_due(started + 2 * recorder_mod.IDLE_SECONDS)  # the step is still running
    recorder.on_step_end()
    stepped = recorder._last_step
    assert not recorder.write_due(stepped + 0.01)
    assert recorder.write_due(stepped + 2 * recorder_mod.IDLE_SECONDS)  # idle
    recorder.on_step("decode", 1)
    recorder._last_step = recorder._last_write + recorder_mod.BUSY_FLUSH_SECONDS  # still stepping, 10 s on
    assert recorder.write_due(recorder._last_step + 0.01)


def test_a_report_written_during_a_step_is_written_again_when_it_ends(tmp_path):
    """A step longer than IDLE_SECONDS (a long prefill, a loaded machine) must not leave a torn report: one written
    while the step ran counts its pass but only some of its layers' calls (`coverage check` then fails on a healthy
    server), so the report stays pending until the step has ended and its calls are in. Calls counted with no step
    hook at all (warm-up) make a written report pending again."""
    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin import recorder as recorder_mod

    recorder = recorder_mod.Recorder(None, KernelPolicy())
    recorder.path = tmp_path / "coverage.json"
    name = "model.layers.0.mlp.down_proj"
    scheme, layer = _prepared_g64_layer(recorder, name)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    recorder.flush()
    assert not recorder._device_dirty and not recorder.counts_changed()
    scheme.apply_weights(layer, x)  # warm-up's call: no step hook ran
    assert recorder.counts_changed()
    recorder.flush()
    assert not recorder.counts_changed()
    recorder.on_step("prefill", 3)
    recorder.flush()  # mid-step (a BUSY_FLUSH_SECONDS write): the pass counted, the call not yet
    torn = json.loads(recorder.path.read_text())
    assert torn["phases"]["prefill"]["forward_passes"] == 1 and "prefill" not in torn["layers"][name]["calls"]
    assert recorder._device_dirty  # still pending
    scheme.apply_weights(layer, x)
    recorder.on_step_end()
    assert recorder._device_dirty and recorder.write_due(recorder._last_step + 2 * recorder_mod.IDLE_SECONDS)
    recorder.flush()
    doc = json.loads(recorder.path.read_text())
    assert doc["layers"][name]["calls"] == {"warmup": 1, "prefill": 1}
    assert not recorder._device_dirty and not recorder.counts_changed()


def test_the_heap_is_trimmed_once_when_serving_starts(monkeypatch):
    """CPU engines (the C++ routes' counter table exists): the freed start-up heap goes back to the OS at the
    first step that serves a request, not during warm-up, and only once; GPU-only engines leave it."""
    from anychip.kernels import hooks, machine
    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin import recorder as recorder_mod

    calls = []
    monkeypatch.setattr(machine, "trim_heap", lambda: calls.append(1) or 0)
    gpu_only = recorder_mod.Recorder(None, KernelPolicy())
    gpu_only.on_step("prefill", 3)
    assert calls == []
    recorder = recorder_mod.Recorder(None, KernelPolicy())
    monkeypatch.setattr(recorder, "_kernel_counts", hooks.KernelCounts.zeros(4))
    recorder.on_step("warmup", 8)
    assert calls == []
    for phase in ("prefill", "decode", "decode"):
        recorder.on_step(phase, 1)
    assert calls == [1]


def test_a_report_that_keeps_failing_is_logged_once_per_error(tmp_path, caplog):
    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin import recorder as recorder_mod

    recorder = recorder_mod.Recorder(None, KernelPolicy())
    recorder.path = tmp_path / "coverage.json"
    errors = iter([OSError("disk full"), OSError("disk full"), OSError("read-only")])

    def failing():
        raise next(errors)

    recorder.document = failing
    with caplog.at_level("WARNING", logger="anychip"):
        for _ in range(3):
            recorder.flush()
    assert [r.getMessage() for r in caplog.records] == [
        f"anychip: could not write coverage report {recorder.path}: OSError('{e}')" for e in ("disk full", "read-only")]
    assert recorder.coverage.dirty


def test_row_parallel_refusal_names_sizes_that_work():
    from anychip.vllm_plugin.scheme import LayerPrepareError

    # K=1536, G64: 24 groups; 1536 over 5 ranks is not even a whole shard, over 16 ranks 96 columns
    with pytest.raises(LayerPrepareError, match=r"divides its 24 groups \(1, 2, 3, 4, 6, 8, 12\)"):
        _scheme().create_weights(torch.nn.Module(), 576, 1536, [576], 96, torch.bfloat16,
                                 weight_loader=lambda *a: None)


@pytest.mark.parametrize("parts", [[256, 64, 64], [768, 768]], ids=["qkv", "gate_up"])
def test_merged_column_parallel_shards(parts):
    """A merged qkv / gate_up layer on one rank of two: N is the sum of this rank's parts, K is whole."""
    layer = torch.nn.Module()
    scheme = _scheme(group_size=32)
    scheme.create_weights(layer, sum(parts) * 2, 576, parts, 576, torch.bfloat16, weight_loader=lambda *a: None)
    assert tuple(layer.weight_packed.shape) == (sum(parts), 576 // 8)
    assert tuple(layer.weight_scale.shape) == (sum(parts), 576 // 32)
    assert scheme.row_parallel is False


def _two_rank_quantize(rank: int, port: int, x: torch.Tensor, out: dict) -> None:
    import torch.distributed as dist

    from anychip.vllm_plugin import compat, tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        compat.tp_device_group = lambda: None  # the default (world) group is the tensor-parallel group here
        half = x.shape[1] // 2
        xq, sx = tensor_parallel.quantize_over_ranks(x[:, rank * half:(rank + 1) * half])
        out[rank] = (xq, sx)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes with a gloo group: a minute or more on a loaded 2-core machine
def test_row_parallel_shards_quantize_with_the_whole_token_scale():
    """Two ranks, each holding half of K: their INT8 values and scales are the unsharded reference's exactly."""
    import socket

    import torch.multiprocessing as mp

    from anychip.kernels.reference import quantize_activations_ref

    x = torch.randn(5, 256, dtype=torch.bfloat16) * torch.logspace(-2, 2, 5, dtype=torch.bfloat16)[:, None]
    x[1, 128:] *= 50  # rank 1 holds this token's largest value: rank 0 must still use it
    x[3] = 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=_two_rank_quantize, args=(r, port, x, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs)
        got = dict(out)
    xq_ref, sx_ref = quantize_activations_ref(x)
    for rank in range(2):
        xq, sx = got[rank]
        assert torch.equal(sx, sx_ref)
        assert torch.equal(xq, xq_ref[:, rank * 128:(rank + 1) * 128])


def test_the_plugin_asks_for_the_amx_tile_state_where_the_cpu_has_amx():
    """vLLM CPU's AMX attention needs the tile state granted (arch_prctl) before its first forward; registering
    the plugin asks for it on a CPU with amx_tile and nowhere else (test_coverage_report's engine with BF16
    linears stopped with SIGILL on such a CPU without it)."""
    import anychip.vllm_plugin as plugin
    from anychip.kernels import machine

    machine.request_amx_tiles.cache_clear()
    plugin._registered = False
    plugin.register()
    amx = machine.is_x86() and "amx_tile" in machine.cpu_flags()
    assert machine.request_amx_tiles.cache_info().currsize == 1  # register() asked
    assert machine.request_amx_tiles() is amx


def test_trim_heap_returns_freed_memory_where_glibc_is():
    """63 MiB of 64 KiB blocks freed between blocks still in use stay mapped by glibc; trim_heap hands them back."""
    import ctypes
    import sys

    from anychip.kernels import machine

    if not sys.platform.startswith("linux"):
        assert machine.trim_heap() is None
        return
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim
    except AttributeError:
        pytest.skip("no glibc malloc_trim (musl?)")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    machine.trim_heap()
    blocks = [libc.malloc(64 * 1024) for _ in range(1024)]  # below glibc's mmap threshold: from the heap
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    kept = blocks[63::64]  # every 64th stays in use (the last included): the freed ones are never the heap's top,
    for i, b in enumerate(blocks):  # so free() keeps them mapped
        if i % 64 != 63:
            libc.free(b)
    returned = machine.trim_heap()
    for b in kept:
        libc.free(b)
    assert returned is not None and returned > 32 * 2**20, returned  # 63 MiB were freed


def test_inductor_simd_reports_the_probed_isa_and_starts_no_probe(monkeypatch):
    """None until Inductor has probed (in a fresh process), then the ISA its C++ code is generated for; the
    recorder puts it in the report's platform section."""
    import subprocess
    import sys

    code = ("from anychip.kernels.machine import inductor_simd\n"
            "before = inductor_simd()\n"
            "from torch._inductor import cpu_vec_isa\n"
            "cpu_vec_isa.valid_vec_isa_list()\n"
            "print(before, '|', inductor_simd(), '|', str(cpu_vec_isa.pick_vec_isa()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    before, after, picked = (part.strip() for part in out.stdout.strip().splitlines()[-1].split("|"))
    assert before == "None" and after == picked and after

    from anychip.kernels import machine
    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin import recorder as recorder_mod

    monkeypatch.setattr(machine, "inductor_simd", lambda: "avx2")
    assert recorder_mod.Recorder(None, KernelPolicy()).document()["platform"]["inductor_simd"] == "avx2"
    monkeypatch.setattr(machine, "inductor_simd", lambda: None)
    assert "inductor_simd" not in recorder_mod.Recorder(None, KernelPolicy()).document()["platform"]


@pytest.mark.parametrize("missing", ["weight_packed", "weight_scale"])
def test_a_tensor_missing_from_the_checkpoint_stops_the_engine(missing):
    """vLLM 0.32 does not track unloaded weights of quantized models: the scheme does, and refuses a layer whose
    files lack its packed weight or its scales instead of serving what torch.empty left in the parameter."""
    from anychip.formats import pack_int4
    from anychip.vllm_plugin.scheme import LayerPrepareError

    layer = torch.nn.Module()
    scheme = _scheme()
    scheme.create_weights(layer, 48, 256, [48], 256, torch.bfloat16, weight_loader=lambda *a: None)
    tensors = {"weight_packed": pack_int4(torch.randint(-8, 8, (48, 256), dtype=torch.int8)),
               "weight_scale": torch.full((48, 4), 0.01, dtype=torch.bfloat16)}
    del tensors[missing]
    load(layer, **tensors)
    with pytest.raises(LayerPrepareError, match=rf"model.layers.7.mlp.down_proj: the checkpoint has no {missing} "
                                                r"for it \(it was never loaded\).*anychip verify"):
        scheme.process_weights_after_loading(layer)


def test_a_merged_layer_missing_one_part_stops_the_engine():
    from anychip.vllm_plugin.scheme import LayerPrepareError

    parts = [64, 32, 32]  # q, k, v merged into one qkv parameter
    layer = torch.nn.Module()
    scheme = _scheme(group_size=32)
    scheme.create_weights(layer, sum(parts), 128, parts, 128, torch.bfloat16, weight_loader=lambda *a: None)
    for shard in ("q", "v"):  # k's tensors are not in the files
        for name in ("weight_packed", "weight_scale"):
            param = getattr(layer, name)
            param.weight_loader(param, torch.ones(1, 1, dtype=param.dtype), shard)
    with pytest.raises(LayerPrepareError, match=r"no weight_packed for it \(only parts \['q', 'v'\] of the 3"):
        scheme.process_weights_after_loading(layer)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_group_scales_of_another_dtype_are_refused_not_converted(dtype):
    """The contract stores BF16 scales (`anychip verify` refuses others); converting them would serve other numbers
    than the checkpoint declares."""
    from anychip.vllm_plugin.scheme import LayerPrepareError

    layer = torch.nn.Module()
    _scheme().create_weights(layer, 48, 256, [48], 256, torch.bfloat16, weight_loader=lambda *a: None)
    with pytest.raises(LayerPrepareError, match=re.escape(f"{dtype} group scales where the contract has BF16")):
        load(layer, weight_scale=torch.full((48, 4), 0.01, dtype=dtype))


@pytest.mark.parametrize("bad", [1e-40, 3.3895e38])  # a subnormal (a zeroed group); 8 s overflows
def test_subnormal_and_huge_scales_stop_the_engine(bad):
    from anychip.formats import pack_int4
    from anychip.vllm_plugin.scheme import LayerPrepareError

    layer = torch.nn.Module()
    scheme = _scheme()
    scheme.create_weights(layer, 48, 256, [48], 256, torch.bfloat16, weight_loader=lambda *a: None)
    scales = torch.full((48, 4), 0.01, dtype=torch.bfloat16)
    scales[5, 2] = bad
    load(layer, weight_packed=pack_int4(torch.randint(-8, 8, (48, 256), dtype=torch.int8)), weight_scale=scales)
    with pytest.raises(LayerPrepareError, match=r"scale \[5, 2\] is .*positive normal numbers"):
        scheme.process_weights_after_loading(layer)


def test_step_phase_counts_a_request_start_as_prefill_and_skips_idle_steps():
    """A one-token prompt (or a one-token embedding input) starts its request: prefill, not decode; a step with
    nothing scheduled runs no model and is not counted; vLLM's warm-up requests ("_...") are warmup."""
    from types import SimpleNamespace

    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin.compat import step_phase
    from anychip.vllm_plugin.recorder import Recorder

    def out(scheduled: dict[str, int], new: tuple[str, ...] = ()) -> SimpleNamespace:
        return SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                               scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new])

    assert step_phase(out({"a": 1}, new=("a",)), False) == ("prefill", 1)
    assert step_phase(out({"a": 1, "b": 1}, new=("b",)), False) == ("prefill", 2)
    assert step_phase(out({"a": 1, "b": 1}), False) == ("decode", 2)
    assert step_phase(out({"a": 5}), False) == ("prefill", 5)  # a later chunk of a prompt
    assert step_phase(out({}), False) == ("idle", 0)
    assert step_phase(out({"_warmup_0_": 8}, new=("_warmup_0_",)), False) == ("warmup", 8)
    recorder = Recorder(None, KernelPolicy())
    _prepared_g64_layer(recorder, "model.layers.0.mlp.down_proj")  # a layer its kernels count: phases reported
    recorder.on_step("idle", 0)
    recorder.on_step("prefill", 1)
    assert recorder.document()["phases"] == {"prefill": {"forward_passes": 1, "tokens": 1}}


def test_a_nan_float_weight_stops_the_engine():
    from anychip.vllm_plugin.scheme import LayerPrepareError, check_float_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    check_float_weights(model)
    with torch.no_grad():
        model[1].weight[2] = float("nan")
    with pytest.raises(LayerPrepareError, match=r"^1\.weight holds NaN or inf"):
        check_float_weights(model)


def test_a_nan_past_the_first_slice_and_the_gpu_load_hook(monkeypatch):
    """The check reads a weight slice by slice (a GPU keeps no weight-sized temporary): an inf in a later slice is
    found. vLLM's GPU model runners run it through the load hook (here a stub runner on a stub GPU platform), with
    the model taken out of its CUDA-graph wrapper."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from anychip.vllm_plugin import compat, scheme

    monkeypatch.setattr(scheme, "CHECK_SLICE", 5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight[3, 1] = float("inf")  # element 13: the third slice
    with pytest.raises(scheme.LayerPrepareError, match=r"^0\.weight holds NaN or inf"):
        scheme.check_float_weights(model)

    class Runner:
        vllm_config = "config"

        def load_model(self) -> str:
            self.model = SimpleNamespace(unwrap=lambda: model)  # as vLLM's CUDAGraphWrapper
            return "loaded"

    seen = []
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(compat, "_classes", lambda name, *modules: [Runner] if name == "GPUModelRunner" else [])
    monkeypatch.setitem(compat._load_hooks, "gpu", None)
    assert compat.install_gpu_model_hook(lambda m, config: seen.append((m, config)))
    assert Runner().load_model() == "loaded" and seen == [(model, "config")]
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.setitem(compat._load_hooks, "gpu", None)
    assert not compat.install_gpu_model_hook(lambda m, config: None)  # a CPU engine has its own hook


def test_an_engine_refusal_is_in_the_report_and_fails_the_check(tmp_path, monkeypatch):
    """probe46: an engine refused at load wrote an empty strict report over the last good one, with no word of why.
    The refusal's message is the report's `refused`, written at once, and coverage check names it."""
    import json

    from anychip.coverage import check
    from anychip.kernels.policy import KernelPolicy
    from anychip.vllm_plugin import recorder as recorder_module
    from anychip.vllm_plugin.config import StrictModeError
    from anychip.vllm_plugin.scheme import LayerPrepareError

    path = tmp_path / "cov.json"
    rec = recorder_module.Recorder(path, KernelPolicy())
    monkeypatch.setattr(recorder_module, "_recorder", rec)
    error = LayerPrepareError("layer model.layers.0.mlp.down_proj: scale [0, 1] is nan")
    doc = json.loads(path.read_text())
    assert doc["refused"] == str(error)
    assert check(doc) == [f"the engine refused to start: {error}"]
    StrictModeError("layer x: no anychip kernel serves it")
    assert json.loads(path.read_text())["refused"] == "layer x: no anychip kernel serves it"


def test_bench_and_eval_engines_read_a_mistral_format_source_the_hugging_face_way(tmp_path, monkeypatch):
    """A repo also in Mistral's own format is served by vLLM with Mistral's config and tokenizer, its W4A8 copy the
    Hugging Face way: anychip's runners read both the Hugging Face way, so BF16 against W4A8 compares weights."""
    from anychip.vllm_plugin import offline

    seen = []
    monkeypatch.setattr(offline, "LLM", lambda **kwargs: seen.append(kwargs))
    (tmp_path / "params.json").write_text("{}")
    offline.make_llm(model=str(tmp_path))
    (tmp_path / "consolidated.safetensors").write_bytes(b"")
    offline.make_llm(model=str(tmp_path))
    offline.make_llm(model=str(tmp_path), tokenizer_mode="mistral")
    assert "config_format" not in seen[0]
    assert seen[1] == {"model": str(tmp_path), "config_format": "hf", "load_format": "safetensors",
                       "tokenizer_mode": "hf"}
    assert seen[2]["tokenizer_mode"] == "mistral" and seen[2]["config_format"] == "hf"
