"""Engines that score token sequences: logprob of every token given the tokens before it.

`VllmEngine` is what `anychip eval` uses: vLLM's public LLM API with prompt logprobs, so a W4A8 directory runs
through whatever vLLM serves it with (the anychip plugin). `TorchEngine` is plain transformers; for a W4A8
directory it runs the torch reference arithmetic (weights dequantized from INT4, activations quantized per token
with reference.quantize_activations_ref), which makes it a check on the vLLM route and a way to evaluate on any
torch device.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from anychip.checkpoint.model_dir import ModelDir
from anychip.envs import VLLM_STARTUP, patched_environ

#: vLLM's process model: the engine core must run in this process (the uni executor, no engine subprocess).
_VLLM_ENV = {**VLLM_STARTUP, "VLLM_CPU_KVCACHE_SPACE": "2"}
#: Sequences per LLM.generate call: big enough to keep vLLM's batches full, small enough for a live progress bar.
VLLM_CHUNK = 512


class Engine(Protocol):
    name: str
    max_len: int
    prefix_id: int

    def encode(self, text: str) -> list[int]: ...

    def token_logprobs(self, seqs: Sequence[Sequence[int]], desc: str) -> list[list[float]]:
        """For each sequence, [logprob(seq[j] | seq[:j]) for j in 1..len-1]."""
        ...

    def close(self) -> None: ...


def _prefix_id(tokenizer) -> int:
    """lm-eval's prefix token: BOS if the tokenizer has one, else EOS."""
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    raise ValueError("the tokenizer has neither a BOS nor an EOS token to prefix empty contexts with")


def vllm_environment() -> AbstractContextManager[None]:
    """Set the variables vLLM reads at start-up (user values win) and restore the environment afterwards."""
    return patched_environ(_VLLM_ENV, override=False)


class VllmEngine:
    """vLLM LLM on `model_dir`; create it inside `vllm_environment()`."""

    def __init__(self, model_dir: str | Path, max_len: int = 2048) -> None:
        from anychip.vllm_plugin import offline

        self._offline = offline
        self.name = "vllm"
        self.max_len = max_len
        # a scored sequence of max_len tokens is a prompt of max_len plus the one token vLLM generates
        self.llm = offline.make_llm(model=str(model_dir), dtype="bfloat16", max_model_len=max_len + 1,
                                    enforce_eager=True, distributed_executor_backend="uni",
                                    gpu_memory_utilization=0.5, seed=0)
        self.tokenizer = self.llm.get_tokenizer()
        self.prefix_id = _prefix_id(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_logprobs(self, seqs: Sequence[Sequence[int]], desc: str) -> list[list[float]]:
        params = self._offline.sampling_params(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        out: list[list[float]] = []
        with tqdm(total=sum(len(s) for s in seqs), desc=desc, unit="tok", unit_scale=True) as bar:
            for i in range(0, len(seqs), VLLM_CHUNK):
                chunk = seqs[i:i + VLLM_CHUNK]
                prompts = [{"prompt_token_ids": list(s)} for s in chunk]
                for seq, res in zip(chunk, self.llm.generate(prompts, params, use_tqdm=False)):
                    lps = res.prompt_logprobs  # [None, {token_id: Logprob}, ...], one per prompt token
                    out.append([lps[j][seq[j]].logprob for j in range(1, len(seq))])
                bar.update(sum(len(s) for s in chunk))
        return out

    def close(self) -> None:
        del self.llm


class SimulatedW4A8Linear(torch.nn.Module):
    """The reference W4A8 arithmetic in float: y = (q8(x) * sx) @ (wq * sw)^T.

    Products of int8 x int4 are exact in fp32; only the accumulation order differs from the int32 reference.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize_activations: bool = True) -> None:
        super().__init__()
        self.register_buffer("weight", weight.float())  # (N, K), already on the INT4 grid for W4A8
        self.bias = bias
        self.quantize_activations = quantize_activations

    @classmethod
    def from_int4(cls, wq: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                  quantize_activations: bool = True) -> SimulatedW4A8Linear:
        from anychip.kernels.reference import dequantize_weight_ref

        return cls(dequantize_weight_ref(wq, scales, torch.float32), bias, quantize_activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from anychip.kernels.reference import quantize_activations_ref

        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.quantize_activations:
            xq, sx = quantize_activations_ref(x2)
            x2 = xq.float() * sx
        y = torch.nn.functional.linear(x2.float(), self.weight)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*lead, -1)


def simulate_w4a8(model: torch.nn.Module, weights: dict[str, tuple[torch.Tensor, torch.Tensor] | None],
                  quantize_activations: bool = True) -> torch.nn.Module:
    """Replace each linear named in `weights` ({prefix: (wq, scales)}) by SimulatedW4A8Linear, in place.
    A None entry keeps the linear's float weight (to measure INT8 activations alone)."""
    for prefix, wqs in weights.items():
        parent, child = prefix.rsplit(".", 1)
        old = model.get_submodule(prefix)
        bias = getattr(old, "bias", None)
        new = (SimulatedW4A8Linear(old.weight.data, bias, quantize_activations) if wqs is None else
               SimulatedW4A8Linear.from_int4(*wqs, bias=bias, quantize_activations=quantize_activations))
        held = [*old.parameters(), *old.buffers()]  # nn.Linear has a weight, the reference linear buffers
        setattr(model.get_submodule(parent), child, new.to(held[0].device if held else wqs[0].device))
    return model


def load_torch_model(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """transformers model; a W4A8 directory gets SimulatedW4A8Linear for each quantized linear."""
    if ModelDir.open(model_dir).kind == "bf16":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).eval()
    from anychip.checkpoint.torch_model import load_reference_model

    model = load_reference_model(model_dir, dtype=dtype)
    weights = {name: (m.wq, m.scales) for name, m in model.named_modules() if hasattr(m, "wq") and hasattr(m, "scales")}
    return simulate_w4a8(model, weights)


class TorchEngine:
    """transformers forward passes in padded batches of about `batch_tokens` tokens, longest first."""

    def __init__(self, model: torch.nn.Module, tokenizer, max_len: int = 2048, batch_tokens: int = 8192,
                 name: str = "torch") -> None:
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.max_len, self.batch_tokens = max_len, batch_tokens
        self.device = next(model.parameters()).device
        self.prefix_id = _prefix_id(tokenizer)

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 max_len: int = 2048) -> TorchEngine:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        return cls(load_torch_model(Path(model_dir), dtype).to(device), tokenizer, max_len=max_len)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    @torch.inference_mode()
    def token_logprobs(self, seqs: Sequence[Sequence[int]], desc: str) -> list[list[float]]:
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        out: list[list[float] | None] = [None] * len(seqs)
        with tqdm(total=sum(len(s) for s in seqs), desc=desc, unit="tok", unit_scale=True) as bar:
            i = 0
            while i < len(order):
                width = len(seqs[order[i]])
                batch = order[i:i + max(1, self.batch_tokens // width)]
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for r, j in enumerate(batch):
                    ids[r, :len(seqs[j])] = torch.tensor(seqs[j])
                    mask[r, :len(seqs[j])] = 1
                ids, mask = ids.to(self.device), mask.to(self.device)
                logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # (B, T-1, V)
                # logprob = logit of the target - logsumexp: one (B, T, V) fp32 tensor, not two
                lp = (logits.gather(2, ids[:, 1:, None]).squeeze(2) - torch.logsumexp(logits, dim=-1)).cpu()
                del logits
                for r, j in enumerate(batch):
                    out[j] = lp[r, :len(seqs[j]) - 1].tolist()
                bar.update(sum(len(seqs[j]) for j in batch))
                i += len(batch)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        del self.model
