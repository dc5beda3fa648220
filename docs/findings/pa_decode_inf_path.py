"""Repro for pa_decode_inf_path.md: FlyDSL main's paged decode (``pa_decode_tile`` at
11c4174d), on calls of more than 16 query rows (several M-tiles), sets a row's first
correction to exp2(0 - m) while its running max is still -inf. Where the row's first tile
maximum m is -128 log2 units or lower, that is exp2(128) = inf, and l = 0 * inf = NaN.

One sequence of 64 tokens, one KV head, QL = 1, per-tensor scales; every query is ones
and every key the same, so every row's scores are equal and the exact output is the mean
of V. The key scale is stepped one fp32 ulp at a time across the edge m = -128. With 16
query heads (one M-tile, the -1e30 path) the output is the mean of V on both sides; with
17 (two M-tiles, the -inf path) every row is NaN from m = -128 on. The fix's arithmetic
is the one-M-tile path's correction, exp2(m_prev - m_new) = exp2(-inf) = 0.

Run: python docs/findings/pa_decode_inf_path.py
"""

import numpy as np
import torch

from fa_lab import decode
from fa_lab.kernels.pa_decode import cases

MAIN = "main-11c4174d"
CTX = 64
#: The two adjacent fp32 key scales on either side of m = -128 (``edge_key_scale()`` finds
#: them; the findings test checks that it still does).
EDGE_KEY_SCALES = (0.02475525252521038, 0.02475525438785553)


def _case(group: int, key_scale: float):
    c = cases.make([CTX], num_q_heads=group, block_size=16, seed=0, shuffle=False,
                   spare_pages=0)
    c.query.fill_(1.0)
    c.key_cache.view(torch.uint8).fill_(0xFE)      # every key element is e4m3 -448
    c.key_scale.fill_(key_scale)
    return c


def run(group: int, key_scale: float) -> dict:
    """The call's first-tile max m (log2 units), its NaN rows, and its largest error
    against the fp64 reference where finite."""
    c = _case(group, key_scale)
    rec: dict = {}
    out = decode.pa_decode_tile(*c.args(), num_partitions=1, upstream=MAIN, recorder=rec)
    ref = cases.reference(c)
    o = out.double()
    fin = torch.isfinite(o).all(-1)
    err = float((o - ref).abs()[fin].max()) if bool(fin.any()) else None
    return {"m": float(rec["first_max"].flatten()[0]), "rows": int(fin.numel()),
            "nan_rows": int((~fin).sum()), "max_err": err}


def edge_key_scale() -> tuple[float, float]:
    """(the largest key scale whose m stays above -128, the next fp32 one), found by
    bisection on the fp32 grid (m falls as the key scale grows)."""
    lo, hi = np.float32(1e-3), np.float32(1.0)
    while np.nextafter(lo, hi) != hi:
        mid = np.float32((float(lo) + float(hi)) / 2)
        if mid in (lo, hi):
            mid = np.nextafter(lo, hi)
        if run(16, float(mid))["m"] > -128.0:
            lo = mid
        else:
            hi = mid
    return float(lo), float(hi)


def repro(edge: tuple[float, float] | None = None) -> dict:
    """{(query heads, "inside" / "outside"): ``run``} at the edge's two key scales
    (``edge``, default ``EDGE_KEY_SCALES``)."""
    inside, outside = EDGE_KEY_SCALES if edge is None else edge
    return {(g, side): run(g, ks) for g in (16, 17)
            for side, ks in (("inside", inside), ("outside", outside))}


if __name__ == "__main__":
    for (g, side), r in repro(edge_key_scale()).items():
        path = "one M-tile, -1e30 path" if g <= 16 else "two M-tiles, -inf path"
        err = "-" if r["max_err"] is None else f"{r['max_err']:.2e}"
        print(f"{g} heads ({path}), m = {r['m']:.6f}: NaN rows {r['nan_rows']}/{r['rows']}, "
              f"max error where finite {err}")
