"""The zoo's entries: one public online-softmax failure each, as data.

An ``Entry`` holds a report's sources, its mechanism in one sentence, the kernel semantics
before and after its fix as ``Policy`` presets (``Semantics`` fields, ``docs/semantics.md``
§10), the smallest input that shows the reported symptom (``Case``) and a check of that
symptom, ``symptom(out, lse, case, records) -> bool``. ``variants`` holds further fixes or
contrasts the report discusses. Where the issue's wording and the reports differ, an entry
follows the reports and says so in ``note``. ``PRESETS`` flattens every entry's policies by
name, as ``fa_lab.upstream.VERSIONS`` does for FlyDSL versions.
"""

from __future__ import annotations

import math

import torch

from fa_lab import policies
from fa_lab.kernels.online.model import LOG2_UNITS
from fa_lab.policies import Policy
from fa_lab.semantics import FLT_MAX

from .base import (Case, Entry, _gen, _policy, empty_row_nonzero, nan_factor_on_o,
                   nan_in_any_row, nan_in_empty_rows, nan_in_visible_rows, silent_mass_loss,
                   zeros_for_visible_rows)
from .round2 import ROUND2


# -- the cases ---------------------------------------------------------------------------

def fa4_tile_boundary() -> Case:
    """Two 128-column tiles, one visible key each, visited last tile first: the first
    visited key scores 0 with v = 0, the second 3.5 log2 units higher with v = 1."""
    k = torch.zeros(1, 129, 1, 1)
    v = torch.zeros(1, 129, 1, 1)
    k[0, 0], v[0, 0] = 3.5, 1.0
    mask = torch.zeros(1, 129, dtype=torch.bool)
    mask[0, 0] = mask[0, 128] = True
    return Case(torch.ones(1, 1, 1, 1), k, v, mask=mask, softmax_scale=LOG2_UNITS)


def varlen_empty_sequence() -> Case:
    """A varlen pair, non-causal: sequence 0 has no keys (seqlen_kv = 0), sequence 1 has 5;
    fp8-valued inputs."""
    g = _gen(5364)
    q, k, v = (torch.randn(2, n, 1, 8, generator=g).to(torch.float8_e4m3fn).float()
               for n in (1, 5, 5))
    return Case(q, k, v, seqlen_kv=[0, 5])


def below_sentinel() -> Case:
    """One row, 64 keys whose raw logits q.k all lie below -5e4: -6e4, and -6e4 + 1024 on
    key 0 (flashinfer #4401's test at target -6e4, one head, D folded into the scale)."""
    k = torch.full((1, 64, 1, 1), -6e4)
    k[0, 0] += 1024
    v = torch.zeros(1, 64, 1, 1)
    v[0, 0] = 1.0
    return Case(torch.ones(1, 1, 1, 1), k, v, softmax_scale=1 / math.sqrt(128))


def causal_more_queries() -> Case:
    """Bottom-right causal with 65 queries over 64 keys: query row 0 sees no key. V holds
    small integers, so sums and means are exact."""
    g = _gen(17477)
    q, k = (torch.randn(1, n, 1, 4, generator=g) for n in (65, 64))
    v = torch.randint(-8, 9, (1, 64, 1, 4), generator=g).float()
    return Case(q, k, v, causal=True)


def padded_batch_row() -> Case:
    """pytorch #103749's shapes: 6 queries, 10 keys, 2 heads, D = 8, scale 0.125, a bool
    mask as the issue's repro writes it: row i of rows 0-4 sees keys 0..i (causal from the
    top-left corner: keys 5-9 are masked for every row) and row 5 (padding) is all False."""
    g = _gen(103749)
    q = torch.randn(1, 6, 2, 8, generator=g)
    k, v = (torch.randn(1, 10, 2, 8, generator=g) for _ in range(2))
    mask = torch.arange(10)[None, :] <= torch.arange(6)[:, None]
    mask[5] = False
    return Case(q, k, v, mask=mask, softmax_scale=0.125)


def old_tokens_hidden() -> Case:
    """pytorch #127055's mask: 640 queries and keys, each row sees keys i-9 .. i
    (triu(-inf, 1) + tril(-inf, -10), additive); random q, k, v, D = 4."""
    g = _gen(127055)
    q, k, v = (torch.randn(1, 640, 1, 4, generator=g) for _ in range(3))
    ninf = torch.full((640, 640), -math.inf)
    return Case(q, k, v, mask=torch.triu(ninf, 1) + torch.tril(ninf, -10))


def nan_cache_tail() -> Case:
    """flash-attention #2374's repro: 4 sequences of one query, 8 heads, D = 64, a KV cache
    of 128 slots per sequence with seqused_k = [32, 64, 96, 48] and NaN in every slot past
    it."""
    g = _gen(2374)
    q = torch.randn(4, 1, 8, 64, generator=g)
    k, v = (torch.randn(4, 128, 8, 64, generator=g) for _ in range(2))
    lens = [32, 64, 96, 48]
    for b, n in enumerate(lens):
        k[b, n:] = v[b, n:] = math.nan
    return Case(q, k, v, seqlen_kv=lens)


def masked_row_beside_a_jump() -> Case:
    """Two query rows of one 16-row warp over three 64-column tiles: row 0 sees only the
    last key (tile 2); row 1 sees every key and its max jumps 20 log2 units at tile 1."""
    k = torch.zeros(1, 129, 1, 2)
    k[0, 64:, 0, 1] = 20.0
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
    v = torch.ones(1, 129, 1, 2)
    mask = torch.ones(2, 129, dtype=torch.bool)
    mask[0, :128] = False
    return Case(q, k, v, mask=mask, softmax_scale=LOG2_UNITS)


def dragged_row() -> Case:
    """Two rows of one 32-row wave over 65 keys: row 0's best key (column 0) scores 200
    log2 units and its tile 1 only 0; row 1's tile 1 jumps 20 above its tile 0."""
    k = torch.zeros(1, 65, 1, 2)
    k[0, 0, 0, 0] = 200.0
    k[0, 64, 0, 1] = 20.0
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
    v = torch.arange(65 * 2, dtype=torch.float32).reshape(1, 65, 1, 2) / 64
    return Case(q, k, v, softmax_scale=LOG2_UNITS)


def _swp_drag():
    """The swp_bf16 kernel's own drag: ``fa_lab.studies.experiments.drag_case``, one
    32-row wave over 8 tiles whose victim row falls 40 log2 units a tile (bf16, D = 64,
    non-causal); under ``lazy_unfixed`` its O and l overflow."""
    from fa_lab.studies.experiments import drag_case

    q, k, v = drag_case(n_tiles=8, rise=10.0, fall=40.0)
    return q, k, v, {"causal": False}


# -- the entries ---------------------------------------------------------------------------

_FA4 = dict(vote="row", threshold=4.0, headroom=8.0, wave_rows=32, o_gate="wave",
            tile_max_floor="never", empty_row_guard="zero_base", epilogue_guard="one",
            p_cast="e4m3", block_n=128, kv_order="descending")


def _fa4(name, desc, **change):
    return _policy(name, desc=desc, **{**_FA4, **change})


_FLYDSL_FP8 = dict(vote="wave", rebase="tile", threshold=8.0, block_n=128, p_cast="e4m3")
_FLASHINFER = dict(mask_value=-5e4, m_init=-5e4, mask_domain="raw", tile_max_floor="never")
_TRT = dict(mask_value=-FLT_MAX, m_init=-FLT_MAX, tile_max_floor="never", epilogue_guard="one")
_SDPA = dict(tile_max_floor="never", epilogue_guard="none")
_CPU_FLASH = dict(block_n=512, tile_max_floor="never", epilogue_guard="none")
_FA3 = dict(block_n=192, kv_order="descending", v_tail="cache", tile_max_floor="never",
            empty_row_guard="zero_base")
_FFPA = dict(vote="row", threshold=0.0, wave_rows=16, o_gate="wave", tile_max_floor="never",
             epilogue_guard="none")

ENTRIES: dict[str, Entry] = {e.name: e for e in (
    Entry(
        "fa4_fp8_saturation", "FA4 (SM100) fp8 forward: a stale max and P lifted by 2^8 "
        "saturate e4m3",
        ("Dao-AILab/flash-attention#2577 (issue, open)", "Dao-AILab/flash-attention#2716 "
         "(issue, closed)", "Dao-AILab/flash-attention#2578 (PR, open)",
         "Dao-AILab/flash-attention#2713 (PR, open)", "Dao-AILab/flash-attention#2717 (PR, "
         "merged, reverted by #2731)", "Dao-AILab/flash-attention#2731 (PR, merged)",
         "vllm-project/flash-attention#166 (PR, merged)"),
        "A row keeps its old max while a later tile beats it by up to the threshold (4), so "
        "P = 2^(8 + jump) reaches 4096, the saturating e4m3 cast clips it to 448 while l "
        "counts it whole, and the dominant keys lose weight with the LSE still exact.",
        _fa4("fa4_fp8_saturation:before", "FA4 fp8 before #2731: threshold 4, max_offset 8"),
        _fa4("fa4_fp8_saturation:after", "#2731 (and #2578): fp8 threshold 0", threshold=0.0),
        fa4_tile_boundary, silent_mass_loss, failure=("silent",),
        variants={
            "threshold_0.75": _fa4("fa4_fp8_saturation:threshold_0.75",
                                   "#2713 / vllm #166: threshold 0.75 < log2(448) - 8",
                                   threshold=0.75),
            "dtype_aware_offset": _fa4("fa4_fp8_saturation:dtype_aware_offset",
                                       "#2717: max_offset 4 for e4m3", headroom=4.0),
            "before_e5m2": _fa4("fa4_fp8_saturation:before_e5m2",
                                "the bug's semantics with an e5m2 P cast", p_cast="e5m2"),
        },
        note="The issue cites a speed/accuracy table in vllm #166; that table is timing only "
             "(accuracy for 0.75 is #2713's). The reported cosine drop at kv_seqlen 128 (one "
             "128-column tile) is not explained by this mechanism; two tiles are needed, as "
             "#2731's 129-key test has."),
    Entry(
        "fa4_fp8_offset", "FA4 fp8: lower max_offset from 8 to 4 instead of the threshold",
        ("Dao-AILab/flash-attention#2694 (PR, open)",),
        "The same stale-max saturation as fa4_fp8_saturation, removed by lifting P by 2^4 "
        "instead of 2^8, so a jump of up to the threshold (4) keeps P at or below 256.",
        _fa4("fa4_fp8_offset:before", "FA4 fp8: threshold 4, max_offset 8"),
        _fa4("fa4_fp8_offset:after", "#2694: max_offset 4 for every fp8 dtype", headroom=4.0),
        fa4_tile_boundary, silent_mass_loss, failure=("silent",),
        note="The PR says P is computed against a running max that lags a tile; in FA4 P uses "
             "a max that already includes its tile, and the excess comes only from the stale "
             "max the threshold allows, so this entry models the threshold (max_lag off)."),
    Entry(
        "flydsl_fp8_empty_tile", "FlyDSL gfx950 fp8 FMHA: an all-masked tile gives NaN "
        "(non-causal)",
        ("ROCm/aiter#5364 (PR, merged)",),
        "With nothing visible in a tile, the tile max and the running max are both -inf, so "
        "their difference is NaN, the wave rescales by exp2(NaN) and P is exp2(-inf + inf); "
        "only causal builds floored the tile max, and the fix floors it always at -3e38.",
        _policy("flydsl_fp8_empty_tile:before", desc="vendored FlyDSL v0.3.0 fp8: causal-only "
                "floor", **_FLYDSL_FP8),
        _policy("flydsl_fp8_empty_tile:after", desc="#5364: tile max floored at -3e38 always",
                tile_max_floor="always", **_FLYDSL_FP8),
        varlen_empty_sequence, nan_in_any_row, failure=("empty", "nonfinite"),
        note="The floor is on the raw-unit max in the kernel and on the log2-unit max in the "
             "model; both stay finite, so the outcome is the same. This is the failure fa_lab's "
             "own FlyDSL models show for a non-causal row whose first tile is all masked."),
    Entry(
        "flashinfer_sentinel", "flashinfer FA2: a finite -5e4 mask sentinel zeroes rows whose "
        "logits lie below it",
        ("flashinfer-ai/flashinfer#4267 (issue, closed)", "flashinfer-ai/flashinfer#4401 (PR, "
         "merged)", "flashinfer-ai/flashinfer#4450 (issue, closed)",
         "flashinfer-ai/flashinfer#4451 (issue, closed)",
         "flashinfer-ai/flashinfer#4452 (issue, closed)"),
        "The running max starts at, and masked logits are set to, -5e4 on the raw logit, so "
        "a row whose real logits all lie far below it keeps the sentinel as its max, every P "
        "underflows to 0 and the guarded epilogue returns zeros.",
        _policy("flashinfer_sentinel:before", desc="math::inf = 5e4: finite sentinel",
                **_FLASHINFER),
        _policy("flashinfer_sentinel:after", desc="#4401: -inf sentinel, max floored at "
                "-FLT_MAX, exponent differences clamped", tile_max_floor="always",
                floor_value=-FLT_MAX, clamp_exp_diff=True),
        below_sentinel, zeros_for_visible_rows, failure=("silent",),
        variants={"intermediate": _policy("flashinfer_sentinel:intermediate",
                                          desc="#4401's intermediate head: -inf sentinel only",
                                          tile_max_floor="never")},
        note="The issue calls the -inf follow-ups a split-KV merge problem; the merge is one "
             "of three sites (#4451, #4452 and the merge). The merged fix floors the scaled row "
             "max at -FLT_MAX in the main loop and clamps differences in the merges; the model "
             "has no split-KV merge, so there its clamp is redundant with the floor."),
    Entry(
        "trtllm_neg_inf", "TensorRT-LLM fmha_v2 no-loop: a fully masked row weights every "
        "masked key 1",
        ("NVIDIA/TensorRT-LLM#17477 (issue, open)",),
        "Masked scores are -FLT_MAX, a finite value, so a row that sees nothing keeps "
        "-FLT_MAX as its max and exp(-FLT_MAX - -FLT_MAX) = 1 gives every masked column weight "
        "1: the output is the mean of V over the visited columns, silently.",
        _policy("trtllm_neg_inf:before", desc="CHECK_NEG_INF compiled out", **_TRT),
        _policy("trtllm_neg_inf:after", desc="CHECK_NEG_INF: an empty max exponentiates "
                "against 0", empty_row_guard="zero_base", **_TRT),
        causal_more_queries, empty_row_nonzero, failure=("empty",),
        note="No fix is merged; 'after' is the CHECK_NEG_INF path the sliding-window and "
             "custom-mask builds already compile, which the issue asks for."),
    Entry(
        "sdpa_masked_row", "PyTorch SDPA: a fully masked (left-padding) row gives NaN",
        ("pytorch/pytorch#103749 (issue, closed)", "pytorch/pytorch#110213 (issue, closed)",
         "huggingface/transformers#38690 (issue, closed)", "pytorch/pytorch#133882 (PR)"),
        "A row whose every key is masked to -inf has max -inf, so each exponent is "
        "-inf - (-inf) = NaN, and the NaN then reaches every row that attends to that "
        "position in the next layer, since a weight of 0 times NaN is NaN.",
        _policy("sdpa_masked_row:before", desc="torch 2.0/2.1: softmax of an all -inf row",
                **_SDPA),
        _policy("sdpa_masked_row:after", desc="torch >= 2.5 (_safe_softmax): an empty row "
                "gives 0", empty_row_guard="zero_base", tile_max_floor="never",
                epilogue_guard="zero"),
        padded_batch_row, nan_in_empty_rows, failure=("empty",),
        note="The issue says the MATH backend gives 0; that holds from torch 2.5 only, and "
             "with a finfo.min additive mask the math path gives the mean of V instead. The "
             "reports do not say how the fused kernels were fixed, so 'after' is one set of "
             "semantics with the documented outcome (0)."),
    Entry(
        "pytorch_cpu_masked_block", "PyTorch CPU flash attention: an all-masked first KV "
        "block makes partially masked rows NaN",
        ("pytorch/pytorch#127055 (issue, closed)", "pytorch/pytorch#130014 (PR, landed in "
         "2.4)"),
        "A row whose first 512-key block is all masked gets max -inf there, so P and the "
        "rescale factor are exp(-inf - (-inf)) = NaN, and the NaN survives the later blocks "
        "where the row's real keys are.",
        _policy("pytorch_cpu_masked_block:before", desc="kv_split 512, no guard", **_CPU_FLASH),
        _policy("pytorch_cpu_masked_block:after", desc="#130014: skip a block while the max "
                "is -inf", empty_row_guard="skip", **_CPU_FLASH),
        old_tokens_hidden, nan_in_visible_rows, failure=("nonfinite",),
        note="The NaN rows are not fully masked: each sees up to 10 keys, all in its second "
             "block."),
    Entry(
        "fa3_v_tail_nan", "FlashAttention-3 (SM90): NaN in the cache past seqlen_k reaches "
        "the output through 0 * NaN",
        ("Dao-AILab/flash-attention#2407 (PR, open)",
         "Dao-AILab/flash-attention#2374 (issue, open)"),
        "TMA loads whole kBlockN-row V tiles (192 rows at hdim 64), so the last tile's rows "
        "past the sequence hold "
        "whatever the cache holds; their P is exactly 0, but 0 * NaN = NaN in the PV product.",
        _policy("fa3_v_tail_nan:before", desc="V tail as loaded from the cache", **_FA3),
        _policy("fa3_v_tail_nan:after", desc="#2407: V rows past seqlen_k zeroed",
                **{**_FA3, "v_tail": "zero"}),
        nan_cache_tail, nan_in_visible_rows, failure=("nonfinite",),
        note="Data hygiene, not softmax arithmetic: K's tail is harmless because masking "
             "overwrites its scores. The SM90 softmax exponentiates an empty (-inf) row max "
             "against 0 (Check_inf in hopper/softmax.h) and its epilogue scales by 0 where "
             "the sum is 0 or NaN, so an all-masked tile or row gives 0, not NaN. The tile: "
             "hopper/tile_size.h's tile_size_fwd_sm90 gives kBlockN 192 for hdim 64 unless the "
             "call is causal, local or paged without TMA (then 128), so #2374's D = 64 "
             "decode reads one 192-row tile over its 128-slot cache."),
    Entry(
        "ffpa_vote_nan", "ffpa-attn: the warp vote applies an all-masked row's NaN factor "
        "to O",
        ("xlite-dev/ffpa-attn#362 (PR, merged)",),
        "The O rescale is gated by a warp vote on any factor < 1, and a row with nothing "
        "visible yet has factor exp2(-inf - (-inf)) = NaN, which the vote applies to its O "
        "whenever another row needs a rescale; the per-row clamp (f < 1) ? f : 1 drops it.",
        _policy("ffpa_vote_nan:before", desc="warp vote gates the O rescale", **_FFPA),
        _policy("ffpa_vote_nan:after", desc="#362 (fp4, native): per-row clamp",
                **{**_FFPA, "o_gate": "row"}),
        masked_row_beside_a_jump, nan_factor_on_o, failure=("nan_factor",),
        note="The PR says the clamp rejects NaN on all-masked rows. In the native kernel's "
             "code (snapshot 92e1d3b) such a row's P is exp2(fma(-inf, c, +inf)) = NaN too, "
             "so its output is NaN before and after; the fix removes the NaN factor only. "
             "fp8 and cute fp16 kept the vote (+23.9% at fp8 D512). The vote fires on any "
             "factor < 1, i.e. whenever a row's max rose (threshold 0), not past a threshold "
             "of 8."),
    Entry(
        "flydsl_lazy_drag", "FlyDSL lazy rescale: a wave's ballot drags a row's max down",
        ("ROCm/FlyDSL#1033 (PR, merged)",),
        "One row's jump past the threshold makes its whole 32-row wave rescale, and the "
        "unfixed body sets each row's max to its own tile max, so a row whose tile max lies "
        "far below its running max multiplies O and l by 2^(m - mt), which overflows.",
        policies.get("lazy_unfixed"), policies.get("lazy"),
        dragged_row, nan_in_visible_rows, failure=("nonfinite",),
        kernels={"swp_bf16": _swp_drag},
        note="fa_lab's own bug; its FlyDSL models reproduce it at scale."),
) + ROUND2}

#: Every entry's policies by name: "<entry>:<before|after|variant>", and the registered
#: built-ins that flydsl_lazy_drag uses ("lazy_unfixed", "lazy").
PRESETS: dict[str, Policy] = {p.name: p for e in ENTRIES.values() for p in e.policies().values()}


def get(name: str) -> Entry:
    """The entry ``name``; ValueError listing the entries.

    Parameters
    ----------
    name : str
        An entry's name (``ENTRIES``' keys).

    Returns
    -------
    Entry

    Examples
    --------
    >>> from fa_lab import zoo
    >>> e = zoo.get("sdpa_masked_row")           # PyTorch SDPA: a fully masked row
    >>> e.failure, e.before.name, e.after.name    # its class of failure and its presets
    (('empty',), 'sdpa_masked_row:before', 'sdpa_masked_row:after')
    >>> e.shows("before"), e.shows("after")      # the symptom, then fixed
    (True, False)
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name not in ENTRIES:
        raise ValueError(f"no zoo entry named {name!r}; choose one of {list(ENTRIES)}")
    return ENTRIES[name]


def entry_of(policy) -> tuple[Entry, str] | None:
    """(entry, key) of the zoo preset ``policy`` (a name or a Policy: "before", "after" or a
    variant's key), or None for a policy no entry names. The built-ins that
    ``flydsl_lazy_drag`` uses map to it."""
    name = getattr(policy, "name", policy)
    for e in ENTRIES.values():
        for key, p in e.policies().items():
            if p.name == name:
                return e, key
    return None


def register_presets() -> tuple[str, ...]:
    """Register every entry's presets (``PRESETS``) in ``fa_lab.policies``, so that they
    appear wherever policies are listed (the dashboards' dropdowns, ``fa-lab table
    --policies``, ``fa-lab sweep``'s policy axis, ``fa-lab attack``) and ``rescale=NAME``
    takes them. Idempotent; returns the names registered now."""
    added = []
    for name, p in PRESETS.items():
        if name not in policies.names():
            policies.register(p, preset=True)
            added.append(name)
    return tuple(added)
