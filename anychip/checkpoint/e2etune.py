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

from anychip.checkpoint.blocktune import fake_quantize_activations, round_bf16_ste

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


class _GroupScaledLinear(torch.autograd.Function):
    """y = x @ (codes x scales)^T with a gradient for x and the scales only. The weight is rebuilt in the backward
    pass instead of saved (autograd would keep every linear's fp32 weight, 4 bytes a weight, for the whole step);
    the scales' gradient is each group's sum of codes x (gy^T x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, codes, scales)
        return torch.nn.functional.linear(x, _weight(codes, scales))

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, codes, scales = ctx.saved_tensors
        gx = gy @ _weight(codes, scales) if ctx.needs_input_grad[0] else None
        gw = gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])  # (N, K), one linear at a time
        return gx, None, (gw.view(codes.shape) * codes).sum(-1)


def _weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(N, K) fp32 from int8 codes (N, G, K/G) and scales (N, G)."""
    return (codes.float() * scales.unsqueeze(2)).flatten(1)


class _TunedLinear(torch.nn.Module):
    """A decoder linear on the server's arithmetic (eval.engines.SimulatedW4A8Linear: per-token INT8 activations
    times codes x BF16 scales in fp32, the output in the input's dtype) whose scales are s0 * exp(t): GPTQ's codes
    (N, K) as int8, its scales s0 (N, G) and the trainable log-factors t (N, G)."""

    def __init__(self, wq: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("codes", wq.to(torch.int8).reshape(wq.shape[0], scales.shape[1], -1).clone())
        self.register_buffer("s0", scales.to(torch.float32).clone())
        self.register_buffer("bias", bias)
        self.t = torch.nn.Parameter(torch.zeros_like(self.s0))

    def scales(self) -> torch.Tensor:
        return round_bf16_ste(self.s0 * torch.exp(self.t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _GroupScaledLinear.apply(fake_quantize_activations(x.float()), self.codes, self.scales())
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
            for t in module.parameters(recurse=False):
                t.data = t.data.clone()
            for name, t in list(module.named_buffers(recurse=False)):
                module._buffers[name] = t.clone()


Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]


def tune_scales(student: torch.nn.Module, teacher: torch.nn.Module, weights: Weights, tokens: torch.Tensor,
                steps: int, lr: float, batch: int, device: torch.device | str, seed: int = 0,
                log: Callable[[str], None] | None = None) -> tuple[Weights, E2EOutcome]:
    """Tune the group scales of `weights` ({linear prefix: (wq, scales)}, GPTQ's result for the decoder linears of
    `student`) end to end against `teacher` (the BF16 source) on the calibration `tokens` (sequences, length).
    `student` is the source with GPTQ's dense changes applied (smoothed norms); its linears named in `weights` are
    replaced first, then it moves to `device` (the model is spent); `teacher` must sit on `device`. Returns the
    chosen (wq, scales) and the outcome; the codes are GPTQ's either way. The held-out sequences are other windows
    of the same calibration text: they can overlap the training windows where the text is short for their number."""
    log = log or (lambda msg: None)
    n = tokens.shape[0]
    heldout = max(1, n // 8)
    if n - heldout < 1:
        raise ValueError(f"end-to-end tuning needs at least 2 calibration sequences (got {n})")
    train, held = tokens[:n - heldout], tokens[n - heldout:]
    teacher.requires_grad_(False)
    with torch.inference_mode(False), torch.enable_grad():
        tuned: dict[str, _TunedLinear] = {}
        for prefix, (wq, sc) in weights.items():  # before the move: the dense weights they replace never go there
            parent, child = prefix.rsplit(".", 1)
            old = student.get_submodule(prefix)
            bias = old.bias.detach().clone() if getattr(old, "bias", None) is not None else None
            tuned[prefix] = _TunedLinear(wq, sc, bias)
            setattr(student.get_submodule(parent), child, tuned[prefix])
        _own_tensors(student)
        student.to(device).requires_grad_(False)
        for m in tuned.values():
            m.t.requires_grad_(True)

        def heldout_kl() -> float:
            with torch.no_grad():
                total = 0.0
                for i in range(0, held.shape[0], batch):
                    ids = held[i:i + batch].to(device)
                    total += float(_kl(student(ids, use_cache=False).logits, teacher(ids, use_cache=False).logits))
                return total / held.numel()

        before = heldout_kl()
        opt = torch.optim.Adam([m.t for m in tuned.values()], lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / max(steps, 1))
        gen = torch.Generator().manual_seed(seed)
        for step in range(steps):
            ids = train[torch.randperm(train.shape[0], generator=gen)[:batch]].to(device)
            with torch.no_grad():
                target = teacher(ids, use_cache=False).logits
            loss = _kl(student(ids, use_cache=False).logits, target) / ids.numel()
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
