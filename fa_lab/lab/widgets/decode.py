"""The decode dashboard: a kernel picker (the paged decode at each modelled upstream version,
the MLA decode, and the paged fp8 prefill) and one call's partitions, their (max, sum) or LSE and the merge, for a
chosen row.

``compute_decode_view`` is the plain function of the controls' values (what the tests
call); ``decode_dashboard`` wires it to widgets through ``dashboards.Dashboard``, as the
other dashboards are wired. The call is built by ``fa_lab.kernels.pa_decode.cases`` (q, K,
V ~ N(0, 1), a shuffled page table) and run by ``fa_lab.decode.partitions``; the merged row
is checked against the fp64 reference. The MLA decode (``fa_lab.mla.mla_decode``) runs one
token over ``context`` keys cut into ``num_partitions`` KV splits, with V = 1 and
N(0, sigma**2) scores (``studies.mla_mass_loss.gaussian_inputs``), so the exact output is
1 and the row (a head, 0..127) shows the unscaled P cast's mass loss; the paged decode's
``query_length``, ``group``, ``per_token`` and ``block_size`` do not apply to it. The paged
fp8 prefill (FlyDSL #1066, ``paged_fp8.view``) runs ``query_length`` causal query positions
of ``group`` heads over ``context`` keys in pages of 64, per tile pair instead of per
partition; ``num_partitions``, ``per_token`` and ``block_size`` do not apply to it.
"""

from __future__ import annotations

import html
import math

import torch

from fa_lab import decode, mla
from fa_lab.kernels import mla_decode, pa_decode
from fa_lab.upstream import DECODE_VERSIONS, FP8_PAGED_VERSIONS

from ..viz.decode import MLA_PANELS, partitions_figure
from . import paged_fp8
from .views import _bool, _choice, _int

#: The kernels the picker offers: label -> (family, upstream version).
KERNELS = {**{f"pa_decode @ {name}": ("pa_decode", name) for name in DECODE_VERSIONS},
           **{f"mla_decode @ {name}": ("mla_decode", name) for name in mla_decode.VERSIONS},
           **{f"{paged_fp8.FAMILY} @ {name}": (paged_fp8.FAMILY, name)
              for name in FP8_PAGED_VERSIONS}}
DEFAULT_KERNEL = "pa_decode @ main-11c4174d"
#: The MLA view's score spread (the standard deviation of its natural-log scores).
MLA_SIGMA = 4.0


def compute_decode_view(kernel=DEFAULT_KERNEL, context=257, query_length=4, group=2,
                        num_partitions=2, per_token=True, row=0, block_size=16, seed=11, *,
                        figures=("partitions",)) -> dict:
    """One decode call (one sequence, one kv head, ``group`` query heads) under ``kernel``
    (a ``KERNELS`` label): ``parts`` (per partition: tile range, max in ``pmax_units``,
    sum, merge weight), the chosen ``row``'s output and its fp64 reference, ``nan_rows``,
    the ``summary`` (HTML) and ``figures``/``make_figures`` (``partitions``). Every value
    is checked before any work (ValueError/TypeError naming it)."""
    _choice("kernel", kernel, tuple(KERNELS))
    context = _int("context", context, 0, 1281)
    query_length = _int("query_length", query_length, 1, 17)
    group = _int("group", group, 1, 17)
    num_partitions = _int("num_partitions", num_partitions, 1, 9)
    per_token = _bool("per_token", per_token)
    _choice("block_size", block_size, (16, 64))
    seed = _int("seed", seed, 0)
    family, version = KERNELS[kernel]
    if family == "mla_decode":
        return _mla_view(kernel, version, context, num_partitions, _int("row", row, 0, mla.NUM_HEADS),
                         seed, figures)
    row = _int("row", row, 0, query_length * group)
    if family == paged_fp8.FAMILY:
        return paged_fp8.view(kernel, version, context, query_length, group, row, seed, figures)
    case = pa_decode.cases.make([context], query_length=query_length, num_q_heads=group,
                                block_size=block_size, per_token=per_token, seed=seed)
    rec = decode.partitions(case.query, case.key_cache, case.value_cache, case.block_tables,
                            case.context_lengths, case.key_scale, case.value_scale,
                            num_partitions=num_partitions, upstream=version)
    out = rec["output"].float().reshape(query_length * group, -1)
    ref = pa_decode.cases.reference(case).reshape(query_length * group, -1)
    weights = rec.get("weights")
    parts = [{"tiles": rec["tiles"][0][p], "pmax": float(rec["pmax"][0, 0, p, row]),
              "psum": float(rec["psum"][0, 0, p, row]),
              "weight": float(weights[0, 0, p, row]) if weights is not None else math.nan}
             for p in range(num_partitions)]
    view = {"params": dict(kernel=kernel, context=context, query_length=query_length,
                           group=group, num_partitions=num_partitions, per_token=per_token,
                           row=row, block_size=block_size, seed=seed),
            "upstream": version, "parts": parts, "pmax_units": rec["pmax_units"],
            "out": out[row], "ref": ref[row], "nan_rows": out.isnan().any(-1).nonzero().flatten().tolist(),
            "bound": row_bound(context, query_length, group, row)}
    view["max_err"] = float((out[row].double() - ref[row]).abs().max())
    view["summary"] = _summary(view)

    def make_figures(which):
        title = (f"{kernel}: row {row} (sees {view['bound']} of {context} tokens), "
                 f"{num_partitions} partition(s), max in {view['pmax_units']} units")
        return {name: partitions_figure(parts, title=title) for name in which
                if name == "partitions"}

    view["figures"] = make_figures(figures)
    view["make_figures"] = make_figures
    return view


def _mla_view(kernel, version, context, num_splits, row, seed, figures) -> dict:
    """The MLA decode's view: one token, ``context`` keys in ``num_splits`` KV splits."""
    query, kv_buffer, pages, scale = _mla_inputs(context, seed)
    out, split_lse = mla.mla_decode(query, kv_buffer, torch.tensor([0, context], dtype=torch.int32),
                                    pages, scale, num_kv_splits=num_splits, backend="emulator")
    sch = mla_decode.model.schedule([0, context], num_splits)
    ranges = [(int(i[4]), int(i[5])) for i in sch["work_info_set"]]
    lse = split_lse[:, 0, row, 0].double()
    weights = torch.softmax(lse, 0) if len(ranges) > 1 else torch.full_like(lse, math.nan)
    parts = [{"tiles": r, "lse": float(lse[j]), "weight": float(weights[j])}
             for j, r in enumerate(ranges)]
    heads = out[0].float()
    ref = torch.ones(mla.V_HEAD_DIM, dtype=torch.float64) if context else \
        torch.full((mla.V_HEAD_DIM,), math.nan, dtype=torch.float64)
    view = {"params": dict(kernel=kernel, context=context, num_partitions=num_splits, row=row,
                           seed=seed, sigma=MLA_SIGMA),
            "upstream": version, "parts": parts, "pmax_units": "lse (natural log)",
            "out": heads[row], "ref": ref,
            "nan_rows": heads.isnan().any(-1).nonzero().flatten().tolist(), "bound": context}
    view["max_err"] = float((heads[row].double() - ref).abs().max())
    view["summary"] = _summary(view).replace("tokens", "keys")

    def make_figures(which):
        title = (f"{kernel}: head {row}, {context} keys in {len(ranges)} split(s), V = 1, "
                 f"score sigma {MLA_SIGMA}")
        return {name: partitions_figure(parts, title=title, panels=MLA_PANELS, unit="keys")
                for name in which if name == "partitions"}

    view["figures"] = make_figures(figures)
    view["make_figures"] = make_figures
    return view


def _mla_inputs(context: int, seed: int):
    from fa_lab.studies import mla_mass_loss
    return mla_mass_loss.gaussian_inputs(MLA_SIGMA, max(context, 1), seed)  # a page even when empty


def row_bound(context: int, query_length: int, group: int, row: int) -> int:
    """How many tokens row ``row`` (= qi * group + g) sees (``model.row_bounds``)."""
    return max(0, pa_decode.model.row_bounds(context, query_length, group)[row])


def _summary(view) -> str:
    nan = view["nan_rows"]
    rows = f"NaN rows: {nan}" if nan else "no NaN row"
    if view["bound"] == 0:
        err = "sees no token (no reference)"
    elif math.isnan(view["max_err"]):
        err = f"sees {view['bound']} tokens, comes out NaN"
    else:
        err = f"sees {view['bound']} tokens, max |out - fp64| = {view['max_err']:.3g}"
    return (f"<b>{html.escape(view['params']['kernel'])}</b><br>{rows}<br>row "
            f"{view['params']['row']}: {err}")


def decode_dashboard(kernel=DEFAULT_KERNEL, context=257, query_length=4, group=2,
                     num_partitions=2, per_token=True, row=0, *, block_size=16, seed=11):
    """The kernel picker and the partitions of one decode call, for a chosen row."""
    import ipywidgets as W

    from .dashboards import Dashboard, _style, _wide

    style, wide = _style(), _wide()
    controls = {
        "kernel": W.Dropdown(options=list(KERNELS), value=kernel, description="kernel",
                             style=style, layout=wide),
        "context": W.IntSlider(value=context, min=0, max=1280, description="context",
                               continuous_update=False, style=style, layout=wide),
        "query_length": W.IntSlider(value=query_length, min=1, max=16, description="query len",
                                    continuous_update=False, style=style, layout=wide),
        "num_partitions": W.IntSlider(value=num_partitions, min=1, max=8,
                                      description="partitions", continuous_update=False,
                                      style=style, layout=wide),
        "per_token": W.Checkbox(value=per_token, description="per-token scales", indent=False),
        "row": W.IntSlider(value=row, min=0, max=16 * group - 1, description="row",
                           continuous_update=False, style=style, layout=wide),
    }
    fixed = dict(group=group, block_size=block_size, seed=seed)
    d = Dashboard(compute_decode_view, controls, fixed, main=("partitions",), tabs=(), auto=())
    d.widget.add_class("fa-lab-dashboard")
    d.widget.add_class("fa-lab-decode-dashboard")
    return d

