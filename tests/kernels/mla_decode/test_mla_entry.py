"""``fa_lab.mla``: upstream's launcher semantics (final_output untouched, split outputs
written), the one-call ``mla_decode`` against fp64, and every bad argument refused by name
before any work."""

from __future__ import annotations

import math

import pytest
import torch

from fa_lab import mla
from fa_lab.kernels.mla_decode import model as M

FP8 = torch.float8_e4m3fn


def valid(n=20):
    g = torch.Generator().manual_seed(0)
    return dict(
        query=torch.randn(2, 128, 576, generator=g).to(FP8),
        kv_buffer=torch.randn(n + 2, 1, 1, 576, generator=g).to(FP8),
        kv_page_indices=torch.arange(n, dtype=torch.int32),
        work_indptr=torch.tensor([0, 2], dtype=torch.int32),
        work_info_set=torch.tensor([[0, 0, 0, 1, 0, 12, 0, 0], [1, 1, 1, 2, 12, n, 0, 0]],
                                   dtype=torch.int32),
        final_output=torch.full((2, 128, 512), 5.0, dtype=torch.bfloat16),
        split_output=torch.zeros(2, 1, 128, 512),
        split_lse=torch.zeros(2, 1, 128, 1),
        softmax_scale=576 ** -0.5)


def test_launcher_writes_splits_and_leaves_final_output():
    a = valid()
    mla.flydsl_mla_fwd_decode(**a, backend="emulator")
    assert (a["final_output"] == 5.0).all()
    q, kv = a["query"].float(), a["kv_buffer"].float().reshape(-1, 576)
    for loc, (k0, k1) in enumerate(((0, 12), (12, 20))):
        o, lse = M.work_item(q[loc], kv[k0:k1], a["softmax_scale"])
        assert torch.equal(a["split_output"][loc, 0], o)
        assert torch.equal(a["split_lse"][loc, 0, :, 0], lse)


def test_mla_decode_matches_fp64_for_any_split():
    a = valid(200)
    ind = torch.tensor([0, 150, 200], dtype=torch.int32)
    pages = torch.randperm(202, generator=torch.Generator().manual_seed(1))[:200].to(torch.int32)
    q, kv = a["query"].float(), a["kv_buffer"].float().reshape(-1, 576)
    outs = []
    for splits in (1, 4):
        out, _ = mla.mla_decode(a["query"], a["kv_buffer"], ind, pages, 0.05,
                                num_kv_splits=splits, backend="emulator")
        outs.append(out)
        for b in range(2):
            ro, _ = M.reference(q[b], kv[pages[ind[b]:ind[b + 1]].long()], 0.05)
            rel = (out[b].double() - ro).norm() / ro.norm()
            assert rel < 2 ** -4  # the P cast's relative error, plus bf16
    assert not torch.equal(outs[0], outs[1])  # splits cast P against other maxima


def _set(a, key, value):
    a[key] = value


def _item(i, word, value):
    def change(a):
        w = a["work_info_set"].clone()
        w[i, word] = value
        a["work_info_set"] = w
    return change


BAD = [
    (lambda a: _set(a, "query", a["query"].float()), TypeError, "query has dtype"),
    (lambda a: _set(a, "query", a["query"][:, :64]), ValueError, "num_heads=64"),
    (lambda a: _set(a, "query", a["query"][..., :512]), ValueError, "head_dim=512"),
    (lambda a: _set(a, "query", a["query"][0]), ValueError, "query must be 3-D"),
    (lambda a: _set(a, "kv_buffer", a["kv_buffer"].reshape(-1, 2, 1, 576)[:, :, :, :]),
     ValueError, "page_size * num_kv_heads"),
    (lambda a: _set(a, "kv_buffer", a["kv_buffer"].to(torch.float8_e4m3fnuz)), TypeError,
     "kv_buffer has dtype"),
    (lambda a: _set(a, "kv_page_indices", a["kv_page_indices"].long()), TypeError,
     "kv_page_indices"),
    (lambda a: _set(a, "work_info_set", a["work_info_set"].reshape(-1)[:13]), ValueError,
     "8 int32 words"),
    (lambda a: _set(a, "work_indptr", torch.tensor([2, 0], dtype=torch.int32)), ValueError,
     "work_indptr"),
    (lambda a: _set(a, "work_indptr", torch.tensor([0, 3], dtype=torch.int32)), ValueError,
     "work_indptr"),
    (lambda a: _set(a, "final_output", a["final_output"][:1]), ValueError, "final_output"),
    (lambda a: _set(a, "split_output", torch.zeros(2, 1, 128, 256)), ValueError, "split_output"),
    (lambda a: _set(a, "split_output", torch.zeros(2, 1, 128, 512, dtype=torch.bfloat16)),
     TypeError, "split_output"),
    (lambda a: _set(a, "split_output", torch.zeros(2, 1, 512, 128).transpose(2, 3)),
     ValueError, "split_output must be contiguous"),
    (lambda a: _set(a, "split_lse", torch.zeros(3, 1, 128, 1)), ValueError, "split_lse"),
    (lambda a: _set(a, "softmax_scale", "0.1"), TypeError, "softmax_scale"),
    (lambda a: _set(a, "softmax_scale", math.nan), ValueError, "softmax_scale"),
    (lambda a: _set(a, "p_headroom", 9.0), ValueError, "p_headroom"),
    (lambda a: _set(a, "backend", "cuda"), ValueError, "backend"),
    (lambda a: _set(a, "backend", "triton"), ValueError, "backend='triton'"),
    (lambda a: _set(a, "upstream", "fixed"), ValueError, "upstream"),
    (_item(0, 2, 2), ValueError, "qo_start=2"),
    (_item(0, 5, -1), ValueError, "kv_start=0, kv_end=-1"),
    (_item(1, 5, 21), ValueError, "kv_end=21"),
    (_item(0, 1, -1), ValueError, "partial_qo_loc=-1"),
    (_item(1, 1, 0), ValueError, "partial_qo_loc=0 is written by an earlier item"),
]


@pytest.mark.parametrize("change,exc,words", BAD)
def test_bad_arguments_are_refused_before_any_work(change, exc, words):
    a = valid()
    a.setdefault("backend", "emulator")
    change(a)
    before = a["split_output"].clone() if isinstance(a["split_output"], torch.Tensor) else None
    with pytest.raises(exc, match=words.replace("*", r"\*").replace("(", r"\(")):
        mla.flydsl_mla_fwd_decode(**a)
    if before is not None:
        assert torch.equal(a["split_output"], before)


def test_a_page_outside_kv_buffer_is_refused():
    a = valid()
    pages = a["kv_page_indices"].clone()
    pages[13] = 22
    a["kv_page_indices"] = pages
    with pytest.raises(ValueError, match=r"kv_page_indices\[12:20\].*page 22"):
        mla.flydsl_mla_fwd_decode(**a, backend="emulator")
    pages[13] = 5  # positions outside every item may hold anything: never read
    pages[19] = 5
    a["kv_page_indices"] = torch.cat([pages, torch.tensor([-7], dtype=torch.int32)])
    mla.flydsl_mla_fwd_decode(**a, backend="emulator")


def test_reduce_and_decode_arguments():
    so, sl = torch.zeros(2, 1, 128, 512), torch.zeros(2, 1, 128, 1)
    final = torch.zeros(1, 128, 512, dtype=torch.bfloat16)
    ind, fmap = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32)
    pmap = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q=2"):
        mla.mla_reduce_v1(so, sl, ind, fmap, pmap, 2, 2, final)
    with pytest.raises(ValueError, match="final_lse"):
        mla.mla_reduce_v1(so, sl, ind, fmap, pmap, 1, 2, final, torch.zeros(1, 128))
    with pytest.raises(ValueError, match="num_kv_splits=1"):
        mla.mla_reduce_v1(so, sl, ind, fmap, pmap, 1, 1, final)
    with pytest.raises(ValueError, match="reduce_partial_map"):
        mla.mla_reduce_v1(so, sl, ind, fmap, torch.tensor([0, 2], dtype=torch.int32), 1, 2, final)
    with pytest.raises(ValueError, match="reduce_final_map"):
        mla.mla_reduce_v1(so, sl, ind, torch.tensor([[1, 2]], dtype=torch.int32), pmap, 1, 2,
                          final)
    a = valid()
    with pytest.raises(ValueError, match="kv_indptr must have num_seqs"):
        mla.mla_decode(a["query"], a["kv_buffer"], torch.tensor([0, 5], dtype=torch.int32),
                       a["kv_page_indices"], 0.1)
    with pytest.raises(ValueError, match="num_kv_splits"):
        mla.mla_decode(a["query"], a["kv_buffer"], torch.tensor([0, 5, 9], dtype=torch.int32),
                       a["kv_page_indices"], 0.1, num_kv_splits=0)
