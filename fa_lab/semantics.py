"""Kernel semantics as data: what an online-softmax kernel does around its rescale.

A ``Policy`` (``fa_lab.policies``) says how a row decides to keep or move its running max
(``vote``, ``rebase``, ``threshold``) and how far P is lifted before its cast
(``p_headroom``). ``Semantics``, which a ``Policy`` holds as ``policy.semantics``, says the
rest: how masked scores, empty rows, exponent differences, the P cast and the epilogue
behave. Each kernel family states which fields it runs (``fa_lab.capabilities.Caps``):
the online-softmax family (``fa_lab.kernels.online``) runs every field, the FlyDSL
families the defaults only, so a policy that changes a field routes to the online family
and any other refuses it, naming the field. ``docs/semantics.md`` §10 defines each field.

The defaults are what the lab's DUALWAVE_SWP kernels do, so every policy that existed
before these fields behaves exactly as it did. Fields, in log2 units unless stated:

* ``wave_rows`` (32): rows that share a ballot, for ``vote="wave"`` and ``o_gate="wave"``:
  16, 32 or 64 consecutive query rows of one head.
* ``o_gate`` (``"always"``): which rows multiply O by their rescale factor ``f``.
  ``"always"`` every row, every tile (a row that kept its max has ``f = 1``);
  ``"row"`` a row whose own ``f < 1`` (a NaN or ``f >= 1`` is not applied);
  ``"wave"`` every row of a wave in which some row has ``f < 1`` (a warp ballot).
  l is always multiplied by the row's own ``f``.
* ``mask_value`` (-inf): the score a masked position gets; ``-inf`` or a finite negative
  sentinel. ``m_init`` (-inf): a row's running max before its first tile.
* ``mask_domain`` (``"scaled"``): where ``mask_value`` and ``m_init`` live. ``"scaled"``:
  in the log2 units in which maxima are compared; ``"raw"``: on the raw logit q.k before the
  softmax scale, so the model uses ``f32(value * c)`` with ``c = softmax_scale * log2 e``.
* ``tile_max_floor`` (``"causal"``): when a tile's max is floored, ``fmax(mt, floor_value)``:
  ``"never"``, ``"causal"`` (causal calls only) or ``"always"``; ``floor_value`` (-3e38,
  finite, in log2 units).
* ``empty_row_guard`` (``"none"``): what a row does while its max is *empty* (``-inf``,
  ``mask_value`` or ``m_init``: no visible key has raised it). ``"none"``: nothing;
  ``"zero_base"``: exponents use 0 in place of an empty max, so P of a masked score is
  ``exp2(mask_value)`` and the factor ``exp2(m_old)`` (FA4's safe max, TensorRT-LLM's
  ``CHECK_NEG_INF``); ``"skip"``: the row skips the tile (P = 0, m, l, O unchanged).
* ``epilogue_guard`` (``"zero"``): the output scale of a row with ``l == 0``: ``"zero"``
  ``rcp(l) if l > 0 else 0`` (a NaN l also gives 0); ``"one"`` 1 where ``l`` is 0 or NaN,
  else ``1/l``; ``"none"`` ``1/l`` (0 * inf = NaN for an empty row).
* ``clamp_exp_diff`` (False): ``fmax(diff, -inf)`` on every exponent difference before
  ``exp2`` (the factor's ``m_old - m_new`` and P's ``x - m``): a NaN difference becomes
  ``-inf``, its exp2 0.
* ``p_cast`` (``"input"``): the format P is rounded to before the PV product: ``"input"``
  (the inputs' dtype: none for fp32), ``"none"``, ``"bf16"``, ``"f16"``, ``"e4m3"``,
  ``"e5m2"``; ``p_saturate`` (True): values past the format's largest finite value are
  clamped to it (satfinite); False: they become inf (bf16, f16, e5m2) or NaN (e4m3).
  l always sums the fp32 P, before the cast. The P offset is ``Policy.p_headroom``.
* ``max_lag`` (False): a tile's P is computed against the running max from before that
  tile, and the rescale that follows covers it; a row with an empty max uses the new one.
* ``block_n`` (None): KV columns per online-softmax step, 1 .. ``MAX_BLOCK_N``; None: the
  kernel's own (64 in the online model).
* ``kv_order`` (``"ascending"``): the order of the KV tiles; ``"descending"`` visits the
  last (partial) tile first, as FlashAttention's kernels do.
* ``v_tail`` (``"zero"``): V rows past the sequence's end inside its last tile: ``"zero"``
  (zero-filled loads) or ``"cache"`` (whatever the KV cache holds there: TMA loads whole
  tiles).
* ``fixed_max`` (None): a number pins every row's max there for the whole walk, in log2
  units: no tile max is consulted, nothing rescales (``f = 1``), and ``P = exp2(x -
  fixed_max)`` (Primus-Turbo's fixed-max forward: 0). None: the running max.
* ``l_sums_cast`` (False): l sums P as cast for the PV product (a row sum taken by an MFMA
  on the packed P) instead of the fp32 P.
* ``q_prescale`` (False): Q is multiplied by ``c`` and rounded to the inputs' 16-bit type
  before the QK product, so a score is ``f32(round(q * c) . k)`` instead of ``f32(q . k * c)``
  (FlyDSL's and Primus-Turbo's bf16 kernels); bf16, f16 and fp32 inputs (fp32: no rounding).
* ``ftz`` (False): exp2 results below 2**-126 (fp32 subnormals) flush to 0, as in a kernel
  built with denormals flushed (FlyDSL's ``daz=True``); False keeps them (the lab's default,
  ``docs/semantics.md`` §4).
* ``l_floor`` (0.0): the epilogue divides by ``fmax(l, l_floor)`` before its guard (a
  positive floor such as FlyDSL flex attention's 1e-12); 0: no floor.
* ``softcap`` (0.0): a logit softcap in natural-log units: the scaled score ``t = S *
  softmax_scale`` becomes ``softcap * tanh(t / softcap)`` before the mask and the max
  (Gemma-2's 50); 0: none. ``softcap_form`` (``"tanh"``): how tanh is computed in fp32:
  ``"tanh"`` exactly; ``"exp_ratio"`` ``(e^u - e^-u) / (e^u + e^-u)``, which is
  ``inf / inf = NaN`` once ``|u| > ~88.7``; ``"exp_sum"`` ``1 - 2 / (e^(2u) + 1)``, which
  saturates at +-1.
* ``exp_floor`` (None): every exp2 argument is floored first, ``fmax(arg, exp_floor)``
  (log2 units; maxNum, so a NaN argument gives the floor): a hardware exp that clamps its
  input (tt-metal's SFPU exp at -88.5 natural); None: no floor.
* ``mask_stage`` (``"scores"``): where the mask acts. ``"scores"``: masked and out-of-range
  scores become ``mask_value`` before the max and the exponent; ``"p"``: the max and the
  exponent see every score of the tile, a cache tail's too, and P is multiplied by the
  visibility afterwards (0 * NaN = NaN; a stale score can raise the max).
* ``p_before_vote`` (False): P is taken against ``fmax(m, mt)``, the max the row would move
  to, before the vote decides; a row that then keeps its max keeps that P, unrescaled.
* ``kv_split`` (None): KV tiles per partial (split-KV, context parallelism, a cascade): the
  walk restarts every ``kv_split`` steps, each partial writes its normalised output and
  its LSE, and the partials are merged: ``w_i = e^(L_i - max L)``, ``out = sum w_i o_i /
  sum w_i``, ``lse = max L + ln sum w_i``. None: one walk, no merge.
* ``merge_empty`` (``"empty"``): what the merge gives where every partial is empty (LSE
  -inf): ``"empty"`` output 0 and LSE -inf (the shift uses 0 in place of -inf);
  ``"nan"`` NaN (``e^(-inf - -inf)``).
* ``lse_base`` (``"e"``): the base the partials write their LSE in, which the merge reads
  as natural logs: ``"e"``; ``"2"`` (``log2 sum 2^x``: the merge then weights each partial
  by its mass to the power 1/ln 2).

``choices()`` lists the values of each field that takes one of a fixed set.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fa_lab import values

#: The floor FlyDSL applies to a causal row's max (numerics.CAUSAL_FLOOR).
DEFAULT_FLOOR = -3e38
#: fp32's largest finite value: TensorRT-LLM's mask value and flashinfer's max floor.
FLT_MAX = 3.4028234663852886e38

#: The Semantics fields that take one of a fixed set of values (``fa_lab.values``), other
#: than the switches (bool fields, also declared there).
_CHOICES = tuple(f for f in values.DECLARED if f not in values.POLICY_FIELDS)

#: The largest ``block_n``: wider than any kernel's KV tile (CPU flash attention's 512
#: included); a step's scores are rows x block_n, so a larger one only costs memory.
MAX_BLOCK_N = 4096


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


@dataclass(frozen=True)
class Semantics:
    """The kernel semantics around a policy's rescale decision (module docstring)."""

    wave_rows: int = 32
    o_gate: str = "always"
    mask_value: float = -math.inf
    m_init: float = -math.inf
    mask_domain: str = "scaled"
    tile_max_floor: str = "causal"
    floor_value: float = DEFAULT_FLOOR
    empty_row_guard: str = "none"
    epilogue_guard: str = "zero"
    clamp_exp_diff: bool = False
    p_cast: str = "input"
    p_saturate: bool = True
    max_lag: bool = False
    block_n: int | None = None
    kv_order: str = "ascending"
    v_tail: str = "zero"
    fixed_max: float | None = None
    l_sums_cast: bool = False
    q_prescale: bool = False
    ftz: bool = False
    l_floor: float = 0.0
    softcap: float = 0.0
    softcap_form: str = "tanh"
    exp_floor: float | None = None
    mask_stage: str = "scores"
    p_before_vote: bool = False
    kv_split: int | None = None
    merge_empty: str = "empty"
    lse_base: str = "e"

    def __post_init__(self):
        for name in _CHOICES:
            value = getattr(self, name)
            kind = bool if isinstance(values.names(name)[0], bool) else type(values.names(name)[0])
            if type(value) is not kind:
                raise TypeError(f"{name} must be a{'n' if kind is int else ''} "
                                f"{kind.__name__}, got {type(value).__name__}")
            values.get(name, value)  # ValueError naming the field and its values
        for name in ("mask_value", "m_init"):
            value = _real(name, getattr(self, name))
            if math.isnan(value) or value >= 0:
                raise ValueError(f"{name} must be -inf or a finite negative number, got {value!r}")
        floor = _real("floor_value", self.floor_value)
        if not math.isfinite(floor) or floor >= 0:
            raise ValueError(f"floor_value must be a finite negative number, got {floor!r}")
        if self.fixed_max is not None:
            fixed = _real("fixed_max", self.fixed_max)
            if not math.isfinite(fixed):
                raise ValueError(f"fixed_max must be None or a finite number, got {fixed!r}")
        l_floor = _real("l_floor", self.l_floor)
        if not math.isfinite(l_floor) or l_floor < 0:
            raise ValueError(f"l_floor must be a finite number >= 0, got {l_floor!r}")
        cap = _real("softcap", self.softcap)
        if not math.isfinite(cap) or cap < 0:
            raise ValueError(f"softcap must be a finite number >= 0, got {cap!r}")
        if cap and self.q_prescale:
            raise ValueError("softcap caps f32(q . k * softmax_scale); it does not combine with "
                             "q_prescale")
        if self.p_before_vote and self.max_lag:
            raise ValueError("p_before_vote takes P against the candidate max; it does not "
                             "combine with max_lag")
        if self.exp_floor is not None:
            ef = _real("exp_floor", self.exp_floor)
            if not math.isfinite(ef) or ef >= 0:
                raise ValueError(f"exp_floor must be None or a finite negative number, got {ef!r}")
        if self.kv_split is not None:
            if isinstance(self.kv_split, bool) or not isinstance(self.kv_split, int):
                raise TypeError(f"kv_split must be None or an int, got {type(self.kv_split).__name__}")
            if self.kv_split < 1:
                raise ValueError(f"kv_split must be >= 1 (tiles per partial), got {self.kv_split}")
        fields = {f.name: f.default for f in dataclasses.fields(self)}
        params = {"floor_value", "p_saturate"}
        unread = values.ignored({n: getattr(self, n) for n in _CHOICES},
                                {p: getattr(self, p) != fields[p] for p in params})
        if unread:
            raise ValueError(unread[0])
        if self.block_n is not None:
            if isinstance(self.block_n, bool) or not isinstance(self.block_n, int):
                raise TypeError("block_n must be None or an int, got "
                                f"{type(self.block_n).__name__}")
            if not 1 <= self.block_n <= MAX_BLOCK_N:
                raise ValueError(f"block_n must be in 1 .. {MAX_BLOCK_N} (KV columns per "
                                 f"step; a kernel's tile), got {self.block_n}")

    def changed(self) -> tuple[str, ...]:
        """The names of the fields that differ from the defaults, in field order."""
        return tuple(f.name for f in dataclasses.fields(self)
                     if getattr(self, f.name) != f.default)

    def describe(self) -> str:
        """The changed fields as ``name=value`` pairs ("" for the defaults)."""
        return " ".join(f"{n}={getattr(self, n)!r}" for n in self.changed())


#: The defaults: DUALWAVE_SWP's semantics.
DEFAULT = Semantics()


def choices() -> dict[str, tuple]:
    """The values each ``Semantics`` field with a fixed set of them accepts, in field order:
    ``{field: (choice, ...)}``, the default among them (``wave_rows``, the named choices,
    and False/True for the switches), as ``fa_lab.values`` declares them. ``mask_value``,
    ``m_init``, ``floor_value``, ``block_n``, ``fixed_max``, ``l_floor``, ``softcap``,
    ``exp_floor`` and ``kv_split`` take a number and are not listed (module docstring)."""
    return {f.name: values.names(f.name) for f in dataclasses.fields(Semantics)
            if f.name in _CHOICES}
