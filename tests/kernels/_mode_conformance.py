"""The conformance check of the choices a family with an entry point of its own claims
beyond the policy's (``Caps.modes``: (choice, value) pairs), each run on the model and the
ports against fp64 (``_conformance.check`` compares: NaN and inf rows, then the error).

A family's runner (``RUNNERS``, by family: its entry point is its own) builds the input
that shows the choice's value, runs the implementation through the family's public entry
point and returns (out, reference), both [rows, columns] fp64. A family that claims modes
and has no runner, or a choice its runner does not know, fails, naming it.

* The paged decode (``fa_lab.decode.pa_decode_tile``; reference ``cases.reference``, fp64
  attention on the dequantized fp8 inputs), errors relative to the largest |V| (the
  bound of the P pack's error):

  - ``scale``: the K/V cache quantized per tensor or per token;
  - ``num_partitions``: 900 tokens (4 tiles) in NP partitions. Besides the output, the
    partials the kernel stores (``pmax``, ``psum``, ``pout``) must number NP, every one
    holding tokens, and merge, by the fp64 rule written here (weights ``psum *
    exp(pmax - max)``), to the output: the split was made and merged;
  - ``upstream``: a version of ``fa_lab.upstream.DECODE_VERSIONS`` on 985c653a's MTP
    input (257 tokens, 4 query positions, per-token scales, 2 partitions: the last
    tile holds one token and starts its partition); the reference's NaN rows are the
    version's closed form (``pa_decode.bound.nan_rows``: every row before the fix,
    none after).

* MLA decode (``fa_lab.mla.mla_decode``): one dominant key (score 0, V = 0) and 639 at
  score -8 (natural units) whose V is 2 to 8 by column, in shuffled pages. The fp64
  reference walks 64-key tiles from the running max, casting ``P * 2**H`` to e4m3 by
  torch's own cast (round to nearest even) while l sums it uncast, per KV split, the
  splits merged by their LSE. Unlifted (H = 0) every small P (e**-8 < 2**-10) rounds to 0
  and the output is 0; lifted by 2**4 it keeps its mass:

  - ``p_headroom``: H;
  - ``num_kv_splits``: the sequence cut into that many splits (the scheduler's
    boundaries), merged by the reduce; the LSE partials must number that many per
    sequence, each finite.

* The backward (``fa_lab.kernels.bwd``, through its implementation's ``backward``):

  - ``lse``: ``"floored"``: causal with 80 queries over 48 keys, so the first 32 rows see
    no key and the forward's LSE is -inf there; dQ, dK and dV against fp64 autograd
    (``tests/_grads.py``), each relative to its largest entry: the empty rows' gradients
    are 0 (an unfloored LSE gives NaN).
"""

from __future__ import annotations

import math

import torch

from fa_lab import decode, mla
from fa_lab.kernels import FAMILIES, module

#: How an implementation is reached on CPU tensors.
BACKEND = {"model": "emulator", "faithful": "interpret"}


def claims(families, claim_type) -> list:
    """One claim per (family, implementation, mode) the capabilities claim."""
    out = []
    for name, fam in families.items():
        for impl, im in fam.implementations.items():
            if im.caps.modes and name not in RUNNERS:
                raise AssertionError(f"family {name!r} claims modes {sorted(im.caps.modes)} but "
                                     "has no runner: add it to RUNNERS in "
                                     "tests/kernels/_mode_conformance.py")
            out.extend(claim_type(name, impl, field, value, None)
                       for field, value in sorted(im.caps.modes, key=repr))
    return out


def is_mode(claim) -> bool:
    return (claim.field, claim.value) in FAMILIES[claim.family].caps(claim.impl).modes


def run_and_reference(claim, device: str = "cpu"):
    if device != "cpu":
        raise AssertionError(f"{claim}: the mode runners run on CPU tensors only")
    return RUNNERS[claim.family](claim, BACKEND[claim.impl])


def _unknown(claim):
    return AssertionError(f"{claim}: the {claim.family} runner has no input for the choice "
                          f"{claim.field!r}: add one in tests/kernels/_mode_conformance.py")


# ---------------------------------------------------------------------------------------
# The paged decode


def _decode(claim, backend):
    from fa_lab.kernels.pa_decode import bound, cases

    field, value = claim.field, claim.value
    npart, upstream, per_token = 2, "main-11c4174d", False
    if field == "scale":
        case = cases.make([300, 700], query_length=2, num_q_heads=4, num_kv_heads=2,
                          block_size=16, per_token=value == "per_token", seed=3)
    elif field == "num_partitions":
        npart = value
        case = cases.make([900], query_length=2, num_q_heads=2, block_size=64, seed=2)
    elif field == "upstream":
        upstream, per_token = value, True
        case = cases.make([257], query_length=4, num_q_heads=2, block_size=16, per_token=True,
                          seed=11)
    else:
        raise _unknown(claim)
    rec = {}
    out = decode.pa_decode_tile(*case.args(), num_partitions=npart, upstream=upstream,
                                backend=backend, recorder=rec).double()
    ref = cases.reference(case)
    if field == "upstream":
        ql, hq = 4, 2
        nan = torch.tensor(bound.nan_rows(257, ql, hq, npart, upstream=value, per_token=per_token))
        ref[nan.reshape(ql, hq)] = math.nan
    if field == "num_partitions":
        _check_partials(claim, rec, out, npart)
    vmax = float(case.value_scale.max()) * 448.0
    d = out.shape[-1]
    return out.reshape(-1, d) / vmax, ref.reshape(-1, d) / vmax


def _check_partials(claim, rec, out, npart):
    """The kernel's stored partials: ``npart`` of them per (sequence, kv head), each with
    tokens, merging in fp64 (natural-log maxima: main's units) to ``out``."""
    pmax, psum, pout = (rec[k].double() for k in ("pmax", "psum", "pout"))
    if pmax.shape[2] != npart or not bool((psum > 0).all()):
        raise AssertionError(f"{claim} does not run the value as declared: partials "
                             f"{tuple(pmax.shape)} (want {npart} per kv head, each holding "
                             f"tokens; psum {psum.flatten().tolist()[:8]})")
    if npart == 1:
        merged = pout[:, :, 0]
    else:
        w = psum * torch.exp(pmax - pmax.amax(2, keepdim=True))
        merged = (w[..., None] * pout).sum(2) / w.sum(2)[..., None]
    seqs, hkv, rows, d = merged.shape
    ql = out.shape[0] // seqs
    merged = merged.reshape(seqs, hkv, ql, rows // ql, d).permute(0, 2, 1, 3, 4)
    err = float((merged.reshape(out.shape) - out).abs().max())
    if not err <= 2.0 ** -6 * float(out.abs().max()):
        raise AssertionError(f"{claim} does not run the value as declared: its partials merge "
                             f"to an output {err:.3g} away from the one it returned")


# ---------------------------------------------------------------------------------------
# MLA decode

_MLA_KEYS, _MLA_LOW = 640, -8.0


def _mla_case():
    from fa_lab.kernels.mla_decode.model import NUM_HEADS, QK_HEAD_DIM, V_HEAD_DIM

    g = torch.Generator().manual_seed(5)
    q = torch.zeros(1, NUM_HEADS, QK_HEAD_DIM)
    q[:, :, V_HEAD_DIM] = 1.0  # the first rope column carries the score
    kv = torch.zeros(_MLA_KEYS, QK_HEAD_DIM)
    kv[1:, V_HEAD_DIM] = _MLA_LOW
    kv[1:, :V_HEAD_DIM] = 2.0 * (1 + torch.arange(V_HEAD_DIM) % 4).float()
    pages = torch.randperm(_MLA_KEYS, generator=g).to(torch.int32)
    buf = torch.zeros(_MLA_KEYS, 1, 1, QK_HEAD_DIM)
    buf[pages.long(), 0, 0] = kv  # position p reads page pages[p]
    f8 = torch.float8_e4m3fn
    return q.to(f8), buf.to(f8), pages, kv.double()


def _mla_reference(kv, starts, ends, headroom):
    """fp64: each split's tile walk (P * 2**H cast to e4m3, l uncast), merged by LSE."""
    from fa_lab.kernels.mla_decode.model import BLOCK_N, V_HEAD_DIM

    s = kv[:, V_HEAD_DIM]  # q . k: every head alike
    parts = []
    for a, b in zip(starts, ends):
        m = l = O = None
        for t0 in range(a, b, BLOCK_N):
            x, v = s[t0:min(t0 + BLOCK_N, b)], kv[t0:min(t0 + BLOCK_N, b), :V_HEAD_DIM]
            m_new = x.max() if m is None else torch.maximum(m, x.max())
            p = torch.exp(x - m_new) * 2.0 ** headroom
            p8 = p.float().to(torch.float8_e4m3fn).double()
            r = 1.0 if m is None else torch.exp(m - m_new)
            l = p.sum() if m is None else l * r + p.sum()
            O = p8 @ v if m is None else O * r + p8 @ v
            m = m_new
        parts.append((O / l, m + torch.log(l) - headroom * math.log(2.0)))
    top = max(lse for _, lse in parts)
    w = [torch.exp(lse - top) for _, lse in parts]
    return sum(wi * o for wi, (o, _) in zip(w, parts)) / sum(w)


def _mla(claim, backend):
    from fa_lab.kernels.mla_decode.model import NUM_HEADS, schedule, work_items

    field, value = claim.field, claim.value
    if field == "p_headroom":
        headroom, splits = value, 1
    elif field == "num_kv_splits":
        headroom, splits = 0.0, value
    else:
        raise _unknown(claim)
    q, buf, pages, kv = _mla_case()
    indptr = torch.tensor([0, _MLA_KEYS], dtype=torch.int32)
    out, lse = mla.mla_decode(q, buf, indptr, pages, 1.0, num_kv_splits=splits,
                              backend=backend, p_headroom=headroom)
    sch = schedule(indptr.tolist(), splits)
    items = sorted(work_items(sch["work_indptr"], sch["work_info_set"]))
    if lse.shape[0] != splits or len(items) != splits or not bool(lse.isfinite().all()):
        raise AssertionError(f"{claim} does not run the value as declared: {lse.shape[0]} LSE "
                             f"partials for {splits} splits")
    ref = _mla_reference(kv, [i[2] for i in items], [i[3] for i in items], headroom)
    return out[0].double(), ref.expand(NUM_HEADS, -1)


# ---------------------------------------------------------------------------------------
# The backward


def _bwd(claim, backend):
    from _grads import attention64, inputs

    if (claim.field, claim.value) != ("lse", "floored"):
        raise _unknown(claim)
    q, k, v, do = inputs(1, 80, 48, 2, 2, 64, seed=5)
    o64, lse64, *grads = attention64(q, k, v, do, causal=True)
    impl = module(claim.family, claim.impl)
    kw = {} if backend == "emulator" else {"interpret": True}
    got = impl.backward(q, k, v, o64.to(q.dtype), do, lse64.float(), causal=True, **kw)
    outs, refs = [], []
    for a, r in zip(got, grads):
        top = float(r.abs().max())
        outs.append(a.double().reshape(-1, a.shape[-1]) / top)
        refs.append(r.reshape(-1, r.shape[-1]) / top)
    return torch.cat(outs), torch.cat(refs)


#: family -> its runner: (claim, backend) -> (out, reference) [rows, columns] fp64.
RUNNERS = {"pa_decode": _decode, "mla_decode": _mla, "bwd": _bwd}
