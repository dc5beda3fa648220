"""How a forward failure reaches dQ, dK and dV, policy by policy: the table of
forward-to-backward propagation.

The backward (FlyDSL's gfx950 dQ and dK/dV kernels, ``fa_lab.kernels.bwd``, behind
``fa_lab.autograd``) reads the forward only through its output O (``delta = rowsum(dO *
O)``) and its LSE (P is recomputed as ``exp2(qk_scale * S - lse2)``; dQ floors ``lse2`` at
-3e38, dK/dV do not). So what a policy did in the forward shows in the gradients through
those two tensors. Three constructed cases (``CASES``), each run under every policy of
``POLICIES`` (FlyDSL's on the DUALWAVE_SWP model, Primus-Turbo's fixed max on the online
model):

* ``"forward_nan"``: the bug report's inputs at K x64 (one head, 32 query rows, 512 keys,
  not causal): lazy_unfixed's stale base and the fixed max's overflow give NaN rows.
* ``"empty_band"``: TransformerEngine #3528's shape, causal with Sq > Skv (bottom-right):
  rows 0..39 see no key, so every policy writes O = 0 and LSE = -inf there.
* ``"underflow_row"``: one query row whose scores all lie near -200 log2 units (it sees
  every key): an online max takes its base from the row itself; the fixed max flushes every
  P and writes a silent zero row with LSE = -inf although the row sees keys.

``run_case`` returns one row of the table: the forward's non-finite rows (NaN, inf, LSE
NaN / +inf / -inf, zero rows), the largest P the backward recomputes from the forward's
LSE (natural units: ``exp(scale S - lse)``, over visible keys; past 1 means the LSE is
below the row's true log-sum-exp), and per gradient its non-finite rows and NaN / inf
counts (``fa_lab.autograd.nonfinite_report``).
"""

from __future__ import annotations

import math
import warnings

import torch

from fa_lab import api
from fa_lab.autograd import nonfinite_report
from fa_lab.studies import experiments
from fa_lab.studies.training import kernel_for

#: the policies of the table: FlyDSL's and the fixed max of Primus-Turbo a6a16cdc
POLICIES = ("eager", "lazy", "lazy_unfixed", "fa4_row", "primus-a6a16cdc")
#: the constructed cases (module docstring)
CASES = ("forward_nan", "empty_band", "underflow_row")


def _randn(g, *shape):
    return torch.randn(*shape, generator=g).bfloat16()


def case_inputs(name: str):
    """(q, k, v, dout, causal) of a case; q [1, Sq, H, 64] bf16."""
    if name == "forward_nan":
        q, k, v = experiments.bf16_inputs(1, 512, 1, 64, k_scale=64)
        do = _randn(torch.Generator().manual_seed(1), 1, 32, 1, 64)
        return q[:, :32], k, v, do, False
    if name == "empty_band":
        g = torch.Generator().manual_seed(21)
        q, k, v, do = (_randn(g, 1, n, 2, 64) for n in (104, 64, 64, 104))
        return q, k, v, do, True
    if name == "underflow_row":
        g = torch.Generator().manual_seed(23)
        q, k, v, do = (_randn(g, 1, n, 1, 64) for n in (16, 128, 128, 16))
        # row 3 reads q = -u and every key holds +u along dimension 0 (plus noise): its
        # scores are about -(u^2) / 8 * log2 e, near -200 log2 units for u = 33.
        u = 33.0
        q[0, 3, 0] = 0
        q[0, 3, 0, 0] = -u
        k[0, :, 0, 0] = u
        return q, k, v, do, False
    raise ValueError(f"case must be one of {CASES}, got {name!r}")


def _scores(q, k, causal):
    """Natural-unit scaled scores [B, H, Sq, Skv] in fp64 (bottom-right causal: -inf)."""
    Sq, Skv, D = q.shape[1], k.shape[1], q.shape[3]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(D)
    if causal:
        live = torch.arange(Skv)[None, :] <= torch.arange(Sq)[:, None] + (Skv - Sq)
        s = s.masked_fill(~live, -math.inf)
    return s


def run_case(name: str, policy: str, *, backend: str = "emulator") -> dict:
    """One row of the table: ``name`` (a ``CASES`` entry) under ``policy``."""
    q, k, v, do, causal = case_inputs(name)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = api.flash_attn_func(qq, kk, vv, causal=causal, rescale=policy,
                                          kernel=kernel_for(policy), backend=backend,
                                          return_lse=True)
    out.backward(do)
    o = out.detach().float()
    s = _scores(q, k, causal)
    visible = s > -math.inf
    with torch.no_grad():
        p = torch.exp(s - lse.double()[..., None]).masked_fill(~visible, 0.0)
    rows = lambda m: sorted((b, h, i) for b, i, h in m.nonzero().tolist())  # noqa: E731
    lse_rows = lambda m: sorted(map(tuple, m.nonzero().tolist()))  # noqa: E731
    row_sees = visible.any(-1)                                      # [B, H, Sq]
    zero = (o == 0).all(-1) & row_sees.permute(0, 2, 1)             # [B, Sq, H]
    p_fin = p[torch.isfinite(p)]
    return {
        "case": name, "policy": policy, "kernel": kernel_for(policy), "causal": causal,
        "shape": {"q": list(q.shape), "k": list(k.shape)},
        "forward": {
            "nan_rows": rows(torch.isnan(o).any(-1)),
            "inf_rows": rows(torch.isinf(o).any(-1) & ~torch.isnan(o).any(-1)),
            "zero_rows_that_see_keys": rows(zero),
            "rows_that_see_no_key": int((~row_sees).sum()),
            "lse_nan": lse_rows(torch.isnan(lse)), "lse_posinf": lse_rows(lse == math.inf),
            "lse_neginf": lse_rows(lse == -math.inf)},
        "p_max": float(p_fin.max()) if p_fin.numel() else None,
        "p_inf": int(torch.isinf(p).sum()), "p_nan": int(torch.isnan(p).sum()),
        "grads": nonfinite_report(dq=qq.grad, dk=kk.grad, dv=vv.grad)}


def table(cases=CASES, policies=POLICIES, *, backend: str = "emulator") -> list[dict]:
    """Every case under every policy (``run_case``), in order."""
    return [run_case(c, p, backend=backend) for c in cases for p in policies]


def summary(row: dict) -> dict:
    """A row as counts: forward NaN / inf / zero rows, LSE NaN / +inf / -inf, and per
    gradient its non-finite rows (the docs' table)."""
    f, g = row["forward"], row["grads"]
    return {"case": row["case"], "policy": row["policy"],
            "out_nan": len(f["nan_rows"]), "out_inf": len(f["inf_rows"]),
            "out_zero": len(f["zero_rows_that_see_keys"]),
            "lse_nan": len(f["lse_nan"]), "lse_posinf": len(f["lse_posinf"]),
            "lse_neginf": len(f["lse_neginf"]),
            "p_max": row["p_max"], "p_inf": row["p_inf"],
            **{f"{n}_rows": len(g[n]["rows"]) for n in ("dq", "dk", "dv")}}
