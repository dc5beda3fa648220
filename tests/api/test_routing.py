"""Upstream's dense routing (flash_attn_interface.py) and fa_lab's refusal to drop an
explicit rescale policy or kernel choice."""

import itertools

import pytest

from fa_lab import policies
from fa_lab.dispatch import TABLE, choose_kernel, supports
from fa_lab.dispatch import ROUTED as KERNELS
from fa_lab.kernels import FAMILIES
from fa_lab.routing import dense_routes_to_dualwave


@pytest.mark.parametrize("batch,seqlen_q,expected", [
    (1, 1, False), (1, 255, False), (1, 256, True), (7, 255, False), (7, 256, True),
    (8, 191, False), (8, 192, True), (8, 255, True), (64, 192, True), (64, 191, False),
])
def test_length_rule(batch, seqlen_q, expected):
    assert dense_routes_to_dualwave(batch, seqlen_q) is expected


@pytest.mark.parametrize("feature", ["has_bias", "has_alibi", "has_sink"])
def test_bias_alibi_sink_force_dualwave(feature):
    assert dense_routes_to_dualwave(1, 1, **{feature: True}) is True
    with pytest.raises(ValueError, match="gfx950"):
        dense_routes_to_dualwave(1, 1, **{feature: True}, arch="gfx942")
    with pytest.raises(ValueError, match="head_dim=96"):
        dense_routes_to_dualwave(1, 1, **{feature: True}, head_dim=96)


def test_arch_and_head_dim_conditions():
    assert dense_routes_to_dualwave(1, 4096, arch="gfx950") is True
    assert dense_routes_to_dualwave(1, 4096, arch="gfx942") is False  # generic everywhere
    assert dense_routes_to_dualwave(1, 4096, head_dim=256) is False
    assert dense_routes_to_dualwave(1, 4096, head_dim=64) is True


# (kwargs, expected kernel)
TRUTH_TABLE = [
    (dict(batch=1, seqlen_q=100, fp8=False), "generic"),
    (dict(batch=1, seqlen_q=300, fp8=False), "swp_bf16"),
    (dict(batch=8, seqlen_q=200, fp8=False), "swp_bf16"),
    (dict(batch=1, seqlen_q=100, fp8=False, rescale="eager"), "generic"),  # generic is eager
    (dict(batch=1, seqlen_q=100, fp8=False, rescale="lazy"), "swp_bf16"),  # not dropped
    (dict(batch=1, seqlen_q=100, fp8=False, rescale="lazy_unfixed"), "swp_bf16"),
    (dict(batch=1, seqlen_q=300, fp8=False, rescale="eager"), "swp_bf16"),
    (dict(batch=1, seqlen_q=100, fp8=False, has_sink=True), "swp_bf16"),
    (dict(batch=1, seqlen_q=100, fp8=True), "swp_fp8"),
    (dict(batch=1, seqlen_q=100, fp8=True, rescale="lazy_capped"), "swp_fp8"),
    (dict(batch=1, seqlen_q=100, fp8=False, rescale="lazy_capped"), "swp_bf16"),
    (dict(batch=1, seqlen_q=100, fp8=False, rescale="fa4_row"), "swp_bf16"),
    (dict(batch=1, seqlen_q=5000, fp8=True, rescale="eager"), "swp_fp8"),
    (dict(batch=1, seqlen_q=5000, fp8=False, kernel="generic"), "generic"),  # explicit wins
    (dict(batch=1, seqlen_q=5000, fp8=False, kernel="generic", rescale="eager"), "generic"),
    (dict(batch=1, seqlen_q=10, fp8=False, kernel="swp_bf16", rescale="lazy"), "swp_bf16"),
    (dict(batch=1, seqlen_q=10, fp8=True, kernel="swp_fp8"), "swp_fp8"),
    (dict(batch=1, seqlen_q=4096, fp8=False, arch="gfx942"), "generic"),
    (dict(batch=1, seqlen_q=4096, fp8=False, arch="gfx942", rescale="eager"), "generic"),
]


@pytest.mark.parametrize("kwargs,expected", TRUTH_TABLE)
def test_truth_table(kwargs, expected):
    assert choose_kernel(**kwargs) == expected


def test_every_choice_implements_the_asked_policy():
    grid = itertools.product([1, 8], [64, 192, 256, 4096], [False, True],
                             [None, *policies.BUILTIN_NAMES, "trtllm_neg_inf:before"])
    seen = set()
    for batch, sq, fp8, rescale in grid:
        kernel = choose_kernel(batch=batch, seqlen_q=sq, fp8=fp8, rescale=rescale)
        seen.add(kernel)
        # a policy with semantics of its own runs on the family that implements them
        semantic = rescale is not None and bool(policies.get(rescale).semantic_fields)
        assert kernel in KERNELS and (kernel == "online") == semantic
        assert semantic or (kernel == "swp_fp8") == fp8
        assert rescale is None or supports(TABLE[(kernel, "emulator")], policies.get(rescale))
    # every family upstream's rules or a policy's semantics can pick is picked; a family of
    # fa_lab's own without semantics of its own runs only where kernel= asks for it
    reachable = {n for n in KERNELS if FAMILIES[n].upstream or FAMILIES[n].caps("model").semantics}
    assert seen == reachable


@pytest.mark.parametrize("kwargs,match", [
    (dict(kernel="generic", rescale="lazy"), r"kernel='generic'.*rescale='lazy'"),
    (dict(kernel="generic", rescale="lazy_unfixed"), r"kernel='generic'.*rescale='lazy_unfixed'"),
    (dict(kernel="generic", rescale="fa4_row"), "vote='row'"),
    (dict(kernel="flash"), "kernel='flash'"),
    (dict(kernel="swa"), "kernel='swa'"),
    (dict(kernel="swp_fp8"), "float8_e4m3fn inputs only"),
    (dict(kernel="swp_bf16", fp8=True), "does not take float8_e4m3fn"),
    (dict(kernel="generic", fp8=True), "does not take float8_e4m3fn"),
    (dict(kernel="generic", has_bias=True), "bias"),
    (dict(kernel="swp_bf16", arch="gfx942"), "gfx950"),
    (dict(kernel="swp_bf16", head_dim=96), "head_dim=96"),
    (dict(rescale="bogus"), "rescale='bogus'"),
    (dict(rescale="lazy", arch="gfx942"), "rescale='lazy' needs the DUALWAVE_SWP"),
    (dict(fp8=True, has_alibi=True), "alibi_slopes is not supported with fp8"),
    (dict(fp8=True, arch="gfx942"), "gfx950"),
    (dict(fp8=True, head_dim=64), "head_dim 128"),
    (dict(has_bias=True, arch="gfx942"), "bias needs the gfx950"),
    (dict(batch=0), "batch"),
    (dict(seqlen_q=-3), "seqlen_q"),
])
def test_errors_name_what_was_asked(kwargs, match):
    base = dict(batch=1, seqlen_q=100, fp8=False) | kwargs
    with pytest.raises(ValueError, match=match):
        choose_kernel(**base)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch=True), "batch"), (dict(batch=2.0), "batch"), (dict(seqlen_q="128"), "seqlen_q"),
    (dict(fp8=1), "fp8"), (dict(rescale=3), "rescale"), (dict(has_sink=None), "has_sink"),
    (dict(arch=950), "arch"), (dict(head_dim=128.0), "head_dim"),
])
def test_type_errors(kwargs, match):
    base = dict(batch=1, seqlen_q=100, fp8=False) | kwargs
    with pytest.raises(TypeError, match=match):
        choose_kernel(**base)
    if "fp8" not in kwargs and "rescale" not in kwargs:
        route_kw = {k: v for k, v in base.items() if k in ("batch", "seqlen_q", "has_sink", "arch", "head_dim")}
        with pytest.raises(TypeError, match=match):
            dense_routes_to_dualwave(**route_kw)


@pytest.mark.parametrize("extra", ["sink", "alibi_slopes", "num_kv_splits"])
def test_a_refusal_never_advises_the_backend_in_use(extra):
    """A zoo preset runs on the online family, which has no sink, ALiBi or split-K: the
    refusal names what is missing, and advises backend='emulator' only to a call on
    another backend."""
    import torch

    import fa_lab

    q = torch.zeros(1, 512, 2, 64, dtype=torch.bfloat16)
    kw = {"sink": torch.zeros(2), "alibi_slopes": torch.zeros(2), "num_kv_splits": 2}
    with pytest.raises(ValueError, match=extra) as e:
        fa_lab.flash_attn_func(q, q, q, rescale="trtllm_neg_inf:before", backend="emulator",
                               **{extra: kw[extra]})
    assert "use backend='emulator'" not in str(e.value)
