"""Where every tensor of a W4A8 decoder checkpoint (Llama and the families that share its layer) lives and what
shape it has.

One place for the names and shapes, so that `quantize`, `prepare --synthetic` and `verify` agree by
construction: the writers emit `linear_tensor_specs(...)` and the verifier expects exactly them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from anychip.checkpoint.scheme import DECODER_LINEARS, GROUP_SIZES, ContractError, W4A8Scheme
from anychip.formats import PACK_FACTOR

#: "model.layers.3.mlp.down_proj.weight" -> layer 3, linear "mlp.down_proj".
_LINEAR_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.(" + "|".join(map(re.escape, DECODER_LINEARS)) + r")\.weight$")
#: "model.layers.3.<rest>" -> layer 3, "<rest>".
_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a writer promises to emit: name, dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


_ATTN_IN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _llama_biases(config: dict[str, Any]) -> tuple[str, ...]:
    """transformers' and vLLM's Llama: `attention_bias` gives q, k, v and o a bias, `mlp_bias` gate, up and down."""
    return ((_ATTN_IN + ("self_attn.o_proj",) if config.get("attention_bias") else ())
            + (_MLP if config.get("mlp_bias") else ()))


def _qwen3_biases(config: dict[str, Any]) -> tuple[str, ...]:
    if config.get("attention_bias"):
        # transformers' Qwen3 then biases o_proj too, vLLM's does not: the checkpoint would not serve as trained.
        raise ContractError("Qwen3ForCausalLM with attention_bias=true: vLLM's Qwen3 has no o_proj bias where "
                            "transformers' has one, so this model would not serve as it was trained")
    return ()


def _attention_biases(config: dict[str, Any]) -> tuple[str, ...]:
    """Gemma 2 and 3's `attention_bias`: q, k, v and o (in transformers' model and vLLM's alike); no MLP bias."""
    return _ATTN_IN + ("self_attn.o_proj",) if config.get("attention_bias") else ()


def _gemma_biases(config: dict[str, Any]) -> tuple[str, ...]:
    if config.get("attention_bias"):
        raise ContractError("GemmaForCausalLM with attention_bias=true: vLLM's Gemma has no attention biases where "
                            "transformers' has them, so this model would not serve as it was trained")
    return ()


#: The RMSNorms of a Llama layer: before attention, before the MLP.
LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")
#: Gemma 2 and 3's "sandwich" norms: each block's output is normalized too before it joins the residual stream.
SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")


@dataclass(frozen=True)
class Family:
    """A decoder architecture whose layer has Llama's linears (q, k, v, o, gate, up, down under the same names,
    rotary GQA attention, a gated MLP whose output is linear in up_proj) and differs in:

    - `biases`: which linears carry a bias, given config.json;
    - `head_norms`: a per-head RMSNorm on q and k (Qwen3, Gemma 3);
    - `norms`: the layer's RMSNorms; `mlp_norm` is the one whose output gate/up read (its input is the residual
      stream), `post_mlp_norm` one applied to down_proj's output before it joins the residual (Gemma 2 / 3);
    - `norm_offset`: the norm multiplies by (offset + weight): Gemma's RMSNorm stores w and applies 1 + w;
    - `residual_multiplier`: each block's output is scaled before the residual add by the decoder layer's
      `residual_multiplier` (Granite; also embedding, attention and logit multipliers, which no quantizer step
      touches);
    - `rotatable`: whether a residual rotation (rotate.py) keeps the function: not with norms inside the
      residual branches, whose per-channel weights do not commute with a rotation;
    - `tied_by_default`: what a config.json that leaves `tie_word_embeddings` out means (transformers' default for
      the architecture: true for Gemma, whose configs saved by transformers 4 omit it)."""

    biases: Callable[[dict[str, Any]], tuple[str, ...]]
    head_norms: bool = False
    norms: tuple[str, ...] = LLAMA_NORMS
    mlp_norm: str = "post_attention_layernorm"
    post_mlp_norm: str | None = None
    norm_offset: float = 0.0
    residual_multiplier: bool = False
    rotatable: bool = True
    tied_by_default: bool = False


#: The architectures anychip quantizes and verifies, by config.json's `architectures` entry.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(_llama_biases),
    "MistralForCausalLM": Family(lambda config: ()),
    "Qwen2ForCausalLM": Family(lambda config: _ATTN_IN),  # q, k, v always biased, o never
    "Qwen3ForCausalLM": Family(_qwen3_biases, head_norms=True),
    # Granite: Llama's layer and biases, scalar multipliers (a rotation passes them)
    "GraniteForCausalLM": Family(_llama_biases, residual_multiplier=True),
    # Gemma: GELU-tanh gated MLP, (1 + w) RMSNorms, the embedding scaled by sqrt(hidden) (the runtimes' business)
    "GemmaForCausalLM": Family(_gemma_biases, norm_offset=1.0, rotatable=False, tied_by_default=True),
    # Gemma 2 and text-only Gemma 3 (model_type gemma3_text): sandwich norms, sliding-window and global layers;
    # Gemma 2's logit soft-capping and Gemma 3's q/k norms
    "Gemma2ForCausalLM": Family(_attention_biases, norms=SANDWICH_NORMS, mlp_norm="pre_feedforward_layernorm",
                                post_mlp_norm="post_feedforward_layernorm", norm_offset=1.0, rotatable=False,
                                tied_by_default=True),
    "Gemma3ForCausalLM": Family(_attention_biases, head_norms=True, norms=SANDWICH_NORMS,
                                mlp_norm="pre_feedforward_layernorm", post_mlp_norm="post_feedforward_layernorm",
                                norm_offset=1.0, rotatable=False, tied_by_default=True),
}


def is_tied(config: dict[str, Any]) -> bool:
    """Whether the output head is the embedding: config.json's tie_word_embeddings, else the architecture's
    default (Family.tied_by_default)."""
    return bool(config.get("tie_word_embeddings", family_of(config).tied_by_default))


def family_of(config: dict[str, Any]) -> Family:
    """The Family config.json names (a plain Llama when it names none: check_architecture refuses those)."""
    archs = config.get("architectures")
    family = FAMILIES.get(archs[0]) if isinstance(archs, list) and len(archs) == 1 else None
    return family or FAMILIES["LlamaForCausalLM"]


def check_architecture(config: dict[str, Any], where: str = "config.json") -> str:
    """The one supported architecture config.json names; ContractError otherwise."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in FAMILIES:
        raise ContractError(f"{where}: architectures {archs}: anychip covers decoders with Llama's linears, one of "
                            f"{', '.join(FAMILIES)}")
    return archs[0]


@dataclass(frozen=True)
class DecoderDims:
    """The dimensions of a decoder's config.json that fix every tensor shape, and the family's extra tensors:
    `biased` lists the linears (DECODER_LINEARS names) that carry a BF16 bias, `head_norms` the q/k norms,
    `norms` the RMSNorms of every layer.
    A config naming no supported architecture reads as a plain Llama (check_architecture refuses it)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    biased: tuple[str, ...] = ()
    head_norms: bool = False
    norms: tuple[str, ...] = LLAMA_NORMS

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str = "config.json") -> DecoderDims:
        family = family_of(config)

        def whole(key: str, default: int | None = None) -> int:
            """config[key], a whole number >= 1 (a string, float, bool, 0 or a negative number is a damaged config,
            which would otherwise surface as a division by zero or a wrong shape after every tensor was written)."""
            value = config.get(key) if default is not None else config[key]
            if value is None and default is not None:
                return default
            if type(value) is not int or value < 1:
                raise ContractError(f"{key} is {value!r}: a whole number of at least 1 is expected")
            return value

        try:
            hidden = whole("hidden_size")
            heads = whole("num_attention_heads")
            dims = cls(
                layers=whole("num_hidden_layers"),
                hidden=hidden,
                intermediate=whole("intermediate_size"),
                heads=heads,
                kv_heads=whole("num_key_value_heads", heads),
                head_dim=whole("head_dim", hidden // heads),
                vocab=whole("vocab_size"),
                tied=is_tied(config),
                biased=family.biases(config),
                head_norms=family.head_norms,
                norms=family.norms,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ContractError):
                raise ContractError(f"{where}: {exc}") from None
            raise ContractError(f"{where}: missing or malformed decoder field {exc}") from exc
        return dims

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) = (out_features, in_features) of each decoder linear."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "self_attn.q_proj": (q, self.hidden),
            "self_attn.k_proj": (kv, self.hidden),
            "self_attn.v_proj": (kv, self.hidden),
            "self_attn.o_proj": (self.hidden, q),
            "mlp.gate_proj": (self.intermediate, self.hidden),
            "mlp.up_proj": (self.intermediate, self.hidden),
            "mlp.down_proj": (self.hidden, self.intermediate),
        }

    def merged_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each decoder linear as vLLM runs it, q/k/v and gate/up merged."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"qkv_proj": (q + 2 * kv, self.hidden), "o_proj": (self.hidden, q),
                "gate_up_proj": (2 * self.intermediate, self.hidden), "down_proj": (self.hidden, self.intermediate)}


def parse_linear_weight(name: str) -> tuple[int, str] | None:
    """(layer index, linear) for a decoder linear's BF16 weight name, else None."""
    m = _LINEAR_WEIGHT.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def parse_layer_tensor(name: str) -> tuple[int, str] | None:
    """(layer index, the name's rest) for any tensor of a decoder layer ("model.layers.7.mlp.down_proj.weight_packed"
    -> (7, "mlp.down_proj.weight_packed")), else None."""
    m = _LAYER_TENSOR.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def linear_prefix(layer: int, linear: str) -> str:
    return f"model.layers.{layer}.{linear}"


def group_size_error(prefix: str, k: int, group_size: int) -> ContractError:
    """The error for K not divisible by the group size; names the layer and the sizes that would work."""
    fits = [g for g in GROUP_SIZES if k % g == 0]
    if not fits:
        fix = (f"no supported group size ({', '.join(map(str, GROUP_SIZES))}) divides it, so this model has no "
               f"W4A8 form anychip's kernels serve (its K must be a multiple of {min(GROUP_SIZES)}); serve it in "
               "BF16 with stock vLLM")
    else:
        fix = f"quantize with --group-size {fits[-1]}"
        if len(fits) > 1:
            fix += f" (or {', '.join(map(str, fits[:-1]))})"
    return ContractError(f"{prefix}: K={k} is not divisible by group size {group_size}: {fix}")


def linear_tensor_specs(prefix: str, n: int, k: int, scheme: W4A8Scheme) -> list[TensorSpec]:
    """The tensors one quantized linear (N, K) is stored as, in the order they are written."""
    if k % scheme.group_size:
        raise group_size_error(prefix, k, scheme.group_size)
    scale = TensorSpec(f"{prefix}.weight_scale", torch.bfloat16, (n, k // scheme.group_size))
    if scheme.format == "pack-quantized":
        return [
            TensorSpec(f"{prefix}.weight_packed", torch.int32, (n, k // PACK_FACTOR)),  # 8 nibbles per word
            scale,
            TensorSpec(f"{prefix}.weight_shape", torch.int64, (2,)),  # [N, K]
        ]
    return [TensorSpec(f"{prefix}.weight", torch.int8, (n, k)), scale]


def bf16_tensor_specs(dims: DecoderDims) -> list[TensorSpec]:
    """The BF16 tensors of a checkpoint other than the decoder linears and their biases (norms, embedding,
    lm_head)."""
    specs = [TensorSpec("model.embed_tokens.weight", torch.bfloat16, (dims.vocab, dims.hidden))]
    for i in range(dims.layers):
        for norm in dims.norms:
            specs.append(TensorSpec(f"model.layers.{i}.{norm}.weight", torch.bfloat16, (dims.hidden,)))
        if dims.head_norms:
            for norm in ("self_attn.q_norm", "self_attn.k_norm"):
                specs.append(TensorSpec(f"model.layers.{i}.{norm}.weight", torch.bfloat16, (dims.head_dim,)))
    specs.append(TensorSpec("model.norm.weight", torch.bfloat16, (dims.hidden,)))
    if not dims.tied:
        specs.append(TensorSpec("lm_head.weight", torch.bfloat16, (dims.vocab, dims.hidden)))
    return specs


def tensor_order(name: str) -> tuple[int, int, str]:
    """Sort key: embedding, then layer by layer (linears in DECODER_LINEARS order), then final norm, lm_head."""
    if name.startswith("model.embed_tokens."):
        return (0, 0, name)
    parsed = parse_layer_tensor(name)
    if parsed:
        layer, rest = parsed
        rank = next((i for i, lin in enumerate(DECODER_LINEARS) if rest.startswith(lin + ".")), len(DECODER_LINEARS))
        return (1, layer, f"{rank:02d}{rest}")
    return (2 if name.startswith("model.") else 3, 0, name)
