"""Block-wise tuning after GPTQ: the INT4 codes and group scales of one decoder layer adjusted together, so that
the layer's output as the server computes it (INT4 x BF16-scale weights, per-token INT8 activations) comes closer
to the BF16 model's.

GPTQ minimizes each linear's own output error on that linear's inputs. It cannot see what follows a linear (the
softmax after q/k, SiLU after gate, the residual sum), the INT8 rounding of the activations, or the error the
earlier quantized layers left in its inputs. Here the target of layer i is the float model's hidden state after
layer i (float inputs through float layers), while the layer being tuned is fed the quantized model's hidden state
entering it: each layer can take back part of the error made before it.

The parameters follow signed-gradient rounding (AutoRound, Cheng et al. 2023): for every weight a rounding
offset v in [-0.5, 0.5] added before rounding, for every group a scale factor 1 + d with |d| <= SCALE_RANGE.
Rounding, the INT8 activation rounding and the BF16 rounding of the scales pass gradients straight through. The
start is the float weights rounded to nearest with GPTQ's scales (v = 0, d = 0), not GPTQ's codes: GPTQ's
dequantized weights sit exactly on the grid, half a step from every rounding boundary, where the straight-through
gradient of a scale is zero and the offsets can only move a code by a whole step. Each step takes `batch`
calibration sequences and moves every parameter by lr * sign(gradient), lr decaying linearly from `lr` (default
1 / steps) to 0. The tuned layer is kept only if its output error over all the calibration sequences is lower
than GPTQ's. The contract is unchanged: symmetric INT4 codes in [-8, 7], one BF16 scale per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anychip.kernels.reference import INT8_MAX, dequantize_weight_ref

#: Largest relative change of a group scale (AutoRound clips its range factors to [0.5, 1]).
SCALE_RANGE = 0.5
QMIN, QMAX = -8, 7


def _round_ste(t: torch.Tensor) -> torch.Tensor:
    return t + (torch.round(t) - t).detach()


def round_bf16_ste(s: torch.Tensor) -> torch.Tensor:
    """s rounded to BF16 as a checkpoint stores its scales, with the gradient passed straight through."""
    return s + (s.to(torch.bfloat16).float() - s).detach()


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric INT8 as quantize_activations_ref computes it, in float, with a straight-through
    gradient (the scale is held constant for the gradient)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True)
    sx = amax / INT8_MAX
    safe = torch.where(sx > 0, sx, torch.ones_like(sx))
    return torch.clamp(_round_ste(x / safe), -INT8_MAX, INT8_MAX) * sx


class TunedLinear:
    """One linear's trainable state: its float weight (N, K) and starting scales (N, G), the offsets v (N, K) and
    the scale factors d (N, G)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, group_size: int, device: torch.device) -> None:
        self.group_size = group_size
        # Copies made here, outside inference mode: autograd saves them for the backward pass.
        self.s0 = scales.to(device, torch.float32).clone()
        self.base = weight.to(device, torch.float32).clone()
        self.v = torch.zeros_like(self.base, requires_grad=True)
        self.d = torch.zeros_like(self.s0, requires_grad=True)

    def scales(self) -> torch.Tensor:
        return round_bf16_ste(self.s0 * (1 + self.d))

    def codes_and_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = self.base.shape
        s = self.scales()
        safe = torch.where(s.abs() > 0, s, torch.ones_like(s)).unsqueeze(2)  # an all-zero group stays zero
        q = torch.clamp(_round_ste(self.base.view(n, -1, self.group_size) / safe
                                   + self.v.view(n, -1, self.group_size)), QMIN, QMAX)
        return q, (q * s.unsqueeze(2)).view(n, k)

    def step(self, lr: float) -> None:
        with torch.no_grad():
            for p, bound in ((self.v, 0.5), (self.d, SCALE_RANGE)):
                if p.grad is not None:
                    p.sub_(lr * torch.sign(p.grad)).clamp_(-bound, bound)
                    p.grad = None

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(wq int8 (N, K), scales bf16 (N, G)) on the CPU."""
        with torch.no_grad():
            q, _ = self.codes_and_weight()
            return (q.reshape(self.base.shape).to(torch.int8).cpu(),
                    self.scales().to(torch.bfloat16).cpu())


@dataclass
class TuneOutcome:
    """Mean squared error of the layer's output against the float target over every calibration sequence, with
    GPTQ's weights (before) and the tuned ones (after); kept: whether the tuned weights replaced GPTQ's."""

    before: float
    after: float
    kept: bool


def _detached(t):
    if torch.is_tensor(t):
        return t.detach().clone()
    if isinstance(t, tuple):
        return tuple(_detached(x) for x in t)
    return t


class _Forward:
    """The layer as a function of its linears' weights, every linear fed per-token INT8 activations."""

    def __init__(self, layer: torch.nn.Module, names: list[str], kwargs: dict) -> None:
        self.layer, self.names = layer, names
        self.fixed = {n: _detached(t) for n, t in [*layer.named_parameters(), *layer.named_buffers()]
                      if n.removesuffix(".weight") not in names}
        self.kwargs = {k: _detached(v) for k, v in kwargs.items()}

    def __call__(self, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        params = dict(self.fixed)
        params.update({f"{n}.weight": w for n, w in weights.items()})
        handles = [self.layer.get_submodule(n).register_forward_pre_hook(
            lambda _m, a: (fake_quantize_activations(a[0]), *a[1:])) for n in self.names]
        try:
            out = torch.func.functional_call(self.layer, params, (x,), self.kwargs)
        finally:
            for h in handles:
                h.remove()
        return out[0] if isinstance(out, tuple) else out


def tune_layer(layer: torch.nn.Module, quantized: dict[str, tuple[torch.Tensor, torch.Tensor]],
               floats: dict[str, torch.Tensor], xs: list[torch.Tensor], targets: list[torch.Tensor], kwargs: dict,
               group_size: int, steps: int, batch: int, lr: float | None = None, seed: int = 0
               ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor], TuneOutcome]:
    """Tune the codes and scales of `layer`'s linears so that its W4A8 output on the inputs `xs` approaches
    `targets` (the float model's; both lists of (sequences, tokens, hidden) batches). `quantized` ({layer-relative
    linear name: (wq, scales)}) is GPTQ's result, `floats` the same linears' float weights: tuning rounds the float
    weights (v = 0: round to nearest with GPTQ's scales) and GPTQ's result is kept unless the tuned layer's error
    is lower. Returns the chosen (wq, scales), the layer's W4A8 outputs for `xs` (INT8 activations included: the
    next layer's inputs) and the losses; the layer's linear weights are left holding the chosen dequantized
    values."""
    device = xs[0].device
    names = list(quantized)
    with torch.inference_mode(False), torch.enable_grad():
        xs = [x.clone() for x in xs]
        targets = [y.clone() for y in targets]
        forward = _Forward(layer, names, kwargs)
        state = {n: TunedLinear(floats[n], sc, group_size, device) for n, (_, sc) in quantized.items()}

        def weights() -> dict[str, torch.Tensor]:
            return {n: t.codes_and_weight()[1] for n, t in state.items()}

        def total_loss(ws: dict[str, torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
            with torch.no_grad():
                outs = [forward(ws, x) for x in xs]
                err = sum(float(torch.sum((o - y) ** 2)) for o, y in zip(outs, targets))
                return err / sum(y.numel() for y in targets), outs

        start = {n: dequantize_weight_ref(wq, sc).to(device) for n, (wq, sc) in quantized.items()}
        before, outs_before = total_loss(start)
        rows = [(b, i) for b, x in enumerate(xs) for i in range(x.shape[0])]
        gen = torch.Generator().manual_seed(seed)
        lr0 = lr if lr is not None else 1.0 / max(steps, 1)
        for step in range(steps):
            pick = [rows[j] for j in torch.randperm(len(rows), generator=gen)[:batch].tolist()]
            x = torch.stack([xs[b][i] for b, i in pick])
            y = torch.stack([targets[b][i] for b, i in pick])
            loss = torch.mean((forward(weights(), x) - y) ** 2)
            loss.backward()
            for t in state.values():
                t.step(lr0 * (1 - step / steps))
        after, outs_after = total_loss(weights()) if steps else (before, outs_before)
        kept = after < before
        chosen = {n: state[n].result() for n in names} if kept else quantized
        outs = outs_after if kept else outs_before
        final = weights() if kept else start
        with torch.no_grad():
            for n in names:
                layer.get_submodule(n).weight.data = final[n].detach().clone()
    return chosen, outs, TuneOutcome(before, after, kept)
