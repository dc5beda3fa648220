"""What a dashboard shows, as plain functions of its control values: each
``compute_*_view`` checks them, runs the kernels (through the cache) and returns the data
and the figures. No browser needed: the tests call these.

A selected policy runs with its own threshold, rebase bound and P headroom unless a control
moves them (``None``, the default, keeps its own). Every lazy policy a view runs beside it
(the fix the row is drawn beside, the other rows of the table) runs at the same threshold
and headroom, so the views compare rules, not settings. A policy run at a setting other
than its own is a variant, named as one (``variant``: ``"cap24 (thr 7)"``) in the tables,
the summaries and the figures; at its own settings it keeps its plain name."""

from __future__ import annotations

import dataclasses
import html
import math

import numpy as np
import pandas as pd
import torch

from fa_lab import metrics, policies, reference
from fa_lab.checks import check_device, nonfinite_inputs
from fa_lab.lab import viz
from fa_lab.api import flash_attn_func, trace
from fa_lab.studies.experiments import bf16_inputs, fp8_inputs, quantize_e4m3
from fa_lab.kernels._common.geometry import BLOCK_M, WAVE_ROWS
from .cache import _CACHE, _figure


#: The built-in policies a dashboard compares, in display order; registered user policies
#: join them (``compared``), and every registered policy is in the dropdowns.
BF16_POLICIES = ("lazy_unfixed", "lazy", "eager")


FP8_POLICIES = ("lazy_unfixed", "lazy_capped", "lazy", "eager")


#: The dashboards' default sizes on a CPU: chosen to redraw within the latency goal on
#: 2 cores (benchmarks/bench_widgets.py measures it; docs/performance.md has the numbers).
CPU_DEFAULTS = dict(S=1024, H=1, D=128)


FP8_CPU_DEFAULTS = dict(S=1024, H=1)


#: Figure sizes (px): the main figure and the tabs' figures share the right column; with
#: the control column (LEFT_WIDTH) they fit a 1600 x 1000 screen with JupyterLab's file
#: browser open.
LEFT_WIDTH = 320


FIGURE_WIDTH = 860


MAIN_HEIGHT = 430


TAB_HEIGHT = 370


#: The heatmap's choices, by label. The swept flag's cells are named by what the policy
#: did to the row (``viz.tracedata.SWEEP_OUTCOMES``): dragged, or left alone.
HEAT_VALUES = (("deficit", "deficit"), ("running max m", "m"), ("tile max", "mt"),
               ("log2(l)", "l"), ("log2(corr)", "corr"), ("swept: dragged or left alone", "swept"),
               ("voted", "vote"), ("wave fired", "fire"))


def _same_threshold(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return float(a) == float(b)


def _headroom_key(h):
    """A P headroom as compared: True (PR #1020's lift, which follows the threshold) apart
    from every number; False and 0 alike (no lift)."""
    return "pr1020" if h is True else float(h)


def _headroom_words(h) -> str:
    if h is True:
        return "headroom #1020"
    return "no headroom" if not h else f"headroom {float(h):g}"


def variant(policy, *, threshold=None, rebase_bound=None, p_headroom=None) -> policies.Policy:
    """The policy ``policy`` (a registered name or a Policy) as a view runs it: with
    ``threshold`` (lazy policies), ``rebase_bound`` (capped policies) and ``p_headroom``
    where given, its own settings where None or where the setting does not apply to it.
    Where a given setting differs from its own, the result is a variant: the same policy
    with those settings, named ``"NAME (thr 7; bound 20; headroom #1020)"`` (the settings
    that differ; ``viz.style.policy_color`` gives it NAME's colour). Otherwise the policy itself,
    under its plain name."""
    pol = policies.as_policy(policy)
    changes, words = {}, []
    if threshold is not None and pol.lazy and not _same_threshold(threshold, pol.threshold):
        changes["threshold"] = threshold
        words.append(f"thr {threshold}" if isinstance(threshold, str) else f"thr {float(threshold):g}")
    if (rebase_bound is not None and "rebase_bound" in pol.parameters
            and float(rebase_bound) != float(pol.rebase_bound)):
        changes["rebase_bound"] = float(rebase_bound)
        words.append(f"bound {float(rebase_bound):g}")
    if p_headroom is not None and _headroom_key(p_headroom) != _headroom_key(pol.p_headroom):
        changes["p_headroom"] = p_headroom
        words.append(_headroom_words(p_headroom))
    if not changes:
        return pol
    return dataclasses.replace(pol, name=f"{pol.name} ({'; '.join(words)})", **changes)


def view_threshold(policy: str, threshold=None):
    """The threshold a view runs its lazy policies at: ``threshold`` if given, else the
    selected ``policy``'s own (upstream's DEFAULT_THRESHOLD for a policy without one, such
    as eager)."""
    if threshold is not None:
        return threshold
    pol = policies.get(policy)
    return pol.threshold if pol.lazy else policies.DEFAULT_THRESHOLD


def compared(base: tuple, selected: str) -> tuple:
    """``base``, then every registered user policy (not the zoo's presets: they are listed,
    not compared), then ``selected`` if still missing."""
    names = [*base, *(n for n in policies.user_names() if n not in base)]
    return tuple(names) + (() if selected in names else (selected,))


def _lazy(name: str) -> bool:
    return policies.get(name).lazy


def fix_of(policy: str) -> str:
    """The policy a row is drawn beside: the fix (``lazy``), or for ``lazy`` itself the
    unfixed rule it replaced."""
    return "lazy_unfixed" if policy == "lazy" else "lazy"


def default_device() -> str:
    """Where the dashboards run: a GPU when there is one (Triton kernels), else the CPU
    (the exact model)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _positive_number(name, x):
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {x!r}")
    return x


def _nonneg_number(name, x):
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {x!r}")
    return x


def _int(name, x, lo, hi=None):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    x = int(x)
    if x < lo or (hi is not None and x >= hi):
        rng = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={x} out of range {rng}")
    return x


def _bool(name, x):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return bool(x)


def _choice(name, x, options):
    if x not in options:
        raise ValueError(f"{name}={x!r}; choose one of {list(options)}")
    return x


def block_trace(q, k, v, rows: range, *, head: int = 0, causal: bool = False, **options):
    """``fa_lab.trace`` of ``rows`` run on their 256-row blocks only. Query blocks never
    interact, so this is the full run's trace, bit for bit, at a fraction of its cost.
    Non-causal: the blocks that hold ``rows``. Causal masks are bottom-right aligned, so
    the run keeps every row from the first block on (the mask of each row is unchanged)."""
    S = q.shape[1]
    b0 = (rows.start // BLOCK_M) * BLOCK_M
    b1 = S if causal else min(S, -(-rows.stop // BLOCK_M) * BLOCK_M)
    if (b0, b1) == (0, S):
        return trace(q, k, v, rows=rows, head=head, causal=causal, **options)
    tr = trace(q[:, b0:b1].contiguous(), k, v, rows=range(rows.start - b0, rows.stop - b0),
               head=head, causal=causal, **options)
    tr.lanes["row"] = tr.lanes["row"] + b0
    tr.steps["row"] = tr.steps["row"] + b0
    return tr


def _auto_tile(tr, lane: int) -> int:
    """The step a wave figure opens on: where the lane first went non-finite, else the
    first step its wave swept it (dragged or left alone), else the first loop step."""
    first = tr.lanes.loc[lane, "first_nonfinite_step"]
    if not pd.isna(first):
        return int(first)
    d = tr.lane(lane)
    drags = d.step[d.swept]
    return int(drags.iloc[0]) if len(drags) else min(1, tr.n_steps - 1)


def _lane_figures(view, names, heat_value, tile) -> dict:
    """The figures of a lane dashboard, by name (each memoised, see ``_figure``):
    ``row`` (the row under its policy beside the fix), ``wave`` (its wave at one step),
    ``heatmap`` (its wave, step by step) and ``nonfinite`` (every bad row)."""
    tr, other, lane, p = view["trace"], view.get("trace_fix"), view["lane"], view["params"]
    out, lse = view["out"], view.get("lse")
    row = p["row"]
    makers = {
        "row": lambda: _figure(
            lambda: viz.lanes.row_compare({tr.policy.name: tr, other.policy.name: other}, lane,
                                          height=MAIN_HEIGHT) if other is not None
            else viz.lanes.lane_lines(tr, lane), (tr, other), "row", lane),
        "wave": lambda: _figure(lambda: viz.heatmap.wave_ballot(tr, tile, wave=row, highlight=lane),
                                tr, "wave", tile, lane),
        "heatmap": lambda: _figure(lambda: viz.heatmap.running_max_heatmap(tr, heat_value,
                                                                           highlight=lane), tr, "heat",
                                   heat_value, lane),
        "nonfinite": lambda: _figure(lambda: viz.outputs.nonfinite_map(
            out, lse=lse, highlight=(row, p["head"]), height=TAB_HEIGHT), out, "nonfinite",
            row, p["head"]),
    }
    return {n: makers[n]() for n in names}


LANE_FIGURES = ("row", "wave", "heatmap", "nonfinite")


def _which(figures) -> tuple:
    if figures is True:
        return LANE_FIGURES
    if figures is False or figures is None:
        return ()
    bad = [f for f in figures if f not in LANE_FIGURES]
    if bad:
        raise ValueError(f"figures={list(figures)}: choose among {LANE_FIGURES}")
    return tuple(figures)


def _bf16_inputs(S, H, D, k_scale, seed, device):
    return _CACHE.get(("bf16", S, H, D, k_scale, seed, str(device)),
                      lambda: bf16_inputs(1, S, H, D, k_scale, seed=seed, device=device))


def wave_rows(row: int, S: int, n_waves: int = 1) -> range:
    """The query rows of the ``n_waves`` 32-row waves starting at ``row``'s wave."""
    w0 = (row // WAVE_ROWS) * WAVE_ROWS
    return range(w0, min(S, w0 + n_waves * WAVE_ROWS))


def _stats_row(name, out, ref=None):
    fin = metrics.finiteness(out)
    row = {"policy": name, "nan_pct": 100 * fin["nan_frac"], "inf_pct": 100 * fin["inf_frac"],
           "nan_rows": fin["nan_rows"], "rows": fin["rows"]}
    if ref is not None:
        row["rel_l2"] = metrics.rel_l2(out, ref)
    return row


def _tile_arg(tile, n_steps):
    if tile is None:
        return None
    return _int("tile", tile, 0, n_steps)


def _finish_view(view: dict, tile, names, heat_value, run_policy, summary) -> dict:
    """The shared tail of the bf16 and fp8 views: the step shown (``tile``, or the followed
    row's own), the summary, and ``make_figures(which)``, which first runs the policy over
    the whole input (``run_policy() -> (out, lse)``) when a partial view needs it."""
    view["tile"] = _tile_arg(tile, view["trace"].n_steps)
    if view["tile"] is None:
        view["tile"] = _auto_tile(view["trace"], view["lane"])
    view["params"]["tile"] = view["tile"]
    view["summary"] = summary(view)

    def make_figures(which):
        if "nonfinite" in which and view["out"] is None:   # a partial view: run policy now
            view["out"], view["lse"] = run_policy()
        return _lane_figures(view, which, heat_value, view["tile"])

    view["figures"] = make_figures(names)
    view["make_figures"] = make_figures
    return view


def _bf16_threshold(policy: str, threshold):
    """The bf16 views' threshold: a number >= 0, the selected policy's own when None."""
    thr = view_threshold(policy, threshold)
    if isinstance(thr, str):
        raise ValueError(f"policy {policy!r} has threshold {thr!r}, the fp8 kernel's rule; "
                         "give threshold= a number for the bf16 kernel")
    return _nonneg_number("threshold", thr)


def compute_rescale_view(k_scale=32, threshold=None, policy="lazy_unfixed", causal=False,
                         S=CPU_DEFAULTS["S"], seed=0, row=0, *, H=CPU_DEFAULTS["H"],
                         D=CPU_DEFAULTS["D"], head=0, n_waves=1, heat_value="deficit",
                         tile=None, device=None, backend="auto", figures=True,
                         with_trace=True, all_policies=True) -> dict:
    """Everything the bf16 dashboard shows for one setting of its controls.

    Inputs are the seed's (q, v ~ N(0,1), k = N(0,1) x ``k_scale``, bf16, batch 1, from
    ``experiments.bf16_inputs`` with ``seed``). Runs every policy of ``compared`` (lazy
    ones at ``threshold``: None is ``policy``'s own) and the fp32 reference, and traces the
    ``n_waves`` waves from ``row``'s wave under ``policy`` and under the fix (``fix_of``),
    on the row's block. A policy run at a threshold other than its own is a ``variant``.

    Returns a dict: ``stats`` (DataFrame: NaN %, inf %, NaN rows, rel-L2 per policy run,
    named as run: a variant by its variant name), ``label`` (what ``policy`` ran as),
    ``out`` and ``lse`` of ``policy``, ``outputs`` (all policies, by the names in
    ``stats``), ``reference``, ``trace``,
    ``trace_fix``, ``lane`` (``row``'s lane in the trace), ``tile`` (the wave figure's step:
    ``tile``, or where the row breaks), ``summary`` (HTML) and ``figures``: all of
    ``LANE_FIGURES`` (``figures=True``), none (False) or the names given;
    ``make_figures(names)`` builds others from the same view later.
    ``all_policies=False`` runs only what the figures asked for need (the traces; the output
    of ``policy`` for the bad-row map, also when ``make_figures`` asks for that map), without
    the reference (``partial`` is True): what a dashboard draws first, before the summary's
    numbers.
    """
    k_scale = _positive_number("k_scale", k_scale)
    policy = _choice("policy", policy, policies.names())
    threshold = _bf16_threshold(policy, threshold)
    causal = _bool("causal", causal)
    S = _int("S", S, 1)
    H = _int("H", H, 1)
    D = _choice("D", D, (64, 128))
    seed = _int("seed", seed, 0)
    row = _int("row", row, 0, S)
    head = _int("head", head, 0, H)
    n_waves = _int("n_waves", n_waves, 1)
    _choice("heat_value", heat_value, tuple(viz.style.TRACE_VALUES))
    names = _which(figures)
    device = default_device() if device is None else check_device("device", device)

    key = ("bf16", S, H, D, k_scale, seed, str(device))
    q, k, v = _bf16_inputs(S, H, D, k_scale, seed, device)
    ref = (_CACHE.get(key + ("ref", causal), lambda: reference.attention(q, k, v, causal=causal)[0])
           if all_policies else None)

    def as_run(name):
        return variant(name, threshold=threshold)

    def run(pol):
        return _CACHE.get(key + (pol, causal, backend), lambda: flash_attn_func(
            q, k, v, causal=causal, rescale=pol, return_lse=True, backend=backend))

    # all_policies=False: only what the figures asked for need run (a trace runs its block)
    runs = (compared(BF16_POLICIES, policy) if all_policies else
            (policy,) if "nonfinite" in names else ())
    ran = {pol.name: pol for pol in map(as_run, runs)}
    outputs = {name: run(pol) for name, pol in ran.items()}
    stats = pd.DataFrame([_stats_row(p, o, ref) for p, (o, _) in outputs.items()],
                         columns=["policy", "nan_pct", "inf_pct", "nan_rows", "rows", "rel_l2"])
    if ref is None:
        stats["rel_l2"] = math.nan
    label = as_run(policy).name
    out, lse = outputs.get(label, (None, None))
    view = {
        "params": dict(k_scale=k_scale, threshold=threshold, policy=policy, causal=causal, S=S,
                       seed=seed, row=row, H=H, D=D, head=head, device=str(device)),
        "label": label, "policies": ran, "stats": stats, "out": out, "lse": lse,
        "reference": ref,
        "outputs": {p: o for p, (o, _) in outputs.items()}, "partial": not all_policies,
        "nonfinite_inputs": _CACHE.get(key + ("nonfinite",), lambda: nonfinite_inputs(q, k, v)),
    }
    if not with_trace:
        view["summary"] = _rescale_summary(view)
        return view
    rows = wave_rows(row, S, n_waves)

    def traced(name):
        pol = as_run(name)
        return _CACHE.get(key + ("trace", pol, causal, backend, head, rows.start, rows.stop),
                          lambda: block_trace(q, k, v, rows, head=head, causal=causal, rescale=pol,
                                              backend=backend))

    tr = traced(policy)
    view["trace"], view["trace_fix"] = tr, traced(fix_of(policy))
    view["lane"] = row - rows.start
    return _finish_view(view, tile, names, heat_value, lambda: run(as_run(policy)),
                        _rescale_summary)


def _stats_html(stats: pd.DataFrame, highlight: str, columns, ran=None) -> str:
    """The table of ``stats``, a row per policy run, in its colour (``ran``: the policies
    run, by the names in ``stats``)."""
    ran = ran or {}
    head = "".join(f"<th style='padding:1px 5px;white-space:nowrap'>{html.escape(c)}</th>"
                   for c, _ in columns)
    body = []
    for _, r in stats.iterrows():
        color = viz.style.policy_color(ran.get(r["policy"], r["policy"]))
        weight = "bold" if r["policy"] == highlight else "normal"
        cells = "".join(f"<td style='padding:1px 5px;text-align:right;white-space:nowrap'>"
                        f"{fmt(r)}</td>" for _, fmt in columns[1:])
        body.append(f"<tr style='font-weight:{weight}'><td style='padding:1px 5px;"
                    f"white-space:nowrap;color:{color}'>&#9632; {html.escape(str(r['policy']))}"
                    f"</td>{cells}</tr>")
    return f"<table style='font-size:12px'><tr>{head}</tr>{''.join(body)}</table>"


def _row_sentence(view) -> str:
    p = view["params"]
    if "trace" not in view:
        return ""
    lane = view["trace"].lanes.loc[view["lane"]]
    first = lane["first_nonfinite_step"]
    where = ("stays finite" if pd.isna(first) else
             f"goes non-finite at KV step {int(first)}")
    return (f"<div style='margin-top:4px'>Row <b>{p['row']}</b> (head {p['head']}) under "
            f"<b>{html.escape(view['label'])}</b> {where}; LSE = "
            f"{viz.tracedata.fmt_number(float(lane['lse']), 6)}; "
            f"{viz.tracedata.sweep_words(view['trace'].lane(view['lane']))}. "
            f"The wave tab shows step {view.get('tile', 0)}.</div>")


def _rescale_summary(view) -> str:
    p = view["params"]
    pending = view.get("partial", False)
    cols = [("policy", None),
            ("NaN %", lambda r: f"{r['nan_pct']:.3f}"),
            ("NaN rows", lambda r: f"{int(r['nan_rows'])}"),
            ("rel-L2", lambda r: "..." if pending else "NaN" if math.isnan(r["rel_l2"])
             else f"{r['rel_l2']:.2e}")]
    return (f"<div class='fa-lab-summary' style='font-size:12px;line-height:1.35'>"
            f"<b>bf16, K x{p['k_scale']:g}, threshold {p['threshold']:g}, "
            f"{'causal' if p['causal'] else 'non-causal'}</b><br>S={p['S']}, H={p['H']}, "
            f"D={p['D']}, seed {p['seed']}, {p['device']}; rel-L2 against fp32"
            + _stats_html(view["stats"], view["label"], cols, view["policies"])
            + ("<div style='color:#777'>the policies' numbers against fp32: "
               "computing...</div>" if pending else "") + _input_sentence(view)
            + _row_sentence(view) + "</div>")


def _input_sentence(view) -> str:
    """Where the inputs themselves hold NaN or inf (``checks.nonfinite_inputs``): said in
    the summary, so that no policy is blamed for them."""
    note = view.get("nonfinite_inputs")
    return ("" if note is None else
            f"<div style='color:#b30000;margin-top:4px'>Inputs: {html.escape(note)}.</div>")


def _headroom(x):
    """A view's P headroom: None (the policy's own), a bool (PR #1020's lift or none) or a
    number of log2 units >= 0."""
    if x is None or isinstance(x, (bool, np.bool_)):
        return None if x is None else bool(x)
    return _nonneg_number("headroom", x)


def compute_fp8_view(k_scale=5000.0, threshold=None, policy="lazy_unfixed", rebase_bound=None,
                     headroom=None, causal=False, S=FP8_CPU_DEFAULTS["S"], seed=0, row=0, *,
                     H=FP8_CPU_DEFAULTS["H"], head=0, n_waves=1, heat_value="deficit",
                     tile=None, device=None, backend="auto", figures=True,
                     all_policies=True) -> dict:
    """Everything the fp8 dashboard shows: the seed's fp8 inputs (q = 0.1 N, k = 0.1 k_scale
    N, V = ones, per-tensor e4m3) through the fp8 kernel under ``policy``, and the chosen
    row's wave traced under it and under the fix.

    ``threshold``: a number (log2 units) or ``"by_kv_len"`` (PR #1020's rule);
    ``rebase_bound``: used by capped policies only; ``headroom``: True for PR #1020's P
    lift, False for none, or a number of log2 units. Each None is ``policy``'s own; the fix
    runs at the same threshold and headroom, and a policy run away from its own settings
    is a ``variant``. Returns a dict with ``policy`` (the resolved policy run, named as run),
    ``label`` (that name), ``stats`` (mean |o - 1| over finite elements, NaN and inf counts),
    ``out``, ``lse``, ``trace``, ``trace_fix``, ``lane``, ``tile``, ``summary``, ``figures``
    and ``make_figures`` (as ``compute_rescale_view``). ``all_policies=False`` (the name
    ``compute_rescale_view`` gives it) runs only the traces, without the whole output and
    its statistics (``stats`` is None, ``partial`` True) unless the bad-row map is asked
    for: what the dashboard draws first.
    """
    k_scale = _positive_number("k_scale", k_scale)
    if threshold is not None and threshold != policies.BY_KV_LEN:
        threshold = _nonneg_number("threshold", threshold)
    if rebase_bound is not None:
        rebase_bound = _nonneg_number("rebase_bound", rebase_bound)
    headroom = _headroom(headroom)
    policy = _choice("policy", policy, policies.names())
    threshold = view_threshold(policy, threshold)
    if headroom is None:
        headroom = policies.get(policy).p_headroom
    causal = _bool("causal", causal)
    S = _int("S", S, 1)
    H = _int("H", H, 1)
    seed = _int("seed", seed, 0)
    row = _int("row", row, 0, S)
    head = _int("head", head, 0, H)
    n_waves = _int("n_waves", n_waves, 1)
    _choice("heat_value", heat_value, tuple(viz.style.TRACE_VALUES))
    names = _which(figures)
    device = default_device() if device is None else check_device("device", device)

    key = ("fp8", S, H, k_scale, seed, str(device))
    (q8, k8, v8), (qd, kd, vd) = _CACHE.get(key, lambda: fp8_inputs(1, S, H, k_scale, seed=seed,
                                                                      device=device))

    def as_run(name):
        return variant(name, threshold=threshold, rebase_bound=rebase_bound, p_headroom=headroom)

    def args_for(name):
        return dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                    rescale=as_run(name), backend=backend)

    def pkey(args):
        return key + tuple(sorted((k, v if k == "rescale" else str(v)) for k, v in args.items()
                                  if "descale" not in k))

    args = args_for(policy)

    def run_policy():
        return _CACHE.get(pkey(args), lambda: flash_attn_func(q8, k8, v8, return_lse=True,
                                                              **args))

    out, lse = run_policy() if all_policies or "nonfinite" in names else (None, None)
    rows = wave_rows(row, S, n_waves)

    def traced(name):
        a = args_for(name)
        return _CACHE.get(pkey(a) + ("trace", head, rows.start, rows.stop),
                          lambda: block_trace(q8, k8, v8, rows, head=head, **a))

    tr = traced(policy)
    stats = None
    if all_policies:
        fin = metrics.finiteness(out)
        dev = (out.double() - 1.0).abs()
        ok = torch.isfinite(dev)
        mad = float(dev[ok].mean()) if bool(ok.any()) else math.nan
        stats = {"mean_abs_dev": mad, "nan": fin["nan"], "inf": fin["inf"],
                 "elements": fin["elements"], "nan_rows": fin["nan_rows"], "rows": fin["rows"]}
    lane = row - rows.start
    own = policies.get(policy)
    view = {
        "params": dict(k_scale=k_scale, threshold=threshold, policy=policy,
                       rebase_bound=(rebase_bound if rebase_bound is not None
                                     else own.rebase_bound),
                       headroom=headroom, causal=causal, S=S, seed=seed, row=row, H=H,
                       head=head, device=str(device)),
        "policy": tr.policy, "label": tr.policy.name, "stats": stats, "out": out, "lse": lse,
        "trace": tr, "trace_fix": traced(fix_of(policy)), "lane": lane,
        "partial": stats is None,
        "nonfinite_inputs": _CACHE.get(key + ("nonfinite",), lambda: nonfinite_inputs(q8, k8, v8)),
    }
    return _finish_view(view, tile, names, heat_value, run_policy, _fp8_summary)


def _fp8_summary(view) -> str:
    p, s, pol = view["params"], view["stats"], view["policy"]
    color = viz.style.policy_color(pol.name)
    settings = ([f"threshold {pol.threshold:g} log2 units"] if pol.lazy else ["eager"]) + (
        [f"rebase bound {pol.rebase_bound:g}"] if pol.rebase_bound is not None else []) + (
        [f"P headroom {pol.p_headroom:.3f}"] if pol.p_headroom else [])
    return (f"<div class='fa-lab-summary' style='font-size:12px;line-height:1.35'>"
            f"<b>fp8, k x{p['k_scale']:.6g}, {'causal' if p['causal'] else 'non-causal'}</b>"
            f"<br>S={p['S']}, H={p['H']}, seed {p['seed']}, {p['device']}<br>"
            f"<span style='color:{color}'>&#9632;</span> <b>{html.escape(pol.name)}</b> "
            f"({', '.join(settings)})<br>"
            + ("<span style='color:#777'>mean |o - 1| and NaN counts of the whole output: "
               "computing...</span>" if s is None else
               f"mean |o - 1| over finite elements: <b>{viz.tracedata.fmt_number(s['mean_abs_dev'], 4)}</b><br>"
               f"NaN elements: <b>{s['nan']}</b> of {s['elements']} "
               f"({100 * s['nan'] / s['elements']:.3f} %), inf: {s['inf']}; "
               f"{s['nan_rows']} of {s['rows']} rows NaN")
            + _input_sentence(view) + _row_sentence(view) + "</div>")


def compute_compare_view(k_scale=32, threshold=None, fp8_policy="lazy", causal=False,
                         S=CPU_DEFAULTS["S"], seed=0, head=0, *, H=CPU_DEFAULTS["H"],
                         D=128, device=None, backend="auto", figures=True) -> dict:
    """The bf16 repro inputs through the unfixed lazy, fixed lazy and eager bf16 kernels
    and, quantised per tensor to e4m3, through the fp8 kernel (``fp8_policy``); each output
    against the fp32 reference of the bf16 inputs. Every lazy policy runs at ``threshold``
    (None: ``fp8_policy``'s own); one run away from its own is a ``variant`` (the fp8
    output is ``"fp8"``; the summary names the policy it ran, as run). Returns ``stats``, ``outputs``, ``reference``, ``summary`` and ``figures``
    (difference)."""
    k_scale = _positive_number("k_scale", k_scale)
    fp8_policy = _choice("fp8_policy", fp8_policy, policies.names())
    threshold = _bf16_threshold(fp8_policy, threshold)
    causal = _bool("causal", causal)
    S = _int("S", S, 1)
    H = _int("H", H, 1)
    D = _choice("D", D, (128,))
    seed = _int("seed", seed, 0)
    head = _int("head", head, 0, H)
    device = default_device() if device is None else check_device("device", device)
    base = compute_rescale_view(k_scale, threshold, "lazy", causal, S, seed, 0, H=H, D=D,
                                head=head, device=device, backend=backend, figures=False,
                                with_trace=False)
    q, k, v = _bf16_inputs(S, H, D, k_scale, seed, device)
    key = ("fp8-of-bf16", S, H, D, k_scale, seed, str(device))
    (q8, qd), (k8, kd), (v8, vd) = _CACHE.get(key, lambda: tuple(quantize_e4m3(x) for x in (q, k, v)))
    pol8 = variant(fp8_policy, threshold=threshold)
    o8 = _CACHE.get(key + (pol8, causal, backend), lambda: flash_attn_func(
        q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, rescale=pol8,
        backend=backend))
    ref = base["reference"]
    outputs = dict(base["outputs"])
    outputs["fp8"] = o8
    stats = pd.concat([base["stats"], pd.DataFrame([_stats_row("fp8", o8, ref)])],
                      ignore_index=True)
    view = {"params": dict(base["params"], fp8_policy=fp8_policy), "fp8_label": pol8.name,
            "stats": stats, "nonfinite_inputs": base["nonfinite_inputs"],
            "outputs": outputs, "reference": ref}
    p = view["params"]
    cols = [("output", None),
            ("NaN %", lambda r: f"{r['nan_pct']:.3f}"),
            ("rel-L2", lambda r: "NaN" if math.isnan(r["rel_l2"]) else f"{r['rel_l2']:.3e}")]
    view["summary"] = (f"<div class='fa-lab-summary' style='font-size:12px'><b>K x{p['k_scale']:g}, "
                       f"threshold {p['threshold']:g}</b><br>S={p['S']}, H={p['H']}; fp8 = e4m3 "
                       f"per tensor under {html.escape(pol8.name)}; rel-L2 against fp32"
                       + _stats_html(stats, "", cols, base["policies"]) + _input_sentence(view)
                       + "</div>")

    def make(which):
        if "difference" not in which:
            return {}
        fig = _figure(lambda: viz.outputs.output_difference_rows(outputs, ref, head=head,
                                                                 policies=base["policies"]),
                      (o8, *(o for o in outputs.values())), "difference", head)
        return {"difference": fig}

    view["figures"] = make(("difference",) if figures else ())
    view["make_figures"] = make
    return view
