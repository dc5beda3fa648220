"""Setup shared by the lesson notebooks (``notebooks/``), so that each lesson opens on its
story rather than on a wall of helpers.

* ``setup(full)``: the device, whether the full (seed-sized) run applies, display options.
* bf16 (lessons 00 and 02): ``with_m_before``, ``with_deficit``, ``row_fate_table``.
* fp8 (lesson 03): ``Fp8Lesson`` holds the seed's fp8 inputs at its KV length and runs or
  traces the fp8 kernel on them (``run_fp8`` / ``trace_fp8`` on any fp8 inputs);
  ``seed_fp8`` reads one figure of the seed's table; ``mean_abs_dev`` is the seed's metric.
* timings (lesson 04): ``round_verdict`` says what interleaved rounds support.

Every function is plain: it computes, it does not print, and it can be called from a
script as well as from a notebook.
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pandas as pd
import torch

#: Where the lessons' words are defined: the glossary notebook beside them, and the spec.
GLOSSARY = "glossary.ipynb"
SEMANTICS = "../docs/semantics.md"


def setup(full: bool = False, *, device: str | None = None, precision: int = 4):
    """(device, big): the device the lesson runs on (a GPU when there is one) and whether
    the full, seed-sized run applies (``full`` and a CUDA GPU). Warns when ``full`` is
    asked for without a GPU. Sets pandas' display precision."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if full and device != "cuda":
        warnings.warn("FULL = True needs a GPU (DEVICE = 'cuda'); this run keeps the default "
                      "CPU sizes", stacklevel=2)
    pd.set_option("display.precision", precision)
    return device, bool(full and device == "cuda")


def to_device(device, *tensors):
    return tuple(t.to(device) for t in tensors)


# ---- bf16 traces -----------------------------------------------------------------------

def with_m_before(steps: pd.DataFrame) -> pd.DataFrame:
    """Trace steps plus ``m_before``, the running max before each step (a trace records m
    after it)."""
    s = steps.copy()
    s["m_before"] = s.groupby("lane").m.shift()
    return s


def with_deficit(trace) -> pd.DataFrame:
    """A trace's steps with ``m_before``, ``true_max`` (the largest tile max so far) and
    ``deficit`` (true_max - m), all in log2 units (``docs/semantics.md`` section 7.1)."""
    s = with_m_before(trace.steps)
    per = float(trace.log2_per_unit)
    for c in ("m", "mt", "m_before"):
        s[c] = s[c] * per
    s["true_max"] = s.groupby("lane").mt.cummax()
    s["deficit"] = s.true_max - s.m
    return s


#: How a row dies, by its LSE (docs/semantics.md section 7.2), in the order of the spec.
FATES = ("+-inf output, finite LSE", "NaN output, LSE = +inf", "LSE = NaN")


def row_fate_table(out: torch.Tensor, lse: torch.Tensor) -> pd.DataFrame:
    """One line per non-finite row of ``out`` [B, S, H, D] (``lse`` [B, H, S]): batch, row,
    head, its NaN / +inf / -inf element counts, its LSE and its fate (``FATES``; a row whose
    LSE is -inf, no visible key, is "LSE = -inf")."""
    bad = ~torch.isfinite(out).all(-1)                       # [B, S, H]
    idx = bad.nonzero().cpu()
    rows = []
    L = lse.permute(0, 2, 1)
    for b, s, h in idx.tolist():
        o = out[b, s, h]
        x = float(L[b, s, h])
        fate = (FATES[1] if x == math.inf else FATES[2] if math.isnan(x) else
                "LSE = -inf" if x == -math.inf else FATES[0])
        rows.append({"batch": b, "row": s, "head": h, "NaN": int(torch.isnan(o).sum()),
                     "+inf": int((o == math.inf).sum()), "-inf": int((o == -math.inf).sum()),
                     "LSE": x, "fate": fate})
    return pd.DataFrame(rows, columns=["batch", "row", "head", "NaN", "+inf", "-inf", "LSE",
                                       "fate"])


# ---- fp8 -------------------------------------------------------------------------------

def mean_abs_dev(out: torch.Tensor) -> float:
    """The seed's metric: mean |o - 1| over the elements that came back finite (V = ones);
    NaN when none did."""
    d = (out.double() - 1).abs()
    ok = torch.isfinite(d)
    return float(d[ok].mean()) if bool(ok.any()) else math.nan


def seed_fp8(policy: str, k_scale: int, field: str, bound: float | None = None):
    """One figure of the seed's fp8 table (data/seed/pr1033_fp8.json)."""
    from fa_lab.studies.experiments import seed_table

    for r in seed_table("fp8")["rows"]:
        if r["policy"] == policy and r["k_scale"] == k_scale and r.get("bound") == bound:
            return r[field]
    raise KeyError((policy, k_scale, bound))


def seed_fp8_elements() -> int:
    """Output elements of the seed's fp8 run (B x S x H x D)."""
    from fa_lab.studies.experiments import seed_table

    setup_ = seed_table("fp8")["setup"]
    return math.prod(int(setup_[k]) for k in ("B", "S", "H", "D"))


def run_fp8(inputs, descales, **kw):
    """``flash_attn_func`` on fp8 ``inputs`` (q8, k8, v8) with their ``descales`` (q, k, v);
    non-causal unless ``causal`` is given."""
    from fa_lab.api import flash_attn_func

    (q8, k8, v8), (qd, kd, vd) = inputs, descales
    kw.setdefault("causal", False)
    return flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kw)


def trace_fp8(inputs, descales, rows, **kw):
    """``fa_lab.trace`` of ``rows`` on fp8 ``inputs`` with their ``descales``."""
    from fa_lab.api import trace

    (q8, k8, v8), (qd, kd, vd) = inputs, descales
    kw.setdefault("causal", False)
    return trace(q8, k8, v8, rows=rows, q_descale=qd, k_descale=kd, v_descale=vd, **kw)


class Fp8Lesson:
    """The seed's fp8 problem (q = 0.1 N(0,1), k = 0.1 k_scale N(0,1), V = ones, per-tensor
    e4m3) at its KV length, keeping the first ``rows`` query rows of ``heads`` heads:
    query rows of different 256-row blocks never interact, so those rows come out exactly
    as in the full run. Inputs are generated on the CPU (the same numbers on any device)
    and cached per k scale."""

    def __init__(self, device="cpu", *, rows=256, heads=1, skv=None):
        from fa_lab.studies.experiments import SEED_SIZES

        self.device = device
        self.rows, self.heads = int(rows), int(heads)
        self.skv = int(skv or SEED_SIZES["fp8"]["S"])
        self.inputs = functools.lru_cache(maxsize=None)(self._inputs)

    def _inputs(self, k_scale, heads=None):
        from fa_lab.studies.experiments import fp8_inputs

        (q8, k8, v8), ds = fp8_inputs(1, self.skv, heads or self.heads, k_scale)
        return to_device(self.device, q8[:, :self.rows].contiguous(), k8, v8), ds

    def run(self, k_scale, heads=None, **kw):
        """``flash_attn_func`` on the k scale's inputs (non-causal unless ``causal``)."""
        return run_fp8(*self.inputs(k_scale, heads), **kw)

    def trace(self, k_scale, rows, heads=None, **kw):
        """``fa_lab.trace`` of ``rows`` on the k scale's inputs."""
        return trace_fp8(*self.inputs(k_scale, heads), rows, **kw)


# ---- timings ---------------------------------------------------------------------------

def round_verdict(rounds, *, name: str = "lazy") -> str:
    """What interleaved rounds of a time ratio (other's time / ``name``'s time) support:
    "faster in every round", "slower in every round", or "within noise" when the rounds
    disagree on the side of 1."""
    r = np.asarray(list(rounds), dtype=float)
    if r.size == 0 or not np.isfinite(r).all():
        raise ValueError("rounds must be a non-empty list of finite ratios")
    if (r > 1).all():
        return f"{name} faster in every round"
    if (r < 1).all():
        return f"{name} slower in every round"
    return "within noise"
