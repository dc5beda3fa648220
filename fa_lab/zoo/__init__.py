"""The failure zoo: the ecosystem's public online-softmax failures, reproduced.

``ENTRIES`` holds one ``Entry`` per public report: its sources, its mechanism, its
semantics before and after the fix (``PRESETS``, registered as policies named
``"<entry>:before"``, ``"<entry>:after"`` and ``"<entry>:<variant>"``), the smallest input
that shows it, the check of its symptom and the class of failure the attack looks for
(``fa_lab.zoo.entries``). The model that runs them is the online-softmax kernel family
(``fa_lab.kernels.online``): ``flash_attn_func(..., rescale="fa4_fp8_saturation:before")``
routes there, and ``fa_lab.kernels.online.model.forward`` is its model.
"""

from .entries import ENTRIES, PRESETS, Case, Entry, entry_of, get, register_presets

register_presets()

__all__ = ["ENTRIES", "PRESETS", "Case", "Entry", "get", "entry_of", "register_presets"]
