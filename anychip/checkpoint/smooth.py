"""Activation smoothing (SmoothQuant, Xiao et al., 2022) folded into the layer, searched per point (as AWQ does).

A per-input-channel factor s moves range from a linear's input to its weight: X W^T = (X / s)(W s)^T. The 1/s is
folded into whatever makes X, so the model computes the same function in exact arithmetic and the checkpoint
keeps the W4A8 contract (the weights W s are quantized as usual; the activations X / s are quantized per token at
run time). The four points of a Llama decoder layer:

    attn_in   input_layernorm.weight / s            -> q_proj, k_proj, v_proj columns * s
    attn_out  v_proj rows (and bias) / s             -> o_proj columns * s, one factor per (KV head, head dim)
                                                        shared by the query heads that read that KV head
    mlp_in    post_attention_layernorm.weight / s   -> gate_proj, up_proj columns * s
    mlp_out   up_proj rows (and bias) / s            -> down_proj columns * s (silu(gate) * up is linear in up)

In a family whose MLP reads another norm (Gemma 3's pre_feedforward_layernorm) mlp_in folds into that one; a
norm that multiplies by (1 + w) (Gemma's) gets w' with 1 + w' = (1 + w) / s (`points_named(..., family)`).
The embedding, the final norm and the head are never touched, so tied embeddings stay tied. The norm weights are
BF16 tensors of the checkpoint that then differ from the BF16 source; `anychip quantize` records which.

Per point, s = max|X|^a / max|W|^(1-a) (normalized to geometric mean 1) for each a in `alphas`, or s = 1; the one
kept minimizes sum over the point's linears of |X W^T - q8(X / s) q4(W s)^T|^2 on calibration inputs, with RTN
group scales and per-token INT8 activations: the arithmetic the checkpoint will be served with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from anychip.checkpoint.layout import FAMILIES, Family
from anychip.checkpoint.rtn import group_scales, quantize_with_scales
from anychip.kernels.reference import quantize_activations_ref


@dataclass(frozen=True)
class SmoothPoint:
    """One place in a decoder layer where a smoothing factor can be folded: `linears` share the input X (the
    first is hooked to record it); 1/s goes into the RMSNorm `norm` or into the output rows of `producer`."""

    name: str
    linears: tuple[str, ...]
    norm: str | None = None
    producer: str | None = None
    norm_offset: float = 0.0  # the norm multiplies by (norm_offset + weight)


POINTS: tuple[SmoothPoint, ...] = (
    SmoothPoint("attn_in", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), norm="input_layernorm"),
    SmoothPoint("attn_out", ("self_attn.o_proj",), producer="self_attn.v_proj"),
    SmoothPoint("mlp_in", ("mlp.gate_proj", "mlp.up_proj"), norm="post_attention_layernorm"),
    SmoothPoint("mlp_out", ("mlp.down_proj",), producer="mlp.up_proj"),
)
POINT_NAMES: tuple[str, ...] = tuple(p.name for p in POINTS)
DEFAULT_ALPHAS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
_FLOOR = 1e-5  # channel statistics below this are treated as this (dead channels get a finite factor)


def points_named(names: tuple[str, ...], family: Family = FAMILIES["LlamaForCausalLM"]) -> tuple[SmoothPoint, ...]:
    """The points called `names`, with the family's norms: which one feeds the MLP, and its (offset + w) form."""
    unknown = [n for n in names if n not in POINT_NAMES]
    if unknown:
        raise ValueError(f"smoothing points {unknown}: use some of {', '.join(POINT_NAMES)}")
    out = []
    for p in POINTS:
        if p.name in names:
            if p.norm is not None:
                p = replace(p, norm=family.mlp_norm if p.name == "mlp_in" else p.norm, norm_offset=family.norm_offset)
            out.append(p)
    return tuple(out)


def channel_tie(layer: torch.nn.Module, point: SmoothPoint) -> torch.Tensor | None:
    """(K,) index from each input channel of the point's linears to the factor it shares: None when every channel
    has its own (norm points, mlp_out); for attn_out, o_proj channel h * D + d reads v_proj row (h // rep) * D + d."""
    if point.name != "attn_out":
        return None
    o = layer.get_submodule(point.linears[0])
    v = layer.get_submodule(point.producer)
    cfg = layer.self_attn.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = v.out_features // kv_heads
    if o.in_features != heads * head_dim or heads % kv_heads:
        raise ValueError(f"o_proj K={o.in_features} does not match {heads} heads x {head_dim} (v_proj "
                         f"{v.out_features} rows over {kv_heads} KV heads): smooth without attn_out")
    c = torch.arange(o.in_features)
    return (c // head_dim) // (heads // kv_heads) * head_dim + c % head_dim


def _reduce(values: torch.Tensor, tie: torch.Tensor | None, size: int) -> torch.Tensor:
    """Per-channel maxima (K,) -> per-factor maxima (size,) over the channels that share a factor."""
    if tie is None:
        return values
    out = torch.zeros(size, device=values.device, dtype=values.dtype)
    return out.scatter_reduce_(0, tie.to(values.device), values, reduce="amax", include_self=True)


def _loss(x: torch.Tensor, weights: list[torch.Tensor], refs: list[torch.Tensor], s: torch.Tensor,
          group_size: int) -> float:
    """sum |X W^T - q8(X / s) q4(W s)^T|^2 over the point's linears; x (M, K), refs[i] = x @ weights[i]^T, s (K,)."""
    xq, sx = quantize_activations_ref(x / s)
    xd = xq.float() * sx
    total = 0.0
    for w, ref in zip(weights, refs):
        ws = w * s
        sc = group_scales(ws, group_size)
        wd = (quantize_with_scales(ws, sc).float().view(ws.shape[0], -1, group_size)
              * sc.float().unsqueeze(2)).reshape(ws.shape)
        total += float(torch.sum((ref - xd @ wd.t()) ** 2))
    return total


def search_point(layer: torch.nn.Module, point: SmoothPoint, x: torch.Tensor, x_amax: torch.Tensor,
                 group_size: int, alphas: tuple[float, ...] = DEFAULT_ALPHAS) -> tuple[float | None, torch.Tensor]:
    """The best factor for `point`: (alpha, or None for s = 1; s (F,) per factor). x (M, K) a sample of the
    point's inputs, x_amax (K,) max |X| per channel over all calibration tokens."""
    weights = [layer.get_submodule(name).weight.data.float() for name in point.linears]
    tie = channel_tie(layer, point)
    size = int(tie.max()) + 1 if tie is not None else x.shape[1]
    expand = (lambda f: f[tie.to(f.device)]) if tie is not None else (lambda f: f)
    ax = _reduce(x_amax.float(), tie, size).clamp(min=_FLOOR)
    aw = _reduce(torch.cat([w.abs() for w in weights]).amax(dim=0), tie, size).clamp(min=_FLOOR)
    x = x.float()
    refs = [x @ w.t() for w in weights]
    best_alpha, best_s = None, torch.ones(size, device=x.device)
    best = _loss(x, weights, refs, expand(best_s), group_size)
    for a in alphas:
        s = ax.pow(a) / aw.pow(1.0 - a)
        s = s / torch.exp(torch.log(s).mean())
        loss = _loss(x, weights, refs, expand(s), group_size)
        if loss < best:
            best, best_alpha, best_s = loss, a, s
    return best_alpha, best_s


@torch.no_grad()
def apply_point(layer: torch.nn.Module, point: SmoothPoint, s: torch.Tensor) -> list[str]:
    """Fold s (F,) into the layer in place; returns the layer-relative names of the BF16 tensors it changed."""
    tie = channel_tie(layer, point)
    changed: list[str] = []
    if point.norm is not None:
        norm = layer.get_submodule(point.norm)
        c = point.norm_offset
        old = norm.weight.data.float() + c  # what the norm multiplies by
        new = (old / s - c).to(torch.bfloat16).float() + c  # the checkpoint stores w in BF16: fold what it will hold
        # a channel whose stored factor would round to 0 or change sign keeps its weight (and s = 1)
        keep = (new == 0) | (new * old <= 0)
        new = torch.where(keep, old, new)
        s_k = old / torch.where(keep, torch.ones_like(new), new)
        s_k = torch.where(keep, torch.ones_like(s_k), s_k)
        norm.weight.data = (new - c).to(norm.weight.dtype)
        changed.append(f"{point.norm}.weight")
    else:
        producer = layer.get_submodule(point.producer)
        producer.weight.data = producer.weight.data / s[:, None].to(producer.weight.dtype)
        if producer.bias is not None:
            producer.bias.data = (producer.bias.data.float() / s).to(torch.bfloat16).to(producer.bias.dtype)
            changed.append(f"{point.producer}.bias")
        s_k = s[tie.to(s.device)] if tie is not None else s
    for name in point.linears:
        lin = layer.get_submodule(name)
        lin.weight.data = lin.weight.data * s_k[None, :].to(lin.weight.dtype)
    return changed
