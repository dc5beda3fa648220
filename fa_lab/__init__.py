"""fa_lab: a lab for flash-attention's online-softmax rescale and how it overflows.

    from fa_lab import flash_attn_func, trace, reference, metrics

``flash_attn_func`` has upstream FlyDSL's signature and the gfx950 kernels' semantics;
``trace`` records chosen lanes step by step; ``reference.attention`` is an fp32 reference;
``metrics`` turns outputs into numbers.
"""

from . import metrics, policies, reference
from .api import count_rescales, flash_attn_func, swa_attn_func, trace
from .trace import Trace

__all__ = ["flash_attn_func", "swa_attn_func", "trace", "count_rescales", "Trace", "reference",
           "metrics", "policies"]
__version__ = "0.1.0"
