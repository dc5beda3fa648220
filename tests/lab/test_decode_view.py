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
    assert set(widgets.KERNELS) == {MAIN, BEFORE, MLA}


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
