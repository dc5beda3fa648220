"""One decode grid point computed: its kernel called through its entry point on the
point's inputs, against the fp64 reference, with the safe region's verdict and the
run's provenance (one row of ``store.DECODE_SCHEMA``).

Inputs (``decode_grid.INPUTS``). The paged kernels: ``fa_lab.kernels.pa_decode.cases.make``
(one sequence of ``context`` tokens, ``group`` query heads on one kv head, q, K, V ~ N(0, 1)
with K times ``spread``, so the logits' standard deviation is about ``spread``; a shuffled
page table), as ``fa-lab table --which decode`` builds them. MLA:
``fa_lab.studies.mla_mass_loss.gaussian_inputs`` (128 heads whose logits are N(0,
``spread``**2), V = 1 on the latent part).

The row: ``rows`` query rows (the kernel's rows x heads), ``undefined`` of them that see no
token (their reference is undefined), ``nan_rows`` of the others with a NaN or inf in
their output, ``nan``/``inf`` such elements, ``nan_frac`` the NaN share of the elements of
the rows that see a token; over the rows that see a token and come out finite:
``max_err`` the largest |out - fp64| in units of max |V|, ``rel_l2`` against fp64, and
``mass_loss`` the mean of 1 - <out, ref> / <ref, ref> (the share of the output's weight
lost: with V = 1 it is 1 - mean(out), MLA's deficit). ``violated``: the hazards of the
kernel's safe region the call is outside of (``onset.bound``'s ``pa_decode:<version>``
and ``mla_decode``; empty: inside), ``"no region"`` for the sliding-window kernel.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
import time

import torch

from fa_lab import decode, mla
from fa_lab.kernels import mla_decode, pa_decode
from fa_lab.studies import mla_mass_loss

from .point import _device_name, _static_provenance, _worker_address

_ROW_AXES = ("kernel", "upstream", "backend", "device", "page_size", "num_partitions",
             "num_partitions_used", "query_length", "scales", "window", "group", "head_dim",
             "p_headroom", "context", "spread", "seed", "point_id")


def _paged(point: dict):
    """(out [rows, D] fp64, ref fp64, max |V|, violated) of a paged decode point."""
    swa = point["kernel"] == "pa_decode_swa"
    case = pa_decode.cases.make([point["context"]], query_length=point["query_length"],
                                num_q_heads=point["group"], head_dim=point["head_dim"],
                                block_size=point["page_size"],
                                per_token=point["scales"] == "per_token", k_mult=point["spread"],
                                seed=point["seed"], spare_pages=1 if swa else 2)
    ref = pa_decode.cases.reference(case, sliding_window=point["window"] if swa else 0)
    vmax = float(case.value_scale.max()) * pa_decode.model.E4M3_MAX
    run = case
    if point["device"] != "cpu":
        run = dataclasses.replace(case, **{f.name: getattr(case, f.name).to(point["device"])
                                           for f in dataclasses.fields(case)})
    kw = {"upstream": point["upstream"], "backend": point["backend"]}
    t0 = time.perf_counter()
    if swa:
        out, q, kc, vc, bt, ctx, ks, vs = run.args()
        decode.pa_decode_ps_launch(out, q, kc, vc, ctx, None, None, None, ks, vs,
                                   sliding_window=point["window"], block_tables=bt,
                                   max_context_partition_num=point["num_partitions_used"], **kw)
        violated = "no region"
    else:
        out = decode.pa_decode_tile(*run.args(), num_partitions=point["num_partitions_used"], **kw)
        m = pa_decode.bound.measure(case, num_partitions=point["num_partitions_used"],
                                    upstream=point["upstream"])
        violated = ",".join(pa_decode.bound.region(point["upstream"]).violated(m))
    if point["device"] == "cuda":
        torch.cuda.synchronize()
    kernel_s = time.perf_counter() - t0
    d = out.shape[-1]
    return out.double().cpu().reshape(-1, d), ref.reshape(-1, d), vmax, violated, kernel_s


def _mla(point: dict):
    """(out [128, 512] fp64, ref fp64, max |V|, violated) of an MLA decode point."""
    M = mla_decode.model
    ctx, h = point["context"], point["p_headroom"]
    query, kv, pages, scale = mla_mass_loss.gaussian_inputs(point["spread"], ctx, point["seed"])
    indptr = torch.tensor([0, ctx], dtype=torch.int32)
    dev = point["device"]
    t0 = time.perf_counter()
    out, _ = mla.mla_decode(query.to(dev), kv.to(dev), indptr.to(dev), pages.to(dev), scale,
                            num_kv_splits=point["num_partitions_used"], backend=point["backend"],
                            p_headroom=h, upstream=point["upstream"])
    if dev == "cuda":
        torch.cuda.synchronize()
    kernel_s = time.perf_counter() - t0
    q, keys = query[0].float(), kv.float().reshape(-1, M.QK_HEAD_DIM)
    if ctx:
        ref, _ = M.reference(q, keys, scale)
        vmax = float(keys[:, :M.V_HEAD_DIM].abs().max())
    else:  # no key: every row's softmax is undefined
        ref = torch.full((M.NUM_HEADS, M.V_HEAD_DIM), math.nan, dtype=torch.float64)
        vmax = math.nan
    region = mla_decode.bound.region(None, headroom=h)
    hit = []
    sch = M.schedule([0, ctx], point["num_partitions_used"])
    for item in sch["work_info_set"].tolist():  # each work item's running max is its own
        k0, k1 = item[4], item[5]
        if k1 > k0:
            hit += [v for v in region.violated(mla_decode.bound.measure(q, keys[k0:k1], scale))
                    if v not in hit]
    return out[0].double().cpu(), ref, vmax, ",".join(hit), kernel_s


def _stats(out: torch.Tensor, ref: torch.Tensor, vmax: float) -> dict:
    seen = torch.isfinite(ref).all(-1)
    fin = torch.isfinite(out).all(-1)
    bad, ok = seen & ~fin, seen & fin
    o, r = out[ok], ref[ok]
    rr = (r * r).sum(-1)
    keep = rr > 0
    norm = float(torch.linalg.vector_norm(r))
    return {"rows": int(seen.numel()), "undefined": int((~seen).sum()),
            "nan_rows": int(bad.sum()), "nan": int(out[seen].isnan().sum()),
            "inf": int(out[seen].isinf().sum()),
            "nan_frac": float(out[seen].isnan().sum()) / out[seen].numel() if seen.any() else math.nan,
            "max_err": float((o - r).abs().max()) / vmax if ok.any() else math.nan,
            "rel_l2": float(torch.linalg.vector_norm(o - r)) / norm if norm > 0 else math.nan,
            "mass_loss": float((1 - (o * r).sum(-1)[keep] / rr[keep]).mean())
            if bool(keep.any()) else math.nan}


def outputs(point: dict):
    """One decode grid point's run: (out [rows, Dv] fp64 on the CPU, its fp64 reference,
    max |V|, the region's violated hazards, the kernel's seconds). A point on CUDA (backend
    ``triton``) on a machine without a GPU is refused before any work, ValueError naming
    the backend axis (``interpret`` runs the same port in Triton's interpreter)."""
    if point["device"] == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"backend {point['backend']!r} runs the compiled Triton port on a CUDA "
                         "device and this machine has none: set the grid's backend axis to "
                         "'interpret' (the same port in Triton's interpreter) or 'emulator', "
                         "or run the sweep on a cluster with GPU workers")
    return _mla(point) if point["kernel"] == "mla_decode" else _paged(point)


def compute_decode_point(point: dict) -> dict:
    """Run one decode grid point (``decode_grid.DecodeGrid.points()``) and return its table
    row (``store.DECODE_SCHEMA``)."""
    t0 = time.perf_counter()
    out, ref, vmax, violated, kernel_s = outputs(point)
    row = {a: point[a] for a in _ROW_AXES}
    row.update(_stats(out, ref, vmax))
    row["violated"] = violated
    row.update(_static_provenance())
    row.update({
        "device_name": _device_name(point["device"]),
        "worker": _worker_address(),
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
        "kernel_s": kernel_s,
        "ref_s": math.nan,
        "wall_s": time.perf_counter() - t0,
    })
    return row
