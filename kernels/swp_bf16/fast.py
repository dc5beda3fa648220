"""Fast Triton flash-attention forward, bf16/f16, with the gfx950 rescale policies.

For throughput, not for reproducing the faithful model bit for bit. What it keeps from
``fa_lab.kernels.swp_bf16.model`` (the policy semantics):

- Q is pre-scaled into log2 units and rounded once to the input dtype
  (``Qs = round(Q * c)``, ``c = f32(1/sqrt(D)) * f32(log2 e)``); scores are fp32.
- The first KV tile sets the base (``m = rowmax``, floored at -3e38 when causal).
- ``eager`` rebases every row to ``fmax(m, tile max)`` every tile.
- Lazy policies vote per 32-row wave (rows ``32w .. 32w+31`` of the query sequence): a
  row votes when ``not (mt - m <= threshold)`` (log2 units, NaN votes yes); if any row of
  its wave voted, every row of the wave rebases, to ``fmax(m, mt)`` (``lazy``, PR #1033)
  or to its own tile max ``mt`` (``lazy_unfixed``, which can drag a row's base down and
  overflow). Otherwise the row keeps its base and its P may reach 2**threshold.
- P is rounded to the input dtype before the PV product; l sums the unrounded P;
  ``out = round(O * (1/l if l > 0 else 0))``, ``lse = m ln2 + ln l`` (-inf when l = 0).
- Bottom-right-aligned causal mask; GQA/MQA (q head h reads kv head h // (H / Hkv)).

What is its own (so NaN fractions and the last bits differ from the model): the tiling
(BLOCK_M x BLOCK_N chosen by the autotuner; a vote happens once per BLOCK_N columns, not
per 64), no 16-column split of the PV product around the rescale, no always-eager last
three tiles, and the fp32 summation order of the tensor cores.

How lazy saves work: when no row of the whole block voted (the usual case once the first
tiles have set the base), the kernel skips the O and l rescale altogether. The test is a
block-wide OR of the row votes (``block_any``), the only cross-warp step on the fast path
(a wgmma warp holds 16 rows, so a 32-row wave always spans two warps); the per-wave vote,
which moves rows between warps, runs only inside that rare branch. With
``row_sum_filter`` the fast path does not even take row maxes: it computes P on the old
base and tests the row sums (a row can vote only if some P > 2**threshold, so only if its
row sum is that large); only a block where some row sum is that large recomputes the
scores, decides exactly and redoes P. Both variants take the same decisions (tested); the
filter is the autotuned default.

On a Hopper GPU at head dim 128, dense calls go to the Gluon kernel (module ``hopper``:
FlashAttention-3's warp-specialised schedule, the same semantics, 128-row blocks); a
pinned ``Config`` keeps the Triton kernel and a ``HopperConfig`` pins the Gluon one. At
head dim 64 the Triton kernel stays the default: there it is the faster of the two.

Split-K (``num_kv_splits``, module ``splitk``) and packed batches (``forward_varlen``,
module ``varlen``) are kernels of their own built from the same device pieces, which live
in ``_triton.fast``: ``walk`` (a query block's walk over a KV column range, whose first
tile sets the base), ``load_q``, ``normalise`` and ``lse``. Throughput against eager and
against the peers: docs/performance.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fa_lab.capabilities import check_policy
from fa_lab.policies import Policy

from . import FAMILY
from .._triton import fast as common
from .._triton.fast import Config, load_q, lse, normalise, program_rows, walk
from . import hopper, splitk
from .hopper import HopperConfig
from .varlen import forward_varlen as _forward_varlen

KERNEL = "fast_bf16"
HEAD_DIMS = common.BF16_HEAD_DIMS
DTYPES = common.BF16_DTYPES

#: What fa_lab.studies.bench.config_sweep times (pinned, one by one) on a new GPU: the
#: tilings that fit an sm_90 program's registers and shared memory at D128 (BLOCK_M 128
#: with 4 warps only at D64; BLOCK_N 128 with at most 2 stages).
CANDIDATE_CONFIGS = (
    Config(128, 128, 8, 2, True),
    Config(128, 64, 8, 3, True),
    Config(128, 64, 8, 4, True),
    Config(128, 64, 4, 3, True),
    Config(128, 128, 8, 2, False),
    Config(128, 64, 8, 3, False),
    Config(64, 64, 4, 2, True),
    Config(64, 64, 4, 3, True),
    Config(64, 64, 4, 2, False),
)
#: The tuner's list (Hopper), shared with split-K and varlen (``_triton.fast``).
CONFIGS = common.BF16_CONFIGS
#: Small tiles for the CPU interpreter (whole waves, cheap numpy work per program).
INTERPRET_CONFIG = common.BF16_INTERPRET_CONFIG


# Lengths and head counts are not specialised: one compile serves every shape.
@triton.jit(do_not_specialize=["H", "GROUP", "seqlen_q", "seqlen_kv", "rebase"])
def _attn_fwd(Q, K, V, Out, Lse, desc_k, desc_v,
              stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
              stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
              H, GROUP, seqlen_q, seqlen_kv, scale_log2, threshold, vote_limit, rebase,
              D: tl.constexpr, CAUSAL: tl.constexpr, LAZY: tl.constexpr,
              INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              USE_TMA: tl.constexpr, ROW_SUM_FILTER: tl.constexpr):
    DTYPE: tl.constexpr = Q.dtype.element_ty
    b, h, hk, m0, rows = program_rows(H, GROUP, BLOCK_M, CAUSAL)
    row_ok = rows < seqlen_q
    qs = load_q(Q + b.to(tl.int64) * stride_qb + h * stride_qh, stride_qs, rows, row_ok,
                scale_log2, D, DTYPE, INTERPRET)
    acc, l, m = walk(qs, desc_k, desc_v, K + b.to(tl.int64) * stride_kb + hk * stride_kh,
                     V + b.to(tl.int64) * stride_vb + hk * stride_vh, stride_ks, stride_vs,
                     b * seqlen_kv, hk * D, 0, seqlen_kv, m0, rows, seqlen_kv - seqlen_q,
                     threshold, vote_limit, rebase, DTYPE, D, BLOCK_M, BLOCK_N, CAUSAL, LAZY,
                     USE_TMA, INTERPRET, ROW_SUM_FILTER, CAUSAL)
    out = normalise(acc, l, DTYPE, INTERPRET)
    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h * stride_oh
              + rows.to(tl.int64)[:, None] * stride_os + tl.arange(0, D)[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + (b * H + h).to(tl.int64) * seqlen_q + rows, lse(l, m), mask=row_ok)


#: Which kernel served the last untuned call, per lazy flag ("triton" or "gluon").
_LAST_ENGINE = {False: "triton", True: "triton"}
_TUNED = common.autotuners(_attn_fwd, CONFIGS, ["seqlen_q", "seqlen_kv", "H", "GROUP", "D", "CAUSAL"],
                           common.set_block_shapes, row_sum_filters=(True,))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
            policy: Policy, interpret: bool = False, config: Config | HopperConfig | None = None,
            num_kv_splits: int = 1):
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D], bf16 or f16 (D 64 or 128).

    ``interpret=True`` runs CPU tensors through Triton's interpreter. ``config`` pins a
    launch configuration: a ``Config`` for the Triton kernel, a ``HopperConfig`` for the
    Gluon kernel (default: the Gluon kernel, tuned, for dense D128 calls on a Hopper GPU;
    otherwise the Triton kernel, autotuned on the GPU, small tiles when interpreted).
    ``num_kv_splits`` > 1 runs split-K (``splitk``): the model's split boundaries,
    one program per (query block, batch x head, split), then a combine kernel; 1 is the
    plain kernel, as in the model.
    Returns (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] fp32, natural log).
    """
    common.check_qkv(q, k, v, DTYPES, HEAD_DIMS)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_policy(policy, FAMILY, "fast")
    common.check_device(q, interpret)
    if isinstance(config, HopperConfig):
        if interpret:
            raise ValueError("a HopperConfig runs the Gluon kernel, which has no interpreter; "
                             "pass a Config (or none) with interpret=True")
        common.check_splits(num_kv_splits, None)
        if num_kv_splits > 1:
            raise ValueError("split-K runs on the Triton kernel: pass a Config (or none) with "
                             f"num_kv_splits={num_kv_splits}")
        return hopper.forward(q, k, v, causal=causal, policy=policy, config=config)
    config = common.check_config(config, fp8=False)
    common.check_splits(num_kv_splits, config)
    if config is None and interpret:
        config = INTERPRET_CONFIG
    if config is None and num_kv_splits == 1 and q.shape[-1] == 128 and hopper.available(q.device):
        _LAST_ENGINE[policy.lazy] = "gluon"
        return hopper.forward(q, k, v, causal=causal, policy=policy)
    if config is None:
        _LAST_ENGINE[policy.lazy] = "triton"

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if num_kv_splits > 1:
        return splitk.run(q, k, v, causal=causal, policy=policy, interpret=interpret,
                          config=config, num_splits=num_kv_splits)
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
    desc_k, desc_v = common.descriptors(k.view(B * Skv, Hkv * D), v.view(B * Skv, Hkv * D), D, config)
    args = (q, k, v, out, lse, desc_k, desc_v,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            H, H // Hkv, Sq, Skv, *common.policy_args(policy, D))
    meta = dict(D=D, CAUSAL=causal, LAZY=policy.lazy, INTERPRET=interpret)
    common.launch_fast(_attn_fwd, _TUNED, lambda bm: (triton.cdiv(Sq, bm), B * H), args, meta,
                       config, interpret)
    return out, lse


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv=None, *,
                   causal: bool, policy: Policy, interpret: bool = False,
                   config: Config | None = None):
    """Packed (varlen) batches in one launch: see ``varlen.forward_varlen``."""
    return _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                           causal=causal, policy=policy, interpret=interpret, config=config)


def best_config(q, k, causal: bool, lazy: bool):
    """The tuned pick for these shapes (after a forward ran): the Gluon kernel's where it
    served them, else the Triton kernel's tuner's, or None."""
    B, Sq, H, D = q.shape
    return (hopper.best_config(q, k, causal, lazy)
            or common.tuned_config(_TUNED[lazy], (Sq, k.shape[1], H, H // k.shape[2], D, causal)))


def tuning_timings(lazy: bool) -> list[dict]:
    """The measurements behind the last untuned call's pick (for the benchmark's record):
    the Gluon kernel's configs where it served that call, else the Triton kernel's tuner's."""
    if _LAST_ENGINE[lazy] == "gluon":
        return hopper.last_timings(lazy)
    return common.tuning_timings(_TUNED[lazy])
