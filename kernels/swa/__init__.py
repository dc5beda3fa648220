"""The gfx950 SWA GQA sliding-window forward (``swa_gfx950.py``): its exact model and its
faithful Triton port. ``flash_attn_func`` does not route to it (upstream's
``flydsl_flash_attn_func`` does not either); ``fa_lab.swa_attn_func`` calls it, handing its
``forward`` the window and the policy as ``rescale=`` (not ``policy=``).

- ``model``: the exact PyTorch model (the definition; ``docs/semantics.md`` §5).
- ``faithful``: the faithful port.
"""

from fa_lab.capabilities import Caps, Family, Implementation


def check_args(q, k, v, *, window_left, window_right, causal, rescale_threshold, rescale):
    """``swa_attn_func``'s own arguments (``model.check_args``); the policy the kernel runs."""
    from .model import check_args as check

    return check(q, k, v, window_left, window_right, causal, rescale_threshold, rescale)


# "window": the sliding window, which swa_attn_func asks of the family that claims it
_CAPS = Caps(frozenset({"bf16"}), (128,), frozenset({"trace", "window"}), frozenset({"wave"}),
             frozenset({"max", "tile"}))
FAMILY = Family("swa", "the SWA sliding-window kernel: bf16, D 128, its own deferred rescale",
                {"model": Implementation("model", _CAPS, policy=False),
                 "faithful": Implementation("faithful", _CAPS, policy=False)},
                routed=False, check_args=check_args)
