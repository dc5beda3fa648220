"""The failure zoo: the ecosystem's public online-softmax failures, reproduced.

``forward`` is the online-softmax model that runs any ``Policy`` with any ``Semantics``
(``fa_lab.zoo.model``).
"""

from .model import LOG2_UNITS, TileRecord, forward, row_history

__all__ = ["forward", "TileRecord", "row_history", "LOG2_UNITS"]
