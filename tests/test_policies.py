"""Policy resolution: defaults, upstream's flag, and every contradiction."""

import math

import pytest

from fa_lab import policies as P


def r(**kw):
    base = dict(fp8=False, seqlen_kv=8192)
    base.update(kw)
    return P.resolve(**base)


def test_defaults_follow_upstream_flag():
    assert r() == P.RescalePolicy("lazy", 8.0, None, 0.0)
    assert r(dualwave_swp_lazy_rescale=False).name == "eager"
    assert r(rescale="lazy_unfixed", rescale_threshold=4).threshold == 4.0


def test_fp8_only_options():
    assert r(fp8=True, rescale="lazy_capped").rebase_bound == 16.0
    assert r(fp8=True, rescale="lazy_capped", rebase_bound=32).rebase_bound == 32.0
    assert r(fp8=True, rescale_threshold="by_kv_len", seqlen_kv=4096).threshold == 6.0
    assert r(fp8=True, rescale_threshold="by_kv_len", seqlen_kv=4097).threshold == 4.0
    lazy = r(fp8=True, p_headroom=True)
    assert lazy.p_headroom == pytest.approx(math.log2(448) - 8)
    eager = r(fp8=True, rescale="eager", p_headroom=True)
    assert eager.p_headroom == pytest.approx(math.log2(448))
    assert r(fp8=True, p_headroom=False).p_headroom == 0.0
    assert r(fp8=True, p_headroom=2.5).p_headroom == 2.5


@pytest.mark.parametrize("kw, exc, words", [
    (dict(rescale="sometimes"), ValueError, "rescale"),
    (dict(rescale=3), TypeError, "rescale"),
    (dict(rescale="lazy_capped"), ValueError, "rescale"),  # fp8-only policy on bf16
    (dict(rescale="lazy", dualwave_swp_lazy_rescale=False), ValueError, "dualwave_swp_lazy_rescale"),
    (dict(dualwave_swp_lazy_rescale="yes"), TypeError, "dualwave_swp_lazy_rescale"),
    (dict(rescale_threshold=-1.0), ValueError, "rescale_threshold"),
    (dict(rescale_threshold=math.nan), ValueError, "rescale_threshold"),
    (dict(rescale_threshold="8"), ValueError, "rescale_threshold"),
    (dict(rescale_threshold="by_kv_len"), ValueError, "rescale_threshold"),  # fp8 rule only
    (dict(rescale="eager", rescale_threshold=8.0), ValueError, "rescale_threshold"),
    (dict(rebase_bound=16), ValueError, "rebase_bound"),
    (dict(fp8=True, rescale="lazy_capped", rebase_bound=-2), ValueError, "rebase_bound"),
    (dict(fp8=True, rescale="lazy", rebase_bound=16), ValueError, "rebase_bound"),
    (dict(p_headroom=True), ValueError, "p_headroom"),
    (dict(fp8=True, p_headroom=-1.0), ValueError, "p_headroom"),
    (dict(fp8=True, p_headroom="on"), TypeError, "p_headroom"),
])
def test_bad_policy_arguments(kw, exc, words):
    with pytest.raises(exc, match=words):
        r(**kw)
