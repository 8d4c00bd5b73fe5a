"""Pure scoring: loglikelihoods in, acc / acc_norm / stderr / paired confidence intervals out.

Definitions follow lm-evaluation-harness's multiple-choice metrics:
  acc       = [argmax_i loglik_i == label]
  acc_norm  = [argmax_i loglik_i / len_i == label]   (len_i: the item's Item.lengths; for built-in tasks lm-eval's
              length in characters of the choice as doc_to_choice returns it, else the scored string's UTF-8 bytes)
  stderr    = sample standard deviation (ddof=1) / sqrt(n), as lm-eval's mean_stderr
Ties pick the first maximum (numpy.argmax), as lm-eval does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Two-sided 95% quantile of the standard normal.
Z95 = 1.959963984540054


def argmax(values: Sequence[float]) -> int:
    """Index of the first maximum (numpy.argmax semantics)."""
    if not values:
        raise ValueError("argmax of an empty sequence")
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def item_correct(logliks: Sequence[float], lengths: Sequence[int], label: int) -> tuple[float, float]:
    """(acc, acc_norm) of one item, each 0.0 or 1.0. `lengths`: each choice's acc_norm denominator."""
    if len(logliks) != len(lengths):
        raise ValueError(f"{len(logliks)} logliks but {len(lengths)} choice lengths")
    if not 0 <= label < len(logliks):
        raise ValueError(f"label {label} out of range for {len(logliks)} choices")
    acc = float(argmax(logliks) == label)
    normed = [ll / max(n, 1) for ll, n in zip(logliks, lengths)]
    return acc, float(argmax(normed) == label)


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def stderr(xs: Sequence[float]) -> float:
    """Standard error of the mean: sample stddev (ddof=1) / sqrt(n); nan for n < 2."""
    n = len(xs)
    if n < 2:
        return float("nan")
    m = mean(xs)
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return math.sqrt(var / n)


@dataclass(frozen=True)
class TaskScore:
    """A task's accuracy for one model, with the per-item 0/1 outcomes that paired comparisons need."""

    acc_items: tuple[float, ...]
    acc_norm_items: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.acc_items)

    def summary(self) -> dict[str, float | int]:
        return {
            "acc": mean(self.acc_items),
            "acc_norm": mean(self.acc_norm_items),
            "n": self.n,
            "acc_stderr": stderr(self.acc_items),
            "acc_norm_stderr": stderr(self.acc_norm_items),
        }


def score_task(logliks: Sequence[Sequence[float]], lengths: Sequence[Sequence[int]],
               labels: Sequence[int]) -> TaskScore:
    """Per-item logliks (one list per item), choice lengths (acc_norm denominators) and labels -> TaskScore."""
    if not len(logliks) == len(lengths) == len(labels):
        raise ValueError(f"{len(logliks)} items of logliks, {len(lengths)} of lengths, {len(labels)} labels")
    pairs = [item_correct(ll, n, y) for ll, n, y in zip(logliks, lengths, labels)]
    return TaskScore(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))


def paired_delta(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """mean(a - b) and its 95% CI from the per-item differences (normal approximation, ddof=1 stderr).

    Paired because both models answer the same items: the item-to-item variance cancels, which makes the
    interval much narrower than one built from the two accuracies' separate stderrs.
    """
    if len(a) != len(b):
        raise ValueError(f"paired_delta needs the same items: {len(a)} vs {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    m, se = mean(d), stderr(d)
    if math.isnan(se):
        return m, float("nan"), float("nan")
    return m, max(-1.0, m - Z95 * se), min(1.0, m + Z95 * se)  # a difference of accuracies lies in [-1, 1]


def compare(quant: TaskScore, base: TaskScore) -> dict[str, float | list[float]]:
    """Delta (quant - base) of acc and acc_norm with paired 95% CIs, in accuracy units (not points), and how many
    items each metric scores differently."""
    acc, acc_lo, acc_hi = paired_delta(quant.acc_items, base.acc_items)
    norm, norm_lo, norm_hi = paired_delta(quant.acc_norm_items, base.acc_norm_items)
    return {"acc": acc, "acc_ci95": [acc_lo, acc_hi], "acc_norm": norm, "acc_norm_ci95": [norm_lo, norm_hi],
            # items the two models score differently: with none, the paired CI is [0, 0] by construction
            "acc_discordant": sum(x != y for x, y in zip(quant.acc_items, base.acc_items)),
            "acc_norm_discordant": sum(x != y for x, y in zip(quant.acc_norm_items, base.acc_norm_items))}


def perplexity(total_logprob: float, n_tokens: int) -> float:
    """exp(-mean token logprob)."""
    if n_tokens <= 0:
        raise ValueError("perplexity of zero tokens")
    return math.exp(-total_logprob / n_tokens)
