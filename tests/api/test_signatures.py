"""The entry points list their parameters (help() and IDEs show them), all of them the
arguments check_call takes, with upstream FlyDSL's names."""

import inspect

import pytest

import fa_lab
from fa_lab import api

UPSTREAM = ("causal", "num_kv_heads", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q",
            "max_seqlen_kv", "num_kv_splits", "dualwave_swp_lazy_rescale", "q_descale",
            "k_descale", "v_descale", "bias", "alibi_slopes", "sink", "return_lse")


@pytest.mark.parametrize("fn, own", [(fa_lab.flash_attn_func, ("return_lse",)),
                                     (fa_lab.trace, ("rows", "batch", "head")),
                                     (fa_lab.count_rescales, ())])
def test_every_entry_point_spells_out_its_parameters(fn, own):
    params = inspect.signature(fn).parameters
    assert list(params)[:3] == ["q", "k", "v"]
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())  # no **options
    assert set(params) == {"q", "k", "v", *api.CALL_OPTIONS, *own}
    assert all(p.kind is p.KEYWORD_ONLY for n, p in params.items() if n not in "qkv")
    # the defaults are check_call's
    checked = inspect.signature(api.check_call).parameters
    for name in api.CALL_OPTIONS:
        if name != "backend" or fn is not fa_lab.count_rescales:  # counts run the model
            assert params[name].default == checked[name].default, (fn.__name__, name)
    assert fn.__doc__ and "q [B" in (fa_lab.flash_attn_func.__doc__ or "")


def test_upstreams_names_and_defaults():
    params = inspect.signature(fa_lab.flash_attn_func).parameters
    assert set(UPSTREAM) <= set(params)
    assert params["causal"].default is True and params["num_kv_splits"].default == 1
    assert params["return_lse"].default is False
    # None, not upstream's True: a given True is a request routing must honour, the default
    # is the upstream version's (fa_lab.upstream), which is True for both versions
    assert params["dualwave_swp_lazy_rescale"].default is None


def test_a_misspelled_argument_is_a_type_error_naming_it():
    from fa_lab.studies.experiments import bf16_inputs

    q = bf16_inputs(1, 64, 1, 64, 1.0)[0]
    with pytest.raises(TypeError, match="rescael"):
        fa_lab.flash_attn_func(q, q, q, rescael="lazy")
