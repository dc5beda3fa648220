"""Numbers that describe an attention output: accuracy against a reference and the
shape of its failure (NaN/inf elements and rows, LSE on the bad rows)."""

from __future__ import annotations

import math

import torch


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over all elements, in fp64; NaN if out has any non-finite."""
    if out.shape != ref.shape:
        raise ValueError(f"out {tuple(out.shape)} and ref {tuple(ref.shape)} differ in shape")
    o, r = out.double(), ref.double()
    if not bool(torch.isfinite(o).all()):
        return math.nan
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r))


def finiteness(out: torch.Tensor, lse: torch.Tensor | None = None) -> dict:
    """NaN/inf counts of an output [B, S, H, D] by element and by row (a row is one
    (b, s, h)), and, given lse [B, H, S], how the LSE reads on the NaN rows."""
    nan = torch.isnan(out)
    inf = torch.isinf(out)
    n = out.numel()
    nan_rows = nan.any(-1)  # [B, S, H]
    inf_rows = inf.any(-1)
    stats = {
        "elements": n,
        "nan": int(nan.sum()),
        "inf": int(inf.sum()),
        "nan_frac": float(nan.sum()) / n,
        "inf_frac": float(inf.sum()) / n,
        "rows": nan_rows.numel(),
        "nan_rows": int(nan_rows.sum()),
        "inf_rows": int(inf_rows.sum()),
    }
    if lse is not None:
        lse_rows = lse.permute(0, 2, 1)  # [B, S, H], aligned with the rows above
        bad = lse_rows[nan_rows]
        good = lse_rows[~(nan_rows | inf_rows)]
        good = good[torch.isfinite(good)]
        stats.update({
            "nan_rows_lse_posinf": int((bad == math.inf).sum()),
            "nan_rows_lse_nan": int(torch.isnan(bad).sum()),
            "nan_rows_lse_finite": int(torch.isfinite(bad).sum()),
            "good_lse_min": float(good.min()) if good.numel() else math.nan,
            "good_lse_max": float(good.max()) if good.numel() else math.nan,
        })
    return stats


def summarize(out: torch.Tensor, ref: torch.Tensor | None = None,
              lse: torch.Tensor | None = None) -> dict:
    """finiteness() plus rel_l2 against ``ref`` when given."""
    stats = finiteness(out, lse)
    if ref is not None:
        stats["rel_l2"] = rel_l2(out, ref)
    return stats
