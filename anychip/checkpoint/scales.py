"""Group scale choice for symmetric INT4: q = clamp(round(w / s), -8, 7), one BF16 scale s per group of G columns.

Three ways, named by `SCALE_SEARCHES`:
    amax   s = amax / 7 (RTN's scale; no search)
    clip   s = ratio * amax / 7 over a grid of ratios, minimizing sum |q s - w|^2.4 (GPTQ's reference `mse` option)
    mse    the same grid minimizing the squared error weighted by each column's input energy diag(H) (the output
           error a diagonal Hessian predicts), then least-squares refinement: s = sum h w q / sum h q^2, rounded to
           BF16, q re-rounded, kept only where it lowers the error

Every candidate is rounded to BF16 before q is computed, so the error measured is the error readers see.
"""

from __future__ import annotations

import torch

from anychip.checkpoint.rtn import INT4_MAX, INT4_MIN, group_scales

SCALE_SEARCHES: tuple[str, ...] = ("amax", "clip", "mse")
#: Candidates ratio * amax / 7 (0.875 puts a negative extreme exactly on -8).
SEARCH_RATIOS = torch.linspace(0.6, 1.0, 41)
CLIP_NORM = 2.4  # GPTQ's reference code: the error norm its `mse` scale search minimizes
REFINE_STEPS = 2
CHUNK_ELEMENTS = 1 << 22


def _quantize(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(w / safe).clamp_(INT4_MIN, INT4_MAX)


def search_scales(w: torch.Tensor, group_size: int, method: str = "mse",
                  col_weight: torch.Tensor | None = None, signed: bool = False) -> torch.Tensor:
    """(N, K) weights -> (N, K // G) bf16 scales by `method`; col_weight (K,) >= 0 weights the columns' errors
    (diag H; None: all 1). An all-zero group gets scale 1. signed: a group's scale may be negative, which puts
    the grid's extra level (-8 s) on the side of the group's larger extreme (llama.cpp's Q4_0 does the same): each
    group keeps whichever sign quantizes it with the lower error (the positive one on a tie)."""
    if method not in SCALE_SEARCHES:
        raise ValueError(f"scale search {method!r}: use one of {SCALE_SEARCHES}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group size {group_size}")
    if method == "amax":
        if signed:
            raise ValueError("signed scales come from a search: use clip or mse")
        return group_scales(w, group_size)
    if not signed:
        return _search(w, group_size, method, col_weight)[0]
    pos, pos_err = _search(w, group_size, method, col_weight)
    neg, neg_err = _search(-w, group_size, method, col_weight)  # round(w / -s) = -round(-w / s): the same error
    return torch.where(neg_err < pos_err, -neg, pos)


def _search(w: torch.Tensor, group_size: int, method: str,
            col_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """search_scales by clip or mse with positive scales: (scales, each group's error with them, in `method`'s
    measure)."""
    n, k = w.shape
    base = group_scales(w, group_size)  # (N, K // G) bf16, 1 for an all-zero group
    wg = w.float().view(n, k // group_size, group_size)  # (N, g, G)
    h = (torch.ones(k, device=w.device) if col_weight is None or method == "clip" else
         col_weight.float().clamp(min=0)).view(1, k // group_size, group_size)
    best_err = torch.full(base.shape, float("inf"), device=w.device)
    best = base.clone()
    ratios = SEARCH_RATIOS.to(w.device)
    chunk = max(1, CHUNK_ELEMENTS // w.numel())  # ratios scored at once: few Python steps, bounded memory
    for r0 in range(0, len(ratios), chunk):
        s = (ratios[r0:r0 + chunk, None, None] * base.float()[None]).to(torch.bfloat16)  # (R, N, g)
        err = _error(wg[None], s, h[None], method)
        i = err.argmin(dim=0, keepdim=True)  # ties -> the smallest ratio, as GPTQ's reference search
        e, c = err.gather(0, i)[0], s.gather(0, i)[0]
        better = e < best_err
        best = torch.where(better, c, best)
        best_err = torch.where(better, e, best_err)
    if method == "mse":
        for _ in range(REFINE_STEPS):
            q = _quantize(wg, best.float().unsqueeze(2))
            den = (h * q * q).sum(dim=2)
            ls = torch.where(den > 0, (h * wg * q).sum(dim=2) / den.clamp(min=1e-30), best.float())
            s = ls.clamp(min=1e-30).to(torch.bfloat16)
            err = _error(wg, s, h, method)
            better = (err < best_err) & (s > 0)
            best = torch.where(better, s, best)
            best_err = torch.where(better, err, best_err)
    return torch.where(wg.abs().amax(dim=2) > 0, best, torch.ones_like(best)), best_err


def _error(wg: torch.Tensor, s: torch.Tensor, h: torch.Tensor, method: str) -> torch.Tensor:
    """(..., g) error of quantizing the groups wg (..., g, G) with scales s (..., g)."""
    sf = s.float().unsqueeze(-1)
    d = (_quantize(wg, sf) * sf - wg).abs_()
    return d.pow_(CLIP_NORM).sum(dim=-1) if method == "clip" else (d.square_() * h).sum(dim=-1)
