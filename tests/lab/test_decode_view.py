"""The decode dashboard (``fa_lab.lab.widgets.decode``): the view's partitions and merge
against the model's recorder and an fp64 reference, the kernel picker reaching the
version, bad values refused, and the wiring (no browser)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("plotly", reason="the lab's figures need plotly (pip install plotly)")

import torch

from fa_lab.kernels.pa_decode.reduce import split_reduce
from fa_lab.lab import widgets

MAIN, BEFORE = "pa_decode @ main-11c4174d", "pa_decode @ flydsl-985c653a^"
MLA = "mla_decode @ main-11c4174d"
PAGED = "swp_fp8_paged @ flydsl-6aeb4321"


def test_the_view_shows_each_partition_and_the_merge():
    v = widgets.compute_decode_view(kernel=MAIN, context=900, query_length=2, group=2,
                                    num_partitions=3, per_token=False, row=3, seed=2)
    parts = v["parts"]
    assert [p["tiles"] for p in parts] == [(0, 2), (2, 4), (4, 4)]
    assert sum(p["weight"] for p in parts) == pytest.approx(1.0, abs=1e-6)
    assert parts[2]["pmax"] == -math.inf and parts[2]["weight"] == 0.0  # the empty partition
    # the weights are the reduce's on the partitions' (max, sum)
    pm = torch.tensor([[p["pmax"]] for p in parts])
    ps = torch.tensor([[p["psum"]] for p in parts])
    rec = {}
    split_reduce(pm, ps, torch.zeros(3, 1, 1), recorder=rec)
    assert torch.allclose(rec["weights"][:, 0], torch.tensor([p["weight"] for p in parts]))
    assert v["bound"] == 900 and v["max_err"] < 0.05 and v["nan_rows"] == []
    fig = v["figures"]["partitions"]
    assert len(fig.data) == 3 and "row 3" in fig.layout.title.text


def test_the_picker_reaches_the_version():
    kw = dict(context=257, query_length=4, group=2, num_partitions=2, per_token=True, seed=11)
    before = widgets.compute_decode_view(kernel=BEFORE, **kw)
    after = widgets.compute_decode_view(kernel=MAIN, **kw)
    assert before["nan_rows"] == list(range(8)) and after["nan_rows"] == []
    assert before["pmax_units"] == "log2" and after["pmax_units"] == "natural"
    assert "comes out NaN" in before["summary"] and "max |out - fp64|" in after["summary"]
    # partition 1 is tile 1, fully masked for row 0: the sentinel cancels to P = 1 before the fix
    assert before["parts"][1]["psum"] == 256.0 and after["parts"][1]["psum"] == 0.0
    assert set(widgets.KERNELS) == {MAIN, BEFORE, MLA, PAGED}


def test_the_picker_reaches_the_mla_decode():
    from fa_lab import mla
    from fa_lab.kernels.mla_decode import model
    from fa_lab.lab.widgets import decode as wd

    v = widgets.compute_decode_view(kernel=MLA, context=200, num_partitions=2, row=5, seed=1,
                                    query_length=16, group=1)  # the paged decode's knobs: unused
    parts = v["parts"]
    assert [p["tiles"] for p in parts] == [(0, 112), (112, 200)]
    # each split's LSE against the fp64 reference of its keys
    query, kv_buffer, pages, scale = wd._mla_inputs(200, 1)
    q, kv = query[0].float(), kv_buffer.float().reshape(-1, model.QK_HEAD_DIM)
    for p in parts:
        _, lse = model.reference(q, kv[p["tiles"][0]:p["tiles"][1]], scale)
        assert abs(p["lse"] - float(lse[5])) < 1e-3
    w = torch.softmax(torch.tensor([p["lse"] for p in parts], dtype=torch.float64), 0)
    assert [p["weight"] for p in parts] == pytest.approx(w.tolist())
    # V = 1: the exact output is 1; the unscaled P cast loses mass (never gains it)
    out, _ = mla.mla_decode(query, kv_buffer, torch.tensor([0, 200], dtype=torch.int32), pages,
                            scale, num_kv_splits=2, backend="emulator")
    assert torch.equal(v["out"], out[0, 5].float())
    assert float(out.float().mean()) < 1.0 and float(v["out"].max()) <= 1.0
    assert v["max_err"] == pytest.approx(float((1.0 - out[0, 5].double()).abs().max()))
    assert v["pmax_units"] == "lse (natural log)" and "keys" in v["summary"]
    fig = v["figures"]["partitions"]
    assert len(fig.data) == 2 and "head 5" in fig.layout.title.text
    with pytest.raises(ValueError, match="row"):
        widgets.compute_decode_view(kernel=MLA, context=64, row=128)


def test_the_picker_reaches_the_paged_fp8_prefill():
    """One causal sequence of 4 positions x 2 heads over 200 keys (4 pages of 64, read two
    at a time): per tile pair the pages read and the row's max and mass, checked against
    the call's table and an fp64 pass over the same scores; the row against the fp64
    reference under threshold 8 (the bare call) and 6."""
    from fa_lab.kernels.swp_fp8 import paged_cases
    from fa_lab.numerics import log2_scale

    v = widgets.compute_decode_view(kernel=PAGED, context=200, query_length=4, group=2, row=5,
                                    seed=1, num_partitions=3, per_token=False)  # unused knobs
    case = paged_cases.make([4], [200], H=2, Hkv=1, k_mult=4.0, seed=1, spare=1)
    bt = case.call["block_table"][0].tolist()
    assert [p["tiles"] for p in v["parts"]] == [(0, 128), (128, 256)]
    assert [p["pages"] for p in v["parts"]] == [tuple(bt[0:2]), tuple(bt[2:4])]
    c = case.call
    ls = log2_scale(c["q_descale"], c["k_descale"], 128)
    x = (case.q8[2, 1].double() @ case.dense[0][0][0, :, 0].double().T).float().double() * ls
    assert v["bound"] == 199          # qi = 2 sees 200 - 4 + 1 + 2 keys
    for p, (lo, hi) in zip(v["parts"], ((0, 128), (128, 199))):
        assert p["pmax"] == pytest.approx(float(x[lo:hi].max()), rel=1e-6)
        assert p["psum"] == pytest.approx(float(torch.exp2(x[lo:hi] - x[lo:hi].max()).sum()), rel=1e-6)
    ref = paged_cases.reference(case).reshape(8, -1)[5]
    assert torch.equal(v["ref"], ref)
    assert v["max_err"] == pytest.approx(float((v["out"].double() - ref).abs().max()))
    assert 0 < v["max_err"] < 0.05 and 0 < v["max_err_threshold_6"] < 0.05
    assert v["threshold"] == 8.0 and v["violated"] == [] and v["nan_rows"] == []
    assert "inside the paged region" in v["summary"]
    fig = v["figures"]["partitions"]
    assert len(fig.data) == 2 and "row 5" in fig.layout.title.text
    assert v["schedule"] == "bn128"


def test_the_paged_fp8_view_draws_the_per_tile_kernel():
    """150 keys are 3 pages, an odd count: the per-tile kernel runs. Its parts are 64-key
    tiles reading one page each, the padding tile 3 reading block_table[0, 0]; the row's
    max per tile against an fp64 pass; the call inside the per-tile region."""
    from fa_lab.kernels.swp_fp8 import paged_cases
    from fa_lab.numerics import log2_scale

    v = widgets.compute_decode_view(kernel=PAGED, context=150, query_length=4, group=2, row=5,
                                    seed=1)
    case = paged_cases.make([4], [150], H=2, Hkv=1, k_mult=4.0, seed=1, spare=1)
    bt = case.call["block_table"]
    assert v["schedule"] == "tile" and v["threshold"] == 8.0
    assert [p["tiles"] for p in v["parts"]] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert [p["pages"] for p in v["parts"]] == [(int(bt[0, t]),) for t in (0, 1, 2)] + [
        (int(bt[0, 0]),)]
    c = case.call
    x = (case.q8[2, 1].double() @ case.dense[0][0][0, :, 0].double().T).float().double() * log2_scale(
        c["q_descale"], c["k_descale"], 128)
    assert v["bound"] == 149
    for p, (lo, hi) in zip(v["parts"], ((0, 64), (64, 128), (128, 149))):
        assert p["pmax"] == pytest.approx(float(x[lo:hi].max()), rel=1e-6)
    assert v["parts"][3]["pmax"] == -math.inf and v["parts"][3]["psum"] == 0.0
    assert 0 < v["max_err"] < 0.05 and v["violated"] == [] and v["nan_rows"] == []
    assert "per-tile kernel" in v["summary"] and "inside the paged region" in v["summary"]
    assert "per tile:" in v["figures"]["partitions"].layout.title.text


@pytest.mark.parametrize("kw, err, words", [
    (dict(kernel="pa_decode"), ValueError, "kernel"),
    (dict(query_length=17), ValueError, "query_length"),
    (dict(row=8), ValueError, "row"),          # 4 x 2 rows
    (dict(per_token=1), TypeError, "per_token"),
    (dict(block_size=32), ValueError, "block_size"),
])
def test_bad_values_are_refused(kw, err, words):
    with pytest.raises(err, match=words):
        widgets.compute_decode_view(**kw)


@pytest.mark.slow
def test_the_dashboard_redraws_when_a_control_moves():
    pytest.importorskip("ipywidgets")
    d = widgets.decode_dashboard(context=300, num_partitions=1)
    assert len(d.last["parts"]) == 1
    d.controls["num_partitions"].value = 2
    assert len(d.last["parts"]) == 2 and d.errors == 0
    d.controls["kernel"].value = BEFORE
    assert d.last["upstream"] == "flydsl-985c653a^"
