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

The paged-attention decode kernel (``pa_decode_tile.py`` and the split reduce it launches
from ``pa_decode_swa.py``) has versions of its own, ``DECODE_VERSIONS`` (a
``DecodeVersion`` each): ``"main-11c4174d"`` (FlyDSL main 11c4174d, which holds
#825 squashed as 61ffdee4, with the P re-mask of 985c653a) and ``"flydsl-985c653a^"``
(the #825 branch at 20faaa4d, the parent of 985c653a). ``fa_lab.decode`` takes them
as ``upstream=``.

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


@dataclass(frozen=True)
class Version:
    """One upstream version's defaults. ``*_lazy``: the registered policy the lazy flag
    selects; ``fp8_reads_flag``: False where fp8 runs its lazy policy whatever the flag;
    ``fp8_threshold``: a number or ``"by_kv_len"``; ``fp8_p_lift``: PR #1020's P lift."""

    name: str
    description: str
    bf16_lazy: str
    fp8_lazy: str
    fp8_reads_flag: bool
    fp8_threshold: float | str
    fp8_p_lift: bool

    def default_policy(self, *, fp8: bool, lazy_flag: bool) -> Policy:
        """The policy a call with no ``rescale=`` runs under this version."""
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
            fp8_p_lift=True),
)}
DEFAULT = "fixed"


@dataclass(frozen=True)
class DecodeVersion:
    """One version of the paged-attention decode tile kernel (``docs/semantics.md`` §12).

    ``commit``: the ROCm/FlyDSL commit whose ``kernels/attention/pa_decode_tile.py`` it
    follows. ``remask_p``: P is zeroed where the score holds the mask sentinel (985c653a's
    fix) on one-M-tile calls. ``split_mtile_inf``: calls of more than 16 query rows
    (several M-tiles) mask with -inf and guard the base (``safe_max``) instead of the
    -1e30 sentinel. ``vmax_valid_only``: per-token mode takes the tile's V-scale maximum
    over the tokens valid for one row only (else over all 256 tokens). ``pmax_natural``:
    the partition maximum is stored in natural-log units (divided by log2 e), as the
    reduce expects; else in log2 units, which the reduce still multiplies by log2 e.
    ``epilogue_l_first``: the output scale is ``rcp(l) * (v_scale / 448)`` in one
    factor; else ``(o * v_scale / 448) * rcp(l)``."""

    name: str
    commit: str
    description: str
    remask_p: bool
    split_mtile_inf: bool
    vmax_valid_only: bool
    pmax_natural: bool
    epilogue_l_first: bool


DECODE_VERSIONS: dict[str, DecodeVersion] = {v.name: v for v in (
    DecodeVersion("main-11c4174d", "11c4174d",
                  "FlyDSL main at 11c4174d: pa_decode_tile with 985c653a's P re-mask (#825)",
                  remask_p=True, split_mtile_inf=True, vmax_valid_only=False,
                  pmax_natural=True, epilogue_l_first=True),
    DecodeVersion("flydsl-985c653a^", "20faaa4d",
                  "the #825 branch at 20faaa4d, the parent of 985c653a: no P re-mask",
                  remask_p=False, split_mtile_inf=False, vmax_valid_only=True,
                  pmax_natural=False, epilogue_l_first=False),
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
    return VERSIONS[current() if name is None else check(name)]
