"""The decode grid's backend axis (``sweep.DecodeGrid``, ``kind: decode``): ``interpret``
runs each decode kernel's Triton port in the interpreter and agrees with the emulator
point for point (identical NaN/inf masks; finite values within one bf16 step, the ports'
stated tolerance: they sum in other fp32 orders); ``triton`` on a machine without a GPU
is refused, naming the axis, before any work."""

from __future__ import annotations

import pytest
import torch

from fa_lab import decode
from fa_lab.studies import sweep
from fa_lab.studies.sweep import decode_point

MAIN, BEFORE = "main-11c4174d", "flydsl-985c653a^"

#: Four points per backend: the paged tile decode before and after 985c653a (per-token
#: scales, query_length 4: the sentinel NaN before the fix), the sliding window, MLA.
GRIDS = [
    {"kernel": ["pa_decode_tile"], "upstream": [BEFORE, MAIN], "scales": ["per_token"],
     "query_length": [4], "context": [257], "num_partitions": [2]},
    {"kernel": ["pa_decode_swa"], "window": [64], "context": [257], "num_partitions": [2]},
    {"kernel": ["mla_decode"], "context": [40], "num_partitions": [2]},
]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _points(backend):
    pts = []
    for g in GRIDS:
        grid = sweep.DecodeGrid({"kind": "decode", "spread": [1.0], "backend": [backend], **g})
        pts += grid.points()
    return pts


@pytest.mark.slow  # Triton's interpreter: four ports
def test_an_interpret_grid_agrees_with_the_emulator_point_for_point():
    interp, emu = _points("interpret"), _points("emulator")
    assert len(interp) == len(emu) == 4
    nan_points = 0
    for pi, pe in zip(interp, emu):
        assert {k: v for k, v in pi.items() if k not in ("backend", "point_id")} == {
            k: v for k, v in pe.items() if k not in ("backend", "point_id")}
        assert pi["point_id"] != pe["point_id"]
        oi, ref_i, vmax_i, viol_i, _ = decode_point.outputs(pi)
        oe, ref_e, vmax_e, viol_e, _ = decode_point.outputs(pe)
        assert torch.equal(ref_i.nan_to_num(), ref_e.nan_to_num()) and vmax_i == vmax_e and viol_i == viol_e
        assert torch.equal(oi.isnan(), oe.isnan()) and torch.equal(oi.isinf(), oe.isinf())
        fin = oe.isfinite()
        assert bool(((oi - oe).abs()[fin] <= 2.0 ** -7 * oe.abs()[fin] + 1e-6).all()), pi["kernel"]
        nan_points += bool(oe.isnan().any())
        # the row the sweep stores agrees too
        ri, re_ = sweep.compute_decode_point(pi), sweep.compute_decode_point(pe)
        for key in ("rows", "undefined", "nan_rows", "nan", "inf", "violated"):
            assert ri[key] == re_[key], (pi["kernel"], key)
        assert ri["max_err"] == pytest.approx(re_["max_err"], abs=2.0 ** -7, nan_ok=True)
    assert nan_points == 1    # 985c653a's parent, and only it


def test_triton_without_a_gpu_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    grid = {"kind": "decode", "kernel": ["pa_decode_tile"], "context": [64], "spread": [1.0],
            "backend": ["triton"]}
    (point,) = sweep.DecodeGrid(grid).points()
    assert point["device"] == "cuda"
    ran = []
    monkeypatch.setattr(decode, "pa_decode_tile", lambda *a, **k: ran.append(1))
    with pytest.raises(ValueError, match="backend 'triton'.*'interpret'"):
        decode_point.outputs(point)
    with pytest.raises(ValueError, match="backend 'triton'"):
        sweep.compute_decode_point(point)
    with pytest.raises(sweep.GridError, match="axis 'backend'.*need a GPU"):
        sweep.run(grid, out=tmp_path, name="no_gpu", progress=False)
    assert not ran and not (tmp_path / "atlas" / "no_gpu").exists()
