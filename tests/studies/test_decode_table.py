"""The paged decode's table over its axes (``fa_lab.studies.decode_table``, ``fa-lab table
--which decode``): each row against a run of its own, the region's verdict beside the NaN
rows it bounds, bad axes refused before any work."""

import pytest
import torch

from fa_lab import decode
from fa_lab.kernels.pa_decode import bound, cases
from fa_lab.studies import decode_table as dt

MAIN, BEFORE = "main-11c4174d", "flydsl-985c653a^"


def test_each_row_is_its_call():
    t = dt.table(contexts=(257,), query_lengths=(4,), partitions=(2,), scales=("per_token",),
                 versions=(MAIN, BEFORE), seed=11, kernels=("pa_decode",))
    assert list(t.upstream) == [MAIN, BEFORE] and list(t.rows) == [8, 8]
    before = t[t.upstream == BEFORE].iloc[0]
    assert before.nan_rows == 8 and before.violated == "sentinel_pack_nan"
    main = t[t.upstream == MAIN].iloc[0]
    assert main.nan_rows == 0 and main.violated == "" and main.max_err < 2 ** -4
    case = cases.make([257], query_length=4, num_q_heads=2, per_token=True, seed=11)
    out = decode.pa_decode_tile(*case.args(), num_partitions=2, upstream=MAIN).double()
    ref = cases.reference(case)
    vmax = float(case.value_scale.max()) * 448
    assert main.max_err == pytest.approx(float((out - ref).abs().max()) / vmax)
    assert bound.region(MAIN).contains(bound.measure(case, num_partitions=2))


def test_inside_the_region_no_row_is_nan():
    t = dt.table(contexts=(0, 1, 300), query_lengths=(1, 3), partitions=(1, 3),
                 scales=("per_token",), versions=(BEFORE,), kernels=("pa_decode",))
    assert (t[t.violated == ""].nan_rows == 0).all()
    assert t.undefined[t.context == 0].gt(0).all()


@pytest.mark.parametrize("kw, err, words", [
    (dict(contexts=()), ValueError, "contexts"),
    (dict(query_lengths=(17,)), ValueError, "query_lengths"),
    (dict(page_sizes=(32,)), ValueError, "page_sizes"),
    (dict(partitions=(True,)), TypeError, "partitions"),
    (dict(scales=("fp8",)), ValueError, "scales"),
    (dict(versions=("fixed",)), ValueError, "versions"),
    (dict(windows=(-1,)), ValueError, "windows"),
    (dict(windows=(1.5,)), TypeError, "windows"),
    (dict(windows=(300,), page_sizes=(16,)), ValueError, "windows: 300 runs pa_decode_swa"),
    (dict(windows=(0,), page_sizes=(1024,)), ValueError, "windows: 0 runs pa_decode_tile"),
    (dict(windows=(300,), page_sizes=(1024,), head_dim=256), ValueError, "head_dim"),
    (dict(spreads=()), ValueError, "spreads"),
    (dict(spreads=(-1.0,)), ValueError, "spreads"),
    (dict(spreads=(float("nan"),)), ValueError, "spreads"),
    (dict(spreads=("2",)), TypeError, "spreads"),
    (dict(kernels=("mla",)), ValueError, "kernels"),
    (dict(kernels=()), ValueError, "kernels"),
    (dict(kernels=("mla_decode",), query_lengths=(1,)), ValueError, "query_lengths"),
    (dict(kernels=("mla_decode",), versions=(MAIN,)), ValueError, "versions"),
    (dict(kernels=("mla_decode",), group=4), ValueError, "group"),
    (dict(kernels=("pa_decode",), p_headrooms=(0.0,)), ValueError, "p_headrooms"),
    (dict(p_headrooms=(9.0,)), ValueError, "p_headrooms"),
    (dict(p_headrooms=()), ValueError, "p_headrooms"),
    (dict(p_headrooms=("8",)), TypeError, "p_headrooms"),
])
def test_bad_axes_are_refused(kw, err, words):
    with pytest.raises(err, match=words):
        dt.table(**kw)


def test_window_rows_run_the_sliding_window_kernel():
    # windows (0, 300) over page sizes (16, 1024): each window takes its kernel's pages
    t = dt.table(contexts=(700,), query_lengths=(2,), partitions=(1, 3), scales=("per_tensor",),
                 versions=(MAIN,), windows=(0, 300), page_sizes=(16, 1024), seed=3,
                 kernels=("pa_decode",))
    assert sorted(zip(t.window, t.page_size, t.num_partitions)) == [
        (0, 16, 1), (0, 16, 3), (300, 1024, 1), (300, 1024, 3)]
    sw = t[t.window == 300].set_index("num_partitions")
    assert (sw.violated == "no region").all() and (sw.nan_rows == 0).all()
    # 3 partitions cover the window's tiles 1 and 2; the fused path runs tile 1 only
    assert sw.max_err[3] < 2 ** -6 < sw.max_err[1]
    case = cases.make([700], query_length=2, num_q_heads=2, block_size=1024, seed=3,
                      spare_pages=1)
    out = dt._run(case, MAIN, 3, 300).double()
    ref = cases.reference(case, sliding_window=300)
    vmax = float(case.value_scale.max()) * 448
    assert sw.max_err[3] == pytest.approx(float((out - ref).abs().max()) / vmax)


def test_the_cli_prints_and_saves_the_table(tmp_path, capsys):
    from fa_lab import results
    from fa_lab.cli import main

    assert main(["table", "--which", "decode", "--contexts", "257", "--query-lens", "2",
                 "--partitions", "2", "--scales", "per_token", "--kernels", "pa_decode",
                 "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "sentinel_pack_nan" in printed and "inside" in printed
    saved = results.load("table_decode_cpu", root=tmp_path)
    assert len(saved["rows"]) == 2 and saved["params"]["contexts"] == [257]
    with pytest.raises(SystemExit):
        main(["table", "--which", "decode", "--causal", "--no-save"])
    assert "--causal" in capsys.readouterr().err
    assert main(["table", "--which", "decode", "--contexts", "300", "--query-lens", "1",
                 "--partitions", "2", "--scales", "per_token", "--windows", "100",
                 "--page-sizes", "1024", "--kernels", "pa_decode", "--no-save"]) == 0
    assert "no region" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["table", "--which", "decode", "--windows", "100", "--no-save"])
    assert "windows: 100 runs pa_decode_swa" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["table", "--which", "bf16", "--windows", "100", "--no-save"])
    assert "--windows is an axis of --which decode" in capsys.readouterr().err
    assert torch.isfinite(torch.tensor([r["max_err"] for r in saved["rows"]
                                        if r["nan_rows"] == 0])).all()


def test_the_spread_axis_scales_k_and_matches_its_call():
    t = dt.table(contexts=(300,), query_lengths=(2,), partitions=(2,), scales=("per_tensor",),
                 versions=(MAIN,), spreads=(1.0, 8.0), seed=5, kernels=("pa_decode",))
    assert list(t.spread) == [1.0, 8.0]
    for sp in (1.0, 8.0):
        case = cases.make([300], query_length=2, num_q_heads=2, k_mult=sp, seed=5)
        out = decode.pa_decode_tile(*case.args(), num_partitions=2, upstream=MAIN).double()
        ref = cases.reference(case)
        vmax = float(case.value_scale.max()) * 448
        row = t[t.spread == sp].iloc[0]
        assert row.max_err == pytest.approx(float((out - ref).abs().max()) / vmax)
    # a wider spread puts more weight on fewer keys: the fp8 P error grows with it
    assert t.max_err[t.spread == 8.0].iloc[0] > t.max_err[t.spread == 1.0].iloc[0]


def test_the_cli_takes_spreads_and_head_dim(capsys):
    from fa_lab.cli import main

    assert main(["table", "--which", "decode", "--contexts", "257", "--query-lens", "1",
                 "--partitions", "1", "--scales", "per_tensor", "--decode-versions", MAIN,
                 "--spreads", "0.5,4", "--head-dim", "128", "--kernels", "pa_decode",
                 "--no-save"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "spread" in lines[0] and len(lines) == 3
    with pytest.raises(SystemExit):
        main(["table", "--which", "decode", "--head-dim", "96", "--no-save"])
    assert "head_dim" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["table", "--which", "bf16", "--spreads", "2", "--no-save"])
    assert "--spreads is an axis of --which decode" in capsys.readouterr().err


def test_mla_rows_are_their_calls_and_show_the_mass_loss_the_lift_removes():
    from fa_lab import mla
    from fa_lab.kernels.mla_decode import model as M
    from fa_lab.studies.mla_mass_loss import gaussian_inputs

    t = dt.table(kernels=("mla_decode",), contexts=(0, 200), partitions=(2,), spreads=(3.0,),
                 p_headrooms=(0.0, 8.0), seed=2)
    assert list(zip(t.context, t.p_headroom)) == [(0, 0.0), (0, 8.0), (200, 0.0), (200, 8.0)]
    assert (t.kernel == "mla_decode").all() and (t.page_size == 1).all()
    empty = t[t.context == 0]
    assert (empty.undefined == 128).all() and empty.max_err.isna().all()
    q, kv, pages, scale = gaussian_inputs(3.0, 200, 2)
    ref, _ = M.reference(q[0].float(), kv.float().reshape(-1, 576), scale)
    for h in (0.0, 8.0):
        out, _ = mla.mla_decode(q, kv, torch.tensor([0, 200], dtype=torch.int32), pages, scale,
                                num_kv_splits=2, backend="emulator", p_headroom=h)
        row = t[(t.context == 200) & (t.p_headroom == h)].iloc[0]
        assert row.max_err == pytest.approx(float((out[0].double() - ref).abs().max()))
        o = out[0].double()
        lost = 1 - (o * ref).sum(-1) / (ref * ref).sum(-1)     # V = 1: 1 - mean(out)
        assert row.mass_loss == pytest.approx(float(lost.mean()))
        assert row.mass_loss == pytest.approx(float((1 - o.mean(-1)).mean()), abs=1e-9)
    up, lifted = (t[(t.context == 200) & (t.p_headroom == h)].iloc[0] for h in (0.0, 8.0))
    assert up.mass_loss > 4 * lifted.mass_loss > 0
    assert "p_flush" in up.violated.split(",")


def test_the_cli_table_takes_the_mla_kernel_and_refuses_what_does_not_apply(capsys):
    from fa_lab.cli import main

    assert main(["table", "--which", "decode", "--kernels", "mla_decode", "--contexts", "200",
                 "--partitions", "1", "--spreads", "2", "--p-headrooms", "0", "--no-save"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].split()[0] == "mla_decode" and "mass loss" in lines[0]
    for args, needle in ((["--kernels", "mla_decode", "--query-lens", "2"], "--query-lens"),
                         (["--kernels", "mla_decode", "--H", "4"], "--H"),
                         (["--kernels", "pa_decode", "--p-headrooms", "8"], "--p-headrooms"),
                         (["--kernels", "mla"], "--kernels"),
                         (["--p-headrooms", "9"], "p_headrooms")):
        with pytest.raises(SystemExit):
            main(["table", "--which", "decode", *args, "--no-save"])
        assert needle in capsys.readouterr().err, args
    with pytest.raises(SystemExit):
        main(["table", "--which", "bf16", "--kernels", "mla_decode", "--no-save"])
    assert "--kernels is an axis of --which decode" in capsys.readouterr().err
