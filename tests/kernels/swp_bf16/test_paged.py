"""Paged KV on the bf16 DUALWAVE_SWP kernel (``fa_lab.paged``; upstream FlyDSL 11c4174d).

A shuffled page table gives the dense call's result bit for bit, in both cache layouts,
and both match an fp64 reference. What the kernel reads past ``seqlen_k``, as upstream's
code does it: block-table entries past ceil(Skv/64) never (their pages may hold NaN, their
ids may be out of range); the rest of the last, partly filled page and physical page 0 on
a padding tile, yes: a NaN in K there is masked away by a select, a NaN in V meets P = 0
in P V and comes out NaN. Every bad paged argument is refused by name before any work.
The faithful port, interpreted (``slow``) and compiled (``gpu``), agrees with the model.
"""

import math
import warnings

import pytest
import torch
from _ports import assert_matches_model, make_inputs

import fa_lab
from fa_lab import reference
from fa_lab.paged import RaggedSeqlenWarning

BF = torch.bfloat16
PAGE = 64


def page_cache(k, v, n_blocks, *, seed=0, bt=None):
    """(k cache, v cache, block table): a linear [n_blocks, 64, Hkv, D] cache holding the
    dense k, v [B, Skv, Hkv, D] in shuffled pages (or the pages ``bt`` names); every other
    row (the last page's tail, unused pages) is random. A shuffled table has one spare
    column, pointing at an unused page."""
    B, Skv, Hkv, D = k.shape
    n = math.ceil(Skv / PAGE)
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(n_blocks, PAGE, Hkv, D, generator=g).to(k.dtype)
    vc = torch.randn(n_blocks, PAGE, Hkv, D, generator=g).to(k.dtype)
    if bt is None:
        order = torch.randperm(n_blocks, generator=g)
        assert n_blocks >= B * (n + 1)
        bt = order[: B * (n + 1)].reshape(B, n + 1).to(torch.int32)
    for b in range(B):
        for t in range(n):
            rows = k[b, t * PAGE:(t + 1) * PAGE]
            kc[bt[b, t], : rows.shape[0]] = rows
            vc[bt[b, t], : rows.shape[0]] = v[b, t * PAGE:(t + 1) * PAGE]
    return kc, vc, bt


def vectorized(kc, vc):
    """The linear cache in aiter's 5-D layout: K [NB, Hkv, D/8, 64, 8], V [NB, Hkv, 8, D, 8]."""
    nb, ps, hkv, d = kc.shape
    k5 = kc.reshape(nb, ps, hkv, d // 8, 8).permute(0, 2, 3, 1, 4).contiguous()
    v5 = vc.reshape(nb, ps // 8, 8, hkv, d).permute(0, 3, 1, 4, 2).contiguous()
    return k5, v5


def lens(B, skv):
    return torch.full((B,), skv, dtype=torch.int32)


def call(q, k, v, backend="emulator", **kw):
    return fa_lab.flash_attn_func(q, k, v, return_lse=True, backend=backend, **kw)


@pytest.mark.parametrize("skv,causal", [(200, True), (130, False), (256, True)])
@pytest.mark.parametrize("layout", ["linear", "vectorized"])
def test_shuffled_page_table_equals_the_dense_call(skv, causal, layout):
    q, k, v = make_inputs(2, 300, skv, 4, 2, 64, 4.0, seed=1)
    kc, vc, bt = page_cache(k, v, 16, seed=2)
    if layout == "vectorized":
        kc, vc = vectorized(kc, vc)
    out_p, lse_p = call(q, kc, vc, causal=causal, block_table=bt, seqlen_k=lens(2, skv),
                        kv_cache_layout=layout)
    out_d, lse_d = call(q, k, v, causal=causal, kernel="swp_bf16")
    assert torch.equal(out_p, out_d) and torch.equal(lse_p, lse_d)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, dtype=torch.float64)
    rows = torch.isfinite(ref_lse)  # (causal rows above the diagonal see no key: -inf)
    assert torch.equal(torch.isfinite(lse_p), rows)
    assert (out_p.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
    # Q is rounded to bf16 after scaling: scores carry its 2**-9 relative error
    assert (lse_p.double() - ref_lse)[rows].abs().max() <= 2 ** -8 * ref_lse[rows].abs().max()


def test_split_k_over_pages_equals_the_dense_split_k():
    q, k, v = make_inputs(1, 384, 700, 2, 1, 64, 4.0, seed=3)
    kc, vc, bt = page_cache(k, v, 16, seed=4)
    kw = dict(causal=False, num_kv_splits=3)
    out_p, _ = call(q, kc, vc, block_table=bt, seqlen_k=lens(1, 700), **kw)
    out_d, _ = call(q, k, v, kernel="swp_bf16", **kw)
    assert torch.equal(out_p, out_d)


def test_a_bias_reads_logical_key_columns():
    # upstream: rows are q tokens, columns the batch's logical keys (l.511-513)
    q, k, v = make_inputs(2, 300, 200, 4, 2, 64, 4.0, seed=25)
    kc, vc, bt = page_cache(k, v, 12, seed=26)
    bias = (torch.randn(300, 200, generator=torch.Generator().manual_seed(27)) * 4).to(BF)
    out_p, _ = call(q, kc, vc, block_table=bt, seqlen_k=lens(2, 200), bias=bias)
    out_d, _ = call(q, k, v, kernel="swp_bf16", bias=bias)
    assert torch.equal(out_p, out_d)
    assert not torch.equal(out_p, call(q, k, v, kernel="swp_bf16")[0])


def test_entries_past_seqlen_k_are_never_read():
    # the spare column and every page no entry below ceil(Skv/64) names hold NaN (page 0
    # too: 200 keys make 4 tiles, no padding tile), and the spare ids are out of range
    q, k, v = make_inputs(2, 300, 200, 4, 2, 64, 4.0, seed=5)
    kc, vc, bt = page_cache(k, v, 12, seed=6)
    clean = call(q, kc, vc, block_table=bt, seqlen_k=lens(2, 200))
    used = set(bt[:, :4].flatten().tolist())
    for page in set(range(12)) - used:
        kc[page] = float("nan")
        vc[page] = float("nan")
    bt[:, 4] = torch.tensor([-1, 10 ** 6])
    poisoned = call(q, kc, vc, block_table=bt, seqlen_k=lens(2, 200))
    assert torch.equal(poisoned[0], clean[0]) and torch.equal(poisoned[1], clean[1])
    assert torch.isfinite(clean[0]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_the_last_pages_tail_is_read_k_masked_v_not(causal):
    # upstream's page descriptor spans the whole page (flash_attn_utils.py l.3428-3434):
    # rows 200..255 of the last page are loaded; S is masked by a select, P V is not
    q, k, v = make_inputs(2, 300, 200, 4, 2, 64, 4.0, seed=7)
    kc, vc, bt = page_cache(k, v, 12, seed=8)
    kw = dict(causal=causal, block_table=bt, seqlen_k=lens(2, 200))
    clean = call(q, kc, vc, **kw)
    tail = bt[:, 3].long()
    kc[tail, 200 - 3 * PAGE:] = float("nan")
    assert torch.equal(call(q, kc, vc, **kw)[0], clean[0])
    vc[tail[1], 200 - 3 * PAGE:] = float("nan")  # batch 1's last page only
    out, lse = call(q, kc, vc, **kw)
    assert torch.isnan(out[1]).all() and torch.equal(out[0], clean[0][0])
    assert torch.equal(lse, clean[1])  # l and m never see V


def test_padding_tiles_read_physical_page_zero():
    # 130 keys: 3 pages, N = 4 tiles; the LDS slot of tile 3 is zeroed, not loaded
    # (flash_attn_utils.py l.3627-3633), so tile 3 reads page 0, which the table never names
    q, k, v = make_inputs(1, 300, 130, 2, 1, 64, 4.0, seed=9)
    bt = torch.tensor([[3, 5, 1, 7]], dtype=torch.int32)
    kc, vc, _ = page_cache(k, v, 8, seed=10, bt=bt)
    kw = dict(causal=False, block_table=bt, seqlen_k=lens(1, 130))
    clean = call(q, kc, vc, **kw)
    assert torch.equal(clean[0], call(q, k, v, causal=False, kernel="swp_bf16")[0])
    kc[0] = float("nan")
    assert torch.equal(call(q, kc, vc, **kw)[0], clean[0])
    vc[0] = float("nan")
    assert torch.isnan(call(q, kc, vc, **kw)[0]).all()


def test_ragged_seqlen_k_runs_every_sequence_to_the_longest():
    # the dense paged launch receives max(seqlen_k) only (flash_attn_interface.py l.487-488)
    q, k, v = make_inputs(2, 300, 200, 4, 2, 64, 4.0, seed=11)
    kc, vc, bt = page_cache(k, v, 12, seed=12)
    with pytest.warns(RaggedSeqlenWarning, match="max\\(seqlen_k\\) = 200") as said:
        ragged = call(q, kc, vc, block_table=bt, seqlen_k=torch.tensor([200, 70], dtype=torch.int32))
    assert [w.filename for w in said] == [__file__]  # the caller's line
    uniform = call(q, kc, vc, block_table=bt, seqlen_k=lens(2, 200))
    assert torch.equal(ragged[0], uniform[0])


def test_trace_and_the_flydsl_arguments_of_a_paged_call():
    from fa_lab import api, dispatch, flydsl

    q, k, v = make_inputs(2, 300, 200, 4, 2, 64, 4.0, seed=21)
    kc, vc, bt = page_cache(k, v, 12, seed=22)
    k5, v5 = vectorized(kc, vc)
    kw = dict(block_table=bt, seqlen_k=lens(2, 200), kv_cache_layout="vectorized")
    tp = fa_lab.trace(q, k5, v5, rows=[0, 299], head=3, batch=1, **kw)
    td = fa_lab.trace(q, k, v, rows=[0, 299], head=3, batch=1, kernel="swp_bf16")
    assert tp.steps.equals(td.steps) and torch.equal(tp.out, td.out)
    planned = dispatch.plan(api.check_call(q, k5, v5, backend="flydsl", **kw))
    up = flydsl.upstream_kwargs(planned.call, accepts=lambda name: True)
    assert up["num_kv_heads"] == 2 and up["kv_cache_layout"] == "vectorized" and "paged" not in up
    assert torch.equal(up["block_table"], bt) and up["seqlen_k"].tolist() == [200, 200]


def test_count_rescales_counts_a_paged_call_as_the_dense_one():
    q, k, v = make_inputs(1, 256, 640, 2, 1, 64, 40.0, seed=23)
    kc, vc, bt = page_cache(k, v, 24, seed=24)
    paged = fa_lab.count_rescales(q, kc, vc, block_table=bt, seqlen_k=lens(1, 640), rescale="lazy")
    dense = fa_lab.count_rescales(q, k, v, rescale="lazy", kernel="swp_bf16")
    assert paged["loop_wave_steps"] > 0 and torch.equal(paged["out"], dense["out"])
    assert {n: x for n, x in paged.items() if n not in ("out", "lse")} == \
        {n: x for n, x in dense.items() if n not in ("out", "lse")}


# ----------------------------------------------------------------------------------
# Bad input: refused by name, before any work (the model's forward is never entered).
# ----------------------------------------------------------------------------------

def _bad_cases():
    q, k, v = make_inputs(2, 300, 200, 4, 2, 64, 4.0, seed=13)
    kc, vc, bt = page_cache(k, v, 12, seed=14)
    sk = lens(2, 200)
    k5, v5 = vectorized(kc, vc)
    base = dict(block_table=bt, seqlen_k=sk)
    f16 = kc.to(torch.float16)
    bad_id = bt.clone()
    bad_id[1, 2] = 12
    neg_id = bt.clone()
    neg_id[0, 0] = -1
    grad_q = q.clone().requires_grad_()
    return q, kc, vc, [
        ("block_table", ValueError, dict(base, block_table=bt[:, :3])),           # too short
        ("block_table", ValueError, dict(base, block_table=bad_id)),              # id >= NumBlocks
        ("block_table", ValueError, dict(base, block_table=neg_id)),              # id < 0
        ("block_table", TypeError, dict(base, block_table=bt.float())),
        ("block_table", ValueError, dict(base, block_table=bt[:1])),              # rows != B
        ("seqlen_k", ValueError, dict(block_table=bt)),                           # missing
        ("seqlen_k", ValueError, dict(base, seqlen_k=sk[:1])),
        ("seqlen_k", ValueError, dict(base, seqlen_k=lens(2, 0))),
        ("seqlen_k", TypeError, dict(base, seqlen_k=[200, 200])),
        ("kv_cache_layout", ValueError, dict(base, kv_cache_layout="linear3d")),
        ("kv_cache_layout", ValueError, dict(base, kv_cache_layout="paged")),
        ("kv_cache_layout", TypeError, dict(base, kv_cache_layout=1)),
        ("kv_cache_layout", ValueError, dict(kv_cache_layout="vectorized")),      # no table
        ("page size", ValueError, dict(base, k=kc[:, :32], v=vc[:, :32])),
        ("k has dtype", TypeError, dict(base, k=f16)),
        ("paged k", ValueError, dict(base, k=kc[0])),                                   # 3-D
        ("paged k", ValueError, dict(base, kv_cache_layout="vectorized", k=k5[..., :4], v=v5[..., :4])),
        ("paged k and v", ValueError, dict(base, v=vc[:, :, :1])),                            # k, v differ
        ("paged k", ValueError, dict(base, kv_cache_layout="vectorized")),              # linear cache
        # fp8 paged calls are FlyDSL #1066's (tests/kernels/swp_fp8/test_swp_fp8_paged.py): packed q
        # over the vectorized cache, so a linear one is refused by name
        ("kv_cache_layout='linear'", ValueError, dict(base, q=q.to(torch.float8_e4m3fn), k=kc.to(torch.float8_e4m3fn),
                                         v=vc.to(torch.float8_e4m3fn), q_descale=1.0, k_descale=1.0,
                                         v_descale=1.0)),
        ("alibi_slopes", ValueError, dict(base, alibi_slopes=torch.ones(4))),
        ("bias", ValueError, dict(base, seqlen_k=torch.tensor([200, 100], dtype=torch.int32),
                                  bias=torch.zeros(300, 200, dtype=BF))),
        ("kernel='generic' has no paged KV", ValueError, dict(base, kernel="generic")),
        ("backend='fast'", ValueError, dict(base, backend="fast")),
        ("paged", ValueError, dict(base, q=grad_q)),
    ]


_Q, _KC, _VC, _BAD = _bad_cases()


@pytest.mark.parametrize("name,error,kw", _BAD, ids=[f"{i}-{c[0]}" for i, c in enumerate(_BAD)])
def test_bad_paged_input_is_refused_by_name_before_any_work(name, error, kw, monkeypatch):
    from fa_lab.kernels.swp_bf16 import model

    def no_work(*a, **k):
        raise AssertionError("the model ran")

    monkeypatch.setattr(model, "forward", no_work)
    kw = dict(kw)
    q, k, v = kw.pop("q", _Q), kw.pop("k", _KC), kw.pop("v", _VC)
    kw.setdefault("backend", "emulator")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedSeqlenWarning)
        with pytest.raises(error, match=name.replace("(", "\\(")):
            fa_lab.flash_attn_func(q, k, v, **kw)


# ----------------------------------------------------------------------------------
# The faithful port: interpreted on CPU, compiled on a GPU.
# ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("layout", ["linear", "vectorized"])
def test_interpreted_port_matches_the_model(layout):
    # 130 keys: a padding tile on page 0; NaN fills every row no key was written to
    q, k, v = make_inputs(1, 64, 130, 2, 1, 64, 4.0, seed=15)
    bt = torch.tensor([[3, 5, 1, 7]], dtype=torch.int32)
    kc, vc, _ = page_cache(k, v, 8, seed=16, bt=bt)
    kc[0] = float("nan")  # K's NaN is masked; V's page 0 stays finite, then NaN
    if layout == "vectorized":
        kc, vc = vectorized(kc, vc)
    kw = dict(causal=True, block_table=bt, seqlen_k=lens(1, 130), kv_cache_layout=layout,
              kernel="swp_bf16")
    kernel, model = call(q, kc, vc, "interpret", **kw), call(q, kc, vc, **kw)
    assert_matches_model(kernel, model, q, k, v, True)
    assert torch.equal(model[0], call(q, k, v, causal=True, kernel="swp_bf16")[0])


@pytest.mark.slow
def test_interpreted_port_reads_page_zero_and_the_tail_as_the_model():
    q, k, v = make_inputs(2, 64, 130, 2, 1, 64, 4.0, seed=17)
    kc, vc, bt = page_cache(k, v, 12, seed=18)
    vc[int(bt[1, 2]), 130 - 2 * PAGE:] = float("nan")  # sequence 1's tail
    kc[0] = vc[0] = 0.0
    vc[0, 5] = float("inf")  # page 0: 0 * inf on the padding tile
    kw = dict(causal=False, block_table=bt, seqlen_k=lens(2, 130), kernel="swp_bf16")
    kernel, model = call(q, kc, vc, "interpret", **kw), call(q, kc, vc, **kw)
    assert torch.isnan(model[0]).all()
    assert_matches_model(kernel, model, q, k, v, False)


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_dots")
@pytest.mark.parametrize("layout", ["linear", "vectorized"])
def test_gpu_port_matches_the_model(layout):
    q, k, v = make_inputs(2, 1000, 1500, 8, 2, 128, 48.0, seed=19)
    kc, vc, bt = page_cache(k, v, 64, seed=20)
    vc[int(bt[1, 23]), 1500 - 23 * PAGE:] = float("nan")  # sequence 1's last-page tail
    if layout == "vectorized":
        kc, vc = vectorized(kc, vc)
    dev = dict(block_table=bt.cuda(), seqlen_k=lens(2, 1500).cuda(), kv_cache_layout=layout,
               kernel="swp_bf16")
    qc, kcc, vcc = q.cuda(), kc.cuda(), vc.cuda()
    for policy, causal in [("lazy_unfixed", True), ("lazy", False), ("lazy", True)]:
        kw = dict(dev, causal=causal, rescale=policy)
        kernel, model = call(qc, kcc, vcc, "triton", **kw), call(qc, kcc, vcc, **kw)
        assert_matches_model(kernel, model, qc, k.cuda(), v.cuda(), causal)
        assert torch.isnan(model[0][1]).any() and torch.isfinite(model[1]).any()
