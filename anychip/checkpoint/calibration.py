"""Calibration for GPTQ and smoothing: token windows of the calibration text (or text the model samples), the
hidden states entering decoder layer 0, and forward hooks that record what each linear of a layer is fed.

Hooks stop the layer's forward (Capture) once every hooked linear has seen its input: a true-sequential stage
needs only the part of the layer up to its linears.
"""

from __future__ import annotations

import torch

from anychip.errors import AnychipError


#: The share of unknown tokens in a calibration text above which GPTQ refuses it.
UNKNOWN_LIMIT = 0.5


def calibration_batch(tokenizer, text: str, samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """(samples, seq_len) token ids: windows at random offsets (fixed seed) of the tokenized text."""
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
    if ids.numel() <= seq_len:
        raise AnychipError(f"calibration text has {ids.numel()} tokens, fewer than --seq-len {seq_len}: "
                           "pass a longer --calibration file")
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and (share := float((ids == unk).float().mean())) >= UNKNOWN_LIMIT:
        raise AnychipError(f"the calibration text is {share:.0%} unknown tokens ({tokenizer.unk_token!r}) to this "
                           "model's tokenizer: GPTQ would fit the layers to one repeated token. Pass a "
                           "--calibration text in the model's language and script")
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


class Capture(Exception):
    """Raised by the first decoder layer's hook to stop the forward once its inputs are recorded."""


def layer_inputs(model, batch: torch.Tensor, device: torch.device) -> tuple[list[torch.Tensor], list[dict]]:
    """Hidden states entering decoder layer 0 for each calibration sequence, and for each layer the keyword
    arguments the model passes to it (rotary embeddings, mask: they differ between the sliding-window and global
    layers of a model that has both, e.g. Gemma 3). The first sequence runs the model with every layer replaced
    by one that records its arguments and passes its input on (the layers' weights stay where they are); the
    others stop at layer 0 (all sequences have one length: the same arguments)."""
    layers = model.model.layers
    inputs: list[torch.Tensor] = []
    kwargs: list[dict] = [{} for _ in layers]

    def recorder(index: int):
        def forward(*args, **kw):
            hidden = args[0] if args else kw["hidden_states"]
            if index == 0:
                inputs.append(hidden.detach())
            kwargs[index].update({k: v for k, v in kw.items() if k != "hidden_states"})
            if index == len(layers) - 1:
                raise Capture
            return hidden
        return forward

    def first_input(_module, args, kw):
        inputs.append((args[0] if args else kw["hidden_states"]).detach())
        raise Capture

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)  # an instance attribute: nn.Module.__call__ finds it before the class's
    try:
        try:
            model(input_ids=batch[0][None].to(device), use_cache=False)
        except Capture:
            pass
    finally:
        for layer in layers:
            del layer.forward
    handle = layers[0].register_forward_pre_hook(first_input, with_kwargs=True)
    try:
        for row in batch[1:]:
            try:
                model(input_ids=row[None].to(device), use_cache=False)
            except Capture:
                pass
    finally:
        handle.remove()
    for kw in kwargs:
        kw["use_cache"] = False
        kw.pop("past_key_values", None)
        kw.pop("past_key_value", None)
    return inputs, kwargs


class HessianHooks:
    """Accumulates H = 2 X^T X / n for each linear of a layer; linears fed the same tensor share one H. Once every
    hooked linear has seen its input in a forward, the forward is stopped (Capture): what follows is not needed.
    With `reference` set to {name: X~} before a forward (the float model's input to the same linear on the same
    tokens), it also accumulates the drift D = 2 (X~ - X)^T X / n."""

    def __init__(self, linears: dict[str, torch.nn.Linear]) -> None:
        self.h: dict[str, torch.Tensor] = {}
        self.d: dict[str, torch.Tensor] = {}
        self.reference: dict[str, torch.Tensor] | None = None
        self.n: dict[str, int] = {}
        self.alias: dict[str, str] = {}
        self._seen: dict[int, tuple[torch.Tensor, str]] = {}  # holds the tensor so its id stays unique
        self._called: set[str] = set()
        self._names = set(linears)
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in linears.items()]

    def _hook(self, name: str):
        def hook(_module, args):
            self._record(name, args[0])
            self._called.add(name)
            if self._called == self._names:
                raise Capture
        return hook

    def _record(self, name: str, x: torch.Tensor) -> None:
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
        if self.reference is not None:
            drift = self.reference[name].reshape(-1, x.shape[1]).float() - x
            d = self.d.get(name)
            if d is None:
                d = self.d[name] = torch.zeros_like(h)
            d.mul_(n / (n + m)).addmm_(drift.t(), x, alpha=2.0 / (n + m))
        self.n[name] = n + m

    def new_forward(self, tokens: int) -> None:
        self._seen.clear()
        self._called.clear()

    def hessian(self, name: str) -> torch.Tensor:
        return self.h[self.alias.get(name, name)]

    def drift(self, name: str) -> torch.Tensor:
        return self.d[self.alias.get(name, name)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class InputSample:
    """Per hooked linear: max |x| per input channel over every token, and every `step`-th token's input row."""

    def __init__(self, linears: dict[str, torch.nn.Linear], step: int) -> None:
        self.amax: dict[str, torch.Tensor] = {}
        self.rows: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
        self._step, self._offset = step, 0
        self._called: set[str] = set()
        self._names = set(linears)
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in linears.items()]

    def _hook(self, name: str):
        def hook(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            a = x.abs().amax(dim=0)
            self.amax[name] = torch.maximum(self.amax[name], a) if name in self.amax else a
            self.rows[name].append(x[self._offset % self._step::self._step].clone())
            self._called.add(name)
            if self._called == self._names:
                raise Capture
        return hook

    def new_forward(self, tokens: int) -> None:
        self._called.clear()
        self._offset += tokens

    def sample(self, name: str) -> torch.Tensor:
        return torch.cat(self.rows[name])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class InputRecord:
    """The input each hooked linear is fed in one forward ({name: tensor}); stops the forward like HessianHooks."""

    def __init__(self, linears: dict[str, torch.nn.Linear]) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self._names = set(linears)
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in linears.items()]

    def _hook(self, name: str):
        def hook(_module, args):
            self.inputs[name] = args[0]
            if set(self.inputs) == self._names:
                raise Capture
        return hook

    def new_forward(self, tokens: int) -> None:
        self.inputs = {}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def forward_pairs(layer, reference, xs: list[torch.Tensor], floats: list[torch.Tensor], kwargs: dict,
                  hooks: HessianHooks) -> None:
    """forward_all for asymmetric calibration: each batch runs through the float `reference` layer (on the float
    model's hidden states `floats`) and then through `layer` (on the quantized model's `xs`), so that `hooks` sees,
    for every linear, the float model's input beside the quantized model's on the same tokens."""
    record = InputRecord({name: reference.get_submodule(name) for name in hooks._names})
    try:
        for x, xf in zip(xs, floats):
            record.new_forward(xf.shape[-2])
            _run(reference, xf, kwargs)
            hooks.new_forward(x.shape[-2])
            hooks.reference = record.inputs
            _run(layer, x, kwargs)
    finally:
        record.remove()
        hooks.reference = None
        hooks.remove()


def _run(layer, x: torch.Tensor, kwargs: dict) -> None:
    try:
        layer(x, **kwargs)
    except Capture:
        pass


def forward_all(layer, xs: list[torch.Tensor], kwargs: dict, hooks) -> None:
    """Run the layer on every calibration sequence until the hooks have what they need."""
    try:
        for x in xs:
            hooks.new_forward(x.shape[-2])
            _run(layer, x, kwargs)
    finally:
        hooks.remove()
