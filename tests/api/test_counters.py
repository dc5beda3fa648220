"""Rescale work per policy, counted over the main loop's (wave, tile) steps."""

import pytest

from fa_lab.api import count_rescales
from fa_lab.studies.experiments import bf16_inputs, drag_case, fp8_inputs


@pytest.fixture(scope="module")
def counts():
    q, k, v = bf16_inputs(1, 1024, 2, 64, 32.0, seed=0)
    return {p: count_rescales(q, k, v, causal=False, rescale=p)
            for p in ("eager", "lazy", "lazy_unfixed", "fa4_row")}


def test_loop_steps_are_waves_times_loop_tiles(counts):
    # 1024 rows x 2 heads = 64 waves; N = 16 tiles, loop tiles 1..12
    for c in counts.values():
        assert c["loop_wave_steps"] == 64 * 12 and c["row_steps"] == 64 * 12 * 32


def test_who_skips_and_who_scales_up(counts):
    assert counts["eager"]["o_rescale_skip_frac"] == 0
    assert counts["lazy"]["o_rescale_skip_frac"] > 0.05
    assert counts["fa4_row"]["o_rescale_skip_frac"] > 0.05
    # only the unfixed rebase ever multiplies a row by more than 1, and each of its
    # swept rows is scaled up (dragged)
    assert counts["lazy_unfixed"]["rows_scaled_up"] == counts["lazy_unfixed"]["rows_swept"] > 0
    for p in ("eager", "lazy", "fa4_row"):
        assert counts[p]["rows_scaled_up"] == 0
    # dragging feeds itself: a lowered base makes the next tile look like a jump, so the
    # unfixed ballot fires more often than the fixed one
    assert counts["lazy_unfixed"]["o_multiplies"] > counts["lazy"]["o_multiplies"]


def test_hand_case_counts():
    q, k, v = drag_case(trigger=True, n_tiles=8)
    c = count_rescales(q, k, v, causal=False, rescale="lazy_unfixed")
    # 32 rows pad to one 256-row block: 8 waves x 4 loop tiles; only the first wave holds
    # the trigger, and it fires at every loop tile, dragging the victim each time
    assert c["loop_wave_steps"] == 32 and c["o_multiplies"] == 4
    assert c["rows_swept"] == 4 and c["rows_scaled_up"] == 4


def test_fp8_not_counted():
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 64, 1, 1.0)
    with pytest.raises(ValueError, match="bf16/f16"):
        count_rescales(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
