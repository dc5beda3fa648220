"""The prediction: a call checked, its tile maxima taken once (``tile_maxima``), and the
kernel's base recurrence replayed per policy (``predict``) into an ``Onset``."""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field

import pandas as pd
import torch

from fa_lab.api import flash_attn_func
from fa_lab.checks import warn_nonfinite_inputs
from fa_lab.numerics import ieee_fp32_matmul
from .recurrences import SCORE_MODS, Tiles, _Bf16, _Fp8, _INF


LEVELS = ("tile", "exact")

#: ``flash_attn_func``'s defaults, read off its signature: ``predict`` answers for the call
#: a user makes, so a bare ``predict(q, k, v)`` is a bare ``flash_attn_func(q, k, v)``
#: (causal, the current upstream's policy).
CALL_DEFAULTS = {name: p.default for name, p in inspect.signature(flash_attn_func).parameters.items()
                 if p.kind is p.KEYWORD_ONLY}


@dataclass
class Onset:
    """``predict``'s answer. Per row ([B, Sq, H]): ``bad`` (predicted non-finite output),
    ``step`` (first step, a KV tile for bf16 or a tile pair for fp8, at which it overflows;
    -1 if never), ``deficit`` (the largest deficit M - m the walk reaches, log2 units),
    ``margin`` (128 minus the tile level's estimate of log2 max|O| at its worst step:
    <= 0 means the tile level predicts overflow), ``dragged`` (loop steps at which the row
    was dragged down), ``elements`` / ``nan_elements`` (the predicted non-finite / NaN output
    elements of the row). ``meta``: kernel, policy, level, sizes, ``nonfinite_inputs`` (where
    q, k and v hold NaN or inf, in words, or None), candidate rows (exact
    level) and timings."""

    bad: torch.Tensor
    step: torch.Tensor
    deficit: torch.Tensor
    margin: torch.Tensor
    dragged: torch.Tensor
    elements: torch.Tensor | None = None
    nan_elements: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.bad.numel()

    @property
    def bad_row_frac(self) -> float:
        return float(self.bad.sum()) / max(1, self.bad.numel())

    @property
    def nonfinite_frac(self) -> float:
        """Predicted non-finite output elements over all elements."""
        D = self.meta["D"]
        if self.elements is None:
            return float(self.bad.sum()) * D / (self.bad.numel() * D)
        return float(self.elements.sum()) / (self.bad.numel() * D)

    @property
    def nan_frac(self) -> float:
        """Predicted NaN output elements over all elements."""
        if self.nan_elements is None:
            return math.nan
        return float(self.nan_elements.sum()) / (self.bad.numel() * self.meta["D"])

    def table(self) -> pd.DataFrame:
        """One row per predicted-bad row: batch, row, head, step, deficit, margin."""
        idx = self.bad.nonzero().tolist()
        return pd.DataFrame([{"batch": b, "row": r, "head": h, "step": int(self.step[b, r, h]),
                              "deficit": float(self.deficit[b, r, h]),
                              "margin": float(self.margin[b, r, h]),
                              "dragged": int(self.dragged[b, r, h])} for b, r, h in idx],
                            columns=["batch", "row", "head", "step", "deficit", "margin", "dragged"])


def _check(q, k, v, causal, rescale, rescale_threshold, rebase_bound, p_headroom, descales,
           fp8_saturate, kernel=None, bias=None, alibi_slopes=None):
    from fa_lab import api

    opts = {"causal": causal, "rescale": rescale, "rescale_threshold": rescale_threshold,
            "rebase_bound": rebase_bound, "p_headroom": p_headroom, "backend": "emulator",
            "kernel": kernel, "bias": bias, "alibi_slopes": alibi_slopes}
    if q.dtype == torch.float8_e4m3fn:
        opts.update(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                    fp8_saturate=fp8_saturate)
    planned = api.plan(q, k, v, **opts)
    call = planned.call
    other = [f for f in call.features if f not in SCORE_MODS]
    if other or call.packing is not None:
        raise NotImplementedError(f"onset.predict models dense calls with at most "
                                  f"{' and '.join(SCORE_MODS)}; got {', '.join(call.features)}")
    return call, planned.family


def tile_maxima(q, k, v, *, causal: bool = CALL_DEFAULTS["causal"], q_descale=None, k_descale=None,
                v_descale=None, exact_scores: bool = True, chunk_rows: int = 1024,
                bias=None, alibi_slopes=None) -> Tiles:
    """Every row's tile maxima (one matmul and an amax per tile; no exp, no PV): the only
    pass over the scores the tile level needs. Arguments as ``predict``."""
    fp8 = q.dtype == torch.float8_e4m3fn
    call, _ = _check(q, k, v, causal, "eager", None, None, None,
                     (q_descale, k_descale, v_descale), None, bias=bias,
                     alibi_slopes=alibi_slopes)
    kern = _Fp8(call) if fp8 else _Bf16(call, exact_scores)
    return kern.tiles(chunk_rows)


def predict(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
            causal: bool = CALL_DEFAULTS["causal"], rescale=CALL_DEFAULTS["rescale"],
            rescale_threshold=None, rebase_bound=None, p_headroom=None,
            q_descale=None, k_descale=None, v_descale=None, fp8_saturate=None,
            level: str = "tile", tiles: Tiles | None = None, exact_scores: bool = True,
            chunk_rows: int = 1024, kernel: str | None = None, bias=None,
            alibi_slopes=None) -> Onset:
    """Predict each row's fate under the kernel fa_lab would run for this call.

    Arguments as ``fa_lab.flash_attn_func``, with its defaults (``CALL_DEFAULTS``: causal,
    and the current upstream version's policy): q [B, Sq, H, D], k and v [B, Skv, Hkv, D];
    fp8 with its descales. ``level``: ``"tile"`` (tile
    maxima only: the one-hot estimate) or ``"exact"`` (candidate rows replayed with their
    known bases; see the module docstring). ``tiles``: a ``tile_maxima`` of the same
    inputs, to share the score pass between policies. ``exact_scores``: scores as the
    model computes them (the exact dot: fp64, one rounding to fp32), so the base sequence
    is the model's bit for bit; False: an fp32 matmul (faster; a few ulps off).
    ``chunk_rows``: rows whose scores are held at once (chunk_rows * Skv * 8 bytes).
    ``kernel``: force a kernel as ``flash_attn_func`` does ("swp_bf16", "swp_fp8").
    ``bias`` [Sq, Skv] and ``alibi_slopes`` [H] or [B, H]: as ``flash_attn_func`` (bf16/f16).
    Tensors may live on a GPU; the answer's tensors are on the CPU."""
    if level not in LEVELS:
        raise ValueError(f"level={level!r}; choose one of {LEVELS}")
    t0 = time.perf_counter()
    call, family = _check(q, k, v, causal, rescale, rescale_threshold, rebase_bound, p_headroom,
                          (q_descale, k_descale, v_descale), fp8_saturate, kernel, bias,
                          alibi_slopes)
    pol = call.policy
    bad_inputs = warn_nonfinite_inputs(q, k, v)  # the output carries them, not the policy
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    meta = {"kernel": family, "policy": pol.name, "policy_resolved": pol.describe(),
            "threshold": float(pol.threshold) if pol.lazy else None, "level": level,
            "B": B, "Sq": Sq, "Skv": Skv, "H": H, "Hkv": Hkv, "D": D, "causal": causal,
            "candidate_rows": 0, "tiles_s": 0.0, "walk_s": 0.0, "exact_s": 0.0,
            "nonfinite_inputs": bad_inputs}
    shape = (B, Sq, H)
    res = {"bad": torch.zeros(shape, dtype=torch.bool),
           "step": torch.full(shape, -1, dtype=torch.int64),
           "deficit": torch.zeros(shape), "margin": torch.full(shape, _INF),
           "dragged": torch.zeros(shape, dtype=torch.int64),
           "elements": torch.zeros(shape, dtype=torch.int64),
           "nan_elements": torch.zeros(shape, dtype=torch.int64)}
    if family not in KERNELS:  # the generic kernel: eager, never dragged
        meta.update(note=f"the {family} kernel is eager: no row is ever dragged",
                    seconds=time.perf_counter() - t0)
        return Onset(**res, meta=meta)
    kern = _Fp8(call) if family == "swp_fp8" else _Bf16(call, exact_scores)
    if (tiles is None or tiles.kernel != family or tiles.shape != kern.shape
            or tiles.fingerprint != kern.fingerprint
            or (family == "swp_bf16" and tiles.exact_scores != exact_scores)):
        tiles = kern.tiles(chunk_rows)
    meta["tiles_s"] = tiles.seconds
    with ieee_fp32_matmul():
        for rows, N, mt, arg, rest in tiles.groups:
            R, S = rows.numel(), mt.shape[-1]
            BH = B * H
            mt, arg = mt.reshape(BH, R, S), arg.reshape(BH, R, S)
            rest = None if rest is None else rest.reshape(BH, R, S)
            b_all, h_all, r_all = _unflatten(B, H, R)
            head_all = kern.head_index(R)
            per = max(1, CHUNK_ELEMENTS // (R * S))       # heads per piece, waves kept whole
            for c0 in range(0, BH, per):
                c1 = min(BH, c0 + per)
                f = slice(c0 * R, c1 * R)
                _predict_piece(kern, pol, level, res, meta, rows, N, Sq, H, chunk_rows,
                               mt[c0:c1].reshape(-1, S), arg[c0:c1].reshape(-1, S).long(),
                               None if rest is None else rest[c0:c1].reshape(-1, S),
                               head_all[f], b_all[f], h_all[f], r_all[f])
    meta["seconds"] = time.perf_counter() - t0
    return Onset(**res, meta=meta)


KERNELS = ("swp_bf16", "swp_fp8")


#: Row-steps handled at once by the walk and the verdict (whole heads at a time).
CHUNK_ELEMENTS = 1 << 23


def _predict_piece(kern, pol, level, res, meta, rows, N, Sq, H, chunk_rows, mt, arg, rest,
                   head, b_i, h_i, r_i):
    """The walk, the verdict and (exact level) the replay for some whole heads of a
    block group, written into ``res`` ([B, Sq, H] tensors on the CPU)."""
    tw = time.perf_counter()
    walk = kern.walk(mt, pol)
    tile = kern.tile_level(walk, mt, arg, rest, head)
    row = rows[r_i]
    real = row < Sq
    where = (b_i[real], row[real], h_i[real])
    for key in ("deficit", "margin", "dragged"):
        res[key][where] = tile[key][real.to(tile[key].device)].cpu().to(res[key].dtype)
    te = time.perf_counter()
    if level == "tile":
        idx = (tile["bad"].cpu() & real).nonzero().flatten()
        if idx.numel():
            w = (b_i[idx], row[idx], h_i[idx])
            res["bad"][w] = True
            res["step"][w] = tile["step"].cpu()[idx]
            n_el, n_nan = kern.one_hot_elements(tile, idx.to(mt.device), head, chunk_rows)
            res["elements"][w] = n_el
            res["nan_elements"][w] = n_nan
    else:
        cand = (tile["candidate"].cpu() & real).nonzero().flatten()
        meta["candidate_rows"] += int(cand.numel())
        hb = b_i[cand] * H + h_i[cand]
        for key in torch.unique(hb).tolist():
            mine = cand[hb == key]
            for c0 in range(0, mine.numel(), chunk_rows):
                sel = mine[c0:c0 + chunk_rows]
                b, h = divmod(key, H)
                sub = {n: walk[n][sel.to(mt.device)] for n in ("m", "corr")}
                fin, nan, st = (x.cpu() for x in kern.replay(b, h, rows[r_i[sel]], N, sub))
                w = (b_i[sel], row[sel], h_i[sel])
                res["elements"][w] = fin.sum(-1)
                res["nan_elements"][w] = nan.sum(-1)
                res["bad"][w] = fin.any(-1)
                res["step"][w] = torch.where(fin.any(-1), st, torch.full_like(st, -1))
    meta["walk_s"] += te - tw
    meta["exact_s"] += time.perf_counter() - te


def _unflatten(B, H, R):
    """(batch, head, row-in-group) of each flat index of a [B, H, R] layout."""
    f = torch.arange(B * H * R)
    return f // (H * R), (f // R) % H, f % R
