"""Every bad input raises a ValueError/TypeError naming the argument, before any work."""

import pytest
import torch

import fa_lab
from fa_lab.models import swp_bf16, swp_fp8

BF = torch.bfloat16
F8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Any call that reaches a model is a failure: errors must come first."""
    def boom(*a, **k):
        raise AssertionError("the model ran before the bad argument was caught")
    monkeypatch.setattr(swp_bf16, "forward", boom)
    monkeypatch.setattr(swp_fp8, "forward", boom)


def t(*shape, dtype=BF):
    return torch.zeros(shape, dtype=torch.float32).to(dtype)


Q = t(1, 64, 4, 64)
KV = t(1, 64, 2, 64)
Q8, KV8 = t(1, 64, 2, 128, dtype=F8), t(1, 64, 2, 128, dtype=F8)
DS = dict(q_descale=1.0, k_descale=1.0, v_descale=1.0)


@pytest.mark.parametrize("args, kw, exc, words", [
    (("q", KV, KV), {}, TypeError, "q must be a torch.Tensor"),
    ((Q[0], KV, KV), {}, ValueError, "q must be 4-D"),
    ((Q, KV[0], KV), {}, ValueError, "k must be 4-D"),
    ((Q, KV, KV[..., None]), {}, ValueError, "v must be 4-D"),
    ((Q.float(), KV, KV), {}, TypeError, "q has dtype"),
    ((Q, KV.half(), KV), {}, TypeError, "k has dtype"),
    ((Q, KV, KV.half()), {}, TypeError, "v has dtype"),
    ((Q, KV, t(1, 32, 2, 64)), {}, ValueError, "k .* and v .* same shape"),
    ((Q, t(2, 64, 2, 64), t(2, 64, 2, 64)), {}, ValueError, "batch"),
    ((Q, t(1, 64, 2, 128), t(1, 64, 2, 128)), {}, ValueError, "head dim"),
    ((t(1, 64, 4, 96), t(1, 64, 2, 96), t(1, 64, 2, 96)), {}, ValueError, "head dim D=96"),
    ((Q, t(1, 64, 3, 64), t(1, 64, 3, 64)), {}, ValueError, "multiple of the kv heads"),
    ((t(1, 0, 4, 64), KV, KV), {}, ValueError, "sequence lengths"),
    ((Q, KV, KV), dict(num_kv_heads=4), ValueError, "num_kv_heads"),
    ((Q, KV, KV), dict(num_kv_heads=2.0), TypeError, "num_kv_heads"),
    ((Q, KV, KV), dict(causal=1), TypeError, "causal"),
    ((Q, KV, KV), dict(return_lse="yes"), TypeError, "return_lse"),
    ((Q, KV, KV), dict(backend="cuda"), ValueError, "backend"),
    ((Q, KV, KV), dict(q_descale=1.0), ValueError, "q_descale"),
    ((Q, KV, KV), dict(fp8_saturate=True), ValueError, "fp8_saturate"),
    ((Q, KV, KV), dict(rescale="nope"), ValueError, "rescale"),
    ((Q, KV, KV), dict(rescale_threshold=-8), ValueError, "rescale_threshold"),
    ((Q, KV, KV), dict(rebase_bound=16), ValueError, "rebase_bound"),
    ((Q8, KV8, KV8), {}, ValueError, "missing q_descale, k_descale, v_descale"),
    ((Q8, KV8, KV8), dict(q_descale=1.0, k_descale=1.0), ValueError, "v_descale"),
    ((Q8, KV8, KV8), dict(DS, k_descale=-1.0), ValueError, "k_descale"),
    ((Q8, KV8, KV8), dict(DS, v_descale=torch.ones(2)), ValueError, "v_descale"),
    ((Q8, KV8, KV8), dict(DS, q_descale="1"), TypeError, "q_descale"),
    ((Q8, KV8, KV8), dict(DS, rescale="lazy_capped", rebase_bound=-1), ValueError, "rebase_bound"),
    ((Q8, KV8, KV8), dict(DS, fp8_saturate="no"), TypeError, "fp8_saturate"),
    ((t(1, 64, 2, 64, dtype=F8), t(1, 64, 2, 64, dtype=F8), t(1, 64, 2, 64, dtype=F8)), DS,
     ValueError, "D = 128"),
])
def test_bad_input_raises_naming_the_argument(args, kw, exc, words):
    with pytest.raises(exc, match=words):
        fa_lab.flash_attn_func(*args, **kw)


@pytest.mark.parametrize("rows, words", [
    (None, "rows"), ([], "rows is empty"), ([64], "query row 64"), ([(0, 4, 0)], "head 4"),
    ([(1, 0, 0)], "batch 1"), ([(0, 0)], "tuple"),
])
def test_bad_trace_rows(rows, words):
    with pytest.raises(ValueError, match=words):
        fa_lab.trace(Q, KV, KV, rows=rows)


def test_backend_errors_name_the_fix():
    with pytest.raises(ValueError, match="backend='triton' needs CUDA"):
        fa_lab.flash_attn_func(Q, KV, KV, backend="triton")
