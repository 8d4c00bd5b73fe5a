"""Rotating a Llama's residual stream by an orthogonal matrix, folded into its weights (QuaRot / SpinQuant's R1).

The hidden state h of every token is replaced by h Q (Q orthogonal, d x d). Each RMSNorm's weight first moves into
the linears that read its output (W diag(gamma)), which leaves a weightless norm, and norm(h Q) = norm(h) Q since Q
keeps lengths. Then every linear that reads the residual stream takes W Q (q, k, v, gate, up), every one that
writes it takes Q^T W (o, down), the embedding E Q, and the head E diag(gamma_final) Q: the model computes the same
function (up to the BF16 rounding of the rotated tensors), in a basis where no channel stands out. Outlier channels
are what per-token INT8 activations and group-wise INT4 weights lose most on; a rotation spreads them over all
channels. The checkpoint stays a plain Llama: the head becomes its own tensor (tie_word_embeddings false), the
norms' weights are ones.

Q = diag(signs) (H ⊗ R) for d = 2^a * b: H the normalized Sylvester-Hadamard matrix of order 2^a, R a random
orthogonal b x b (from the QR of a Gaussian matrix), signs random; seeded, so a recipe is reproducible.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from anychip.checkpoint.io import copy_side_files, weight_files
from anychip.checkpoint.layout import FAMILIES, check_architecture
from anychip.checkpoint.scheme import ContractError

_READS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_READS_MLP = ("mlp.gate_proj", "mlp.up_proj")
_WRITES = ("self_attn.o_proj", "mlp.down_proj")


def orthogonal(d: int, seed: int) -> torch.Tensor:
    """A seeded d x d orthogonal matrix (fp64): diag(random signs) (Hadamard(2^a) ⊗ random orthogonal(b))."""
    gen = torch.Generator().manual_seed(seed)
    a = (d & -d).bit_length() - 1  # the power of two in d
    b = d >> a
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(a):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h /= (1 << a) ** 0.5
    if b > 1:
        q, r = torch.linalg.qr(torch.randn(b, b, generator=gen, dtype=torch.float64))
        r_orth = q * torch.sign(torch.diagonal(r))  # Haar-distributed
    else:
        r_orth = torch.ones(1, 1, dtype=torch.float64)
    signs = torch.randint(0, 2, (d,), generator=gen).double() * 2 - 1
    return signs[:, None] * torch.kron(h, r_orth.contiguous())


def rotate_llama(src: str | Path, dst: str | Path, seed: int = 0) -> Path:
    """Write the BF16 Llama in `src` rotated by `orthogonal(hidden, seed)` to `dst` (BF16 safetensors, the config
    with an untied head, the tokenizer and other side files copied). Returns dst."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    # Every supported family's residual stream is Llama's: q/k/v biases act after the rotated input, Qwen3's q/k
    # norms on each head's output; only biases of o_proj / down_proj (which write the stream) rotate.
    arch = check_architecture(config, f"{src}/config.json")
    family = FAMILIES[arch]
    if not family.rotatable:
        why = "its RMSNorms apply 1 + w" + (", and each block's output is normalized before the residual add (a "
                                            "rotation does not pass through that norm)" if family.post_mlp_norm else "")
        raise ContractError(f"{src}/config.json: {arch}: {why}; the residual rotation is not done for it (quantize it "
                            "without --rotate)")
    dst.mkdir(parents=True, exist_ok=False)
    tensors: dict[str, torch.Tensor] = {}  # rotated in place, tensor by tensor: the model is held once
    for f in weight_files(src):
        with safe_open(str(f), framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    d = int(config["hidden_size"])
    q = orthogonal(d, seed)

    def read(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:  # W diag(gamma) Q
        return ((w.double() * gamma.double()) @ q).to(torch.bfloat16)

    embed = tensors["model.embed_tokens.weight"]
    head = tensors.get("lm_head.weight", embed)
    tensors["lm_head.weight"] = read(head, tensors["model.norm.weight"])
    tensors["model.embed_tokens.weight"] = (embed.double() @ q).to(torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        for norm, names in (("input_layernorm", _READS), ("post_attention_layernorm", _READS_MLP)):
            gamma = tensors[p + norm + ".weight"]
            for name in names:
                tensors[p + name + ".weight"] = read(tensors[p + name + ".weight"], gamma)
            tensors[p + norm + ".weight"] = torch.ones(d, dtype=torch.bfloat16)
        for name in _WRITES:
            tensors[p + name + ".weight"] = (q.T @ tensors[p + name + ".weight"].double()).to(torch.bfloat16)
            if p + name + ".bias" in tensors:
                tensors[p + name + ".bias"] = (tensors[p + name + ".bias"].double() @ q).to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(src, dst)
    return dst
