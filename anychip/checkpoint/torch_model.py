"""A W4A8 checkpoint run by plain transformers, its quantized linears on the torch reference.

The oracle for end-to-end checks: the same weights vLLM serves through anychip, with none of vLLM or our kernels
involved (activations quantized per token by reference.quantize_activations_ref, INT32 group sums exact).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from anychip.checkpoint.model_dir import ModelDir
from anychip.formats import unpack_int4
from anychip.kernels.reference import w4a8_linear_dynamic_ref


class ReferenceW4A8Linear(torch.nn.Module):
    def __init__(self, wq: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("wq", wq)  # (N, K) int8 in [-8, 7]
        self.register_buffer("scales", scales)  # (N, K // G)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w4a8_linear_dynamic_ref(x, self.wq, self.scales, self.bias)


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors files, by name."""
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def read_quantized_linears(model_dir: str | Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]],
                                                             dict[str, torch.Tensor]]:
    """({linear prefix: (wq (N, K) int8, scales (N, K // G))}, {other tensor name: tensor}) of a W4A8 directory,
    in either format."""
    tensors = read_tensors(Path(model_dir))
    quantized = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_scale")}
    linears = {}
    for prefix in sorted(quantized):
        if f"{prefix}.weight_packed" in tensors:
            n, k = (int(v) for v in tensors[f"{prefix}.weight_shape"].tolist())
            wq = unpack_int4(tensors[f"{prefix}.weight_packed"], k)
        else:
            wq = tensors[f"{prefix}.weight"]
        linears[prefix] = (wq, tensors[f"{prefix}.weight_scale"])
    # a quantized linear's own tensors are weight_packed / weight_shape / weight_scale (or weight); its bias, which
    # shares the prefix, stays BF16 and dense
    dense = {k: v for k, v in tensors.items()
             if not (k.rsplit(".", 1)[0] in quantized and k.rsplit(".", 1)[1].startswith("weight"))}
    return linears, dense


def load_reference_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """transformers LlamaForCausalLM with every quantized linear replaced by ReferenceW4A8Linear."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    ModelDir.open(model_dir).require_scheme()  # refuses non-W4A8 checkpoints with a clear message
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)  # an oracle: plain CPU init is fine
    linears, dense = read_quantized_linears(model_dir)
    for prefix, (wq, scales) in linears.items():
        parent_name, child = prefix.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), child,
                ReferenceW4A8Linear(wq, scales.float(), dense.pop(f"{prefix}.bias", None)))
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    missing = [m for m in missing if not m.endswith((".wq", ".scales"))]
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.to(dtype)  # assign=True put the checkpoint's BF16 tensors in place of the model's `dtype` ones
    for module in model.modules():
        if isinstance(module, ReferenceW4A8Linear):
            module.scales = module.scales.float()  # the W4A8 arithmetic's own, whatever the rest's dtype
    return model.eval()
