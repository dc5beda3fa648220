"""The seed's tables as runnable experiments, and the plumbing to keep their results.

``bf16_table`` reruns PR #1033's bf16 table (rel-L2 against fp32 and NaN fractions of the
unfixed lazy, fixed lazy and eager rescale over K scales); ``fp8_table`` reruns its fp8
table (mean |o - 1| with V = ones and NaN counts per rebase rule). Both take their sizes as
arguments: the defaults run in seconds on 2 CPU cores, ``SEED_SIZES`` are the seed's.
``save_result`` writes a JSON with provenance to the results folder atomically (through
``fa_lab.results``: ``./fa_lab_results`` by default); the lab's reference runs are in
``REFERENCE_DIR`` (data/results), read with ``fa_lab.results.reference``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from fa_lab import metrics, reference, results
from fa_lab.api import flash_attn_func
from fa_lab.checks import check_int, check_positive
from fa_lab.numerics import E4M3_MAX, e4m3
from fa_lab.policies import get as get_policy

ROOT = results.ROOT  # the checkout: its data/ holds the lab's reference data
#: the bug report's own tables: data/seed/ in a checkout, fa_lab/_seed/ in an installed wheel
SEED_DIR = next((d for d in (ROOT / "data" / "seed", Path(__file__).resolve().parents[1] / "_seed")
                 if d.is_dir()), ROOT / "data" / "seed")
#: the lab's reference results (data/results): read, never written by a run
REFERENCE_DIR = results.REFERENCE_DIR
# results I/O lives in fa_lab.results; these names stay importable from here
provenance = results.provenance
atomic_write_bytes = results.atomic_write_bytes
atomic_write_json = results.atomic_write_json

BF16_K_SCALES = (8, 16, 24, 32, 48, 64)
BF16_POLICIES = ("lazy_unfixed", "lazy", "eager")
FP8_K_SCALES = (1000, 5000, 20000)
#: (label, rescale, rebase_bound) for the fp8 table's columns.
FP8_VARIANTS = (
    ("unfixed", "lazy_unfixed", None),
    ("bound 8", "lazy_capped", 8.0),
    ("bound 16", "lazy_capped", 16.0),
    ("bound 32", "lazy_capped", 32.0),
    ("monotonic", "lazy", None),
    ("eager", "eager", None),
)
SEED_SIZES = {"bf16": dict(B=2, S=8192, H=32, D=128), "fp8": dict(B=2, S=12288, H=8)}
CPU_SIZES = {"bf16": dict(B=1, S=2048, H=4, D=128), "fp8": dict(B=1, S=2048, H=2)}


def seed_table(name: str) -> dict:
    """The seed's own figures (data/seed/pr1033_<name>.json, ``name`` "bf16" or "fp8").

    A missing file raises ``FileNotFoundError`` naming it and the seed tables there; a
    truncated or invalid one, or one without a list of ``rows`` each with a numeric
    ``k_scale``, ``ValueError`` naming it."""
    path = SEED_DIR / f"pr1033_{results.check_name(name)}.json"
    if not path.is_file():
        have = sorted(p.stem[len("pr1033_"):] for p in SEED_DIR.glob("pr1033_*.json"))
        raise FileNotFoundError(f"no seed table {name!r}: {path} does not exist; "
                                f"seed tables in {SEED_DIR}: {', '.join(have) or '(none)'}")
    table = results.read_json(path)
    if not isinstance(table, dict) or not isinstance(table.get("rows"), list):
        raise ValueError(f"{path}: not a seed table: it holds no list 'rows' (a seed table "
                         "is a JSON object whose 'rows' list the seed's figures)")
    for i, row in enumerate(table["rows"]):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: rows[{i}] is a {type(row).__name__}, not an object")
        check_positive(f"{path}: rows[{i}]['k_scale']", row.get("k_scale"))
    return table


def _generator(device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(check_int("seed", seed, lo=0))
    return g


def bf16_inputs(B, S, H, D, k_scale, *, seed=0, device="cpu", dtype=torch.bfloat16):
    """The seed's repro inputs: q, v ~ N(0,1), k = round(N(0,1) * K).

    Parameters
    ----------
    B, S, H, D : int
        Batch, sequence length, heads and head dim: each tensor is [B, S, H, D].
    k_scale : float
        K, the keys' scale (the bug report's K-scale table: x1 ... x64).
    seed : int
        The generator's seed; default 0.
    device : str or torch.device
        Default ``"cpu"``.
    dtype : torch.dtype
        Default bf16: q, k and v are rounded to it (k after the scaling).

    Returns
    -------
    q, k, v : torch.Tensor

    Examples
    --------
    >>> from fa_lab.studies.experiments import bf16_inputs
    >>> q, k, v = bf16_inputs(1, 256, 2, 64, k_scale=32)
    >>> q.shape, k.dtype
    (torch.Size([1, 256, 2, 64]), torch.bfloat16)
    >>> bool(k.float().std() > 16 * q.float().std())
    True
    """
    g = _generator(device, seed)
    shape = (B, S, H, D)
    q = torch.randn(shape, generator=g, device=device).to(dtype)
    k = (torch.randn(shape, generator=g, device=device) * k_scale).to(dtype)
    v = torch.randn(shape, generator=g, device=device).to(dtype)
    return q, k, v


def quantize_e4m3(x: torch.Tensor):
    """Per-tensor quantisation: descale = amax / 448, x8 = e4m3(x / descale)."""
    descale = float(x.abs().max()) / E4M3_MAX
    return e4m3(x.float() / descale).to(torch.float8_e4m3fn), descale


def fp8_inputs(B, S, H, k_scale, *, seed=0, device="cpu", D=128):
    """The seed's fp8 inputs: q = 0.1 N(0,1), k = 0.1 K N(0,1), V = ones, quantised."""
    g = _generator(device, seed)
    shape = (B, S, H, D)
    q8, qd = quantize_e4m3(0.1 * torch.randn(shape, generator=g, device=device))
    k8, kd = quantize_e4m3(0.1 * k_scale * torch.randn(shape, generator=g, device=device))
    v8, vd = quantize_e4m3(torch.ones(shape, device=device))
    return (q8, k8, v8), (qd, kd, vd)


def drag_case(*, n_tiles=8, rise=10.0, fall=40.0, trigger=True, D=64, dtype=torch.bfloat16,
              device="cpu"):
    """A hand-built wave in which one row drags another (bf16 kernel, one 32-row wave).

    Row 0 (the trigger) has a flat tile whose score rises by ``rise`` log2 units per tile
    (``trigger=False``: stays at 0, so nothing ever fires). Row 1 (the victim) starts at
    about 100 and its tile max falls by ``fall`` per tile. Rows 2..31 see score 0. V is all
    ones, so every finite output is exactly 1. Under ``lazy_unfixed`` each loop tile rebases
    the victim down by ``fall``: its O and l grow by 2**fall per tile until they overflow.
    Returns q [1, 32, 1, D], k and v [1, 64 * n_tiles, 1, D]."""
    from fa_lab.kernels.swp_bf16.model import softmax_scale_log2

    if n_tiles < 4:
        raise ValueError(f"n_tiles must be >= 4 (the kernel's minimum), got {n_tiles}")
    qv = 8.0  # exact in bf16; Qs = round(8 * c)
    qs = float(torch.tensor(qv * softmax_scale_log2(D)).to(dtype))
    q = torch.zeros(1, 32, 1, D)
    q[0, 0, 0, 0] = qv
    q[0, 1, 0, 1] = qv
    k = torch.zeros(1, 64 * n_tiles, 1, D)
    for t in range(n_tiles):
        k[0, 64 * t:64 * (t + 1), 0, 0] = (rise * t if trigger else 0.0) / qs
        k[0, 64 * t:64 * (t + 1), 0, 1] = (100.0 - fall * t) / qs
    v = torch.ones(1, 64 * n_tiles, 1, D)
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


def _check_sizes(**sizes):
    for name, x in sizes.items():
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")


def bf16_table(k_scales=BF16_K_SCALES, *, B=1, S=2048, H=4, D=128, causal=False, seed=0,
               device="cpu", policies=BF16_POLICIES, threshold=None, backend="auto",
               progress=True) -> pd.DataFrame:
    """One row per (K scale, policy): rel_l2 against fp32, NaN/inf fractions and rows, and
    the LSE read-out on the NaN rows."""
    _check_sizes(B=B, S=S, H=H, D=D)
    check_int("seed", seed, lo=0)
    if not k_scales:
        raise ValueError("k_scales is empty")
    rows = []
    bar = tqdm(total=len(k_scales) * len(policies), desc="bf16 table", disable=not progress)
    for K in k_scales:
        q, k, v = bf16_inputs(B, S, H, D, K, seed=seed, device=device)
        ref, _ = reference.attention(q, k, v, causal=causal)
        for pol in policies:
            thr = threshold if get_policy(pol).lazy else None
            out, lse = flash_attn_func(q, k, v, causal=causal, rescale=pol, return_lse=True,
                                       rescale_threshold=thr, backend=backend)
            stats = metrics.summarize(out, ref, lse)
            rows.append({"k_scale": K, "policy": pol, **stats})
            bar.update()
        del q, k, v, ref
    bar.close()
    return pd.DataFrame(rows)


def fp8_table(k_scales=FP8_K_SCALES, *, B=1, S=2048, H=2, causal=False, seed=0, device="cpu",
              variants=FP8_VARIANTS, threshold=None, p_headroom=None, saturate=None,
              backend="auto", progress=True) -> pd.DataFrame:
    """One row per (k scale, variant): mean |o - 1| over finite elements and NaN counts."""
    _check_sizes(B=B, S=S, H=H)
    check_int("seed", seed, lo=0)
    if not k_scales:
        raise ValueError("k_scales is empty")
    rows = []
    bar = tqdm(total=len(k_scales) * len(variants), desc="fp8 table", disable=not progress)
    for K in k_scales:
        (q8, k8, v8), (qd, kd, vd) = fp8_inputs(B, S, H, K, seed=seed, device=device)
        for label, pol, bound in variants:
            thr = threshold if get_policy(pol).lazy else None
            out = flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                  causal=causal, rescale=pol, rebase_bound=bound,
                                  rescale_threshold=thr, p_headroom=p_headroom,
                                  fp8_saturate=saturate, backend=backend)
            fin = metrics.finiteness(out)
            dev = (out.double() - 1.0).abs()
            ok = torch.isfinite(dev)  # the seed averages the elements that came back finite
            mad = float(dev[ok].mean()) if bool(ok.any()) else math.nan
            rows.append({"k_scale": K, "variant": label, "policy": pol, "bound": bound,
                         "mean_abs_dev": mad, **fin})
            bar.update()
    bar.close()
    return pd.DataFrame(rows)


# ---- seed comparison -------------------------------------------------------------------

def bf16_versus_seed(table: pd.DataFrame) -> pd.DataFrame:
    """Wide view: per K scale, measured rel-L2 / NaN % beside the seed's."""
    seed = {r["k_scale"]: r for r in seed_table("bf16")["rows"]}
    for i, K in enumerate(table["k_scale"]):  # a string K would match no seed row
        check_positive(f"table row {i}: k_scale", K)
    out = []
    for K, g in table.groupby("k_scale"):
        row = {"k_scale": K}
        by = g.set_index("policy")
        for pol in by.index:
            row[f"{pol}_rel_l2"] = by.loc[pol, "rel_l2"]
            row[f"{pol}_nan_pct"] = 100 * by.loc[pol, "nan_frac"]
        s = seed.get(K)
        if s is not None:
            row["seed_unfixed_rel_l2"] = s["lazy_unfixed"]
            row["seed_unfixed_nan_pct"] = s["lazy_unfixed_nan_pct"]
            row["seed_lazy_rel_l2"] = s["lazy"]
            row["seed_eager_rel_l2"] = s["eager"]
        out.append(row)
    return pd.DataFrame(out)


def fp8_versus_seed(table: pd.DataFrame) -> pd.DataFrame:
    seed_rows = seed_table("fp8")["rows"]
    for i, K in enumerate(table["k_scale"]):
        check_positive(f"table row {i}: k_scale", K)

    def seed_of(K, pol, bound):
        for r in seed_rows:
            if r["k_scale"] == K and r["policy"] == pol and r.get("bound") == bound:
                return r
        return None

    rows = []
    for _, r in table.iterrows():
        bound = None if pd.isna(r["bound"]) else r["bound"]
        s = seed_of(r["k_scale"], r["policy"], bound)
        rows.append({"k_scale": r["k_scale"], "variant": r["variant"],
                     "mean_abs_dev": r["mean_abs_dev"], "nan": r["nan"],
                     "seed_mean_abs_dev": None if s is None else s["mean_abs_dev"],
                     "seed_nan": None if s is None else s["nan"]})
    return pd.DataFrame(rows)


# ---- provenance and storage (fa_lab.results) ------------------------------------------
# Kept here for the modules, benchmarks and notebooks that import them from experiments.

def save_result(name: str, table: pd.DataFrame, *, params: dict, device="cpu",
                directory: Path | None = None) -> Path:
    """Store a table as <results folder>/<name>.json with provenance and parameters
    (``fa_lab.results.save``: atomic, ``name`` confined to the directory). ``directory``
    defaults to the results folder (``$FA_LAB_RESULTS`` or ./fa_lab_results)."""
    return results.save(name, table, params=params, device=device, root=directory)
