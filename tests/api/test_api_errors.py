"""Every bad input raises a ValueError/TypeError naming the argument, before any work."""

import re

import pytest
import torch

import fa_lab
from fa_lab.kernels.swp_bf16 import model as swp_bf16
from fa_lab.kernels.swp_fp8 import model as swp_fp8

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


@pytest.mark.parametrize("version, refused", [
    ("3.5.1", True), ("3.4.0", True), ("2.9.9", True), ("", True), ("3.6.0", False),
    ("3.10.0", False), ("4.0.0+git1a2b3c", False)])
def test_a_triton_older_than_the_floor_is_refused_naming_its_version(monkeypatch, version, refused):
    """Triton below the kernels' floor lacks APIs they use: every Triton backend refuses,
    naming the version and the fix, before any work (3.10 is newer than 3.6, not older)."""
    triton = pytest.importorskip("triton")
    from fa_lab import kernels

    monkeypatch.setattr(triton, "__version__", version)
    assert kernels.available() is not refused
    if not refused:
        return
    why = f"Triton {version or '(no version)'} is older than the kernels need (pip install 'triton>=3.6')"
    for backend in ("interpret", "fast"):
        with pytest.raises(RuntimeError, match=re.escape(f"backend='{backend}' cannot run: {why}")):
            fa_lab.flash_attn_func(Q, KV, KV, backend=backend)
    with pytest.raises(RuntimeError, match=re.escape(f"exact_dots cannot run: {why}")):
        kernels.exact_dots()
    # on CPU tensors 'auto' means the model, which needs no Triton
    assert fa_lab.api.plan(Q, KV, KV).backend == "emulator"


def test_a_missing_triton_is_refused_naming_the_install(monkeypatch):
    import sys

    from fa_lab import kernels

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert kernels.unavailable() == "Triton is not installed (pip install 'triton>=3.6')"
    with pytest.raises(RuntimeError, match=r"backend='interpret' cannot run: Triton is not installed"):
        fa_lab.flash_attn_func(Q, KV, KV, backend="interpret")
