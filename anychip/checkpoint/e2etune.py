"""End-to-end tuning of the group scales after GPTQ: the INT4 codes stay as GPTQ chose them, and every BF16 group
scale of the model is adjusted so that the W4A8 model's next-token distribution on calibration text comes closer
to the BF16 source's (KL divergence, teacher = the source).

GPTQ, its refit and block tuning each fit one linear or one layer to a local target. What a layer-local fit cannot
see is how the errors of thirty layers add up in the logits, which is what perplexity and the multiple-choice
tasks score. Here the whole model is the function: its linears on the server's arithmetic (the codes times the
BF16 scales, per-token INT8 activations with a straight-through gradient), every scale one parameter, the loss
the KL divergence of the W4A8 model's distribution from the source's at every calibration token. Only scales move
(EfficientQAT's end-to-end stage trains the same parameters), so the result keeps GPTQ's codes and its error
compensation, and the contract is unchanged: symmetric INT4 codes in [-8, 7], one positive BF16 scale per group.

A scale is s0 * exp(t) with t starting at 0 (GPTQ's scale exactly) and rounded to BF16 in the forward pass
(gradient straight through), so it stays positive and the step size is relative. Adam, the step size decaying
linearly to 0; each step takes `batch` sequences of the training part. The last eighth of the calibration
sequences (at least one) is held out: the tuned scales are kept only if the held-out KL divergence is lower than
with GPTQ's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from anychip.checkpoint.blocktune import fake_quantize_activations

#: Largest |t| (a scale moves at most by a factor e^0.5 either way).
LOG_SCALE_RANGE = 0.5


@dataclass
class E2EOutcome:
    """Held-out KL divergence (nats a token) with GPTQ's scales (before) and the tuned ones (after); kept: whether
    the tuned scales replaced GPTQ's; train / heldout: calibration sequences used for each."""

    before: float
    after: float
    kept: bool
    train: int
    heldout: int

    def record(self) -> dict:
        return {"kl_heldout_gptq": self.before, "kl_heldout_tuned": self.after, "kept": self.kept,
                "train_sequences": self.train, "heldout_sequences": self.heldout}


class _TunedLinear(torch.nn.Module):
    """A decoder linear on the server's arithmetic (eval.engines.SimulatedW4A8Linear: per-token INT8 activations
    times codes x BF16 scales in fp32, the output in the input's dtype) whose scales are s0 * exp(t): GPTQ's codes
    (N, K), its scales s0 (N, G) and the trainable log-factors t (N, G)."""

    def __init__(self, wq: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 device: torch.device) -> None:
        super().__init__()
        self.shape = tuple(wq.shape)
        self.register_buffer("codes", wq.to(device, torch.float32).view(wq.shape[0], scales.shape[1], -1))
        self.register_buffer("s0", scales.to(device, torch.float32))
        self.t = torch.nn.Parameter(torch.zeros_like(self.s0))
        self.bias = bias

    def scales(self) -> torch.Tensor:
        s = self.s0 * torch.exp(self.t)
        return s + (s.to(torch.bfloat16).float() - s).detach()  # BF16 as stored, gradient straight through

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = (self.codes * self.scales().unsqueeze(2)).view(self.shape)
        y = torch.nn.functional.linear(fake_quantize_activations(x.float()), w)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def clamp(self) -> None:
        with torch.no_grad():
            self.t.clamp_(-LOG_SCALE_RANGE, LOG_SCALE_RANGE)

    def result(self) -> torch.Tensor:
        with torch.no_grad():
            return self.scales().to(torch.bfloat16).cpu()


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of KL(teacher || student), in fp32."""
    s = torch.log_softmax(student_logits.float().flatten(0, -2), dim=-1)
    t = torch.log_softmax(teacher_logits.float().flatten(0, -2), dim=-1)
    return torch.nn.functional.kl_div(s, t, log_target=True, reduction="sum")


def _own_tensors(model: torch.nn.Module) -> None:
    """Give every parameter and buffer of `model` a copy made outside inference mode (GPTQ moved the layers in it),
    which autograd can save for the backward pass."""
    with torch.no_grad():
        for module in model.modules():
            for name, t in module.named_parameters(recurse=False):
                t.data = t.data.clone()
            for name, t in list(module.named_buffers(recurse=False)):
                module._buffers[name] = t.clone()


Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]


def tune_scales(student: torch.nn.Module, teacher: torch.nn.Module, weights: Weights, tokens: torch.Tensor,
                steps: int, lr: float, batch: int, seed: int = 0,
                log: Callable[[str], None] | None = None) -> tuple[Weights, E2EOutcome]:
    """Tune the group scales of `weights` ({linear prefix: (wq, scales)}, GPTQ's result for the decoder linears of
    `student`) end to end against `teacher` (the BF16 source) on the calibration `tokens` (sequences, length).
    `student` is the source with GPTQ's dense changes applied (smoothed norms), on the device to compute on; its
    linears named in `weights` are replaced (the model is spent). Returns the chosen (wq, scales) and the outcome;
    the codes are GPTQ's either way."""
    log = log or (lambda msg: None)
    device = next(student.parameters()).device
    n = tokens.shape[0]
    heldout = max(1, n // 8)
    if n - heldout < 1:
        raise ValueError(f"end-to-end tuning needs at least 2 calibration sequences (got {n})")
    train, held = tokens[:n - heldout], tokens[n - heldout:]
    teacher.requires_grad_(False)
    with torch.inference_mode(False), torch.enable_grad():
        _own_tensors(student)
        student.requires_grad_(False)
        tuned: dict[str, _TunedLinear] = {}
        for prefix, (wq, sc) in weights.items():
            parent, child = prefix.rsplit(".", 1)
            old = student.get_submodule(prefix)
            bias = old.bias.detach().clone() if getattr(old, "bias", None) is not None else None
            tuned[prefix] = _TunedLinear(wq, sc, bias, device)
            setattr(student.get_submodule(parent), child, tuned[prefix])

        def heldout_kl() -> float:
            with torch.no_grad():
                total = 0.0
                for i in range(0, held.shape[0], batch):
                    ids = held[i:i + batch].to(device)
                    total += float(_kl(student(ids).logits, teacher(ids).logits))
                return total / held.numel()

        before = heldout_kl()
        opt = torch.optim.Adam([m.t for m in tuned.values()], lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / max(steps, 1))
        gen = torch.Generator().manual_seed(seed)
        for step in range(steps):
            ids = train[torch.randperm(train.shape[0], generator=gen)[:batch]].to(device)
            with torch.no_grad():
                target = teacher(ids).logits
            loss = _kl(student(ids).logits, target) / ids.numel()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            for m in tuned.values():
                m.clamp()
            if (step + 1) % max(1, steps // 5) == 0 or step + 1 == steps:
                log(f"end-to-end scales: step {step + 1}/{steps}, KL {loss.detach().item():.5f} a token")
        after = heldout_kl() if steps else before
    kept = after < before
    out = {p: (wq, tuned[p].result()) if kept else (wq, sc) for p, (wq, sc) in weights.items()}
    return out, E2EOutcome(before, after, kept, int(train.shape[0]), int(heldout))
