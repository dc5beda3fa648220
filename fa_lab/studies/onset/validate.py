"""The prediction against a model's output: the row-level confusion of one run
(``validate``) and over a grid of K scales and policies (``validate_grid``)."""

from __future__ import annotations

import math
import time

import pandas as pd
import torch

from .predict import Onset, predict, tile_maxima


def model_bad_rows(out: torch.Tensor) -> torch.Tensor:
    """[B, Sq, H] bool: rows of a model's output with any non-finite element."""
    return ~torch.isfinite(out.float()).all(-1)


def validate(pred: Onset, out: torch.Tensor) -> dict:
    """Row-level confusion of ``pred`` against a model's output ``out`` [B, Sq, H, D]:
    tp/fp/fn/tn, precision, recall, agreement, and the predicted and measured bad-row,
    non-finite and NaN fractions (percentage points of error in ``*_err_pp``)."""
    meas = model_bad_rows(out).cpu()
    p = pred.bad
    tp = int((p & meas).sum())
    fp = int((p & ~meas).sum())
    fn = int((~p & meas).sum())
    tn = int((~p & ~meas).sum())
    n = tp + fp + fn + tn
    outf = out.float()
    meas_nonfinite = float((~torch.isfinite(outf)).sum()) / outf.numel()
    meas_nan = float(torch.isnan(outf).sum()) / outf.numel()
    res = {"rows": n, "tp": tp, "fp": fp, "fn": fn, "tn": tn,
           "precision": tp / (tp + fp) if tp + fp else math.nan,
           "recall": tp / (tp + fn) if tp + fn else math.nan,
           "agreement": (tp + tn) / n if n else math.nan,
           "pred_bad_row_frac": pred.bad_row_frac, "model_bad_row_frac": float(meas.float().mean()),
           "pred_nonfinite_frac": pred.nonfinite_frac, "model_nonfinite_frac": meas_nonfinite,
           "pred_nan_frac": pred.nan_frac, "model_nan_frac": meas_nan}
    res["bad_row_err_pp"] = 100 * abs(res["pred_bad_row_frac"] - res["model_bad_row_frac"])
    res["nonfinite_err_pp"] = 100 * abs(res["pred_nonfinite_frac"] - res["model_nonfinite_frac"])
    res["nan_err_pp"] = (100 * abs(res["pred_nan_frac"] - meas_nan)
                         if not math.isnan(res["pred_nan_frac"]) else math.nan)
    return res


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def validate_grid(*, dtype: str = "bf16", B: int = 1, S: int = 2048, H: int = 4, D: int = 128,
                  k_scales=(8, 16, 24, 32, 40, 48, 56, 64), thresholds=(2, 4, 6, 8, 10, 12),
                  policies=("lazy_unfixed", "lazy", "fa4_row", "lazy_capped", "eager"),
                  causal: bool = False, seed: int = 0, device="cpu", backend: str = "emulator",
                  levels=("tile", "exact"), exact_thresholds=None, exact_scores: bool = True,
                  chunk_rows: int = 1024, model: bool = True, on_k=None,
                  heads: int | None = None, progress: bool = False) -> pd.DataFrame:
    """The predictor against the model on a grid of the seed's inputs (``experiments.
    bf16_inputs`` / ``fp8_inputs``, as ``fa_lab.studies.sweep`` builds them): one row per (K scale,
    policy, threshold, level) with the row-level confusion and the predicted and measured
    fractions (``validate``), and the times: ``model_s`` (one model run), ``tiles_s`` (the
    score pass, shared by every cell of a K scale), ``predict_s`` (the walk and verdict,
    plus the replay at the exact level). A policy without a threshold (eager) runs once
    per K scale. ``exact_thresholds``: the thresholds at which the exact level runs
    (default: all). ``model=False``: the predictor alone (no confusion; the measured
    columns are NaN), for grids whose model runs are recorded elsewhere. ``on_k``: called
    with the table so far after each K scale (to save partial results). ``heads``: keep
    only batch 0's first ``heads`` heads of the full-size draw (a subsample: the same
    inputs those heads have in the whole tensor)."""
    from fa_lab import api
    from fa_lab.studies import experiments as ex
    from fa_lab import policies as pols

    rows = []
    cells = [(pol, thr) for pol in policies
             for thr in (thresholds if pols.get(pol).lazy else (None,))]
    total = len(k_scales) * len(cells)
    done = 0
    for K in k_scales:
        if dtype == "fp8":
            (q, k, v), (qd, kd, vd) = ex.fp8_inputs(B, S, H, K, seed=seed, device=device, D=D)
            desc = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
        else:
            q, k, v = ex.bf16_inputs(B, S, H, D, K, seed=seed, device=device)
            desc = {}
        if heads is not None:
            q, k, v = (x[:1, :, :heads].contiguous() for x in (q, k, v))
        tiles = tile_maxima(q, k, v, causal=causal, exact_scores=exact_scores,
                            chunk_rows=chunk_rows, **desc)
        for pol, thr in cells:
            kw = {"causal": causal, "rescale": pol, "rescale_threshold": thr, **desc}
            out, model_s = None, math.nan
            if model:
                _sync(device)
                t0 = time.perf_counter()
                out = api.flash_attn_func(q, k, v, backend=backend, **kw)
                _sync(device)
                model_s = time.perf_counter() - t0
            for level in levels:
                if level == "exact" and exact_thresholds is not None and thr is not None \
                        and thr not in exact_thresholds:
                    continue
                pred = predict(q, k, v, level=level, tiles=tiles, chunk_rows=chunk_rows,
                               exact_scores=exact_scores, **kw)
                r = validate(pred, out) if out is not None else _unmeasured(pred)
                rows.append({"dtype": dtype, "B": B, "S": S, "H": H, "D": D, "causal": causal,
                             "heads_kept": heads,
                             "seed": seed, "k_scale": float(K), "policy": pol,
                             "threshold": math.nan if thr is None else float(thr),
                             "level": level, "backend": backend, **r,
                             "candidate_rows": pred.meta["candidate_rows"],
                             "model_s": model_s, "tiles_s": tiles.seconds,
                             "predict_s": pred.meta["walk_s"] + pred.meta["exact_s"]})
            del out
            done += 1
            if progress:
                print(f"\r{done}/{total} K={K} {pol} thr={thr}", end="", flush=True)
        del q, k, v, tiles
        if on_k is not None:
            on_k(pd.DataFrame(rows))
    if progress:
        print()
    return pd.DataFrame(rows)


def _unmeasured(pred: Onset) -> dict:
    nan = math.nan
    return {"rows": pred.rows, "tp": None, "fp": None, "fn": None, "tn": None,
            "precision": nan, "recall": nan, "agreement": nan,
            "pred_bad_row_frac": pred.bad_row_frac, "model_bad_row_frac": nan,
            "pred_nonfinite_frac": pred.nonfinite_frac, "model_nonfinite_frac": nan,
            "pred_nan_frac": pred.nan_frac, "model_nan_frac": nan, "bad_row_err_pp": nan,
            "nonfinite_err_pp": nan, "nan_err_pp": nan}


def worst_cell(table: pd.DataFrame, column: str = "bad_row_err_pp") -> dict:
    """The grid cell where the prediction misses by the most (ties: the first)."""
    i = table[column].astype(float).idxmax()
    return table.loc[i].to_dict()
