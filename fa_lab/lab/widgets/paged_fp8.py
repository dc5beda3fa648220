"""The kernel picker's paged fp8 prefill (FlyDSL #1066, ``fa_lab.kernels.swp_fp8.paged``):
one sequence of ``query_length`` query positions and ``group`` heads over ``context`` keys
in a shuffled page-64 table, causal (bottom-right), through ``flash_attn_func`` as a bare
call runs it (the builder's lazy threshold 8) and under the dense builder's threshold 6.

Per tile pair (the kernel reads two pages at a time; per tile of one page for an odd page
count, which runs the per-tile kernel) the view gives its key range, the pages it reads, and for the chosen row its largest score ``pmax`` (log2 units, the kernel's
fp32 scores) and its mass ``psum`` = sum 2^(s - pmax) over the keys it sees there (fp64):
where the row's softmax mass sits, and how far each pair's keys lie below the row's best
(P below 2^-(10 + H) flushes in the e4m3 cast, H = log2(448) - threshold; the per-tile
kernel has H = 0). The row's output
is checked against the fp64 reference under both thresholds, and the call against the
paged region (``onset.bound("swp_fp8_paged")``). Its inputs are
``kernels/swp_fp8/paged_cases.make``'s: q, V ~ N(0, 1), K ~ ``k_mult`` N(0, 1).
"""

from __future__ import annotations

import html
import math

import torch

import fa_lab
from fa_lab.kernels import swp_fp8
from fa_lab.kernels.swp_fp8.model import log2_scale
from fa_lab.studies import onset

from ..viz.decode import PAGED_PANELS, partitions_figure

#: The picker's label stem; the version follows it (``fa_lab.upstream.FP8_PAGED_VERSIONS``).
FAMILY = "swp_fp8_paged"
#: K's spread in the view (times N(0, 1) before the per-tensor quantization).
K_MULT = 4.0


def view(kernel: str, version: str, context: int, query_length: int, group: int, row: int,
         seed: int, figures) -> dict:
    """The paged fp8 prefill's view (module docstring); ``row`` = qi * group + g. A
    ``context`` of an odd page count runs #1066's per-tile kernel (``schedule`` "tile"):
    the parts are then its 64-key tiles, one page each, and the region's answer the
    per-tile region's (``onset.paged_fp8_tile``)."""
    case = swp_fp8.paged_cases.make([query_length], [context], H=group, Hkv=1, k_mult=K_MULT,
                            seed=seed, spare=1)
    try:
        schedule = onset.paged_fp8.schedule(case.q8, case.k5, case.v5, **case.call)
        out = fa_lab.flash_attn_func(case.q8, case.k5, case.v5, **case.call, backend="emulator")
    except ValueError as e:
        raise ValueError(f"context={context}: {e}") from None
    region = onset.bound(f"{FAMILY}:{version}")
    out6 = fa_lab.flash_attn_func(case.q8, case.k5, case.v5, **case.call, backend="emulator",
                                  rescale="lazy", rescale_threshold=6.0, p_headroom=True)
    ref = swp_fp8.paged_cases.reference(case)
    qi, g = divmod(row, group)
    sees = max(0, context - query_length + 1 + qi)
    c = case.call
    x = (case.q8[qi, g].double() @ case.dense[0][0][0, :, 0].double().T).float() * log2_scale(
        c["q_descale"], c["k_descale"], swp_fp8.paged_cases.HEAD_DIM)
    m = onset.paged_fp8.measure(case.q8, case.k5, case.v5, **case.call)
    ids = m.pages[0]
    per = 1 if schedule == "tile" else 2     # pages a tile (pair) reads
    width = per * swp_fp8.paged_cases.PAGE
    parts = []
    for p in range(len(ids) // per):
        lo, hi = width * p, min(width * (p + 1), sees)
        s = x[lo:hi].double()
        pmax = float(s.max()) if s.numel() else -math.inf
        psum = float(torch.exp2(s - pmax).sum()) if s.numel() else 0.0
        parts.append({"tiles": (width * p, width * (p + 1)),
                      "pages": tuple(int(i) for i in ids[per * p:per * (p + 1)]),
                      "pmax": pmax, "psum": psum, "weight": math.nan})
    rows = out.float().reshape(query_length * group, -1)
    ref_rows = ref.reshape(query_length * group, -1)
    err = float((rows[row].double() - ref_rows[row]).abs().max())
    err6 = float((out6.float().reshape(query_length * group, -1)[row].double()
                  - ref_rows[row]).abs().max())
    pol = region.tile.policy if schedule == "tile" else region.policy
    v = {"params": dict(kernel=kernel, context=context, query_length=query_length, group=group,
                        row=row, seed=seed, k_mult=K_MULT),
         "upstream": version, "schedule": schedule, "parts": parts, "pmax_units": "log2", "out": rows[row],
         "ref": ref_rows[row], "nan_rows": rows.isnan().any(-1).nonzero().flatten().tolist(),
         "bound": sees, "max_err": err, "max_err_threshold_6": err6,
         "threshold": float(pol.threshold), "violated": region.violated(m)}
    verdict = ("inside the paged region" if not v["violated"]
               else "outside the paged region: " + ", ".join(v["violated"]))
    which = ("the per-tile kernel, no P headroom" if schedule == "tile"
             else "the paired-page kernel")
    v["summary"] = (f"<b>{html.escape(kernel)}</b> ({which}, threshold {v['threshold']:g})<br>"
                    f"row {row}: sees {sees} "
                    f"of {context} keys, max |out - fp64| = {err:.3g} (threshold 6: {err6:.3g})"
                    f"<br>{verdict}")

    def make_figures(which):
        unit = "tile" if schedule == "tile" else "tile pair"
        title = (f"{kernel}: row {row} (sees {sees} of {context} keys), per {unit}: "
                 "max and mass of the row's scores")
        return {name: partitions_figure(parts, title=title, panels=PAGED_PANELS, unit="keys")
                for name in which if name == "partitions"}

    v["figures"] = make_figures(figures)
    v["make_figures"] = make_figures
    return v
