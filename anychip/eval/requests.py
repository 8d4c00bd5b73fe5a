"""Text -> token requests, the lm-evaluation-harness way, deduplicated; and perplexity windows.

Every request is scored by one primitive that an engine provides: the logprob of each token of a sequence given
the tokens before it. A loglikelihood request (context, continuation) is the sum over the continuation's tokens;
a perplexity window is the sum over its last `n_scored` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from anychip.eval.errors import EvalDataError
from anychip.eval.tasks import Item

Encode = Callable[[str], list[int]]
#: (context token ids, continuation token ids)
TokenPair = tuple[tuple[int, ...], tuple[int, ...]]


class PairEncoder:
    """lm-eval's HFLM._encode_pair with the context encoding cached (many choices share one context).

    Trailing whitespace of the context moves to the front of the continuation; the continuation's tokens are
    encode(context + continuation)[len(encode(context)):], so a token that merges across the boundary is
    counted in the continuation. An empty context is replaced by `prefix_id` (lm-eval's prefix token).
    """

    def __init__(self, encode: Encode, prefix_id: int) -> None:
        self.encode = encode
        self.prefix_id = prefix_id
        self._ctx_cache: dict[str, tuple[int, ...]] = {}

    def __call__(self, context: str, continuation: str) -> TokenPair:
        if context == "":
            return (self.prefix_id,), tuple(self.encode(continuation))
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        ctx = self._ctx_cache.get(context)
        if ctx is None:
            ctx = self._ctx_cache[context] = tuple(self.encode(context))
        whole = self.encode(context + continuation)
        cont = tuple(whole[len(ctx):])
        if not ctx:  # a whitespace-only context: score everything after the prefix token
            return (self.prefix_id,), tuple(whole)
        if not cont:
            raise EvalDataError(f"continuation {continuation!r} encodes to no tokens after context "
                                f"{context[-40:]!r} with this model's tokenizer: nothing to score")
        return ctx, cont


@dataclass(frozen=True)
class RequestPlan:
    """The unique token pairs of a task and, per item, the index of each choice's pair in `pairs`."""

    pairs: tuple[TokenPair, ...]
    index: tuple[tuple[int, ...], ...]

    def gather(self, pair_logliks: Sequence[float]) -> list[list[float]]:
        return [[pair_logliks[i] for i in idx] for idx in self.index]


def plan_requests(items: Sequence[Item], encoder: PairEncoder) -> RequestPlan:
    """Tokenize every (context, continuation) of every item once; identical token pairs are scored once."""
    unique: dict[TokenPair, int] = {}
    index: list[tuple[int, ...]] = []
    for item in items:
        idx = []
        for context, continuation in item.requests():
            pair = encoder(context, continuation)
            idx.append(unique.setdefault(pair, len(unique)))
        index.append(tuple(idx))
    return RequestPlan(tuple(unique), tuple(index))


def pair_sequence(pair: TokenPair, max_len: int) -> tuple[list[int], int]:
    """The token sequence an engine scores for a pair (left-truncated to max_len, as lm-eval does) and how many
    of its last logprobs belong to the continuation."""
    ctx, cont = pair
    if len(cont) >= max_len:
        raise EvalDataError(f"a choice of {len(cont)} tokens does not fit the model's {max_len}-token window: "
                            "shorten it (a choice is scored whole; only its context is cut from the left)")
    seq = list(ctx + cont)[-max_len:]
    return seq, len(cont)


@dataclass(frozen=True)
class Window:
    """tokens[start:end] is scored; its last n_scored tokens count towards perplexity."""

    start: int
    end: int
    n_scored: int


def rolling_windows(n_tokens: int, window: int, stride: int) -> list[Window]:
    """Sliding windows of `window` tokens every `stride` tokens; every token but the first is scored once.

    The first window scores tokens 1..window-1; each later one scores only its last `stride` tokens, so every
    such token sees at least window - stride tokens of context.
    """
    if not 0 < stride <= window:
        raise ValueError(f"stride {stride} must be in 1..window ({window})")
    if n_tokens < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    out: list[Window] = []
    prev_end = 1  # token 0 has no context and is never scored
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        out.append(Window(begin, end, end - prev_end))
        prev_end = end
        if end == n_tokens:
            break
    return out
