"""The zoo's second round: public reports filed after the first ten entries, as data.

Each entry is checked against its report's thread (the sources; a report the lab's search
corpora do not hold says so in its source, and the entry models the report's text as
issue 39 states it). Four of them merge partial attention states (split-KV, context
parallelism, a cascade): ``Semantics.kv_split`` restarts the walk every that many tiles and
the partials merge as ``merge_empty`` and ``lse_base`` say.
"""

from __future__ import annotations

import math

import torch

from fa_lab.kernels.online.model import LOG2_UNITS
from fa_lab.numerics import LOG2E
from fa_lab.semantics import FLT_MAX

from .base import (Case, Entry, _gen, _policy, empty_row_nonzero, nan_in_empty_rows,
                   nan_in_visible_rows)


def silent_error(out, lse, case, records) -> bool:
    """Every output finite, and some row more than 0.05 max|V| from the exact softmax:
    weight moved between keys or partials, and nothing flags it."""
    ref_o = case.reference()[0]
    vmax = float(case.v.abs().max()) or 1.0
    return bool(torch.isfinite(out).all() and (out.double() - ref_o).abs().max() > 0.05 * vmax)


# -- the cases ---------------------------------------------------------------------------

def empty_band() -> Case:
    """TransformerEngine #3528: FA4 reads the window -1 as a bound, so the causal band is
    empty: 2 query rows over 128 keys with nothing visible, walked as two 64-key
    context-parallel steps (two partials)."""
    g = _gen(3528)
    q, k, v = (torch.randn(1, n, 1, 8, generator=g) for n in (2, 128, 128))
    return Case(q, k, v, mask=torch.zeros(2, 128, dtype=torch.bool))


def large_logits() -> Case:
    """vllm #56578's probe through attention: one row, scaled scores 1, 100, 3000 and 5000
    (natural units, softmax_scale 1) under Gemma-2's cap of 50; V = 0, 1, 2, 3."""
    k = torch.tensor([1.0, 100.0, 3000.0, 5000.0]).reshape(1, 4, 1, 1)
    v = torch.arange(4.0).reshape(1, 4, 1, 1)
    return Case(torch.ones(1, 1, 1, 1), k, v, softmax_scale=1.0)


def prefix_and_suffix() -> Case:
    """A chunked-prefix merge (sglang #40903's long prefix, short suffix): one row, a
    64-key prefix partial with V = -1 and a 16-key suffix partial with V = +1, every score
    0, so the exact output is (16 - 64) / 80 = -0.6."""
    q = torch.zeros(1, 1, 1, 4)
    k = torch.zeros(1, 80, 1, 4)
    v = torch.ones(1, 80, 1, 4)
    v[0, :64] = -1.0
    return Case(q, k, v)


def stale_tail() -> Case:
    """A paged KV cache of 64 slots whose sequence holds 5 keys; the 59 unused slots hold
    NaN in K (a freed block's stale contents); V's tail is loaded as zeros."""
    g = _gen(53628)
    q = torch.randn(1, 1, 1, 8, generator=g)
    k, v = (torch.randn(1, 64, 1, 8, generator=g) for _ in range(2))
    k[0, 5:] = math.nan
    return Case(q, k, v, seqlen_kv=5)


def zero_context_rows() -> Case:
    """vllm #28181's shape in miniature: 3 causal query rows over 2 keys (bottom-right), one
    key per partial: row 0 sees no key in either partial, row 1 sees key 0 only (one empty
    partial beside a full one), row 2 both."""
    g = _gen(28181)
    q, k, v = (torch.randn(1, n, 1, 8, generator=g) for n in (3, 2, 2))
    return Case(q, k, v, causal=True)


def empty_partitions() -> Case:
    """flashinfer #4051's states inside a split-KV call: sequence 0 has no keys, so both of
    its 64-key partials are (0, -inf); sequence 1 has 70 keys in two partials."""
    g = _gen(4051)
    q, k, v = (torch.randn(2, n, 1, 8, generator=g) for n in (1, 128, 128))
    return Case(q, k, v, seqlen_kv=[0, 70])


def leading_chunk_masked() -> Case:
    """vllm #48364: one row's top-k index list of 64 slots whose first 16 (one BLOCK_N
    chunk) are -1 padding, then 48 valid keys. Padding slots load as 0 (the kernel's masked
    gather), so their K and V are 0."""
    g = _gen(48364)
    q = torch.randn(1, 1, 1, 8, generator=g)
    k, v = (torch.randn(1, 64, 1, 8, generator=g) for _ in range(2))
    k[0, :16] = v[0, :16] = 0.0
    mask = torch.ones(1, 64, dtype=torch.bool)
    mask[0, :16] = False
    return Case(q, k, v, mask=mask)


def sliding_pair_with_padding() -> Case:
    """pytorch #196170's repro, batch entry 1: embed_dim 1, 4 tokens, each attending to
    itself and the one before (the bucketed mask) with keys 2 and 3 padded, so token 3
    sees nothing."""
    g = _gen(196170)
    q, k, v = (torch.rand(1, 4, 1, 1, generator=g) for _ in range(3))
    band = (torch.arange(4)[None, :] <= torch.arange(4)[:, None]) & \
           (torch.arange(4)[None, :] >= torch.arange(4)[:, None] - 1)
    mask = band & (torch.arange(4) < 2)[None, :]
    return Case(q, k, v, mask=mask, softmax_scale=1.0)


def all_masked_row() -> Case:
    """tt-metal #56056's shape (1, 1, 1, 64): one row whose 64 scores are all -inf (a
    fully masked row), V = 0 .. 63."""
    v = torch.arange(64.0).reshape(1, 64, 1, 1)
    return Case(torch.ones(1, 1, 1, 1), torch.ones(1, 64, 1, 1), v,
                mask=torch.zeros(1, 64, dtype=torch.bool))


def small_jump() -> Case:
    """One row over two 64-column tiles: key 0 scores 0 (V = 0), key 64 scores 3 log2 units
    (V = 1), within a threshold of 8; the exact output is 8 / 9."""
    k = torch.zeros(1, 65, 1, 1)
    k[0, 64] = 3.0
    v = torch.zeros(1, 65, 1, 1)
    v[0, 64] = 1.0
    mask = torch.zeros(1, 65, dtype=torch.bool)
    mask[0, 0] = mask[0, 64] = True
    return Case(torch.ones(1, 1, 1, 1), k, v, mask=mask, softmax_scale=LOG2_UNITS)


# -- the entries ---------------------------------------------------------------------------

_FA4_PARTIAL = dict(empty_row_guard="zero_base", tile_max_floor="never", kv_split=1)
_FLASHINFER = dict(tile_max_floor="always", floor_value=-FLT_MAX, clamp_exp_diff=True,
                   kv_split=1)
_PLAIN = dict(tile_max_floor="never", epilogue_guard="none")
_SPARSE_MLA = dict(block_n=16, tile_max_floor="never", epilogue_guard="none")
_VLLM = dict(empty_row_guard="zero_base")  # Triton unified attention: a -inf max becomes 0
_TT_EXP = -88.5 * LOG2E  # the SFPU exp's input clamp, -88.5 natural, in log2 units

ROUND2 = (
    Entry(
        "te_cp_empty_band", "TransformerEngine context parallelism: an empty causal band's "
        "-inf LSE turns to NaN in the merge",
        ("NVIDIA/TransformerEngine#3528 (issue, open)",
         "NVIDIA/TransformerEngine#3532 (PR, not found in the search corpora)"),
        "With the band empty every partial writes output 0 and LSE -inf, and the merge's "
        "shift max(lse) is -inf, so each weight is exp(-inf - -inf) = NaN.",
        _policy("te_cp_empty_band:before", desc="FA4 partials, unguarded LSE merge",
                merge_empty="nan", **_FA4_PARTIAL),
        _policy("te_cp_empty_band:after", desc="a merge that keeps (0, -inf) empty",
                **_FA4_PARTIAL),
        empty_band, nan_in_empty_rows, failure=("empty",),
        note="#3528's root cause is TE passing window -1 where FA4 (after flash-attention "
             "#2490) wants None; its fix translates the sentinel, which restores the band "
             "(the case's mask), not a kernel semantics. The lab models the merge the issue "
             "says turns the empty band into NaN; 'after' is the guarded merge. The backward's "
             "exp(S - LSE) with LSE = -inf is not modelled (no backward here)."),
    Entry(
        "vllm_softcap_exp_ratio", "vLLM Triton attention: a softcap's tanh as an exp ratio "
        "gives NaN for large logits",
        ("vllm-project/vllm#56578 (issue, closed)", "vllm-project/vllm#56579 (PR, merged)"),
        "apply_softcap computed tanh(S/cap) as (e^u - e^-u) / (e^u + e^-u), and once "
        "|S/cap| > ~88.7 both exponentials overflow, so a visible score becomes "
        "inf / inf = NaN and poisons the row's max.",
        _policy("vllm_softcap_exp_ratio:before", desc="tanh as an exponential ratio",
                softcap=50.0, softcap_form="exp_ratio", **_VLLM),
        _policy("vllm_softcap_exp_ratio:after", desc="#56579: 1 - 2 / (e^(2u) + 1)",
                softcap=50.0, softcap_form="exp_sum", **_VLLM),
        large_logits, nan_in_visible_rows, failure=("nonfinite",),
        note="The attack's fp64 reference caps its scores too (cap tanh(t / cap), exact "
             "tanh: ``adversary.softcap_reference``), so a capped output is judged against "
             "the attention asked for; the entry's class is the reported NaN. Both presets "
             "keep the unified kernel's guard that sets a -inf running max to 0 (a row or "
             "tile with nothing visible)."),
    Entry(
        "lse_base2_merge", "vLLM / SGLang chunked-prefix merge: a base-2 LSE read as a "
        "natural log",
        ("vllm-project/vllm#52796 (issue or PR, not found in the search corpora)",
         "sgl-project/sglang#35045 (PR, open)", "sgl-project/sglang#40903 (issue, open)",
         "flashinfer-ai/flashinfer#4547 (PR, open)"),
        "flashinfer's prefill returns log2(sum 2^x) while merge_state_v2 weights each "
        "partial by exp(lse), so each partial's weight is its mass to the power 1/ln 2 and "
        "the longer partial takes too much of the output, silently.",
        _policy("lse_base2_merge:before", desc="base-2 LSE into a natural-log merge",
                kv_split=1, lse_base="2"),
        _policy("lse_base2_merge:after", desc="#35045: LSE times ln 2 before the merge",
                kv_split=1),
        prefix_and_suffix, silent_error, failure=("silent",),
        note="sglang #35045 measures max |error| 0.105 at prefix 4096; on this case the "
             "error is 0.16 of max|V|. With two partials the error stays below 0.09 of V's "
             "range; more partials (split-KV) raise it."),
    Entry(
        "paged_tail_mask_after", "Paged KV: stale or NaN values in a block's unused tail "
        "leak through a mask applied after the arithmetic",
        ("vllm-project/vllm#53628 (issue or PR, not found in the search corpora)",
         "NVIDIA/TensorRT-LLM#18354 (issue or PR, not found in the search corpora)",
         "vllm-project/vllm#47305 (PR, merged)"),
        "The kernel takes the max and exponent over every slot it loaded and multiplies P by "
        "the mask afterwards, so a NaN in an unused slot's K makes its P NaN and 0 * NaN "
        "reaches l and O (a stale finite score raises the max instead).",
        _policy("paged_tail_mask_after:before", desc="mask multiplies P", mask_stage="p",
                **_VLLM),
        _policy("paged_tail_mask_after:after", desc="scores masked before the max", **_VLLM),
        stale_tail, nan_in_visible_rows, failure=("nonfinite",),
        note="Neither #53628 nor #18354 is in the lab's corpora; the entry models issue 39's "
             "text. vllm #47305 (Triton unified attention, merged) is the nearest thread: it "
             "stops the loads at seq_len because the score mask cannot stop 0 * NaN in PV "
             "(the V side is fa3_v_tail_nan)."),
    Entry(
        "flashinfer_merge_empty", "flashinfer cascade merge: two empty states merge to NaN",
        ("flashinfer-ai/flashinfer#4051 (issue, open)", "flashinfer-ai/flashinfer#5262 (PR, "
         "open)", "flashinfer-ai/flashinfer#4054 (PR, open)"),
        "An empty state is (0, -inf), and merging two of them evaluates exp2(-inf - -inf) "
        "with the shift s_max = -inf, so output and LSE are NaN.",
        _policy("flashinfer_merge_empty:before", desc="merge_state: shift by max(lse)",
                merge_empty="nan", **_FLASHINFER),
        _policy("flashinfer_merge_empty:after", desc="#5262: a finite shift for the "
                "exponents, -inf kept", **_FLASHINFER),
        empty_partitions, nan_in_empty_rows, failure=("empty",),
        note="The merge here reads natural logs; flashinfer's exp2 of base-2 LSEs gives the "
             "same weights. The main loop is flashinfer's after #4401, so each partial "
             "alone is (0, -inf)."),
    Entry(
        "vllm_merge_attn_states_empty", "vLLM merge_attn_states: an empty prefix and an "
        "empty suffix merge to NaN",
        ("vllm-project/vllm#28181 (PR, merged)", "vllm-project/vllm#39148 (PR, closed)",
         "vllm-project/vllm#27491 (issue, closed)"),
        "A query with no context and no suffix keys has prefix_lse = suffix_lse = -inf, so "
        "the merge's max_lse is -inf and exp(lse - max_lse) = exp(-inf - -inf) is NaN in "
        "the output and the LSE.",
        _policy("vllm_merge_attn_states_empty:before", desc="merge shifted by max_lse",
                merge_empty="nan", block_n=1, kv_split=1, **_VLLM),
        _policy("vllm_merge_attn_states_empty:after", desc="#28181: an infinite max_lse "
                "returns the empty state", block_n=1, kv_split=1, **_VLLM),
        zero_context_rows, nan_in_empty_rows, failure=("empty",),
        note="#28181 (CUDA) returns the prefix state when max_lse is infinite; #39148 (Triton, "
             "closed) clamped max_lse to -1e30 and added 1e-10 to the denominator. A single "
             "empty partial beside a full one merges correctly before the fix too (row 1). "
             "The partials keep the attention kernels' guard (a -inf max becomes 0), so each "
             "empty partial is (0, -inf)."),
    Entry(
        "vllm_sparse_mla_leading_chunk", "vLLM XPU sparse MLA: a fully masked leading index "
        "chunk NaN-poisons the row",
        ("vllm-project/vllm#48364 (issue, closed)", "vllm-project/vllm#48366 (PR, merged)"),
        "The running max starts at -inf and masked logits are -inf, so a first 16-entry "
        "chunk of padding gives exp2(-inf - -inf) = NaN for the rescale and P, and "
        "NaN * 0 keeps acc and e_sum NaN through every later valid chunk.",
        _policy("vllm_sparse_mla_leading_chunk:before", desc="-inf init and mask",
                **_SPARSE_MLA),
        _policy("vllm_sparse_mla_leading_chunk:after", desc="#48366: -1e30 for both",
                mask_value=-1e30, m_init=-1e30, **_SPARSE_MLA),
        leading_chunk_masked, nan_in_visible_rows, failure=("nonfinite",),
        note="The fix also makes a row with no valid index return 0: its P is exp2(0) = 1 "
             "on slots whose V loaded as 0."),
    Entry(
        "pytorch_mha_masked_row", "PyTorch nn.MultiheadAttention (need_weights): a fully "
        "masked row is NaN and poisons the gradients",
        ("pytorch/pytorch#196170 (PR, open)", "pytorch/pytorch#41508 (issue, open)",
         "pytorch/pytorch#189045 (PR, open)"),
        "The need_weights path calls a plain softmax, so a row whose every key is masked is "
        "0/0 = NaN, and autograd's 0 * NaN then spreads it to the shared projection's "
        "gradients.",
        _policy("pytorch_mha_masked_row:before", desc="softmax() + bmm()", **_PLAIN),
        _policy("pytorch_mha_masked_row:after", desc="#196170: _safe_softmax (0)",
                empty_row_guard="zero_base", tile_max_floor="never"),
        sliding_pair_with_padding, nan_in_empty_rows, failure=("empty",),
        note="The lab has no backward: the entry models the forward symptom that feeds the "
             "gradient poisoning (the masked row's NaN output and LSE)."),
    Entry(
        "ttmetal_exp_clamp", "tt-metal softmax: an all -inf row gives 1/N through the SFPU "
        "exp's clamp",
        ("tenstorrent/tt-metal#56056 (issue, open)", "tenstorrent/tt-metal#56430 (PR, open)"),
        "The row's max is -inf, so x - max is NaN, and the exp's input clamp max(val, -88.5) "
        "turns every NaN into -88.5, so each key gets the same tiny weight and the row "
        "returns the mean of V.",
        _policy("ttmetal_exp_clamp:before", desc="SFPU exp clamps at -88.5", exp_floor=_TT_EXP,
                **_PLAIN),
        _policy("ttmetal_exp_clamp:after", desc="#56430: NaN passes the exp", **_PLAIN),
        all_masked_row, empty_row_nonzero, failure=("empty",),
        note="#56430 makes the row NaN, as torch.softmax gives; the lab's reference gives 0 "
             "for an empty row, so the fix still counts as 'empty' there. The issue's row sums "
             "to 0.97 on hardware (an approximate exp); the model's exact exp2 gives 1/64 each."),
    Entry(
        "mslk_p_before_vote", "MSLK conditional rescale: P taken with the new max before the "
        "skip decision",
        ("meta-pytorch/MSLK#242 (issue or PR, not found in the search corpora)",),
        "The kernel computes P against the tile's new max and then decides to skip the "
        "rescale, so a row that keeps its old max adds a P too small by 2^(new - old) "
        "without rescaling O and l, and the tile loses weight silently.",
        _policy("mslk_p_before_vote:before", desc="P before the vote", vote="row",
                threshold=8.0, p_before_vote=True, block_n=64),
        _policy("mslk_p_before_vote:after", desc="P against the max the vote keeps",
                vote="row", threshold=8.0, block_n=64),
        small_jump, silent_error, failure=("silent",),
        note="MSLK #242 is not in the lab's corpora; the entry models issue 39's text with a "
             "row vote and FlyDSL's threshold 8; block_n 64 (the online model's default) is "
             "named so that both presets run on the online-softmax family."),
)
