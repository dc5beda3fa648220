"""What the tests of the faithful ports share: inputs, the kernel and the model side by side,
and the comparisons every port is held to (identical non-finite masks, finite values to
fp32 summation order, traces tile for tile)."""

import math

import numpy as np
import torch

import fa_lab
from fa_lab import reference

POLICIES = ("eager", "lazy", "lazy_unfixed", "fa4_row")
INF = math.inf
# Unit roundoff of the P packs and of the output (round to nearest: half an ulp at 1.0).
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def make_inputs(B, Sq, Skv, H, Hkv, D, k_scale, *, dtype=torch.bfloat16, seed=0, device="cpu"):
    """q, v ~ N(0,1), k ~ N(0,1) * k_scale (the seed's recipe), any shapes."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, Sq, H, D, generator=g, device=device).to(dtype)
    k = (torch.randn(B, Skv, Hkv, D, generator=g, device=device) * k_scale).to(dtype)
    v = torch.randn(B, Skv, Hkv, D, generator=g, device=device).to(dtype)
    return q, k, v


def both(q, k, v, *, causal, policy, kernel_backend="interpret", **kw):
    """(kernel out, kernel lse), (model out, model lse) on the same inputs. kernel= is
    explicit: the api would route short eager calls to the generic kernel's model."""
    kw = dict(causal=causal, rescale=policy, return_lse=True, kernel="swp_bf16", **kw)
    return (fa_lab.flash_attn_func(q, k, v, backend=kernel_backend, **kw),
            fa_lab.flash_attn_func(q, k, v, backend="emulator", **kw))


def assert_same_masks(name, a, b):
    a, b = a.float(), b.float()
    for what, fn in (("NaN", torch.isnan), ("+inf", lambda x: x == INF), ("-inf", lambda x: x == -INF)):
        ma, mb = fn(a), fn(b)
        assert torch.equal(ma, mb), (f"{name}: {what} masks differ "
                                     f"(kernel {int(ma.sum())}, model {int(mb.sum())}, "
                                     f"{int((ma ^ mb).sum())} positions)")


def output_tolerance(q, k, v, causal, out_model):
    """Per element: 1e-3 of the model's largest |output|, plus what the two fp32
    summation orders can legitimately change after rounding. The scores differ in their
    last bits, so a P value next to a rounding boundary may round to the neighbouring
    16-bit value (2u relative); all of them at once move the output by at most
    2u * sum_j P_j |v_j| / l, the softmax-weighted |V| (an fp32 reference with |V|). The
    final rounding may flip as well: 2u of the element's magnitude."""
    u = UNIT_ROUNDOFF[out_model.dtype]
    weighted_abs_v, _ = reference.attention(q, k, v.abs(), causal=causal)
    b = out_model.double()
    fin = torch.isfinite(b)
    return 1e-3 * b[fin].abs().max() + 2 * u * (weighted_abs_v.double() + b.abs())


def assert_matches_model(kernel, model, q, k, v, causal):
    """Identical NaN/+inf/-inf masks on out and LSE; finite outputs within
    ``output_tolerance``; LSE within 1e-5 of the largest finite |LSE| (fp32 order)."""
    (out_k, lse_k), (out_m, lse_m) = kernel, model
    assert out_k.dtype == out_m.dtype and out_k.shape == out_m.shape
    assert lse_k.dtype == torch.float32 and lse_k.shape == lse_m.shape
    assert_same_masks("out", out_k, out_m)
    assert_same_masks("lse", lse_k, lse_m)
    fin = torch.isfinite(out_m)
    if fin.any():
        err = (out_k.double() - out_m.double()).abs()
        tol = output_tolerance(q, k, v, causal, out_m)
        ratio = (err / tol)[fin].max().item()
        assert ratio <= 1, f"out: |kernel - model| up to {ratio:.2f} x the tolerance"
    fin = torch.isfinite(lse_m)
    if fin.any():
        err = (lse_k.double() - lse_m.double())[fin].abs().max()
        assert err <= 1e-5 * lse_m[fin].abs().max() + 1e-6, f"lse: max |kernel - model| {err:.3g}"


def assert_traces_match(tk, tm):
    """Kernel trace == model trace tile for tile: booleans exact, values to fp32 order."""
    sk, sm = tk.steps, tm.steps
    assert list(sk.columns) == list(sm.columns) and len(sk) == len(sm) > 0
    for c in ("lane", "step", "col0", "phase", "batch", "head", "row",
              "vote", "fire", "swept", "o_finite", "l_finite"):
        assert (sk[c].values == sm[c].values).all(), f"trace column {c} differs"
    # m and mt are maxima of scores summed in another order; corr and l are exp2 of
    # differences of such values (rel. error ~ ulp(m) * ln 2), accumulated; below the
    # smallest normal fp32 (2**-126) only an absolute comparison means anything.
    tiny = 2.0**-126
    for c, rtol, atol in (("m", 1e-6, 1e-4), ("mt", 1e-6, 1e-4), ("corr", 2e-4, tiny)):
        np.testing.assert_allclose(sk[c].values, sm[c].values, rtol=rtol, atol=atol,
                                   equal_nan=True, err_msg=f"trace column {c}")
    # Where corr is subnormal (or 0 on one side), l = l_prev * corr is too: there the
    # two may differ by up to l_prev * 2**-126 absolutely.
    sub = (np.abs(sk["corr"].values) < tiny) | (np.abs(sm["corr"].values) < tiny)
    lk, lm = sk["l"].values, sm["l"].values
    np.testing.assert_allclose(lk[~sub], lm[~sub], rtol=2e-4, atol=tiny, equal_nan=True,
                               err_msg="trace column l")
    l_max = np.abs(lm[np.isfinite(lm)]).max()
    # (a row that already overflowed: the same inf, or NaN, in both)
    same = (lk[sub] == lm[sub]) | (np.isnan(lk[sub]) & np.isnan(lm[sub]))
    with np.errstate(invalid="ignore"):  # inf - inf where the two agree
        near = np.abs(lk[sub] - lm[sub]) <= tiny * l_max
    assert (same | near).all(), \
        "trace column l (after a subnormal corr)"
    lanes_k, lanes_m = tk.lanes, tm.lanes
    for c in ("batch", "head", "row", "first_nonfinite_step", "n_swept", "out_finite"):
        assert lanes_k[c].equals(lanes_m[c]), f"lanes column {c} differs"
    np.testing.assert_allclose(lanes_k.lse.values, lanes_m.lse.values, rtol=1e-5, equal_nan=True)
    assert_same_masks("trace out", tk.out, tm.out)


# The generic kernel's error budget (its model's tests and its port's):
# P pack error, relative: bf16 truncation drops up to one bf16 ulp (2**-7 of the value);
# f16 rounds to nearest (2**-11). The output is rounded to nearest once more.
P_PACK_ERR = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-11}
OUT_ROUND = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
F32_EPS = 2.0**-23


def score_scale(q, k):
    """Per (b, h, row): max |q . k| / sqrt(D) over all keys, in fp64 (the LSE's magnitude)."""
    G = q.shape[2] // k.shape[2]
    kk = k.double().repeat_interleave(G, dim=2)
    return torch.einsum("bshd,bthd->bhst", q.double().abs(), kk.abs()).amax(-1) / math.sqrt(q.shape[-1])


def check_generic_bounds(q, k, v, causal, out, lse):
    """Bounds from the kernel's roundings. Output: the P pack (one-sided truncation for
    bf16; f16 adds an absolute 2**-25 per underflowing P), the output rounding, and fp32
    sums over at most Skv terms. LSE: Q is not rounded here, so only fp32 errors remain:
    the scale constants and the exp2 argument (relative 2**-23 of the score magnitude)
    and the sum of P (Skv * 2**-23)."""
    skv = k.shape[1]
    ref, ref_lse = reference.attention(q, k, v, causal=causal, dtype=torch.float64)
    assert torch.isfinite(out).all()
    vmax = v.double().abs().max().item()
    smax = score_scale(q, k).max().item() * math.log2(math.e)
    tol = (P_PACK_ERR[q.dtype] + OUT_ROUND[q.dtype] + (skv + 4 * smax + 8) * F32_EPS) * vmax
    if q.dtype == torch.float16:
        tol += skv * 2.0**-25 * vmax
    assert (out.double() - ref).abs().max().item() <= tol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin) and (lse[~fin] == -math.inf).all()
    if fin.any():
        tol_lse = (4 * score_scale(q, k) * math.log2(math.e) + skv + 8) * F32_EPS
        assert ((lse.double() - ref_lse).abs() <= tol_lse)[fin].all()
    assert (out.double()[ref.abs().sum(-1) == 0] == 0).all()  # fully masked rows
