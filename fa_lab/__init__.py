"""fa_lab: a lab for flash-attention's online-softmax rescale and how it overflows.

    from fa_lab import flash_attn_func, trace, Policy, reference, metrics

``flash_attn_func`` has upstream FlyDSL's signature and the gfx950 kernels' semantics;
``trace`` records chosen lanes step by step; ``Policy`` is a rescale policy (the built-ins
are registered in ``fa_lab.policies``; write and ``register`` your own);
``reference.attention`` is an fp32 reference; ``metrics`` turns outputs into numbers;
``set_upstream`` / ``using_upstream`` pick the FlyDSL version whose defaults a bare call
takes (``fa_lab.upstream``).
"""

from . import metrics, policies, reference, results, upstream
from .api import count_rescales, flash_attn_func, swa_attn_func, trace
from .compare import compare
from .policies import Policy
from .trace import Trace
from .upstream import set_upstream, using_upstream

__all__ = ["flash_attn_func", "swa_attn_func", "trace", "count_rescales", "compare", "Trace",
           "Policy", "reference", "metrics", "policies", "results", "upstream", "set_upstream",
           "using_upstream"]
__version__ = "0.1.0"
