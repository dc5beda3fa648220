"""backend="flydsl" (upstream's real kernel) and fa_lab.compare.

No MI355X here: the backend must say what is missing before any work, and, given a stand-in
for upstream's function, pass exactly the arguments the user asked for (or refuse them).
``compare`` is checked on hand-built tensors and on the model against its interpreted port.
"""

import math
import sys
import textwrap

import pytest
import torch

import fa_lab
from fa_lab import flydsl
from fa_lab.compare import tensor_diff
from fa_lab.studies.experiments import drag_case
from fa_lab.kernels.swp_bf16 import model as model


def small(seed=0, k_scale=1.0, S=64, H=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, S, H, 64, generator=g).bfloat16()
    k = (torch.randn(1, S, H, 64, generator=g) * k_scale).bfloat16()
    v = torch.randn(1, S, H, 64, generator=g).bfloat16()
    return q, k, v


@pytest.fixture
def no_model(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model ran before the error")
    monkeypatch.setattr(model, "forward", boom)


def test_flydsl_on_cpu_tensors_says_what_is_missing(no_model):
    with pytest.raises(flydsl.BackendUnavailable, match="GPU tensors"):
        fa_lab.flash_attn_func(*small(), backend="flydsl")


def test_flydsl_without_package_names_where_it_looked(monkeypatch):
    monkeypatch.delenv(flydsl.ENV, raising=False)
    monkeypatch.setattr(flydsl, "INTERFACES", ("fa_lab_no_such_pkg.attn:flydsl_flash_attn_func",))
    with pytest.raises(flydsl.BackendUnavailable, match="FlyDSL.*fa_lab_no_such_pkg.*FA_LAB_FLYDSL"):
        flydsl.upstream_function()
    monkeypatch.setenv(flydsl.ENV, "no-colon")
    with pytest.raises(flydsl.BackendUnavailable, match="module:function"):
        flydsl.upstream_function()


def test_flydsl_on_a_cuda_build_names_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    with pytest.raises(flydsl.BackendUnavailable, match="ROCm.*gfx950.*NVIDIA H200"):
        flydsl.check_device(torch.device("cuda"))


@pytest.fixture
def fake_upstream(monkeypatch, tmp_path):
    """A stand-in for upstream's flydsl_flash_attn_func (its keywords as in FlyDSL main:
    no return_lse) that records its arguments and answers with the model."""
    (tmp_path / "fake_flydsl_iface.py").write_text(textwrap.dedent('''
        import torch
        from fa_lab.kernels.swp_bf16 import model as swp_bf16
        from fa_lab.policies import get as get_policy
        CALLS = []
        def flydsl_flash_attn_func(q, k, v, *, causal=True, num_kv_heads=None,
                                   cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
                                   max_seqlen_kv=None, num_kv_splits=1,
                                   dualwave_swp_lazy_rescale=True):
            CALLS.append(dict(causal=causal, num_kv_heads=num_kv_heads,
                              cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                              num_kv_splits=num_kv_splits,
                              lazy=dualwave_swp_lazy_rescale))
            if cu_seqlens_q is not None:
                return torch.zeros_like(q)
            pol = get_policy("lazy" if dualwave_swp_lazy_rescale else "eager")
            return swp_bf16.forward(q, k, v, causal=causal, policy=pol)[0]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(flydsl.ENV, "fake_flydsl_iface:flydsl_flash_attn_func")
    monkeypatch.setattr(flydsl, "check_device", lambda device: None)
    import fake_flydsl_iface  # made at run time (above)
    fake_flydsl_iface.CALLS.clear()
    yield fake_flydsl_iface
    sys.modules.pop("fake_flydsl_iface", None)


def test_flydsl_passes_the_request(fake_upstream):
    q, k, v = small()
    out = fa_lab.flash_attn_func(q, k[:, :, :1].contiguous(), v[:, :, :1].contiguous(),
                                 causal=False, rescale="eager", backend="flydsl")
    call = fake_upstream.CALLS[-1]
    assert call["causal"] is False and call["num_kv_heads"] == 1 and call["lazy"] is False
    assert out.shape == q.shape
    fa_lab.flash_attn_func(q, k, v, backend="flydsl")  # upstream's default: lazy
    assert fake_upstream.CALLS[-1]["lazy"] is True


def test_flydsl_refuses_what_upstream_lacks(fake_upstream):
    q, k, v = small()
    for kw, match in ((dict(rescale="lazy_unfixed"), "models only"),
                      (dict(rescale="fa4_row"), "models only"),
                      (dict(rescale_threshold=4.0), "fixed threshold 8"),
                      (dict(kernel="swp_bf16"), "routes by itself"),
                      (dict(return_lse=True), "return_lse"),
                      (dict(sink=torch.zeros(2)), "sink")):
        with pytest.raises(ValueError, match=match):
            fa_lab.flash_attn_func(q, k, v, backend="flydsl", **kw)
    assert fake_upstream.CALLS == []  # nothing ran


def test_flydsl_varlen_forwards_cu_seqlens(fake_upstream):
    q, k, v = (x[0] for x in small(S=96))
    cu = torch.tensor([0, 40, 96], dtype=torch.int32)
    fa_lab.flash_attn_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=56,
                           causal=True, backend="flydsl")
    call = fake_upstream.CALLS[-1]
    assert call["cu_seqlens_q"] is cu and call["max_seqlen_q"] == 56


def test_flydsl_has_no_trace_and_no_swa():
    q, k, v = small()
    with pytest.raises(ValueError, match="no trace"):
        fa_lab.trace(q, k, v, rows=0, backend="flydsl")
    with pytest.raises(ValueError, match="SWA"):
        fa_lab.swa_attn_func(q, k, v, window_left=8, backend="flydsl")


def test_tensor_diff_counts_by_hand():
    inf, nan = math.inf, math.nan
    a = torch.tensor([nan, inf, 1.0, 2.0, -inf])
    b = torch.tensor([nan, 1.0, -inf, 2.5, -inf])
    d = tensor_diff("x", a, b)
    got = {m.kind: (m.in_a, m.in_b, m.differ) for m in d.masks}
    assert got == {"nan": (1, 1, 0), "+inf": (1, 0, 1), "-inf": (1, 2, 1)}
    assert d.both_finite == 1 and d.rel_l2 == pytest.approx(0.5 / 2.5) and d.max_abs == 0.5
    assert not d.same_masks
    with pytest.raises(ValueError, match="shapes differ"):
        tensor_diff("x", a, b[:3])


def test_compare_model_with_its_interpreted_port():
    q, k, v = drag_case()
    c = fa_lab.compare(q, k, v, a="emulator", b="interpret", causal=False,
                       rescale="lazy_unfixed", kernel="swp_bf16")
    assert c.same_masks, str(c)
    assert sum(m.in_a for m in c.out.masks) > 0  # the drag does produce non-finite outputs
    assert c.out.both_finite == 0 or c.out.rel_l2 < 1e-2
    assert "nan" in str(c) and c.lse is not None


def test_compare_bad_arguments():
    q, k, v = small()
    with pytest.raises(ValueError, match="both 'emulator'"):
        fa_lab.compare(q, k, v, a="emulator", b="emulator")
    with pytest.raises(ValueError, match="b='cuda'"):
        fa_lab.compare(q, k, v, b="cuda")
    with pytest.raises(TypeError, match="backend"):
        fa_lab.compare(q, k, v, a="emulator", b="interpret", backend="triton")
    with pytest.raises(ValueError, match="'triton' needs GPU tensors"):
        fa_lab.compare(q, k, v, a="emulator", b="triton")
    with pytest.raises(flydsl.BackendUnavailable):
        fa_lab.compare(q, k, v, b="flydsl")  # on a CPU: before the model runs
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        fa_lab.compare(q.tolist(), k, v)     # b=None: the bad argument named, not b


def test_compare_defaults_to_two_backends_this_machine_runs():
    """CPU tensors: the model and the interpreted Triton ports (Triton is a dev
    dependency, so it is here), with the numbers of the explicit call."""
    q, k, v = small(k_scale=8.0)
    c = fa_lab.compare(q, k, v, causal=False, rescale="lazy_unfixed", kernel="swp_bf16")
    assert (c.a, c.b) == ("emulator", "interpret")
    want = fa_lab.compare(q, k, v, a="emulator", b="interpret", causal=False,
                          rescale="lazy_unfixed", kernel="swp_bf16")
    assert str(c) == str(want)
    # beside a = "interpret" the other CPU backend is the model
    assert fa_lab.compare(q, k, v, a="interpret", causal=False).b == "emulator"


def test_compare_default_says_why_nothing_runs_beside_a(monkeypatch, no_model):
    import fa_lab.kernels
    from fa_lab.compare import default_b

    monkeypatch.setattr(fa_lab.kernels, "unavailable", lambda: "Triton is not installed (pip ...)")
    q, k, v = small()
    with pytest.raises(ValueError, match=r"^b=None: no backend beside a='emulator' runs tensors "
                       r"on cpu here \('interpret': backend 'interpret' cannot run here: "
                       r"Triton is not installed"):
        fa_lab.compare(q, k, v)
    assert default_b("cpu", "interpret") == "emulator"


def test_compare_default_on_a_gpu(monkeypatch):
    """No GPU here: the choice among GPU backends, with what each needs faked."""
    import fa_lab.kernels
    from fa_lab.compare import default_b

    monkeypatch.setattr(fa_lab.kernels, "unavailable", lambda: None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    assert default_b("cuda") == "triton"                  # CUDA: no FlyDSL, the Triton ports
    monkeypatch.setattr(flydsl, "check_device", lambda device: None)
    monkeypatch.setattr(flydsl, "upstream_function", lambda: None)
    assert default_b("cuda") == "flydsl"                  # an MI355X with FlyDSL
    assert default_b("cuda", a="flydsl") == "triton"
