"""q, k, v in another layout than [B, S, H, D] (SDPA's [B, H, S, D]): a warning naming the
expected layout where the shapes are no legitimate call's, none where they are one, and
a hint in the shape errors such a layout causes."""

import warnings

import pytest
import torch

import fa_lab
from fa_lab import api, checks

BF = torch.bfloat16


def t(*shape):
    return torch.zeros(shape, dtype=BF)


def layout_warnings(fn, *args, result=None, **kw) -> list:
    """The layout warnings of ``fn(*args, **kw)``; its value appended to ``result``."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        value = fn(*args, **kw)
    if result is not None:
        result.append(value)
    return [w for w in said if "[B, S, H, D]" in str(w.message)]


@pytest.mark.parametrize("q, k", [
    ((1, 1024, 8, 128), (1, 1024, 8, 128)),      # self-attention
    ((1, 1, 32, 128), (1, 4096, 8, 128)),        # decoding: one query, GQA
    ((1, 16, 64, 64), (1, 16, 8, 64)),           # more heads than tokens, GQA
    ((2, 16, 32, 64), (2, 16, 32, 64)),          # more heads than tokens, few heads
    ((1, 8, 64, 64), (1, 512, 64, 64)),          # a short query over a long KV
    ((1, 512, 256, 64), (1, 512, 256, 64)),      # as many heads as any model has
    ((1, 256, 128, 128), (1, 256, 128, 128)),
])
def test_legitimate_shapes_do_not_warn(q, k):
    assert layout_warnings(api.plan, t(*q), t(*k), t(*k), causal=False) == []
    assert checks.layout_problem(q, k) is None


@pytest.mark.parametrize("q, k, words", [
    ((1, 8, 1024, 128), (1, 8, 1024, 128), "have 1024 heads (dim 2), more than any model's 256"),
    ((1, 32, 512, 64), (1, 8, 512, 64), "have 512 heads (dim 2)"),     # SDPA with GQA
    ((2, 16, 128, 64), (2, 16, 128, 64), "have 128 heads over 16 tokens"),
    ((1, 4, 64, 64), (1, 4, 64, 64), "have 64 heads over 4 tokens"),
])
def test_sdpa_layout_warns_naming_the_expected_one(q, k, words):
    planned = []
    said = layout_warnings(api.plan, t(*q), t(*k), t(*k), causal=False, result=planned)
    assert len(said) == 1 and said[0].category is UserWarning
    text = str(said[0].message)
    assert words in text and "fa_lab takes [B, S, H, D]" in text
    assert "q.transpose(1, 2)" in text
    assert said[0].filename == __file__        # the caller's line, not fa_lab's
    # the call runs as given: a warning, not a refusal
    assert planned[0].call.seqlen_q == q[1]


def test_every_entry_point_warns():
    q = t(1, 8, 512, 64)
    for fn, kw in ((fa_lab.flash_attn_func, {}), (fa_lab.trace, {"rows": 0}),
                   (fa_lab.count_rescales, {})):
        said = layout_warnings(fn, q, q, q, causal=False, **kw)
        assert len(said) == 1 and said[0].filename == __file__, fn.__name__
    # varlen: packed [total, H, D] with a head axis no model has
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    packed = t(8, 300, 64)
    said = layout_warnings(api.plan, packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=4, causal=False)
    assert len(said) == 1 and "300 heads" in str(said[0].message)


def test_shape_errors_of_another_layout_say_so():
    # SDPA's decoding call: q [B, H, 1, D], k [B, Hkv, Skv, D]
    with pytest.raises(ValueError) as e:
        api.plan(t(1, 32, 1, 64), t(1, 8, 64, 64), t(1, 8, 64, 64))
    text = str(e.value)
    assert text.startswith("q heads H=1 must be a multiple of the kv heads Hkv=64")
    assert "read as [B, H, S, D] (SDPA's layout), q [1, 32, 1, 64] and k [1, 8, 64, 64] would " \
           "make a valid call" in text and "q.transpose(1, 2)" in text
    # a shape error that no layout explains: no hint
    with pytest.raises(ValueError) as e:
        api.plan(t(1, 64, 4, 64), t(1, 48, 3, 64), t(1, 48, 3, 64))
    assert "transpose" not in str(e.value)
