"""The decoder families anychip quantizes besides Llama (layout.FAMILIES): Mistral, Qwen2 (q/k/v biases), Qwen3
(per-head q/k norms) and Llama with attention / MLP biases, each a tiny random model made by transformers.

What the families change is which BF16 tensors sit beside the INT4 linears; each test states what a wrong
handling of them would do. The vLLM test serves every family through the plugin and compares prompt logprobs
position by position with the torch reference on the same checkpoint (tests/vllm_runner.py, as a user's LLM(...)
call): measured here, max 0.007-0.015 and mean 0.002-0.004 nats over 47 positions; a bias or norm dropped or
applied twice, or a layout error, moves them by tenths of a nat or more.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from anychip.checkpoint.layout import FAMILIES, LLAMA_NORMS
from anychip.checkpoint.quantize import quantize_checkpoint
from anychip.checkpoint.scheme import ContractError, W4A8Scheme
from anychip.checkpoint.torch_model import read_tensors
from anychip.checkpoint.verify import verify_checkpoint
from anychip.coverage import check

ROOT = Path(__file__).resolve().parents[1]
# hidden 128 over 4 heads: head_dim 32, the smallest vLLM's CPU attention serves (16 is refused)
FAMILY_MODELS = {
    "llama-biased": dict(architecture="LlamaForCausalLM", hidden_size=128, attention_bias=True, mlp_bias=True),
    "mistral": dict(architecture="MistralForCausalLM", hidden_size=128),
    "qwen2": dict(architecture="Qwen2ForCausalLM", hidden_size=128),
    "qwen3": dict(architecture="Qwen3ForCausalLM", hidden_size=128, head_dim=64),  # q width 256 != hidden
    # the multipliers far from 1, so that one left out of GPTQ's layer replay or the GGUF shows
    "granite": dict(architecture="GraniteForCausalLM", hidden_size=128, embedding_multiplier=6.0,
                    residual_multiplier=0.3, attention_multiplier=0.05, logits_scaling=4.0),
    "gemma": dict(architecture="GemmaForCausalLM", hidden_size=128, head_dim=32),
    # a sliding-window layer (16 positions, shorter than the prompts) and a global one (Gemma 3: with its own rotary)
    "gemma2": dict(architecture="Gemma2ForCausalLM", hidden_size=128, head_dim=32, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"]),
    "gemma3": dict(architecture="Gemma3ForCausalLM", hidden_size=128, head_dim=32, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"]),
}
# token ids, not text: transformers reads a Qwen2/Qwen3 directory's tokenizer as Qwen2Tokenizer whatever it is, which
# splits the tiny word-level vocabulary's text into a few tokens
PROMPT_IDS = [(i * 37) % 97 for i in range(48)]


def _extras(arch: str, config: dict) -> set[str]:
    """The layer-0 BF16 tensors the family adds to Llama's."""
    out = {f"model.layers.0.{lin}.bias" for lin in FAMILIES[arch].biases(config)}
    out |= {f"model.layers.0.{norm}.weight" for norm in FAMILIES[arch].norms if norm not in LLAMA_NORMS}
    if FAMILIES[arch].head_norms:
        out |= {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"}
    return out


def _rewrite(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the weights of a (copied) checkpoint and its SHA256SUMS, so only the contract can object."""
    from anychip.checkpoint.manifest import write_manifest

    for f in directory.glob("*.safetensors"):
        f.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_manifest(directory)


@pytest.fixture(scope="module")
def family(tiny_llama, tmp_path_factory):
    """family(name) -> (BF16 dir, W4A8 G32 RTN dir), made once per family."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(name: str) -> tuple[Path, Path]:
        if name not in made:
            src = tiny_llama(**FAMILY_MODELS[name])
            made[name] = src, quantize_checkpoint(src, tmp_path_factory.mktemp(name) / "w4a8", W4A8Scheme(32))
        return made[name]

    return make


@pytest.mark.parametrize("name", list(FAMILY_MODELS))
def test_each_family_quantizes_with_its_own_bf16_tensors(family, name):
    """The family's biases and head norms are written BF16 with the source's values, and verify names the
    architecture; a quantizer that dropped them (as Llama's contract did) would fail verify or lose the bias."""
    src, dst = family(name)
    config = json.loads((src / "config.json").read_text())
    arch = config["architectures"][0]
    extras = _extras(arch, config)
    assert extras or arch in ("MistralForCausalLM", "GemmaForCausalLM", "GraniteForCausalLM")
    report = verify_checkpoint(dst)
    assert report.architecture == arch and report.num_linears == 7 * config["num_hidden_layers"]
    source, stored = read_tensors(src), read_tensors(dst)
    for name_ in extras:
        assert stored[name_].dtype == torch.bfloat16 and torch.equal(stored[name_], source[name_]), name_


@pytest.mark.parametrize("name", ["qwen2", "llama-biased"])
def test_the_reference_model_applies_the_checkpoints_biases(family, name):
    """The torch oracle (load_reference_model: `anychip eval --engine torch`, and what the vLLM tests compare with)
    takes each quantized linear's BF16 bias from the checkpoint. It once dropped them: a bias shares its linear's
    prefix, and the filter that set the quantized tensors apart took it too, silently (the loader's strict check
    never saw it). The tiny sources' biases are non-zero, so an oracle without them gives other logits."""
    from anychip.checkpoint.torch_model import load_reference_model

    _, dst = family(name)
    stored = read_tensors(dst)
    model = load_reference_model(dst)
    biased = [n for n in stored if n.endswith(".bias")]
    assert biased
    for tensor_name in biased:
        prefix = tensor_name.removesuffix(".bias")
        bias = model.get_submodule(prefix).bias
        assert bias is not None and torch.equal(bias.to(torch.bfloat16), stored[tensor_name]), tensor_name
        assert stored[tensor_name].abs().max() > 0.1, tensor_name
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        before = model(ids).logits.float().log_softmax(-1)
        for tensor_name in biased:
            model.get_submodule(tensor_name.removesuffix(".bias")).bias = None
        after = model(ids).logits.float().log_softmax(-1)
    # measured: 0.46 nats mean over the prompt for both families, far beyond the vLLM test's tolerance (0.03 mean),
    # so that test (vLLM against this oracle) fails for a plugin that drops biases
    assert (after - before).abs().gather(-1, ids[:, 1:, None]).mean() > 0.1


def test_the_reference_model_is_built_in_the_dtype_asked_for(family):
    """load_reference_model(dtype=float32) once gave BF16 (load_state_dict(assign=True) put the checkpoint's
    tensors in place); the W4A8 arithmetic's scales stay fp32 either way."""
    from anychip.checkpoint.torch_model import ReferenceW4A8Linear, load_reference_model

    _, dst = family("qwen2")
    for dtype in (torch.float32, torch.bfloat16):
        model = load_reference_model(dst, dtype=dtype)
        floats = {p.dtype for n, p in model.named_parameters()}
        assert floats == {dtype}, floats
        linears = [m for m in model.modules() if isinstance(m, ReferenceW4A8Linear)]
        assert linears and all(m.scales.dtype == torch.float32 and m.wq.dtype == torch.int8 for m in linears)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3", "qwen2"])
def test_a_config_without_tie_word_embeddings_takes_the_architectures_default(family, name, tmp_path):
    """transformers 4 leaves tie_word_embeddings out of a Gemma config.json (google/gemma-2b's has none), and
    transformers reads it as true for Gemma, false for the others: quantize and verify read it the same way."""
    from anychip.checkpoint.layout import is_tied

    src, _ = family(name)
    config = json.loads((src / "config.json").read_text())
    bare = Path(shutil.copytree(src, tmp_path / "bare"))
    tied = config.pop("tie_word_embeddings")
    (bare / "config.json").write_text(json.dumps(config))
    assert is_tied(config) is name.startswith("gemma")
    if tied is not name.startswith("gemma"):
        # a tied source without the key reads as untied, as transformers reads it: no lm_head tensor to quantize
        # beside, which must be named up front rather than a model served with a missing head
        with pytest.raises(ContractError, match='lm_head.weight is missing.*"tie_word_embeddings": true'):
            quantize_checkpoint(bare, tmp_path / "w4a8", W4A8Scheme(32))
        return
    dst = quantize_checkpoint(bare, tmp_path / "w4a8", W4A8Scheme(32))
    assert verify_checkpoint(dst).architecture == config["architectures"][0]


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama-biased", "gemma2", "gemma3"])
def test_verify_wants_exactly_the_familys_tensors(family, name, tmp_path):
    """A missing bias or head norm, and a bias the config does not give, are contract errors naming the tensor."""
    _, dst = family(name)
    config = json.loads((dst / "config.json").read_text())
    extra = sorted(_extras(config["architectures"][0], config))[0]
    missing = Path(shutil.copytree(dst, tmp_path / "missing"))
    tensors = read_tensors(missing)
    del tensors[extra]
    _rewrite(missing, tensors)
    with pytest.raises(ContractError, match=extra.replace(".", r"\.") + " is missing"):
        verify_checkpoint(missing)
    stray = Path(shutil.copytree(dst, tmp_path / "stray"))
    tensors = read_tensors(stray)
    n = tensors["model.layers.1.mlp.down_proj.weight_shape"].tolist()[0]
    if "model.layers.1.mlp.down_proj.bias" in tensors:  # llama with mlp_bias: every linear has one already
        config["mlp_bias"] = False
        (stray / "config.json").write_text(json.dumps(config))
    else:
        tensors["model.layers.1.mlp.down_proj.bias"] = torch.zeros(n, dtype=torch.bfloat16)
    _rewrite(stray, tensors)
    with pytest.raises(ContractError, match=r"model\.layers\.\d\.mlp\.\w+_proj\.bias.*does not give this linear"):
        verify_checkpoint(stray)


def test_other_architectures_are_refused_by_name(tiny_llama, copy_dir, tmp_path):
    src = copy_dir(tiny_llama())
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"architectures": ["Phi3ForCausalLM"]}))
    with pytest.raises(ContractError, match=r"Phi3ForCausalLM.*LlamaForCausalLM, MistralForCausalLM, "
                                            r"Qwen2ForCausalLM, Qwen3ForCausalLM, GraniteForCausalLM, "
                                            r"GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM"):
        quantize_checkpoint(src, tmp_path / "out", W4A8Scheme(32))
    (src / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3ForCausalLM"],
                                                          "attention_bias": True}))
    with pytest.raises(ContractError, match="o_proj bias"):
        quantize_checkpoint(src, tmp_path / "out", W4A8Scheme(32))
    (src / "config.json").write_text(json.dumps(config | {"architectures": ["GemmaForCausalLM"],
                                                          "attention_bias": True}))
    with pytest.raises(ContractError, match="no attention biases"):
        quantize_checkpoint(src, tmp_path / "out", W4A8Scheme(32))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", list(FAMILY_MODELS))
def test_gptq_smoothing_and_rotation_keep_each_familys_function(tiny_llama, name, tmp_path):
    """GPTQ (with its default smoothing, which divides biases where it folds into a biased producer, and folds
    into Gemma's 1 + w norms and its pre-MLP norm) and the residual rotation run on the family's layer. The
    rotated BF16 model computes the source's function (measured: max |d logprob| 0.005-0.008 over 40 positions; a
    bias rotated that should not be, or a head norm folded, gives tenths); Gemma 3, whose block outputs are
    normalized, is refused a rotation. The GPTQ checkpoint, on the torch reference, stays near the BF16 model
    (measured KL 0.0015-0.0035 nats a position; a bias or norm lost is about 1 nat on these models)."""
    from transformers import AutoModelForCausalLM

    from anychip.checkpoint.gptq import gptq_quantizer
    from anychip.checkpoint.rotate import rotate_llama
    from anychip.checkpoint.torch_model import load_reference_model

    src = tiny_llama(**FAMILY_MODELS[name])
    ids = torch.tensor([[(i * 37) % 97 for i in range(40)]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits.log_softmax(-1)
        if not FAMILIES[FAMILY_MODELS[name]["architecture"]].rotatable:
            with pytest.raises(ContractError, match="without --rotate"):
                rotate_llama(src, tmp_path / "rot")
            assert not (tmp_path / "rot").exists()
        else:
            rotated = AutoModelForCausalLM.from_pretrained(rotate_llama(src, tmp_path / "rot"), dtype=torch.float32)
            assert float((rotated.eval()(ids).logits.log_softmax(-1) - base).abs().max()) < 0.05
        text = tmp_path / "calib.txt"
        text.write_text(" ".join(f"w{(i * 7) % 97}" for i in range(2000)))
        scheme = W4A8Scheme(group_size=32)
        dst = quantize_checkpoint(src, tmp_path / "gptq", scheme,
                                  gptq_quantizer(src, scheme, calibration=text, samples=8, seq_len=64), method="gptq")
        recipe = json.loads((dst / "config.json").read_text())["quantization_config"]["anychip"]["recipe"]
        assert recipe["bf16_changed_tensors"]  # smoothing folded somewhere: the path under test ran
        out = load_reference_model(dst, torch.float32)(ids).logits.log_softmax(-1)
    kl = float((base.exp() * (base - out)).sum(-1).mean())
    assert kl < 0.03, kl


@pytest.mark.parametrize("name", list(FAMILY_MODELS))
def test_gptq_layer_outputs_are_the_quantized_layers_outputs(tiny_llama, name):
    """GPTQ hands the next layer the quantized layer's outputs without another forward (residual + the MLP's
    output, through Gemma's post-MLP norm, times Granite's residual multiplier): they must be what the layer with
    its quantized weights computes."""
    from transformers import AutoModelForCausalLM

    from anychip.checkpoint.calibration import layer_inputs
    from anychip.checkpoint.gptq import DEFAULT_GPTQ, _quantize_layer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama(**FAMILY_MODELS[name]), dtype=torch.float32).eval()
    family = FAMILIES[FAMILY_MODELS[name]["architecture"]]
    with torch.no_grad():
        xs, kwargs = layer_inputs(model, torch.tensor([[(i * 37) % 97 for i in range(40)]]), torch.device("cpu"))
        xs = [model.model.layers[0](xs[0], **kwargs[0])]  # layer 1's input
        layer = model.model.layers[1]
        _, outs = _quantize_layer(layer, xs, kwargs[1], W4A8Scheme(32), DEFAULT_GPTQ, family)
        want = layer(xs[0], **kwargs[1])
    assert torch.allclose(outs[0], want, atol=1e-5, rtol=1e-5), float((outs[0] - want).abs().max())


@pytest.mark.parametrize("name", ["gemma", "gemma3", "qwen2"])
def test_smoothing_folds_keep_the_layer_function(tiny_llama, name):
    """Each smoothing point folded with random factors leaves the decoder layer's output as it was: into the
    family's MLP norm (Gemma 3: pre_feedforward_layernorm, whose 1 + w must become (1 + w) / s, stored in BF16),
    and a factor so large that the stored 1 + w would round to 0 leaves that channel alone."""
    from transformers import AutoModelForCausalLM

    from anychip.checkpoint.calibration import layer_inputs
    from anychip.checkpoint.smooth import POINT_NAMES, apply_point, points_named

    model = AutoModelForCausalLM.from_pretrained(tiny_llama(**FAMILY_MODELS[name]), dtype=torch.float32).eval()
    family = FAMILIES[FAMILY_MODELS[name]["architecture"]]
    torch.manual_seed(0)
    with torch.no_grad():
        xs, kwargs = layer_inputs(model, torch.tensor([[(i * 37) % 97 for i in range(40)]]), torch.device("cpu"))
        layer = model.model.layers[1]
        before = layer(xs[0], **kwargs[1])
        for point in points_named(POINT_NAMES, family):
            k = layer.get_submodule(point.linears[0]).in_features if point.norm else \
                layer.get_submodule(point.producer).out_features
            s = torch.empty(k).uniform_(0.25, 4.0)
            s[0] = 1e4
            if point.norm:
                old = layer.get_submodule(point.norm).weight.detach().clone()
            changed = apply_point(layer, point, s)
            if point.norm:
                assert changed == [f"{point.norm}.weight"]
                new = layer.get_submodule(point.norm).weight
                assert not torch.equal(new[1:], old[1:]), point.name
                assert torch.equal(new, new.bfloat16().float())  # what the checkpoint can hold
                if point.norm_offset:  # 1 + w' = (1 + w) / 1e4 rounds w' to -1: the channel is left alone
                    assert new[0] == old[0], point.name
        after = layer(xs[0], **kwargs[1])
    # a v_proj / up_proj bias / s is stored in BF16 (what the checkpoint holds), 2^-9 of it lost, then o_proj /
    # down_proj multiply it back by s: biases of 0.5 move the output by a few 1e-4 (the weights stay fp32 here)
    tol = 2e-3 if FAMILY_MODELS[name].get("attention_bias") or FAMILY_MODELS[name].get("mlp_bias") or \
        name == "qwen2" else 1e-4
    assert torch.allclose(after, before, atol=tol, rtol=1e-4), float((after - before).abs().max())
    assert [p.norm for p in points_named(("attn_in", "mlp_in"), family)] == ["input_layernorm", family.mlp_norm]


@pytest.mark.parametrize("name", list(FAMILY_MODELS))
def test_calibration_replays_each_layer_with_its_own_arguments(tiny_llama, name):
    """GPTQ runs the model layer by layer from captured inputs: each layer must get the arguments the model gives
    it (Gemma 3's sliding-window and global layers get different masks and rotary tables), so replaying the
    layers reproduces the model's forward. With layer 0's arguments for every layer, Gemma 3's global layer
    would attend through a 16-token window."""
    from transformers import AutoModelForCausalLM

    from anychip.checkpoint.calibration import layer_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_llama(**FAMILY_MODELS[name]), dtype=torch.float32).eval()
    batch = torch.tensor([[(i * 37 + j) % 97 for i in range(48)] for j in range(2)])
    with torch.no_grad():
        xs, kwargs = layer_inputs(model, batch, torch.device("cpu"))
        assert len(xs) == 2 and len(kwargs) == len(model.model.layers)
        for j, h in enumerate(xs):
            for layer, kw in zip(model.model.layers, kwargs):
                h = layer(h, **kw)
                h = h[0] if isinstance(h, tuple) else h
            want = model.model(batch[j:j + 1]).last_hidden_state
            assert torch.allclose(model.model.norm(h), want, atol=1e-5), (name, j)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("name", list(FAMILY_MODELS))
def test_each_family_serves_through_vllm_like_the_reference(family, name, mode, tmp_path):
    """vLLM's own model class for the family, the plugin's W4A8 routes: prompt logprobs position by position
    against the torch reference of the same checkpoint, and strict coverage of every linear. `compiled` is
    vLLM's default mode (torch.compile; on a GPU also CUDA graphs and anychip's norm-fusion pass, which then
    carries the family's biases into the fused kernels)."""
    from anychip.checkpoint.torch_model import load_reference_model

    _, dst = family(name)
    out, cov = tmp_path / "out.json", tmp_path / "coverage.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "ANYCHIP_COVERAGE": str(cov)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_runner.py"), str(dst), str(out),
                           "--max-tokens", "2", "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--prompt-logprobs",
                           "--max-model-len", "256", *(["--compile"] if mode == "compiled" else [])],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["quantization"] == "anychip-w4a8"
    row = result["outputs"][0]
    assert row["prompt_token_ids"] == PROMPT_IDS
    ids = torch.tensor([row["prompt_token_ids"]])
    with torch.no_grad():
        logp = load_reference_model(dst)(ids).logits[0].float().log_softmax(-1)
    ref = [float(logp[i, t]) for i, t in enumerate(row["prompt_token_ids"][1:])]
    diffs = [abs(a - b) for a, b in zip(ref, row["prompt_logprobs"], strict=True)]
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.03, (max(diffs), sum(diffs) / len(diffs))
    layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    doc = json.loads(cov.read_text())
    assert check(doc, expect_linears=4 * layers, group_size=32) == []  # strict: no reference route


def test_the_tiny_writer_makes_each_family(tiny_llama):
    """The fixture itself: each family's model has its architecture and extra tensors (else the tests above
    would test Llama four times)."""
    for name, spec in FAMILY_MODELS.items():
        src = tiny_llama(**spec)
        config = json.loads((src / "config.json").read_text())
        assert config["architectures"] == [spec["architecture"]], name
        assert _extras(spec["architecture"], config) <= set(read_tensors(src)), name



def test_layer_tensor_names_and_checkpoint_order():
    """One parser reads a decoder tensor's layer index (any module, any suffix); the checkpoint order puts the
    embedding first, then each layer (its linears in DECODER_LINEARS order, by layer number, not by string), then the
    final norm and the head."""
    from anychip.checkpoint.layout import parse_layer_tensor, tensor_order

    assert parse_layer_tensor("model.layers.7.mlp.down_proj.weight_packed") == (7, "mlp.down_proj.weight_packed")
    assert parse_layer_tensor("model.layers.x.mlp.weight") is None
    assert parse_layer_tensor("model.norm.weight") is None
    names = ["lm_head.weight", "model.norm.weight", "model.layers.10.self_attn.q_proj.weight",
             "model.layers.2.mlp.down_proj.weight", "model.layers.2.input_layernorm.weight",
             "model.layers.2.self_attn.q_proj.weight", "model.embed_tokens.weight"]
    assert sorted(names, key=tensor_order) == [
        "model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight",
        "model.layers.2.input_layernorm.weight", "model.layers.10.self_attn.q_proj.weight", "model.norm.weight",
        "lm_head.weight"]
