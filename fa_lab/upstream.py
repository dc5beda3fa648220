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
