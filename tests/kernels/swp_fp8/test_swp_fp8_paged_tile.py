"""FlyDSL #1066's per-tile paged fp8 kernel (6aeb4321) on the fp8 family:
``fa_lab.kernels.swp_fp8.paged_tile`` and its port ``faithful_paged_tile``.

The interface runs (192, 128), (192, 192) and an odd page count (one page included) on
this kernel. These tests check which calls go there and what a bare call runs (threshold
8, no P headroom); the model against an fp64 reference; a shuffled page table against
the identity table and against the per-tile walk over each sequence's dense K and V;
which pages are read (a row's own pages, and ``block_table[0, 0]`` for padding tiles) and
which are not (NaN there changes nothing); the refusals; and the port against the model
(interpreted: ``slow``; compiled: ``gpu``).
"""

import math
import sys
from pathlib import Path

import pytest
import torch

import fa_lab
from fa_lab import metrics, reference
from fa_lab.kernels.swp_fp8 import paged_tile
from fa_lab.paged import check_fp8, fp8_schedule
from fa_lab.studies.experiments import quantize_e4m3

sys.path.insert(0, str(Path(__file__).parent))
from test_swp_fp8_paged import assert_port_matches_model  # noqa: E402

FP8 = torch.float8_e4m3fn
PAGE = 64
NAN = torch.tensor(float("nan")).to(FP8)


def vectorized(kc, vc):
    """A linear fp8 cache (K [NB, 64, Hkv, D], V [NB, 64, Hkv, Dv]) in the vectorized 5-D
    layout (kVS = 16)."""
    nb, ps, hkv, d = kc.shape
    dv = vc.shape[-1]
    k5 = kc.reshape(nb, ps, hkv, d // 16, 16).permute(0, 2, 3, 1, 4).contiguous()
    v5 = vc.reshape(nb, ps // 16, 16, hkv, dv).permute(0, 3, 1, 4, 2).contiguous()
    return k5, v5


def make_case(lens_q, lens_k, *, D=192, Dv=128, H=2, Hkv=1, k_scale=2.0, seed=0, spare=2):
    """Packed q, each sequence's dense k and v (fp8), a shuffled vectorized cache holding
    them (every other page random), and ``flash_attn_func``'s keyword arguments. Page 0
    holds no key; each row has ``spare`` entries past its pages naming random pages."""
    g = torch.Generator().manual_seed(seed)
    n = [math.ceil(s / PAGE) for s in lens_k]
    width = max(n) + spare
    n_blocks = 1 + len(lens_k) * width
    q8, qd = quantize_e4m3(torch.randn(sum(lens_q), H, D, generator=g))
    ks = [k_scale * torch.randn(s, Hkv, D, generator=g) for s in lens_k]
    vs = [torch.randn(s, Hkv, Dv, generator=g) for s in lens_k]
    kd = max(float(x.abs().max()) for x in ks if x.numel()) / 448.0
    vd = max(float(x.abs().max()) for x in vs if x.numel()) / 448.0
    dense = [((x / kd).to(FP8)[None], (y / vd).to(FP8)[None]) for x, y in zip(ks, vs)]
    kc = torch.randn(n_blocks, PAGE, Hkv, D, generator=g).to(FP8)
    vc = torch.randn(n_blocks, PAGE, Hkv, Dv, generator=g).to(FP8)
    order = 1 + torch.randperm(n_blocks - 1, generator=g)
    bt = order[: len(lens_k) * width].reshape(len(lens_k), width).to(torch.int32)
    for b, (kb, vb) in enumerate(dense):
        for t in range(n[b]):
            rows = kb[0, t * PAGE:(t + 1) * PAGE]
            kc[bt[b, t], : rows.shape[0]] = rows
            vc[bt[b, t], : rows.shape[0]] = vb[0, t * PAGE:(t + 1) * PAGE]
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    call = dict(cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=max(lens_q), block_table=bt,
                seqlen_k=torch.tensor(lens_k, dtype=torch.int32), kv_cache_layout="vectorized",
                q_descale=qd, k_descale=kd, v_descale=vd)
    return q8, kc, vc, call, dense


def run(q8, kc, vc, call, **kw):
    kw.setdefault("backend", "emulator")
    return fa_lab.flash_attn_func(q8, *vectorized(kc, vc), **call, **kw)


def checked(q8, kc, vc, call, **change):
    c = {**call, **change}
    return check_fp8(q8, *vectorized(kc, vc), causal=True, max_seqlen_kv=c.get("max_seqlen_kv"),
                     **{k: c[k] for k in ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q",
                                          "block_table", "seqlen_k", "kv_cache_layout")})


def bits(x):
    return x.view(torch.int16)


# ---- which kernel, and what a bare call runs -------------------------------------------

@pytest.mark.parametrize("dims, lens_k, max_kv, want", [
    ((128, 128), [200, 100], None, "bn128"),    # 4 pages of max(seqlen_k): even
    ((128, 128), [150, 100], None, "tile"),     # 3 pages: odd
    ((128, 128), [64, 30], None, "tile"),       # one page
    ((128, 128), [200, 100], 300, "tile"),      # max_seqlen_kv sizes the build: 5 pages
    ((192, 128), [200, 100], None, "tile"),
    ((192, 192), [256, 128], None, "tile"),
])
def test_use_bn128_picks_the_kernel(dims, lens_k, max_kv, want):
    assert fp8_schedule(dims, math.ceil(max(max_kv or 0, max(lens_k)) / PAGE)) == want
    q8, kc, vc, call, _ = make_case([40, 30], lens_k, D=dims[0], Dv=dims[1])
    assert checked(q8, kc, vc, call, max_seqlen_kv=max_kv).schedule == want


def test_a_bare_per_tile_call_runs_threshold_8_without_headroom():
    """``_build_paged_fp8`` passes no threshold (the builder's 8) and the per-tile
    ``sub_m`` adds no P headroom; the lazy flag off runs ``rescale_o`` (eager, H 0)."""
    q8, kc, vc, call, _ = make_case([64], [200])
    k5, v5 = vectorized(kc, vc)
    pol = fa_lab.api.plan(q8, k5, v5, **call, backend="emulator").call.policy
    assert (pol.vote, pol.rebase, pol.threshold, pol.p_headroom) == ("wave", "max", 8.0, 0.0)
    eager = fa_lab.api.plan(q8, k5, v5, **call, dualwave_swp_lazy_rescale=False).call.policy
    assert eager.vote == "tile" and eager.p_headroom == 0.0
    bare = run(q8, kc, vc, call)
    explicit = run(q8, kc, vc, call, rescale="lazy", rescale_threshold=8.0)
    assert torch.equal(bits(bare), bits(explicit))


# ---- the model against fp64, and page tables against dense K and V -----------------------

CASES = [((128, 128), [300, 40], [700, 150]),   # 11 pages: loop tiles; odd
         ((192, 128), [200, 90, 1], [384, 128, 50]),
         ((192, 192), [260, 64], [600, 64])]


@pytest.mark.parametrize("dims, lens_q, lens_k", CASES)
def test_matches_an_fp64_reference(dims, lens_q, lens_k):
    q8, kc, vc, call, dense = make_case(lens_q, lens_k, D=dims[0], Dv=dims[1], k_scale=4.0)
    out, lse = run(q8, kc, vc, call, return_lse=True)
    assert out.shape == (sum(lens_q), 2, dims[1])
    ds = {k: call[k] for k in ("q_descale", "k_descale", "v_descale")}
    cq = call["cu_seqlens_q"].tolist()
    for b, (kb, vb) in enumerate(dense):
        ref, ref_lse = reference.attention(q8[cq[b]:cq[b + 1]][None], kb, vb, causal=True,
                                           dtype=torch.float64, **ds)
        o = out[cq[b]:cq[b + 1]].double()
        assert torch.isfinite(o).all()
        assert metrics.rel_l2(o, ref[0]) < 3e-2
        assert (lse[b, :, :cq[b + 1] - cq[b]].double() - ref_lse[0]).abs().max() < 2e-2
        assert torch.isinf(lse[b, :, cq[b + 1] - cq[b]:]).all()


@pytest.mark.parametrize("dims, lens_q, lens_k", CASES)
def test_shuffled_pages_equal_the_dense_walk_bit_for_bit(dims, lens_q, lens_k):
    """The shuffled table, the identity table over a contiguous cache, and the per-tile
    walk over each sequence's dense K and V (zero past seqlen_k, as a dense tile reads
    it) give the same bits."""
    q8, kc, vc, call, dense = make_case(lens_q, lens_k, D=dims[0], Dv=dims[1], k_scale=4.0)
    out = run(q8, kc, vc, call, rescale="lazy", rescale_threshold=2.0)  # decisions fire
    n = [math.ceil(s / PAGE) for s in lens_k]
    k2 = torch.zeros(1 + sum(n), PAGE, *kc.shape[2:]).to(FP8)
    v2 = torch.zeros(1 + sum(n), PAGE, *vc.shape[2:]).to(FP8)
    bt = torch.zeros(len(n), max(n), dtype=torch.int32)
    nxt = 1
    for b, s in enumerate(lens_k):
        for t in range(n[b]):
            k2[nxt], v2[nxt], bt[b, t] = kc[call["block_table"][b, t]], vc[call["block_table"][b, t]], nxt
            nxt += 1
    ident = run(q8, k2, v2, {**call, "block_table": bt}, rescale="lazy", rescale_threshold=2.0)
    assert torch.equal(bits(out), bits(ident))
    pol = fa_lab.policies.resolve(fp8=True, seqlen_kv=max(lens_k), rescale="lazy",
                                  rescale_threshold=2.0)
    cq = call["cu_seqlens_q"].tolist()
    ls = paged_tile.log2_scale(call["q_descale"], call["k_descale"], dims[0])
    for b, (kb, vb) in enumerate(dense):
        pad = math.ceil(lens_k[b] / PAGE) * PAGE + 8 * PAGE - lens_k[b]
        kz = torch.nn.functional.pad(kb.float(), (0, 0, 0, 0, 0, pad)).to(FP8)
        vz = torch.nn.functional.pad(vb.float(), (0, 0, 0, 0, 0, pad)).to(FP8)
        o, _ = paged_tile.run_sequence(q8[cq[b]:cq[b + 1]][None], kz, vz, Skv=lens_k[b], ls=ls,
                                       v_descale=call["v_descale"], policy=pol, saturate=True)
        assert torch.equal(bits(out[cq[b]:cq[b + 1]]), bits(o.to(torch.bfloat16)))


@pytest.mark.slow
def test_no_headroom_flushes_keys_10_below_the_max():
    """One wave over a key at score 0 and 4095 keys ``gap`` log2 units below it, V = 1
    (exact output 1), D = 192 so the bare call runs per tile: with no P headroom a P of
    2**-10 ties to e4m3's 0, so at gap 10 O keeps the one key while l counts all; the
    BN128 kernel's lift of log2(448) - 8 keeps it (docs/findings/fp8_paged_threshold.md)."""
    from fa_lab.numerics import LOG2E, f32

    D, n = 192, 4095
    kd = 1.0 / f32(f32(1 / math.sqrt(D)) * f32(LOG2E))  # ls = 1: raw scores in log2 units
    res = {}
    for gap in (9.0, 10.0):
        q = torch.zeros(32, 1, D)
        q[:, 0, 0] = 1.0
        k = torch.zeros(n + 1, 1, D)
        k[1:, 0, 0] = -gap
        kc = k.reshape(-1, PAGE, 1, D).to(FP8)
        vc = torch.ones(n + 1, 1, 128).reshape(-1, PAGE, 1, 128).to(FP8)
        call = dict(cu_seqlens_q=torch.tensor([0, 32], dtype=torch.int32),
                    cu_seqlens_kv=torch.tensor([0, n + 1], dtype=torch.int32), max_seqlen_q=32,
                    block_table=torch.arange(kc.shape[0], dtype=torch.int32)[None],
                    seqlen_k=torch.tensor([n + 1], dtype=torch.int32),
                    kv_cache_layout="vectorized", q_descale=1.0, k_descale=kd, v_descale=1.0)
        q8 = q.to(FP8)
        res[gap] = [float(run(q8, kc, vc, call, **kw)[0, 0, 0])
                    for kw in ({}, dict(p_headroom=True))]
    assert res[9.0][0] == 1.0  # 2**-9 is e4m3's smallest subnormal: kept
    assert res[10.0][0] == pytest.approx(1 / (1 + n * 2.0 ** -10), rel=1e-2)
    assert res[10.0][1] > 1  # lifted by 0.807: kept, rounded up as a subnormal


# ---- what is read --------------------------------------------------------------------

def test_nan_in_pages_no_tile_reads_changes_nothing():
    """Every page but the rows' own and ``block_table[0, 0]``'s NaN, each row's entries
    past its own pages NaN pages or out-of-range ids (BN128 would read the partner of an
    odd last page), NaN K in the last page's tail: the same bits."""
    lens_q, lens_k = [150, 60, 20], [200, 100, 30]
    q8, kc, vc, call, _ = make_case(lens_q, lens_k, spare=3)
    clean = run(q8, kc, vc, call)
    bt = call["block_table"].clone()
    used = {int(bt[b, t]) for b, s in enumerate(lens_k) for t in range(math.ceil(s / PAGE))}
    kp, vp = kc.clone(), vc.clone()
    for blk in range(kc.shape[0]):
        if blk not in used:
            kp[blk], vp[blk] = NAN, NAN
    for b, s in enumerate(lens_k):
        kp[int(bt[b, s // PAGE]), s % PAGE:] = NAN  # the last page's tail, K only
    bt[0, 4:] = 10**6
    bt[1, 2:] = -1
    bt[2, 1:] = 10**6
    poisoned = run(q8, kp, vp, {**call, "block_table": bt})
    assert torch.equal(bits(poisoned), bits(clean))


def test_padding_tiles_read_the_first_entry_of_the_table():
    """Sequence 1 has one page and 64 query rows: its block walks 4 tiles, and tiles 1-3
    read ``block_table[0, 0]``. A NaN in that page's V past sequence 0's keys meets
    P = 0 in every row of both sequences; the entry after sequence 1's page, which the
    BN128 kernel would read as a partner, is never read."""
    lens_q, lens_k = [40, 64], [50, 40]
    q8, kc, vc, call, _ = make_case(lens_q, lens_k)
    bt = call["block_table"]
    clean = run(q8, kc, vc, call)
    vp = vc.clone()
    vp[int(bt[0, 0]), 50:] = NAN
    out = run(q8, kc, vp, call)
    assert torch.isnan(out.float()).all()
    vp = vc.clone()
    vp[int(bt[1, 1])] = NAN
    assert torch.equal(bits(run(q8, kc, vp, call)), bits(clean))


# ---- refusals --------------------------------------------------------------------------

def test_bad_arguments_are_refused_by_name_before_any_work(monkeypatch):
    q8, kc, vc, call, _ = make_case([100, 30], [200, 100])

    def no_work(*a, **k):
        raise AssertionError("the model ran")

    monkeypatch.setattr(paged_tile, "forward", no_work)
    bt = call["block_table"]
    bad00 = bt.clone()
    bad00[0, 0] = 999
    cases = [
        (dict(block_table=bt[:, :3]), ValueError, "block_table has 3 pages per row, too short"),
        (dict(block_table=torch.where(bt == bt[1, 1], 999, bt)), ValueError,
         "block_table row 1 holds block ids"),
        (dict(block_table=bad00), ValueError, "block_table row 0 holds block ids"),
        (dict(seqlen_k=torch.tensor([200, 99], dtype=torch.int32)), ValueError, "differs"),
        (dict(causal=False), ValueError, "causal=False"),
    ]
    for change, exc, match in cases:
        with pytest.raises(exc, match=match):
            run(q8, kc, vc, {**call, **change})
    q160, k160, v160, call160, _ = make_case([100, 30], [200, 100], Dv=160)
    with pytest.raises(ValueError, match=r"head dims \(D, Dv\) = \(192, 160\)"):
        run(q160, k160, v160, call160)


def test_the_first_entry_must_be_in_range_even_when_only_padding_tiles_read_it():
    """Sequence 0 has no keys, so no tile reads its entries as its own pages; every
    padding tile reads ``block_table[0, 0]``."""
    q8, kc, vc, call, _ = make_case([30, 30], [0, 100])
    assert torch.isfinite(run(q8, kc, vc, call)[30:].float()).all()
    bt = call["block_table"].clone()
    bt[0, 0] = -5
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = -5"):
        run(q8, kc, vc, {**call, "block_table": bt})
    q8, kc, vc, call, _ = make_case([30], [128], D=128, Dv=128)
    pk = checked(q8, kc, vc, call)
    assert pk.schedule == "bn128"
    with pytest.raises(ValueError, match="per-tile schedule"):
        paged_tile.forward(q8, *vectorized(kc, vc), q_descale=1.0, k_descale=1.0, v_descale=1.0,
                           policy=fa_lab.policies.get("eager"), paged=pk)


def test_one_sequence_on_bn128_takes_the_launch_lengths_so_they_must_match():
    """``paged_bn128_varlen`` is ``use_bn128 and B > 1``: a one-sequence BN128 call runs the
    dense build, whose lengths are max_seqlen_q and the KV length, not cu_seqlens; the
    per-tile kernel reads cu_seqlens whatever B."""
    q8, kc, vc, call, _ = make_case([60], [128], D=128, Dv=128)
    assert checked(q8, kc, vc, call).schedule == "bn128"
    with pytest.raises(ValueError, match="max_seqlen_q=64 and the KV length 128"):
        run(q8, kc, vc, {**call, "max_seqlen_q": 64})
    with pytest.raises(ValueError, match="max_seqlen_q=60 and the KV length 256"):
        run(q8, kc, vc, {**call, "max_seqlen_kv": 256})
    q8, kc, vc, call, _ = make_case([60], [100])  # D 192: per tile
    assert torch.equal(bits(run(q8, kc, vc, {**call, "max_seqlen_q": 64})), bits(run(q8, kc, vc, call)))


# ---- the faithful port -----------------------------------------------------------------

def both(q8, kc, vc, call, backend, **kw):
    return (run(q8, kc, vc, call, backend=backend, return_lse=True, **kw),
            run(q8, kc, vc, call, backend="emulator", return_lse=True, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("dims, kw", [((192, 192), {}),
                                      ((128, 128), dict(rescale="eager")),
                                      ((192, 128), dict(rescale="lazy", rescale_threshold=2.0))],
                         ids=["192-192-bare", "128-odd-eager", "192-128-thr2"])
def test_interpreted_port_matches_the_model(dims, kw):
    q8, kc, vc, call, _ = make_case([70, 20], [450, 30], D=dims[0], Dv=dims[1], k_scale=6.0)
    assert_port_matches_model(*both(q8, kc, vc, call, "interpret", **kw))


@pytest.mark.slow
def test_interpreted_port_matches_the_model_on_nan_and_inf():
    """V NaN in sequence 0's last page tail (its rows all NaN), V NaN in the page padding
    tiles read past sequence 0's keys (``block_table[0, 0]``, 30 keys: sequence 2's rows,
    one page, all NaN too), K NaN past seqlen_k in sequence 1's last page (masked, and its
    4 tiles are all its own: nothing); a V descale of 1e37 sends the larger outputs of
    sequence 1 to +-inf and leaves the small ones finite."""
    q8, kc, vc, call, _ = make_case([40, 30, 20], [30, 250, 64], D=192, Dv=128)
    bt = call["block_table"]
    kp, vp = kc.clone(), vc.clone()
    vp[int(bt[0, 0]), 30:] = NAN
    kp[int(bt[1, 3]), 250 - 3 * PAGE:] = NAN
    kernel, model = both(q8, kp, vp, {**call, "v_descale": 1e37}, "interpret")
    out = model[0].float()
    assert torch.isnan(out[:40]).all() and torch.isnan(out[70:]).all()
    assert torch.isinf(out[40:70]).any() and torch.isfinite(out[40:70]).any()
    assert not torch.isnan(out[40:70]).any()
    assert_port_matches_model(kernel, model)


@pytest.mark.gpu
def test_compiled_port_matches_the_model():
    q8, kc, vc, call, _ = make_case([700, 300, 1], [1000, 700, 70], D=192, Dv=192, H=4, Hkv=2,
                                    k_scale=6.0)
    dev = torch.device("cuda")
    q8, kc, vc = q8.to(dev), kc.to(dev), vc.to(dev)
    call = {k: (x.to(dev) if isinstance(x, torch.Tensor) else x) for k, x in call.items()}
    kernel = run(q8, kc, vc, call, backend="triton", return_lse=True)
    model = run(q8, kc, vc, call, backend="emulator", return_lse=True)
    assert_port_matches_model(tuple(x.cpu() for x in kernel), tuple(x.cpu() for x in model))
