"""The arithmetic of `anychip bench latency` and `anychip bench serve`, as pure functions over recorded timings.

Runners record raw times (seconds from `time.perf_counter`); everything reported is computed here, so the tests
can check it on made-up timings without starting an engine.

Latency (llama-bench semantics): one repetition is one prefill of `pp` tokens taking `t_pp` seconds and `tg`
single-token decode steps taking `t_tg` seconds.  pp = pp / t_pp, tg = tg / t_tg,
total = (pp + tg) / (t_pp + t_tg), in tokens per second; each is averaged over repetitions (mean and sample sd,
as llama-bench reports `avg_ts` and `stdev_ts`).

Serving (one streamed request): TTFT = first token - send, TPOT = (last token - first token) / (output tokens - 1),
ITL = the gaps between consecutive streamed chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class MeanSd:
    mean: float
    sd: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.mean:.2f} ± {self.sd:.2f}"


def mean_sd(values: Sequence[float]) -> MeanSd:
    """Mean and sample standard deviation (n - 1); sd is 0 for a single value, NaN for none."""
    n = len(values)
    if n == 0:
        return MeanSd(math.nan, math.nan, 0)
    mean = math.fsum(values) / n
    if n == 1:
        return MeanSd(mean, 0.0, 1)
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return MeanSd(mean, math.sqrt(var), n)


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside 0..100")
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# ---- latency (llama-bench) ----


@dataclass(frozen=True)
class RepTiming:
    """One repetition: seconds for one prefill of pp tokens, and for tg single-token decode steps."""

    t_pp: float
    t_tg: float


def rates(pp: int, tg: int, rep: RepTiming) -> tuple[float, float, float]:
    """(pp, tg, total) tokens per second of one repetition."""
    if rep.t_pp <= 0 or rep.t_tg <= 0:
        raise ValueError(f"non-positive timing {rep}: a runner recorded a zero or negative duration")
    return pp / rep.t_pp, tg / rep.t_tg, (pp + tg) / (rep.t_pp + rep.t_tg)


@dataclass(frozen=True)
class LatencySummary:
    pp: MeanSd
    tg: MeanSd
    total: MeanSd
    t_pp_s: MeanSd
    t_tg_s: MeanSd

    def as_dict(self) -> dict[str, dict[str, float | int]]:
        return {k: getattr(self, k).as_dict() for k in ("pp", "tg", "total", "t_pp_s", "t_tg_s")}


def summarize_latency(pp: int, tg: int, reps: Sequence[RepTiming]) -> LatencySummary:
    """Mean ± sd over repetitions of the per-repetition rates (tokens/s) and raw times (s)."""
    if not reps:
        raise ValueError("no repetitions recorded")
    per_rep = [rates(pp, tg, r) for r in reps]
    return LatencySummary(
        pp=mean_sd([r[0] for r in per_rep]),
        tg=mean_sd([r[1] for r in per_rep]),
        total=mean_sd([r[2] for r in per_rep]),
        t_pp_s=mean_sd([r.t_pp for r in reps]),
        t_tg_s=mean_sd([r.t_tg for r in reps]),
    )


@dataclass(frozen=True)
class RunPlan:
    """The sizes a runner measures; reason says what was reduced and why (None: as requested)."""

    pp: int
    tg: int
    reps: int
    reason: str | None = None


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(x, 1.0)))))


def plan_within_budget(pp: int, tg: int, reps: int, s_per_pp_token: float, s_per_tg_token: float,
                       budget_s: float, min_reps: int = 2) -> RunPlan:
    """Fit warm-up + reps repetitions into budget_s, given probed seconds per token: first drop repetitions
    (to min_reps), then shrink pp and tg to powers of two (at least 16 and 4). A slow peer (stock vLLM W4A8 at
    a few tokens/s) still gets a row, with the reduction written into it."""
    per_rep = pp * s_per_pp_token + tg * s_per_tg_token
    if (reps + 1) * per_rep <= budget_s:
        return RunPlan(pp, tg, reps)
    floor_reps = min(reps, min_reps)
    fit = int(budget_s // per_rep) - 1 if per_rep > 0 else reps
    new_reps = max(floor_reps, min(reps, fit))
    why = f"estimated {per_rep:.1f} s per repetition against a {max(budget_s, 0):.0f} s budget"
    if (new_reps + 1) * per_rep <= budget_s:
        return RunPlan(pp, tg, new_reps, f"reps {reps} -> {new_reps}: {why}")
    shrink = max(budget_s, 0) / ((new_reps + 1) * per_rep)
    new_pp = min(pp, max(16, _pow2_floor(pp * shrink)))
    new_tg = min(tg, max(4, _pow2_floor(tg * shrink)))
    return RunPlan(new_pp, new_tg, new_reps,
                   f"pp {pp} -> {new_pp}, tg {tg} -> {new_tg}, reps {reps} -> {new_reps}: {why}")


def ratio(ours: float, theirs: float) -> float:
    """ours / theirs, NaN when either is missing or theirs is zero."""
    if not (ours == ours and theirs == theirs) or theirs == 0:
        return math.nan
    return ours / theirs


# ---- serving (streamed requests) ----


@dataclass
class RequestRecord:
    """What the client saw of one streamed request; times are perf_counter seconds.

    chunk_times: arrival time of every streamed chunk that carried text (first one = first token).
    output_tokens: from the server's usage report when given, else the number of chunks.
    """

    start: float
    end: float
    prompt_tokens: int
    output_tokens: int
    chunk_times: list[float] = field(default_factory=list)
    ok: bool = True
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else math.nan

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first; NaN for one-token outputs."""
        if not self.chunk_times or self.output_tokens < 2:
            return math.nan
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Dist:
    """mean, p50, p99 of a distribution in milliseconds."""

    mean_ms: float
    p50_ms: float
    p99_ms: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def dist_ms(values_s: Sequence[float]) -> Dist:
    vals = [v for v in values_s if v == v]  # drop NaN
    if not vals:
        return Dist(math.nan, math.nan, math.nan)
    return Dist(1e3 * math.fsum(vals) / len(vals), 1e3 * percentile(vals, 50), 1e3 * percentile(vals, 99))


@dataclass(frozen=True)
class ServeSummary:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # requests / s
    output_throughput: float  # output tokens / s
    total_throughput: float  # (input + output) tokens / s
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        for k in ("ttft", "tpot", "itl", "e2e"):
            d[k] = getattr(self, k).as_dict()
        return d


def summarize_serve(records: Sequence[RequestRecord], duration_s: float) -> ServeSummary:
    """Aggregate one concurrency level: failed requests count only in `failed`; throughput is over the wall time
    of the whole level (first send to last finish)."""
    if duration_s <= 0:
        raise ValueError(f"duration {duration_s} s is not positive")
    ok = [r for r in records if r.ok]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    return ServeSummary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        input_tokens=inp,
        output_tokens=out,
        request_throughput=len(ok) / duration_s,
        output_throughput=out / duration_s,
        total_throughput=(inp + out) / duration_s,
        ttft=dist_ms([r.ttft for r in ok]),
        tpot=dist_ms([r.tpot for r in ok]),
        itl=dist_ms([gap for r in ok for gap in r.itl]),
        e2e=dist_ms([r.latency for r in ok]),
    )


def efficiency(summary: ServeSummary, peak_tflops: float | None, peak_gbps: float | None) -> dict[str, float]:
    """The article's normalisations: TTFT efficiency 1 / (TFLOPS * TTFT[s]) and throughput per TFLOPS, plus the
    same per GB/s of memory bandwidth (decode on small models is memory bound)."""
    out: dict[str, float] = {}
    ttft_s = summary.ttft.mean_ms / 1e3
    for key, peak in (("tflops", peak_tflops), ("gbps", peak_gbps)):
        if peak is None:
            continue
        if peak <= 0:
            raise ValueError(f"--peak-{key} must be positive, got {peak}")
        out[f"ttft_efficiency_per_{key}"] = 1.0 / (peak * ttft_s) if ttft_s > 0 else math.nan
        out[f"total_throughput_per_{key}"] = summary.total_throughput / peak
        out[f"output_throughput_per_{key}"] = summary.output_throughput / peak
    return out
