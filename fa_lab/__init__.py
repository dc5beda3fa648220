"""fa_lab: a lab for flash-attention's online-softmax rescale and how it overflows.

    from fa_lab import flash_attn_func, trace, reference, metrics

``flash_attn_func`` has upstream FlyDSL's signature and the gfx950 kernels' semantics;
``trace`` records chosen lanes step by step; ``reference.attention`` is an fp32 reference;
``metrics`` turns outputs into numbers.
"""

import importlib.util as _ilu
import pathlib as _pathlib
import sys as _sys

# kernels/ sits beside this package and is installed as fa_lab.kernels; from a plain source
# checkout (PYTHONPATH=., as on a lent GPU machine) register it under that name too.
_KERNELS = _pathlib.Path(__file__).resolve().parent.parent / "kernels"
if "fa_lab.kernels" not in _sys.modules and _ilu.find_spec("fa_lab.kernels") is None \
        and (_KERNELS / "__init__.py").exists():
    _spec = _ilu.spec_from_file_location("fa_lab.kernels", _KERNELS / "__init__.py",
                                         submodule_search_locations=[str(_KERNELS)])
    _sys.modules["fa_lab.kernels"] = _ilu.module_from_spec(_spec)
    _spec.loader.exec_module(_sys.modules["fa_lab.kernels"])
    kernels = _sys.modules["fa_lab.kernels"]

from . import metrics, policies, reference  # noqa: E402
from .api import count_rescales, flash_attn_func, swa_attn_func, trace  # noqa: E402
from .compare import compare  # noqa: E402
from .trace import Trace  # noqa: E402

__all__ = ["flash_attn_func", "swa_attn_func", "trace", "count_rescales", "compare", "Trace",
           "reference", "metrics", "policies"]
__version__ = "0.1.0"
