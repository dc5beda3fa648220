"""fa_lab.sdpa.patched: SDPA routed through flash_attn_func, against SDPA in fp64; what it
refuses; the non-finite events it records; the original restored."""

import math

import pytest
import torch
import torch.nn.functional as F

import fa_lab
from fa_lab import sdpa

ORIGINAL = F.scaled_dot_product_attention


def bhsd(B, H, S, D, *, Hkv=None, L=None, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L or S, D, generator=g).bfloat16()
    k = (torch.randn(B, Hkv or H, S, D, generator=g) * scale).bfloat16()
    v = torch.randn(B, Hkv or H, S, D, generator=g).bfloat16()
    return q, k, v


def ref64(q, k, v, **kw):
    return ORIGINAL(q.double(), k.double(), v.double(), **kw)


def close(a, r, tol=2.0 ** -7):
    assert a.dtype == torch.bfloat16 and a.shape == r.shape
    assert (a.double() - r).abs().max() <= tol * r.abs().max()


@pytest.mark.parametrize("kw", [
    dict(is_causal=True), dict(is_causal=False), dict(is_causal=True, scale=64 ** -0.5),
    dict(enable_gqa=True, is_causal=True),
])
def test_patched_sdpa_equals_sdpa_in_fp64(kw):
    q, k, v = bhsd(2, 4, 48, 64, Hkv=2 if kw.get("enable_gqa") else None, seed=1)
    with sdpa.patched(rescale="lazy", backend="emulator") as rec:
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    assert rec.calls == 1 and rec.events == []
    close(out, ref64(q, k, v, **kw))


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_masks_become_the_bias(mask):
    q, k, v = bhsd(1, 2, 40, 64, L=24, seed=2)
    g = torch.Generator().manual_seed(3)
    if mask == "bool":
        m = torch.rand(24, 40, generator=g) > 0.3
        m[:, 0] = True  # no empty row
    else:
        m = (torch.randn(1, 1, 24, 40, generator=g) * 3).bfloat16().float()
    with sdpa.patched(backend="emulator") as rec:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert rec.events == []
    close(out, ref64(q, k, v, attn_mask=m if mask == "bool" else m.double()))


def test_gradients_equal_sdpa_in_fp64():
    q, k, v = bhsd(1, 2, 40, 64, seed=4)
    do = torch.randn(1, 2, 40, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa.patched(backend="emulator") as rec:
        F.scaled_dot_product_attention(*leaves, is_causal=True).backward(do)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ORIGINAL(*ref, is_causal=True).backward(do.double())
    assert rec.events == []
    for a, r in zip(leaves, ref):
        close(a.grad, r.grad, 2.0 ** -6)


@pytest.mark.parametrize("change, match", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(dropout_p=-0.1), "dropout_p=-0.1"),
    (dict(dropout_p=float("nan")), "dropout_p=nan"),
    (dict(dropout_p=True), "dropout_p=True"),
    (dict(scale=0.5), "scale"),
    (dict(is_causal=True, attn_mask=torch.ones(16, 16, dtype=torch.bool)), "attn_mask together"),
    (dict(attn_mask=torch.ones(2, 1, 16, 16, dtype=torch.bool).tril()
          .logical_or(torch.arange(2).view(2, 1, 1, 1).bool())), "differs between batch"),
    (dict(attn_mask=torch.ones(3, 16, 16, dtype=torch.bool)), "does not broadcast"),
    (dict(attn_mask=torch.ones(16, 15, dtype=torch.bool)), r"\[16, 15\] does not broadcast"),
    (dict(attn_mask=torch.zeros(2, 3, 16, 16)), r"\[2, 3, 16, 16\] does not broadcast"),
    (dict(attn_mask=torch.ones(1, 2, 2, 16, 16, dtype=torch.bool)), "does not broadcast"),
    (dict(attn_mask=torch.full((16, 16), 0.1)), "cannot represent exactly"),
    (dict(attn_mask=torch.zeros(16, 16).requires_grad_()), "attn_mask requires grad"),
    (dict(attn_mask=torch.zeros(16, 16, dtype=torch.int32)), "attn_mask must be bool"),
    (dict(query=lambda q: q.float()), "query dtype torch.float32"),
    (dict(query=lambda q: q[..., :32]), "head dims must equal|head dim 32"),
    (dict(key=lambda k: k[:, :1], value=lambda v: v[:, :1]), "enable_gqa"),
    (dict(query=lambda q: q[0]), "4-D"),
])
def test_what_it_cannot_honour_is_refused_by_name(change, match):
    q, k, v = bhsd(2, 2, 16, 64)
    args = {"query": q, "key": k, "value": v}
    for name in ("query", "key", "value"):
        if name in change:
            args[name] = change.pop(name)(args[name])
    with sdpa.patched(backend="emulator") as rec:
        with pytest.raises((ValueError, TypeError), match=match):
            F.scaled_dot_product_attention(**args, **change)
    assert rec.calls == 0


def test_causal_with_unequal_lengths_is_refused():
    q, k, v = bhsd(1, 1, 32, 64, L=16)
    with sdpa.patched(backend="emulator"), pytest.raises(ValueError, match="top-left"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_bad_options_fail_on_entry_and_nesting_is_refused():
    with pytest.raises(ValueError, match="rescale"):
        with sdpa.patched(rescale="no_such_policy"):
            pass
    with pytest.raises(ValueError, match="causal is set per call"):
        with sdpa.patched(causal=True):
            pass
    assert F.scaled_dot_product_attention is ORIGINAL
    with sdpa.patched():
        with pytest.raises(RuntimeError, match="nesting is refused"):
            with sdpa.patched():
                pass
        assert sdpa.active() is not None
    assert sdpa.active() is None and F.scaled_dot_product_attention is ORIGINAL


def test_the_original_is_restored_on_an_exception():
    with pytest.raises(KeyError):
        with sdpa.patched(backend="emulator"):
            assert F.scaled_dot_product_attention is not ORIGINAL
            raise KeyError("boom")
    assert F.scaled_dot_product_attention is ORIGINAL and sdpa.active() is None
    with sdpa.patched(backend="emulator"):  # usable again
        pass


class Attn(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Attn(), Attn()])

    def forward(self, q, k, v):
        return self.blocks[1](self.blocks[0](q, k, v), k, v)


def dragged_inputs():
    """The bug report's recipe (K x64, 512 keys): lazy_unfixed leaves NaN rows, lazy none."""
    from fa_lab.studies.experiments import bf16_inputs
    q, k, v = bf16_inputs(1, 512, 1, 64, 64.0, seed=0)
    return (t.transpose(1, 2).contiguous() for t in (q, k, v))


@pytest.mark.parametrize("policy", ["lazy", "lazy_unfixed"])
def test_events_name_call_module_phase_and_rows(policy):
    q, k, v = dragged_inputs()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    net = Net()
    with sdpa.patched(rescale=policy, kernel="swp_bf16", backend="emulator", model=net) as rec:
        rec.step = 7
        out = F.scaled_dot_product_attention(*leaves)
        with torch.no_grad():
            net(*(t.detach() for t in leaves))
        out.float().sum().backward()
    direct = fa_lab.flash_attn_func(*(t.detach().transpose(1, 2) for t in leaves), causal=False,
                                    rescale=policy, kernel="swp_bf16", backend="emulator")
    bad = sorted((0, h, s) for s, h in (~torch.isfinite(direct[0].float()).all(-1)).nonzero().tolist())
    assert rec.calls == 3
    if policy == "lazy":
        assert bad == [] and rec.events == [] and torch.isfinite(leaves[0].grad).all()
        return
    assert bad, "the recipe must drag a row under lazy_unfixed"
    fwd = [e for e in rec.events if e.phase == "forward" and e.tensor == "out"]
    assert [(e.call, e.step, e.module) for e in fwd[:2]] == [(0, 7, None), (1, 7, "blocks.0")]
    assert list(fwd[0].rows) == bad and fwd[0].kind == "nonfinite"
    back = {e.tensor: e for e in rec.events if e.phase == "backward"}
    assert set(back) >= {"dq", "dk"} and "dout" not in back
    assert back["dq"].call == 0 and set(back["dq"].rows) >= set(bad)
    grads = fa_lab.autograd.nonfinite_report(dq=leaves[0].grad.transpose(1, 2))
    assert list(back["dq"].rows) == grads["dq"]["rows"]


def test_a_fully_masked_row_is_refused_sdpa_gives_zeros_fa_lab_nan():
    q, k, v = bhsd(1, 1, 32, 64, seed=6)
    m = torch.ones(32, 32, dtype=torch.bool)
    m[5] = False
    assert torch.equal(ref64(q, k, v, attn_mask=m)[0, 0, 5], torch.zeros(64, dtype=torch.float64))
    direct = fa_lab.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=False,
                                    bias=torch.where(m, 0.0, -math.inf).bfloat16(), backend="emulator")
    assert torch.isnan(direct[0, 5]).all()
    with sdpa.patched(backend="emulator") as rec:
        with pytest.raises(ValueError, match=r"masks every key of query rows \[5\]"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        with pytest.raises(ValueError, match="masks every key"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(m, 0.0, -math.inf))
    assert rec.calls == 0


@pytest.mark.parametrize("version, dies", [("main-11c4174d", True), ("fixed", False)])
def test_the_upstream_version_sets_the_default_policy(version, dies):
    """No rescale given: the version's default runs (before PR #1033: the unfixed rebase)."""
    q, k, v = dragged_inputs()
    with sdpa.patched(upstream=version, kernel="swp_bf16", backend="emulator") as rec:
        F.scaled_dot_product_attention(q, k, v)
    direct = fa_lab.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=False,
                                    upstream=version, kernel="swp_bf16", backend="emulator")
    assert bool(rec.events) == dies == bool((~torch.isfinite(direct)).any())
    with pytest.raises(ValueError, match="upstream"):
        with sdpa.patched(upstream="no-such-version"):
            pass
