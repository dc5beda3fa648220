"""The faithful MLA decode port against the model: in Triton's interpreter on CPU (bit for
bit: the dots are exact in fp64, exp2/log2 rounded once from fp64, every fp32 step in the
model's order), through the compiled path's exact dots (the scratch loop, run interpreted),
and compiled on a GPU inside ``exact_dots()`` (``gpu``: identical NaN masks; libdevice's fp64 exp2
and log2 may sit one fp64 ulp from torch's, which can move a value by an fp32 ulp and, at
an e4m3 tie, one P by a rounding step)."""

from __future__ import annotations

import pytest
import torch

from fa_lab import mla
from fa_lab.kernels.mla_decode import faithful as F
from fa_lab.kernels.mla_decode import model as M

FP8 = torch.float8_e4m3fn


def case(lengths, splits, seed=0, poison=None):
    """Random fp8 inputs for sequences of ``lengths`` keys over shuffled pages; ``poison``
    (a position) gets a NaN code."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(len(lengths), M.NUM_HEADS, M.QK_HEAD_DIM, generator=g).to(FP8)
    kv = (torch.randn(total + 3, 1, 1, M.QK_HEAD_DIM, generator=g) * 2).to(FP8)
    pages = torch.randperm(total + 3, generator=g)[:total].to(torch.int32)
    if poison is not None:
        kv.view(torch.uint8)[int(pages[poison]), 0, 0, 7] = 0x7F
    ind = [0]
    for n in lengths:
        ind.append(ind[-1] + n)
    return q, kv, pages, M.schedule(ind, splits)


def both(q, kv, pages, sch, headroom=0.0, **port_kw):
    N = sch["num_partial"]
    out = []
    for run in ("model", "port"):
        so = torch.full((N, 1, 128, 512), -3.0)
        sl = torch.full((N, 1, 128, 1), -3.0)
        args = (q, kv, pages, sch["work_indptr"], sch["work_info_set"], so, sl, 0.05)
        if run == "model":
            M.forward(*args, p_headroom=headroom)
        else:
            F.forward(*args, p_headroom=headroom, interpret=True, **port_kw)
        out.append((so, sl))
    return out


def assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x.isnan(), y.isnan())
        assert torch.equal(x.nan_to_num(), y.nan_to_num())


def test_interpreted_port_matches_model_one_tile():
    q, kv, pages, sch = case([37], 1)
    (mo, ml), (po, pl) = both(q, kv, pages, sch)
    assert torch.isfinite(mo).all()
    assert_same((mo, ml), (po, pl))


@pytest.mark.slow
@pytest.mark.parametrize("headroom,heads", [(0.0, None), (8.0, 64)])
def test_interpreted_port_matches_model_splits_sentinels(headroom, heads):
    # sequence 0: 2 tiles + 2 keys in 2 splits; 1: empty (NaN item); 2: a NaN key; 3: 1 key
    q, kv, pages, sch = case([130, 0, 20, 1], 2, seed=1, poison=130 + 4)
    (mo, ml), (po, pl) = both(q, kv, pages, sch, headroom, heads_per_program=heads)
    rows = sch["reduce_indptr"].tolist()
    nan_items = {rows[1], rows[2]}  # the empty item and the poisoned sequence's item
    for loc in range(sch["num_partial"]):
        assert mo[loc].isnan().all() == (loc in nan_items)
    assert_same((mo, ml), (po, pl))


def test_entry_point_backends_agree():
    q, kv, pages, sch = case([70, 5], 2, seed=2)
    res = {}
    for backend in ("emulator", "interpret"):
        N = sch["num_partial"]
        so, sl = torch.zeros(N, 1, 128, 512), torch.zeros(N, 1, 128, 1)
        final = torch.full((2, 128, 512), 9.0, dtype=torch.bfloat16)
        mla.flydsl_mla_fwd_decode(q, kv, pages, sch["work_indptr"], sch["work_info_set"],
                                  final, so, sl, 0.05, backend=backend)
        assert (final == 9.0).all()  # the kernel never writes final_output
        res[backend] = (so, sl)
    assert_same(res["emulator"], res["interpret"])


def test_scratch_dots_equal_the_interpreters_exact_dots(monkeypatch):
    """The exact dot a compiled run takes inside ``exact_dots()`` (a loop over a scratch
    buffer, since Triton cannot compile this fp64 ``tl.dot``) gives the model's bits."""
    from fa_lab.kernels._triton import dots
    q, kv, pages, sch = case([70, 5], 2, seed=11, poison=3)
    allocated, real = [], dots.scratch_buffer

    def spy(mode, grid, floats, device):
        allocated.append(mode)
        return real(mode, grid, floats, device)

    monkeypatch.setattr(dots, "dot_mode", lambda interpreted: dots.DOT_EXACT_SCRATCH)
    monkeypatch.setattr(dots, "scratch_buffer", spy)
    model, port = both(q, kv, pages, sch, headroom=3.0, heads_per_program=64)
    assert allocated == [dots.DOT_EXACT_SCRATCH]
    assert_same(model, port)
    assert model[0].isnan().any() and not model[0].isnan().all()  # the poisoned key's item


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_dots")
def test_gpu_compiled_port_matches_model():
    q, kv, pages, sch = case([1000, 64, 0, 3], 3, seed=3, poison=1000 + 10)
    N = sch["num_partial"]
    so_m, sl_m = torch.zeros(N, 1, 128, 512), torch.zeros(N, 1, 128, 1)
    M.forward(q, kv, pages, sch["work_indptr"], sch["work_info_set"], so_m, sl_m, 0.05)
    dev = torch.device("cuda")
    so, sl = torch.zeros(N, 1, 128, 512, device=dev), torch.zeros(N, 1, 128, 1, device=dev)
    F.forward(q.to(dev), kv.to(dev), pages.to(dev), sch["work_indptr"], sch["work_info_set"],
              so, sl, 0.05, interpret=False)
    so, sl = so.cpu(), sl.cpu()
    assert torch.equal(so.isnan(), so_m.isnan()) and torch.equal(sl.isnan(), sl_m.isnan())
    fin = ~so_m.isnan()
    assert (so[fin] == so_m[fin]).float().mean() > 0.99
    assert (so[fin] - so_m[fin]).abs().max() <= 2 ** -4 * so_m[fin].abs().max()
    assert (sl - sl_m).nan_to_num().abs().max() <= 1e-5 * sl_m.nan_to_num().abs().max()
