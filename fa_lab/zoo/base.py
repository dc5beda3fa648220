"""The zoo's building blocks: ``Case`` (one input), ``Entry`` (one report), the presets'
colours and the symptom checks the entries share (``fa_lab.zoo.entries`` holds the entries).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from fa_lab import reference
from fa_lab.kernels.online.model import forward
from fa_lab.policies import Policy
from fa_lab.semantics import Semantics


@dataclass(frozen=True, eq=False)
class Case:
    """One input: q [B, Sq, H, D], k and v [B, Skv, Hkv, D], a 2-D ``mask`` [Sq, Skv] (bool,
    True = visible, or additive natural-log with -inf = masked) or None, ``causal``,
    ``seqlen_kv`` (None, an int or B ints) and ``softmax_scale``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool = False
    mask: torch.Tensor | None = None
    seqlen_kv: object = None
    softmax_scale: float | None = None

    def run(self, policy: Policy, record: list | None = None):
        """(out, lse) of the online-softmax model under ``policy``."""
        return forward(self.q, self.k, self.v, policy=policy, causal=self.causal, mask=self.mask,
                       seqlen_kv=self.seqlen_kv, softmax_scale=self.softmax_scale, record=record)

    def reference(self):
        """(out, lse) of ``fa_lab.reference.attention`` in fp64 over each sequence's valid
        keys only (a cache tail past ``seqlen_kv`` is never read)."""
        B, Skv = self.q.shape[0], self.k.shape[1]
        lens = [Skv] * B if self.seqlen_kv is None else (
            [self.seqlen_kv] * B if isinstance(self.seqlen_kv, int) else list(self.seqlen_kv))
        outs, lses = [], []
        for b, n in enumerate(lens):
            bias = None
            if self.mask is not None:
                m = self.mask[:, :n]
                bias = torch.where(m, 0.0, -math.inf) if m.dtype == torch.bool else m.double()
            o, s = reference.attention(self.q[b:b + 1], self.k[b:b + 1, :n], self.v[b:b + 1, :n],
                                       causal=self.causal, softmax_scale=self.softmax_scale,
                                       dtype=torch.float64, bias=bias)
            outs.append(o)
            lses.append(s)
        return torch.cat(outs), torch.cat(lses)


@dataclass(frozen=True)
class Entry:
    """One report: ``sources`` as ``owner/repo#N (kind, state)``, ``mechanism`` in one
    sentence, ``before``/``after`` presets, ``case()`` its smallest input, ``symptom``, and
    ``failure``: the class(es) of failure the report shows, in the attack's terms
    (``fa_lab.studies.adversary.CLASSES``: what ``fa-lab attack`` searches for).
    ``kernels``: other kernel families whose own models show the failure, each with a
    builder of its input (``run_kernel``)."""

    name: str
    title: str
    sources: tuple[str, ...]
    mechanism: str
    before: Policy
    after: Policy
    case: Callable[[], Case]
    symptom: Callable
    variants: dict = field(default_factory=dict)
    note: str = ""
    failure: tuple = ()
    kernels: dict = field(default_factory=dict)

    def policies(self) -> dict[str, Policy]:
        return {"before": self.before, "after": self.after, **self.variants}

    def _preset(self, policy) -> Policy:
        """``policy`` as a Policy: a preset's name (a ValueError naming the names the entry
        has) or a Policy."""
        if isinstance(policy, str):
            presets = self.policies()
            if policy not in presets:
                raise ValueError(f"policy={policy!r} is not a preset of zoo entry {self.name!r}; "
                                 f"choose one of {', '.join(map(repr, presets))} or pass a Policy")
            return presets[policy]
        if isinstance(policy, Policy):
            return policy
        raise TypeError(f"policy must be a preset name (str) or a fa_lab.Policy, got "
                        f"{type(policy).__name__}")

    def run(self, policy: Policy | str = "before", case: Case | None = None):
        """(out, lse, case, records) under a preset's name or a Policy."""
        pol = self._preset(policy)
        case = self.case() if case is None else case
        records: list = []
        out, lse = case.run(pol, record=records)
        return out, lse, case, records

    def shows(self, policy: Policy | str = "before") -> bool:
        """Whether the symptom appears on the entry's case under ``policy``."""
        return bool(self.symptom(*self.run(policy)))

    def run_kernel(self, kernel: str, policy: Policy | str = "before"):
        """(out, lse) of ``flash_attn_func`` on another kernel family's model
        (``kernels[kernel]()`` gives its (q, k, v, call arguments): an input at a size where
        that family fails as the report says)."""
        from fa_lab.api import flash_attn_func

        if kernel not in self.kernels:
            raise ValueError(f"kernel: entry {self.name!r} runs on {sorted(self.kernels)}, "
                             f"not {kernel!r}")
        pol = self._preset(policy)
        q, k, v, kw = self.kernels[kernel]()
        return flash_attn_func(q, k, v, rescale=pol, kernel=kernel, backend="emulator",
                               return_lse=True, **kw)


# -- shared pieces -------------------------------------------------------------------------

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


#: Each entry's colour: its "before" preset wears it, "after" a light tint, variants a
#: middle one (so an entry's presets read as one family in a legend).
_COLORS = {"fa4_fp8_saturation": "#d95f02", "fa4_fp8_offset": "#a6761d",
           "flydsl_fp8_empty_tile": "#7570b3", "flashinfer_sentinel": "#c51b7d",
           "trtllm_neg_inf": "#66a61e", "sdpa_masked_row": "#e6ab02",
           "pytorch_cpu_masked_block": "#1f78b4", "fa3_v_tail_nan": "#b15928",
           "ffpa_vote_nan": "#6a3d9a", "te_cp_empty_band": "#76b900",
           "vllm_softcap_exp_ratio": "#fb9a99", "lse_base2_merge": "#e31a1c",
           "paged_tail_mask_after": "#8c510a", "flashinfer_merge_empty": "#dd3497",
           "vllm_sparse_mla_leading_chunk": "#fdbf6f", "pytorch_mha_masked_row": "#a6cee3",
           "ttmetal_exp_clamp": "#35978f", "mslk_p_before_vote": "#cab2d6",
           "vllm_merge_attn_states_empty": "#b2df8a"}


_SHARES = {"before": 0.0, "after": 0.55, "before_e5m2": 0.2, "threshold_0.75": 0.3,
           "intermediate": 0.3, "dtype_aware_offset": 0.42}


def _tint(color: str, share: float) -> str:
    """``color`` mixed with white: ``share`` of white (0: the colour itself)."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * share):02x}" for c in rgb)


def _policy(name, vote="tile", threshold=None, headroom=0.0, rebase="max", desc="", **sem):
    entry, _, key = name.partition(":")
    color = _tint(_COLORS[entry], _SHARES[key])
    lazy = {} if threshold is None else {"threshold": threshold}  # an eager vote reads none
    return Policy(vote=vote, rebase=rebase, p_headroom=headroom, name=name, description=desc,
                  color=color, semantics=Semantics(**sem), **lazy)


def _visible_rows(case: Case) -> torch.Tensor:
    """[B, Sq, H] True where a row has at least one visible key (its reference lse)."""
    return torch.isfinite(case.reference()[1]).permute(0, 2, 1)


def _nan_rows(out: torch.Tensor) -> torch.Tensor:
    return torch.isnan(out).any(-1)


def nan_in_visible_rows(out, lse, case, records) -> bool:
    """A row that sees at least one key comes out NaN."""
    return bool((_nan_rows(out) & _visible_rows(case)).any())


def nan_in_any_row(out, lse, case, records) -> bool:
    """Some row comes out NaN: a row with no visible key (the reference gives 0) or one
    that sees keys, e.g. only in tiles after an all-masked first one."""
    return bool(_nan_rows(out).any())


def nan_in_empty_rows(out, lse, case, records) -> bool:
    """A row with no visible key comes out NaN (the reference gives 0)."""
    return bool((_nan_rows(out) & ~_visible_rows(case)).any())


def silent_mass_loss(out, lse, case, records) -> bool:
    """Finite output more than 0.1 from the exact softmax while the LSE stays within 1e-3:
    the output lost or gained weight and nothing flags it."""
    ref_o, ref_l = case.reference()
    return bool(torch.isfinite(out).all() and (out.double() - ref_o).abs().max() > 0.1
                and (lse.double() - ref_l).abs().max() < 1e-3)


def empty_row_nonzero(out, lse, case, records) -> bool:
    """A row with no visible key returns a finite, nonzero output (the reference gives 0)."""
    empty = ~_visible_rows(case)
    return bool((torch.isfinite(out) & (out != 0)).any(-1)[empty].any())


def zeros_for_visible_rows(out, lse, case, records) -> bool:
    """A row with visible keys and a nonzero reference returns exactly 0."""
    ref_o = case.reference()[0]
    zero = (out == 0).all(-1) & (ref_o != 0).any(-1)
    return bool((zero & _visible_rows(case)).any())


def nan_factor_on_o(out, lse, case, records) -> bool:
    """Some row's O was multiplied by a NaN factor (recorded per tile)."""
    return any(bool(torch.isnan(r.o_factor).any()) for r in records)
