"""The failure zoo: the ecosystem's public online-softmax failures, reproduced.

``forward`` is the online-softmax model that runs any ``Policy`` with any ``Semantics``
(``fa_lab.zoo.model``); ``ENTRIES`` holds one ``Entry`` per public report: its sources,
its mechanism, its semantics before and after the fix (``PRESETS``), the smallest input
that shows it and the check of its symptom (``fa_lab.zoo.entries``).
"""

from .entries import ENTRIES, PRESETS, Case, Entry, get
from .model import LOG2_UNITS, TileRecord, forward, row_history

__all__ = ["forward", "TileRecord", "row_history", "LOG2_UNITS", "ENTRIES", "PRESETS", "Case",
           "Entry", "get"]
