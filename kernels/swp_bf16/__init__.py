"""The gfx950 DUALWAVE_SWP bf16/f16 forward: its exact model and its Triton ports.

- ``model``: the exact PyTorch model (the definition; ``docs/semantics.md`` §2).
- ``faithful``: the faithful port, decision for decision (``forward``, ``forward_varlen``).
- ``combine``: the faithful port's split-K ranges and the pass that combines the splits.
- ``fast``: the fast kernel (the policy's semantics, its own tiling); ``num_kv_splits`` > 1
  hands off to ``splitk``; on Hopper at head dim 128 dense calls go to ``hopper`` (Gluon).
- ``splitk``: the fast kernel's split-K (the model's split boundaries) and its combine.
- ``varlen``: the fast kernel on packed (varlen) batches, in one launch.
"""

from fa_lab.capabilities import HALF, Caps, Family, Implementation
from fa_lab.routing import DUALWAVE

from .._common.geometry import BLOCK_M, BLOCK_N, tiles_for_block

#: The vote and rebase values each implementation runs, by name (``fa_lab.values``).
_VOTES, _REBASES = frozenset({"tile", "wave", "row"}), frozenset({"max", "tile", "capped"})
_FAST_VOTES, _FAST_REBASES = frozenset({"tile", "wave"}), frozenset({"max", "tile"})
#: What the model and the faithful port take: every call feature but a sliding window.
_FEATURES = frozenset({"bias", "alibi_slopes", "sink", "num_kv_splits", "varlen", "trace", "paged"})


def unconsulted(call, policy) -> str | None:
    """Why a lazy ``policy`` is never consulted on a dense ``call``: DUALWAVE_SWP decides
    lazily only on KV tiles 1 .. N-4 of each 256-row block (``model``), so a call whose
    blocks have at most 4 tiles rescales every tile eagerly. None where some block
    consults it (split-K and varlen calls are not looked at)."""
    # (a block has at least ceil(Skv / BLOCK_N) >= 5 tiles past Skv = 4 * BLOCK_N)
    if call.packing is not None or "num_kv_splits" in call.features or call.seqlen_kv > 4 * BLOCK_N:
        return None
    n = max(tiles_for_block(q0, call.seqlen_q, call.seqlen_kv, call.causal)
            for q0 in range(0, call.seqlen_q, BLOCK_M))
    if n > 4:
        return None
    return (f"rescale={policy.name!r} is never consulted here: DUALWAVE_SWP decides lazily only "
            f"on KV tiles 1 .. N-4 of each 256-row block, and Skv={call.seqlen_kv} gives N = {n}, "
            "so every tile rescales eagerly")


FAMILY = Family(
    "swp_bf16", "DUALWAVE_SWP: bf16/f16, the lazy wave-ballot rescale (upstream's long-sequence kernel)",
    {"model": Implementation("model", Caps(HALF, (64, 128), _FEATURES, _VOTES, _REBASES,
                                           rules=True)),
     "faithful": Implementation("faithful", Caps(HALF, (64, 128), _FEATURES, _VOTES,
                                                 _REBASES), varlen="faithful"),
     "fast": Implementation("fast", Caps(HALF, (64, 128), frozenset({"num_kv_splits", "varlen"}),
                                         _FAST_VOTES, _FAST_REBASES), varlen="varlen")},
    rule=DUALWAVE, unconsulted=unconsulted)
