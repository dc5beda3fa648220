"""Every findings page's repro (docs/findings/<name>.py) runs and shows the failure its page
claims: numbers against exact expectations (V = ones gives 1 wherever a row is finite), the
copy against its fixed upstream, and the edges at +-1 ulp."""

import importlib.util
import math
from pathlib import Path

import pytest

FINDINGS = Path(__file__).resolve().parents[2] / "docs" / "findings"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"finding_{name}", FINDINGS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_page_has_its_repro_and_every_repro_its_page():
    pages = {p.stem for p in FINDINGS.glob("*.md") if p.stem != "index"}
    repros = {p.stem for p in FINDINGS.glob("*.py")}
    assert pages == repros and len(pages) >= 5
    for name in pages:
        text = (FINDINGS / f"{name}.md").read_text()
        assert f"docs/findings/{name}.py" in text, name   # the page names its repro
        for heading in ("## Where", "## Mechanism", "## Repro", "## Fix", "## Safe region",
                        "## Copies"):
            assert heading in text, (name, heading)


def test_mslk_bf16_lazy_rebase():
    r = load("mslk_bf16_lazy_rebase").repro()
    assert r["mslk-2a3c897"]["nan_rows"] == 1 and math.isnan(r["mslk-2a3c897"]["row1"])
    assert r["mslk-2a3c897"]["row1_lse"] == math.inf
    assert r["fixed"]["nan_rows"] == 0 and r["fixed"]["row1"] == 1.0
    assert r["mslk-2a3c897"]["others_exact"] and r["fixed"]["others_exact"]


@pytest.mark.slow
def test_aiter_fp8_lazy_rebase_ignores_the_flag():
    r = load("aiter_fp8_lazy_rebase").repro()
    assert r[("aiter-4676", True)] > 0.9 and r[("aiter-4676", False)] == r[("aiter-4676", True)]
    assert r[("fixed", True)] == 0 and r[("fixed", False)] == 0


def test_mslk_fp8_lazy_rebase():
    r = load("mslk_fp8_lazy_rebase").repro()
    assert r["mslk-2a3c897:fp8"]["nan_share"] > 0.9
    fixed = r["mslk-2a3c897:fp8 with #1033"]
    assert fixed["nan_share"] == 0 and fixed["max_err_where_finite"] == 0


@pytest.mark.slow
def test_primus_fixed_max_edges_and_the_bug_report_inputs():
    mod = load("primus_fixed_max")
    r = mod.repro()
    assert mod.EDGE == pytest.approx(127.997179, abs=1e-6)
    s, out, violated = r["just_below_edge"]
    assert s < mod.EDGE and out == pytest.approx(1.0, abs=1e-6) and violated == []
    s, out, violated = r["just_above_edge"]
    assert s > mod.EDGE and math.isnan(out) and violated == ["overflow at the fixed max"]
    assert math.isnan(r["two_keys_at_127"][0]) and r["v2_at_127.5"][0] == math.inf
    assert r["at_-126"] == (1.0, [])
    s, out, violated = r["just_below_-126"]
    assert s < -126 and out == 0.0 and violated == ["underflow at the fixed max"]
    assert r["k_x16"] == {"nan_rows": 0.0, "inf_rows": 0.0, "zero_rows": 0.0}
    assert r["k_x32"]["nan_rows"] > 0.5 and r["k_x32"]["inf_rows"] > 0


def test_flex_masked_rows_give_zero_and_low_rows_shrink():
    r = load("flex_masked_rows").repro()
    m = r["masked_row"]
    assert m["flex-931"] == [0.0, 0.0, 0.0]                      # the suspected mean does not happen
    assert m["finite-mask-inf-start"] == pytest.approx(m["mean_v"], abs=2e-3)  # it would without m_init
    o = r["row0_output_by_logit"]
    assert o[-80.0] == 1.0 and o[-87.0] == pytest.approx(1.0, abs=4e-3)
    assert 0.5 < o[-88.0] < 0.8 and o[-90.0] < 0.1 and o[-100.0] < 1e-5 and o[-170.0] == 0.0


def test_sage_first_tile_nan_and_flushed_tail():
    r = load("sage_first_tile").repro()
    assert r["first_tile"]["first tile masked"] == {"nan_rows": 64, "rows": 64, "finite": False}
    assert r["first_tile"]["second tile masked"] == {"nan_rows": 0, "rows": 64, "finite": True}
    t = r["flushed_tail"]
    # 1 + 4095 * 2^-11 = 2.9995 in l, only the key at 0 in O: 1 / 2.9995
    assert t["sage-869"] == pytest.approx(1 / (1 + 4095 * 2.0 ** -11), rel=1e-3)
    assert t["sage-869-P-x448"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.slow
def test_fp8_threshold_8_flushes_the_band_threshold_6_keeps():
    r = load("fp8_paged_threshold").repro()
    n = 4095
    # gap 11: P = 2^(-11 + 0.807) < 2^-10 flushes at THR 8, so O holds the one key and l all
    assert r[11.0][8.0] == pytest.approx(1 / (1 + n * 2.0 ** -11), rel=1e-2)
    assert r[12.0][8.0] == pytest.approx(1 / (1 + n * 2.0 ** -12), rel=1e-2)
    assert r[11.0][6.0] > 1 and r[12.0][6.0] > 1               # kept, rounded up as subnormals
    assert r[10.0][8.0] == r[10.0][6.0] and r[13.0][8.0] == r[13.0][6.0]


def test_mla_decode_p_cast_loses_half_the_mass_without_the_lift():
    r = load("mla_decode_p_cast").repro()
    (out0, lse0), (out8, lse8) = r[0.0], r[8.0]
    # the 1023 keys at 2^-10 flush to 0 in the PV product, stay in l: out = 1 / (1 + 1023/1024)
    assert out0 == pytest.approx(1 / (1 + 1023 / 1024), rel=2 ** -8)
    assert out8 == pytest.approx(1.0, abs=2 ** -8)
    assert lse0 == pytest.approx(r["exact_lse"], abs=1e-5) and lse8 == pytest.approx(r["exact_lse"], abs=1e-5)


def test_pa_decode_inf_path_nan_from_m_of_minus_128_on_several_m_tiles():
    mod = load("pa_decode_inf_path")
    r = mod.repro()
    for g in (16, 17):
        assert -128.0 < r[(g, "inside")]["m"] < -127.99998 and r[(g, "outside")]["m"] == -128.0
        assert r[(g, "inside")]["nan_rows"] == 0 and r[(g, "inside")]["max_err"] < 2e-3
    assert r[(16, "outside")]["nan_rows"] == 0 and r[(16, "outside")]["max_err"] < 2e-3
    assert r[(17, "outside")]["nan_rows"] == 17 and r[(17, "outside")]["max_err"] is None


def test_pa_decode_inf_path_edge_is_found_by_bisection():
    mod = load("pa_decode_inf_path")
    assert mod.edge_key_scale() == mod.EDGE_KEY_SCALES
