"""fa_lab: a lab for flash-attention's online-softmax rescale and how it overflows.

    from fa_lab import flash_attn_func, trace, Policy, reference, metrics

``flash_attn_func`` has upstream FlyDSL's signature and the gfx950 kernels' semantics;
``trace`` records chosen lanes step by step; ``Policy`` is a rescale policy (the built-ins
are registered in ``fa_lab.policies``; write and ``register`` your own);
``reference.attention`` is an fp32 reference; ``metrics`` turns outputs into numbers;
``set_upstream`` / ``using_upstream`` pick the FlyDSL version whose defaults a bare call
takes (``fa_lab.upstream``); ``zoo`` holds the ecosystem's public online-softmax failures,
whose presets are registered policies (``"<entry>:before"``, ``"<entry>:after"``; the
registry imports the zoo when a preset is first named or the names are listed, and
``fa_lab.zoo`` imports on first use: the core never imports it).
A ``RoutingWarning`` says a call runs other than it seems to ask (another kernel than
upstream's, or a policy that is never consulted); ``warnings`` filters it by category.
"""

from fa_lab import metrics, policies, reference, results, sdpa, upstream
from fa_lab.api import count_rescales, flash_attn_func, swa_attn_func, trace
from fa_lab.compare import compare
from fa_lab.dispatch import RoutingWarning
from fa_lab.policies import Policy, RuleError
from fa_lab.trace import Trace
from fa_lab.upstream import set_upstream, using_upstream

__all__ = ["flash_attn_func", "swa_attn_func", "trace", "count_rescales", "compare", "Trace",
           "Policy", "RuleError", "RoutingWarning", "reference", "metrics", "policies", "results", "upstream",
           "set_upstream", "using_upstream", "zoo", "sdpa"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "zoo":  # imported on first use: the core never imports the zoo
        import importlib

        return importlib.import_module("fa_lab.zoo")
    raise AttributeError(f"module 'fa_lab' has no attribute {name!r}")
