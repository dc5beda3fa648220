"""Predict which rows a lazy rescale kills, from tile maxima, without the kernel's accumulation.

    from fa_lab.studies import onset
    pred = onset.predict(q, k, v, rescale="lazy_unfixed", causal=False)
    pred.bad            # [B, Sq, H] bool: rows predicted to come out non-finite
    pred.step           # [B, Sq, H] int: the step (KV tile; fp8: tile pair) where they overflow
    pred.bad_row_frac, pred.nonfinite_frac, pred.nan_frac
    onset.validate(pred, out)   # row-level confusion against a model's output

    tiles = onset.tile_maxima(q, k, v)                  # the score pass, once per input ...
    onset.predict(q, k, v, rescale="lazy", tiles=tiles)  # ... shared by every policy
    onset.validate_grid(S=2048, H=4, k_scales=(8, 32, 64))  # predictor vs model on a grid

    region = onset.bound("fa4_fp8_saturation:before")   # the safe region in closed form
    region.contains(onset.measure(q, k, v, policy="fa4_fp8_saturation:before"))
    onset.bound("swp_fp8_paged")        # FlyDSL #1066's paged fp8 prefill (onset.paged_fp8)
    onset.bound("swp_fp8_paged_tile")   # its per-tile kernel (onset.paged_fp8_tile)
    onset.bound("swp_fp8_split")        # FlyDSL #1097's fp8 split-K (onset.fp8_split)
    onset.bound("pa_decode_swa")        # the sliding-window decode (kernels/pa_decode/swa_bound.py)

**The mechanism** (``docs/semantics.md`` §7). Every row keeps a base ``m`` and, in real
arithmetic, ``l = 2^(M - m) L`` and ``O_d = 2^(M - m) L o_d``, where ``M`` is the best score
it has seen, ``L = sum 2^(s - M)`` is in [1, n] and ``o`` is its correct partial output. The
gap ``M - m`` is the **deficit** δ. A rescale that rebases a row *down* (a wave fired and
the row's own tile max sits below its base: it is *dragged*) raises δ by ``m - mt``;
the row's own later jumps lower it again. fp32 overflows at 2^128, so component ``d`` of O
is lost once ``δ + log2 L + log2|o_d| >= 128``, and inf never comes back. The row's output
is then non-finite. (l alone overflowing makes the output ``O * rcp(inf) = 0``: finite,
wrong, and not counted here as a bad row; the model agrees.)

**The prediction** needs only the row's tile maxima ``mt`` (one matmul and an amax per
tile; no exp, no PV), because the base sequence ``m_t`` is a function of them alone: the
ballot compares ``mt - m`` with the threshold per 32-row wave, and the rebase picks ``mt``,
``fmax(m, mt)`` or keeps ``m``. ``predict`` replays that recurrence with the kernel's own
decision function (``fa_lab.kernels._common.models.decide``, so user policies and rules work), then
judges overflow at two levels:

* ``level="tile"`` (default): the one-hot estimate. ``L ~ 1`` and ``o ~ v[j*]``, the value
  row of the best key so far, so component ``d`` dies at the first step where
  ``M_t - m_t + log2 |v[j*, d]| >= 128`` (NaN where l overflows too). Cheapest: scores,
  amax, argmax, the walk.
* ``level="exact"``: the tile level's upper bound (``L <= n``, ``|o_d| <= max|v|``) picks the
  *candidate* rows that could overflow; only those are replayed, each freed from its wave
  because its bases and factors are known, in the kernel's own arithmetic (fp32 state,
  exact dots, the P packs rounded), which gives each element's fate. Rows that cannot reach
  2^128 are never touched by an exp.

Kernels: DUALWAVE_SWP bf16/f16 (§2: prologue, lazy main loop over tiles ``1 .. N-4`` with
the 16/48 PV split, eager epilogue) and fp8 BN128 (§3: one decision per tile pair, P cast
to e4m3 before PV, headroom H). An fp8 base so low that the addend ``0 - ls * m`` is +inf
(a causal row with no visible key, floored at -3e38, once ls >= 1.1342746) kills the row
at that pair (§1.2). Calls that upstream routes to the generic kernel are eager and never
drag: every row is predicted finite.

Score modifiers: ``bias`` and ``alibi_slopes`` (bf16/f16) enter the scores exactly as the
model adds them (``models.swp_bf16.ScoreMods``, before masking), so they move the tile maxima,
the ballot and the walk. A row whose prologue tile is fully masked in a non-causal call
(a -inf bias over its first 64 keys: no causal floor, §1.2) starts from the base -inf, and
``exp2(-inf - -inf)`` is NaN at every column: the whole row is predicted NaN at step 1.
The sink, split-K and varlen are not modelled here (``predict`` takes no such argument).
"""

from .recurrences import OVERFLOW_LOG2, PACK_LIMIT_LOG2, PACK_FLOOR_LOG2, SCORE_MODS, Tiles
from .predict import LEVELS, Onset, tile_maxima, predict, KERNELS, CHUNK_ELEMENTS
from .validate import model_bad_rows, validate, validate_grid, worst_cell
from .bound import FAMILY_BOUNDS, UNBOUNDED, Hazard, Region, bound, register_family
from .measure import Measure, measure
from . import fixed_max, fp8_split, paged_fp8, paged_fp8_tile

__all__ = ["OVERFLOW_LOG2", "PACK_LIMIT_LOG2", "PACK_FLOOR_LOG2", "SCORE_MODS", "Tiles", "LEVELS", "Onset",
           "tile_maxima", "predict", "KERNELS", "CHUNK_ELEMENTS", "model_bad_rows", "validate",
           "validate_grid", "worst_cell", "Hazard", "Measure", "Region", "bound", "measure", "UNBOUNDED",
           "FAMILY_BOUNDS", "register_family", "paged_fp8", "paged_fp8_tile", "fp8_split", "fixed_max"]
