"""Upstream FlyDSL versions as data: what a bare ``flydsl_flash_attn_func`` call meant there.

fa_lab's signature is upstream's, so a pasted call runs unchanged; which policy it runs
depends on the FlyDSL it came from. A ``Version`` holds, per dtype, the policy that
``dualwave_swp_lazy_rescale=True`` (upstream's default) selects, whether the flag is read
at all, the fp8 threshold rule and whether fp8 lifts P before its cast
(``docs/semantics.md`` §3.5, §6).

* ``"main-11c4174d"`` (the seed's base): bf16 lazy is the unfixed body (own tile max);
  the fp8 call sites call the lazy correction unconditionally (the flag is never read),
  rebasing to the tile max with threshold 8 and no P lift.
* ``"fixed"`` (PR #1033 and #1020 merged): bf16 lazy takes fmax(m, tile max); fp8 lazy is
  monotonic with its threshold from the KV length (6 up to 4096 columns, else 4) and P
  lifted by 2^(log2 448 - THR) before the cast (eager: 2^log2 448).

Copies of these bodies in other repositories are versions too, named ``<repo>-<commit>``
(``docs/findings/`` has one bug report per failure they carry). Each names the repository,
the commit and the lines read, and says what the lab approximates where it cannot place
the copy exactly; a dtype whose body no FlyDSL family runs is refused by name, pointing at
the registered policy that runs it on the online-softmax model:

* ``"mslk-2a3c897"`` (meta-pytorch/MSLK at 2a3c897): the bf16 lazy body is the pre-#1033
  one (own tile max, THR 8, flag on by default): ``lazy_unfixed`` on DUALWAVE_SWP, exact.
  Its fp8 kernel keeps log2-unit maxima and a bf16 P ("HIPREC"), which the e4m3 fp8 family
  does not model: policy ``"mslk-2a3c897:fp8"`` (online model, approximate).
* ``"aiter-4676"`` (ROCm/aiter PR #4676 at 3f5d5e7c): the vendored fp8 dense body calls the
  lazy correction whatever the flag, rebasing to the tile max with THR 8 and no P lift: the
  ``"main-11c4174d"`` fp8 defaults. The PR adds no bf16 DUALWAVE_SWP build.
* ``"primus-a6a16cdc"`` (AMD-AGI/Primus-Turbo at a6a16cdc, PR #458): the training forward
  is causal only, so ``dualwave_swp_fixed_max`` is on: a zero reference max, P =
  exp2(score). Policy ``"primus-a6a16cdc"`` runs it on the online model.

The paged-attention decode kernel (``pa_decode_tile.py`` and the split reduce it launches
from ``pa_decode_swa.py``) has versions of its own, ``DECODE_VERSIONS`` (a
``DecodeVersion`` each): ``"main-11c4174d"`` (FlyDSL main 11c4174d, which holds
#825 squashed as 61ffdee4, with the P re-mask of 985c653a) and ``"flydsl-985c653a^"``
(the #825 branch at 20faaa4d, the parent of 985c653a). ``fa_lab.decode`` takes them
as ``upstream=``.

The fp8 kernel's split-K (FlyDSL #1097) has unit contracts of its own,
``FP8_SPLIT_VERSIONS`` (an ``Fp8SplitVersion`` each): ``"flydsl-20a76439"`` (#1097: maxima
in scaled units, the LSE without the P headroom) and ``"aiter-4676-raw-m"`` (the raw-unit
maxima aiter #4676's docstring records). ``fa_lab.kernels.swp_fp8.split.forward`` takes
them as ``upstream=``.

The paged fp8 prefill (FlyDSL #1066, ``flash_attn_fp8_paged_gfx950.py``) has versions of
its own too, ``FP8_PAGED_VERSIONS`` (an ``Fp8PagedVersion`` each): ``"flydsl-6aeb4321"``
(the #1066 commit), whose builder defaults the lazy threshold to 8. A ``Version`` names the
one it holds (``fp8_paged``; ``"fixed"`` holds it, the others have no paged fp8 kernel and
refuse such a call), and a bare paged fp8 call runs its defaults.

``flash_attn_func(..., upstream=NAME)`` picks a version for one call; ``set_upstream`` and
``using_upstream`` for a block. The default is ``"fixed"``: FlyDSL as it is today.
Explicit ``rescale=``, ``rescale_threshold=`` and ``p_headroom=`` override a version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass

from fa_lab import policies
from fa_lab.policies import BY_KV_LEN, DEFAULT_THRESHOLD, Policy
from fa_lab.semantics import Semantics


@dataclass(frozen=True)
class Version:
    """One upstream version's defaults. ``*_lazy``: the registered policy the lazy flag
    selects; ``fp8_reads_flag``: False where fp8 runs its lazy policy whatever the flag;
    ``fp8_threshold``: a number or ``"by_kv_len"``; ``fp8_p_lift``: PR #1020's P lift.
    ``repository`` and ``commit``: where the body was read, ``read`` the files and lines;
    ``approximates``: what the lab does not place exactly ("" where it does);
    ``refuses``: (``"bf16"`` or ``"fp8"``, why) for each dtype no FlyDSL family runs."""

    name: str
    description: str
    bf16_lazy: str
    fp8_lazy: str
    fp8_reads_flag: bool
    fp8_threshold: float | str
    fp8_p_lift: bool
    repository: str = "ROCm/FlyDSL"
    commit: str = ""
    read: tuple[str, ...] = ()
    approximates: str = ""
    refuses: tuple[tuple[str, str], ...] = ()
    fp8_paged: str | None = None

    def refusal(self, *, fp8: bool) -> str | None:
        """Why this version cannot run a bare call of that dtype (None: it can)."""
        return dict(self.refuses).get("fp8" if fp8 else "bf16")

    def default_policy(self, *, fp8: bool, lazy_flag: bool, paged: bool | str = False) -> Policy:
        """The policy a call with no ``rescale=`` runs under this version; ValueError for a
        dtype the version refuses (``refuses``), naming the policy that runs its body. A
        paged fp8 call (``paged``: True, or the kernel ``fa_lab.paged.PagedFp8.schedule``
        names) runs the paged builder's defaults (``fp8_paged``, a name in
        ``FP8_PAGED_VERSIONS``): its threshold, and the P headroom of that kernel; a
        version without that kernel refuses it."""
        if fp8 and paged:
            if self.fp8_paged is None:
                raise ValueError(f"upstream={self.name!r} has no paged fp8 kernel (FlyDSL #1066 "
                                 "is not in it); leave upstream= out to run FlyDSL as it is today")
            paged_version = FP8_PAGED_VERSIONS[self.fp8_paged]
            base = (dataclasses.replace(policies.get("lazy"), threshold=paged_version.threshold)
                    if lazy_flag else policies.get("eager"))
            lift = paged_version.tile_p_lift if paged == "tile" else True
            return dataclasses.replace(base, p_headroom=lift) if lift else base
        why = self.refusal(fp8=fp8)
        if why is not None:
            raise ValueError(f"upstream={self.name!r} has no {'fp8' if fp8 else 'bf16/f16'} "
                             f"body fa_lab runs as a bare call: {why}")
        if not fp8:
            return policies.get(self.bf16_lazy if lazy_flag else "eager")
        if lazy_flag or not self.fp8_reads_flag:
            base = dataclasses.replace(policies.get(self.fp8_lazy), threshold=self.fp8_threshold)
        else:
            base = policies.get("eager")
        return dataclasses.replace(base, p_headroom=self.fp8_p_lift)


VERSIONS: dict[str, Version] = {v.name: v for v in (
    Version("main-11c4174d", "FlyDSL main at 11c4174d, before PR #1033 and #1020 (the seed's base)",
            bf16_lazy="lazy_unfixed", fp8_lazy="lazy_unfixed", fp8_reads_flag=False,
            fp8_threshold=DEFAULT_THRESHOLD, fp8_p_lift=False),
    Version("fixed", "FlyDSL with PR #1033 (monotonic lazy rebase) and PR #1020 (fp8 P lift, "
            "threshold by KV length) merged",
            bf16_lazy="lazy", fp8_lazy="lazy", fp8_reads_flag=True, fp8_threshold=BY_KV_LEN,
            fp8_p_lift=True, fp8_paged="flydsl-6aeb4321"),
    Version("mslk-2a3c897", "meta-pytorch/MSLK at 2a3c897 (2026-08-21): FlyDSL's pre-#1033 lazy "
            "bodies, reached through MSLK's FlyDSL FwOp (MSLK #497)",
            bf16_lazy="lazy_unfixed", fp8_lazy="lazy_unfixed", fp8_reads_flag=True,
            fp8_threshold=DEFAULT_THRESHOLD, fp8_p_lift=False,
            repository="meta-pytorch/MSLK", commit="2a3c897",
            read=("mslk/attention/flydsl/flash_attn_utils.py l.4678-4751 (bf16 lazy_rescale_o: "
                  "corr = exp2(m_row - m_tile_max), the new max m_tile_max), l.1746 and "
                  "l.1897 (lazy flag on, THR 8), l.5465-5490 and l.5695-5706 (fp8 scores "
                  "scaled to log2 units after the QK product), l.5936-5962 (fp8 P packed to bf16), l.6009-6045 (fp8 "
                  "lazy_rescale_o, the same own-tile-max rebase)",
                  "mslk/attention/flydsl/flash_attn_fp8_gfx950.py l.340-346 and l.417-423 "
                  "(fp8 reads the lazy flag)",
                  "mslk/attention/flydsl/flash_attn_interface.py l.814 (flag default True)",
                  "mslk/attention/fmha/flydsl.py l.415-473 (FwOp calls it without the flag)"),
            approximates="fp8: policy 'mslk-2a3c897:fp8' on the online-softmax model takes "
                         "one decision per 64-column tile against an fp32 score f32(q.k * c) "
                         "and folds the V descale into the output, where MSLK dequantises V "
                         "to bf16 and pipelines P across tiles",
            refuses=(("fp8", "its fp8 kernel keeps log2-unit maxima and a bf16 P (HIPREC), "
                              "which the e4m3 swp_fp8 family does not model; pass "
                              "rescale='mslk-2a3c897:fp8' (the online model, approximate) "
                              "and leave upstream= out"),)),
    Version("aiter-4676", "ROCm/aiter PR #4676 at 3f5d5e7c (open): fp8 unified attention "
            "vendoring FlyDSL's fp8 DUALWAVE_SWP body from v0.3.0",
            bf16_lazy="lazy_unfixed", fp8_lazy="lazy_unfixed", fp8_reads_flag=False,
            fp8_threshold=DEFAULT_THRESHOLD, fp8_p_lift=False,
            repository="ROCm/aiter", commit="3f5d5e7c",
            read=("aiter/ops/flydsl/kernels/flash_attn_dualwave_common.py l.361-383 (P = "
                  "exp2(fma(s, ls, -ls*m))), l.1020 (THR 8), l.1833-1843 (P cast straight to "
                  "e4m3, no lift), l.2577-2616 (lazy_rescale_o) and "
                  "l.2618-2653 (lazy_correct_o): the wave rebases to m_tile_max",
                  "aiter/ops/flydsl/kernels/flash_attn_fp8_gfx950.py l.332-356 and l.490-502 "
                  "(lazy_correct_o called whatever the flag)"),
            approximates="the dense body only: aiter's paged, varlen and split-K machinery "
                         "around it is not modelled",
            refuses=(("bf16", "PR #4676 adds fp8 kernels only"),)),
    Version("primus-a6a16cdc", "AMD-AGI/Primus-Turbo at a6a16cdc (PR #458, 20be606f): the "
            "training forward with dualwave_swp_fixed_max = causal",
            bf16_lazy="eager", fp8_lazy="eager", fp8_reads_flag=True,
            fp8_threshold=DEFAULT_THRESHOLD, fp8_p_lift=False,
            repository="AMD-AGI/Primus-Turbo", commit="a6a16cdc",
            read=("primus_turbo/flydsl/utils/attn_helper.py l.414-420 (fixed max = causal; "
                  "row sum by MFMA), l.884-904 (Q pre-scaled, rounded to bf16), l.958-1013 "
                  "(P cast by fptrunc, l sums the cast P, rcp(l) if l > 0), l.1041-1057 "
                  "(zero max; tile_rescale_o and tile_row_max do nothing), l.1295-1316 (LSE)",
                  "primus_turbo/flydsl/attention/flash_attn_fwd.py l.51 and l.659-663 "
                  "(denormals flushed), l.262-273 (the zero max replaces the prologue's)",
                  "primus_turbo/pytorch/kernels/attention/attention_flydsl_impl.py l.53-54 "
                  "(causal, bf16 only), l.127 (always built causal)"),
            approximates="c = f32(f32(1/sqrt(D)) * f32(log2 e)) where Primus takes a fast "
                         "rsqrt; the QK product in one fp64 dot rounded once; one 64-column "
                         "step per tile",
            refuses=(("bf16", "its fixed-max forward runs on the online-softmax model only: "
                              "pass rescale='primus-a6a16cdc' and leave upstream= out"),
                     ("fp8", "Primus-Turbo's FlyDSL forward is bf16 only"))),
)}
DEFAULT = "fixed"


@dataclass(frozen=True)
class Fp8PagedVersion:
    """One version of FlyDSL #1066's paged fp8 prefill builder (``docs/semantics.md`` §17;
    ``fa_lab.kernels.swp_fp8.paged``, ``paged_tile``): the lazy ``threshold`` its builder
    defaults to, the page sizes and (D, Dv) pairs it takes, and whether its per-tile kernel
    lifts P (``tile_p_lift``; the paired-page BN128 kernel's headroom is log2(448) -
    threshold; ``fa_lab.paged.fp8_schedule`` says which kernel a call runs). ``read``: the files and places read; ``approximates``: what
    the lab does not place exactly."""

    name: str
    repository: str
    commit: str
    description: str
    threshold: float
    page_sizes: tuple
    head_dims: tuple
    tile_p_lift: bool = False
    read: tuple[str, ...] = ()
    approximates: str = ""


FP8_PAGED_VERSIONS: dict[str, Fp8PagedVersion] = {v.name: v for v in (
    Fp8PagedVersion(
        "flydsl-6aeb4321", "ROCm/FlyDSL", "6aeb43216b9814b5c14232132e03acb538ab4525",
        "FlyDSL with #1066 (paged fp8 prefill): causal packed-varlen cross-attention over a "
        "vectorized page-64 cache, its builder's lazy threshold 8",
        threshold=DEFAULT_THRESHOLD, page_sizes=(64,), head_dims=((128, 128), (192, 128), (192, 192)),
        read=("kernels/attention/flash_attn_fp8_paged_gfx950.py (build_flash_attn_paged_fp8_module: "
              "rescale_threshold=8.0 and its refusals; flash_attn_paged_fp8_bn128_kernel: the "
              "pair loop, _merge_tile_max, _correct_o, _subtile_tail, the epilogue; "
              "_validate_paged_bn128_launch)",
              "kernels/attention/flash_attn_interface.py (_flydsl_flash_attn_paged: the fp8 "
              "checks, use_bn128 = (D, Dv) == (128, 128) and an even page count; "
              "_build_paged_fp8 passes no rescale_threshold)",
              "kernels/attention/flash_attn_fp8_paged_gfx950.py (flash_attn_dualwave_swp_fp8_"
              "gfx950_kernel: the per-tile prologue, loop clusters 0-7 and epilogue C0-C13)",
              "kernels/attention/flash_attn_utils.py (DualwaveFp8SoftmaxHelper.lazy_correct_o, "
              "_lazy_rescale_o_paged, rescale_o, _lazy_correction, sub_m (no headroom for "
              "paged per-tile), cast_p, scale_v_p; DualwaveFp8GemmHelper._pv_step_fp8, "
              "_pv_step_fp8_segmented, _p_to_fp8_i32x8; _make_dualwave_swp_fp8_traits; "
              "init_tile_bounds; load_page_id and load_page_id_pair)"),
        approximates="fp32 sums (QK, P V, the row sums) in the model's order, not the MFMA's; "
                     "c in ls = c * (qd * kd) from the correctly rounded 1/sqrt(D) where the "
                     "kernel takes a fast rsqrt; the code index gives these files by "
                     "character offset, not line"),
)}
FP8_PAGED_DEFAULT = "flydsl-6aeb4321"

#: The policies that run copies' bodies no FlyDSL family runs (the online-softmax model).
COPY_POLICIES = tuple(policies.register(p, preset=True, replace=True) for p in (
    Policy("tile", "max", name="primus-a6a16cdc", color="#5b3a00",
           description="Primus-Turbo a6a16cdc's fixed-max forward: Q pre-scaled to bf16, a zero "
                       "reference max, P = exp2(score), bf16 P by fptrunc, l summing the cast "
                       "P, denormals flushed",
           semantics=Semantics(fixed_max=0.0, p_cast="bf16", p_saturate=False,
                               l_sums_cast=True, q_prescale=True, ftz=True)),
    Policy("wave", "tile", threshold=DEFAULT_THRESHOLD, name="mslk-2a3c897:fp8", color="#3d5a80",
           description="MSLK 2a3c897's fp8 body: the pre-#1033 own-tile-max rebase, THR 8, "
                       "log2-unit maxima, P packed to bf16 (approximate)",
           semantics=Semantics(p_cast="bf16", p_saturate=False, ftz=True)),
))

@dataclass(frozen=True)
class DecodeVersion:
    """One version of the paged-attention decode tile kernel (``docs/semantics.md`` §13).

    ``commit``: the ROCm/FlyDSL commit whose ``kernels/attention/pa_decode_tile.py`` it
    follows. ``remask_p``: P is zeroed where the score holds the mask sentinel (985c653a's
    fix) on one-M-tile calls. ``split_mtile_inf``: calls of more than 16 query rows
    (several M-tiles) mask with -inf and guard the base (``safe_max``) instead of the
    -1e30 sentinel. ``vmax_valid_only``: per-token mode takes the tile's V-scale maximum
    over the tokens valid for one row only (else over all 256 tokens). ``pmax_natural``:
    the partition maximum is stored in natural-log units (divided by log2 e), as the
    reduce expects; else in log2 units, which the reduce still multiplies by log2 e.
    ``epilogue_l_first``: the output scale is ``rcp(l) * (v_scale / 448)`` in one
    factor; else ``(o * v_scale / 448) * rcp(l)``. ``sw_partitions_default``: the launcher
    (``pa_decode_fp8.pa_decode_ps_launch``) takes a sliding-window call's
    ``max_context_partition_num=0`` as the recommended count; else it refuses it. The
    sliding-window kernel itself (``pa_decode_swa.compile_pa_decode_sw``) computes the
    same in both versions."""

    name: str
    commit: str
    description: str
    remask_p: bool
    split_mtile_inf: bool
    vmax_valid_only: bool
    pmax_natural: bool
    epilogue_l_first: bool
    sw_partitions_default: bool = False


DECODE_VERSIONS: dict[str, DecodeVersion] = {v.name: v for v in (
    DecodeVersion("main-11c4174d", "11c4174d",
                  "FlyDSL main at 11c4174d: pa_decode_tile with 985c653a's P re-mask (#825)",
                  remask_p=True, split_mtile_inf=True, vmax_valid_only=False,
                  pmax_natural=True, epilogue_l_first=True),
    DecodeVersion("flydsl-985c653a^", "20faaa4d",
                  "the #825 branch at 20faaa4d, the parent of 985c653a: no P re-mask",
                  remask_p=False, split_mtile_inf=False, vmax_valid_only=True,
                  pmax_natural=False, epilogue_l_first=False, sw_partitions_default=True),
)}
DECODE_DEFAULT = "main-11c4174d"


def check_decode(name) -> DecodeVersion:
    """The decode version named ``name`` (None: ``DECODE_DEFAULT``); TypeError/ValueError
    naming ``upstream`` otherwise."""
    if name is None:
        name = DECODE_DEFAULT
    if not isinstance(name, str):
        raise TypeError(f"upstream must be a decode version name (str), got {type(name).__name__}")
    if name not in DECODE_VERSIONS:
        raise ValueError(f"upstream={name!r} is not a known pa_decode version; choose one of "
                         f"{list(DECODE_VERSIONS)}")
    return DECODE_VERSIONS[name]


@dataclass(frozen=True)
class Fp8SplitVersion:
    """One version of the fp8 kernel's split-K unit contracts (``docs/semantics.md`` §16;
    ``fa_lab.kernels.swp_fp8.split``). ``m_units``: what a split's stored maximum is,
    ``"scaled"`` (m * ls, log2 units: the combine's exp2(m_s - m_max) is a log2 gap) or
    ``"raw"`` (the raw fp8-product maximum, which the combine still reads as log2 units).
    ``lse_headroom``: the LSE takes the P headroom H off (``m * ls * ln 2 + ln l - H ln 2``);
    else l's 2**H stays in it. ``read``: the files and places read; ``approximates``:
    what the lab does not place exactly ("" where it does)."""

    name: str
    repository: str
    commit: str
    description: str
    m_units: str
    lse_headroom: bool
    read: tuple[str, ...] = ()
    approximates: str = ""


FP8_SPLIT_VERSIONS: dict[str, Fp8SplitVersion] = {v.name: v for v in (
    Fp8SplitVersion(
        "flydsl-20a76439", "ROCm/FlyDSL", "20a76439",
        "FlyDSL after #1097 (fp8 varlen, split-K, head dims (D, Dv), fp8 LSE): split maxima "
        "stored scaled by ls, the LSE with the P headroom taken off",
        m_units="scaled", lse_headroom=True,
        read=("kernels/attention/flash_attn_fp8_gfx950.py (builder: head_dim % 64, head_dim_v "
              "% 32, num_kv_splits, varlen; its one attention kernel, the BN128 pair loop, "
              "launched for dense, varlen and split-K builds; the epilogue inv_l = rcp(l) * vd, "
              "the split store and the combine launch)",
              "kernels/attention/flash_attn_utils.py (_make_dualwave_swp_fp8_traits: bn128 = "
              "True for every build; init_descale: c * (qd * kd); reduce_max, max2: maxNum; "
              "DualwaveFp8SoftmaxHelper.sub_m: H = "
              "log2 448 - THR when lazy; DualwaveFp8StoreHelper.store_splitk_partial_o: m_row * "
              "c_logit_scale, bf16 O packs, store_empty_split: -1e30 and 0; "
              "DualwaveSplitKCombineHelper: maxNum of m, l > 0 splits weighted exp2(m_s - "
              "m_max) * l_s, rcp(den) if den > 0)",
              "ROCm/aiter #5326's port of the same code, aiter/ops/flydsl/kernels/fmha_gfx950/"
              "pipeline.py _store_lse and _p_headroom_log2 (LSE = m*ln2 + ln l - H*ln2, dense "
              "and combined)"),
        approximates="the merge commit of #1097 itself is not in the code index: 20a76439 is "
                     "the FlyDSL commit it holds for these two files, which carry #1097's "
                     "features; FlyDSL's fp8 builder there returns no LSE, so the LSE follows "
                     "the aiter port"),
    Fp8SplitVersion(
        "aiter-4676-raw-m", "ROCm/aiter", "3f5d5e7c",
        "the unit bug aiter #4676 records: split maxima stored in raw fp8-product units, so "
        "every split but the largest is weighted exp2(-gap) = 0",
        m_units="raw", lse_headroom=True,
        read=("aiter/ops/flydsl/kernels/flash_attn_dualwave_common.py l.2717-2758 "
              "(store_splitk_partial_o), l.2760-2778 (splitk_m_out: its docstring records the "
              "bug, the code multiplies by c_logit_scale), l.3007-3045 (the combine)",),
        approximates="no commit carries the bug: splitk_m_out arrived with fp8 split-K itself "
                     "(1ae6b629); this is the body its docstring describes, m stored as the "
                     "kernel carries it, on FlyDSL 20a76439's split path"),
)}
FP8_SPLIT_DEFAULT = "flydsl-20a76439"


def check_fp8_split(name) -> Fp8SplitVersion:
    """The fp8 split-K version named ``name`` (None: ``FP8_SPLIT_DEFAULT``); TypeError/
    ValueError naming ``upstream`` otherwise."""
    if name is None:
        name = FP8_SPLIT_DEFAULT
    if not isinstance(name, str):
        raise TypeError(f"upstream must be an fp8 split version name (str), got {type(name).__name__}")
    if name not in FP8_SPLIT_VERSIONS:
        raise ValueError(f"upstream={name!r} is not a known fp8 split-K version; choose one of "
                         f"{list(FP8_SPLIT_VERSIONS)}")
    return FP8_SPLIT_VERSIONS[name]

_state = threading.local()


def check(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"upstream must be a version name (str), got {type(name).__name__}")
    if name not in VERSIONS:
        raise ValueError(f"upstream={name!r} is not a known FlyDSL version; choose one of "
                         f"{list(VERSIONS)}")
    return name


def current() -> str:
    """The version calls without ``upstream=`` use (this thread)."""
    return getattr(_state, "name", DEFAULT)


def set_upstream(name: str) -> None:
    """Choose the upstream version for the calls that follow (this thread)."""
    _state.name = check(name)


@contextlib.contextmanager
def using_upstream(name: str):
    """``with fa_lab.using_upstream("main-11c4174d"): ...``: the version for a block."""
    check(name)
    before = current()
    _state.name = name
    try:
        yield VERSIONS[name]
    finally:
        _state.name = before


def get(name: str | None = None) -> Version:
    """The named version, or the current one."""
    return VERSIONS[getattr(_state, "name", DEFAULT) if name is None else check(name)]
