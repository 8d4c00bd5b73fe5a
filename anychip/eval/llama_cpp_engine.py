"""llama.cpp as an accuracy peer: the same token sequences the other engines score, through llama-cpp-python.

The tokens come from the Hugging Face tokenizer of the BF16 source (the one vLLM and transformers use), not from
llama.cpp's own tokenizer, so every request is the same token ids in every engine and the per-item outcomes pair
up. llama.cpp returns the logits of every position (`logits_all`); a token's logprob is its logit minus the
row's logsumexp, in float64.

Sequences are scored in sorted order and each keeps the KV cache of the longest prefix it shares with the one
before (the choices of an item share their context, and TruthfulQA's primer is shared by every item): only the
new suffix is decoded, and the prefix's logits rows are the ones computed for the same tokens before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from anychip.bench.gguf_peers import FTYPES, f32_gguf, llama_cpp_quantized
from anychip.bench.peers import llama_cpp_available
from anychip.eval.errors import EvalDataError

#: File types `anychip eval --llama-cpp` accepts: llama.cpp's quantizer's, plus the unquantized F32 conversion
#: (the check that the conversion and this engine are right: it should score like the BF16 model).
LLAMA_CPP_TYPES: tuple[str, ...] = ("F32", *FTYPES)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefix_schedule(seqs: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(index, tokens kept from the previous sequence's cache) in the order the engine scores them: sorted by
    tokens, so neighbours share the longest prefixes. At least one token of each sequence is decoded again, so
    the last row of logits is always fresh (a sequence equal to a prefix of the one before)."""
    order = sorted(range(len(seqs)), key=lambda i: tuple(seqs[i]))
    out: list[tuple[int, int]] = []
    prev: Sequence[int] = ()
    for i in order:
        keep = min(common_prefix(prev, seqs[i]), len(seqs[i]) - 1)
        out.append((i, keep))
        prev = seqs[i]
    return out


def token_logprobs_from_logits(logits: np.ndarray, seq: Sequence[int]) -> list[float]:
    """logits: (len(seq), V), row j predicting token j+1 -> [logprob(seq[j] | seq[:j]) for j in 1..len-1]."""
    rows = logits[:len(seq) - 1].astype(np.float64)  # (T-1, V)
    peak = rows.max(axis=1, keepdims=True)
    lse = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))
    target = rows[np.arange(len(seq) - 1), np.asarray(seq[1:])]
    return (target - lse).tolist()


def gguf_for(bf16: Path, ftype: str) -> Path:
    """The GGUF of `bf16` in `ftype`: the F32 conversion, or llama.cpp's quantization of it (made once, cached in
    `<bf16>-gguf/`, anychip.bench.gguf_peers)."""
    if ftype not in LLAMA_CPP_TYPES:
        raise EvalDataError(f"--llama-cpp {ftype}: use one of {', '.join(LLAMA_CPP_TYPES)}")
    if ftype == "F32":
        return f32_gguf(bf16)
    return llama_cpp_quantized(bf16, ftype)


class LlamaCppEngine:
    """llama-cpp-python on `gguf`, tokenized by the Hugging Face tokenizer of `tokenizer_dir` (the BF16 source)."""

    def __init__(self, gguf: str | Path, tokenizer_dir: str | Path, max_len: int = 2048,
                 threads: int | None = None, name: str = "llama.cpp") -> None:
        llama_cpp_available()
        import llama_cpp
        from transformers import AutoTokenizer

        from anychip.eval.engines import _prefix_id

        self.name, self.max_len, self.gguf = name, max_len, Path(gguf)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        self.prefix_id = _prefix_id(self.tokenizer)
        threads = threads or len(os.sched_getaffinity(0))
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max_len, n_batch=512, logits_all=True,
                                   n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
        if self.llm.n_vocab() < len(self.tokenizer):
            raise EvalDataError(f"{self.gguf.name} has {self.llm.n_vocab()} tokens, the tokenizer in {tokenizer_dir} "
                                f"{len(self.tokenizer)}: convert the GGUF from that model's weights")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_logprobs(self, seqs: Sequence[Sequence[int]], desc: str) -> list[list[float]]:
        out: list[list[float] | None] = [None] * len(seqs)
        llm = self.llm
        with tqdm(total=sum(len(s) for s in seqs), desc=desc, unit="tok", unit_scale=True) as bar:
            llm.reset()
            for i, keep in prefix_schedule(seqs):
                seq = list(seqs[i])
                if len(seq) > self.max_len:
                    raise ValueError(f"a {len(seq)}-token sequence does not fit llama.cpp's {self.max_len} context")
                llm.n_tokens = keep  # eval() drops the KV cache from here on and decodes the rest
                llm.eval(seq[keep:])
                out[i] = token_logprobs_from_logits(llm.scores[:len(seq)], seq)
                bar.update(len(seq))
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.llm.close()
        del self.llm
