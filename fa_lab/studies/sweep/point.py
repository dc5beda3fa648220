"""One grid point computed: the call it names, its outputs' finiteness, error against
fp32, bad-row statistics and rescale counts, with the provenance of the run."""

from __future__ import annotations

import datetime as _dt
import functools
import math
import os
import platform
import socket
import subprocess
import time

import torch

from .grid import BY_KV_LEN, ROOT, _call_kwargs, _policy_name


@functools.lru_cache(maxsize=None)
def _static_provenance() -> dict:
    from fa_lab import __version__

    try:
        from importlib.metadata import version
        triton_version = version("triton")
    except Exception:  # noqa: BLE001
        triton_version = None
    commit = os.environ.get("FA_LAB_GIT_COMMIT")
    if commit is None:
        try:
            r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10)
            if r.returncode == 0:
                commit = r.stdout.strip()
                d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   cwd=ROOT, capture_output=True, text=True, timeout=10)
                if d.returncode == 0 and d.stdout.strip():
                    commit += "-dirty"
        except (OSError, subprocess.SubprocessError):
            pass
    return {"fa_lab_version": __version__, "torch_version": torch.__version__,
            "triton_version": triton_version, "python_version": platform.python_version(),
            "hostname": socket.gethostname(), "git_commit": commit}


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _worker_address() -> str | None:
    try:
        from distributed import get_worker
        return get_worker().address
    except (ImportError, ValueError):
        return None


def _bad_row_stats(out: torch.Tensor, lse: torch.Tensor, ref: torch.Tensor) -> dict:
    finite = torch.isfinite(out).all(-1)  # [B, S, H]
    bad = ~finite
    lse_rows = lse.permute(0, 2, 1)  # [B, S, H]
    lb = lse_rows[bad]
    stats = {
        "bad_rows": int(bad.sum()),
        "bad_row_frac": float(bad.sum()) / bad.numel(),
        "bad_rows_lse_posinf": int((lb == math.inf).sum()),
        "bad_rows_lse_neginf": int((lb == -math.inf).sum()),
        "bad_rows_lse_finite": int(torch.isfinite(lb).sum()),
        "bad_rows_lse_nan": int(torch.isnan(lb).sum()),
        "ref_nonfinite_rows": int((~torch.isfinite(ref).all(-1)).sum()),
    }
    o, r = out[finite].double(), ref[finite].double()
    norm = torch.linalg.vector_norm(r)
    stats["rel_l2_finite_rows"] = (float(torch.linalg.vector_norm(o - r) / norm)
                                   if o.numel() and norm > 0 else math.nan)
    return stats


FINITENESS_KEYS = ("elements", "rows", "nan", "inf", "nan_frac", "inf_frac", "nan_rows",
                   "inf_rows", "nan_rows_lse_posinf", "nan_rows_lse_nan", "nan_rows_lse_finite",
                   "good_lse_min", "good_lse_max")


COUNT_KEYS = ("loop_wave_steps", "o_multiplies", "o_rescale_skip_frac", "rows_swept",
              "rows_scaled_up", "row_steps")


def _run_decided(point: dict, q, k, v, kw: dict, count: bool):
    """(out, lse, counts or None): the point's call run as its grid's expansion planned it
    (``api.plan_decided``: no routing or policy resolution again), with a rescale counter
    on the model when ``count`` (``api.count_rescales``'s counts)."""
    from fa_lab import api, dispatch
    from fa_lab.counters import RescaleCounter

    planned = api.plan_decided(point["kernel"], point["policy_planned"], q, k, v,
                               return_lse=True, **kw)
    counter = RescaleCounter(planned.call.policy) if count else None
    out, lse = dispatch.run(planned, counter)
    return out, lse, counter.summary() if count else None


def compute_point(point: dict, *, counts: str = "auto") -> dict:
    """Run one grid point and return its table row (see ``SCHEMA``). ``counts``: "auto"
    counts rescales where it is free (bf16 on the emulator: the counted model run is the
    run); "always" also for bf16 on other backends (one more model run); "never"."""
    from fa_lab import api, metrics, reference
    from fa_lab.studies import experiments as ex

    t0 = time.perf_counter()
    device = point["device"]
    B, S, H, D, K, seed = (point[a] for a in ("B", "S", "H", "D", "k_scale", "seed"))
    if point["dtype"] == "fp8":
        (q, k, v), (qd, kd, vd) = ex.fp8_inputs(B, S, H, K, seed=seed, device=device, D=D)
        desc = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    else:
        q, k, v = ex.bf16_inputs(B, S, H, D, K, seed=seed, device=device)
        desc = {}
    kw = {**_call_kwargs(point), **desc}
    cnt, source = {}, None
    t1 = time.perf_counter()
    counted = point["dtype"] == "bf16" and point["backend"] == "emulator" and counts != "never"
    if "policy_planned" in point:  # planned once, when the grid was expanded
        out, lse, c = _run_decided(point, q, k, v, kw, counted)
        if counted:
            cnt, source = c, "model run"
    elif counted:
        c = api.count_rescales(q, k, v, **kw)
        out, lse = c.pop("out"), c.pop("lse")
        cnt, source = c, "model run"
    else:
        out, lse = api.flash_attn_func(q, k, v, return_lse=True, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    kernel_s = time.perf_counter() - t1
    if point["dtype"] == "bf16" and counts == "always" and source is None:
        if "policy_planned" in point:
            _, _, cnt = _run_decided(point, q, k, v, {**kw, "backend": "emulator"}, True)
        else:
            c = api.count_rescales(q, k, v, **{**kw, "backend": "emulator"})
            c.pop("out"), c.pop("lse")
            cnt = c
        source = "extra model run"
    t2 = time.perf_counter()
    ref, _ = reference.attention(q, k, v, causal=point["causal"], **desc)
    ref_s = time.perf_counter() - t2
    fin = metrics.finiteness(out, lse)
    stats = {key: fin[key] for key in FINITENESS_KEYS}
    stats["rel_l2"] = metrics.rel_l2(out, ref)
    stats.update(_bad_row_stats(out, lse, ref))
    if point["dtype"] == "fp8":  # the seed's fp8 metric: V = ones, mean |o - 1| over finite
        dev = (out.double() - 1.0).abs()
        ok = torch.isfinite(dev)
        stats["mean_abs_dev"] = float(dev[ok].mean()) if bool(ok.any()) else math.nan
    else:
        stats["mean_abs_dev"] = math.nan
    row = {a: point[a] for a in ("k_scale", "S", "H", "B", "D", "seed", "causal", "dtype",
                                 "backend", "device", "point_id", "threshold_asked", "kernel",
                                 "policy_resolved", "threshold_used")}
    row["policy"] = _policy_name(point["policy"])
    row["threshold"] = math.nan if point["threshold"] in (None, BY_KV_LEN) else float(point["threshold"])
    row.update(stats)
    for key in COUNT_KEYS:
        row[key] = cnt.get(key)
    row["counts_source"] = source or ("fp8: count_rescales counts the bf16 loop only"
                                      if point["dtype"] == "fp8" else "not counted")
    row.update(_static_provenance())
    row.update({
        "device_name": _device_name(device),
        "worker": _worker_address(),
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
        "kernel_s": kernel_s,
        "ref_s": ref_s,
        "wall_s": time.perf_counter() - t0,
    })
    return row
