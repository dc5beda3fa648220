"""A safe region's parts, shared by every family's closed-form bound (``kernels/<family>/
bound.py``) and by ``fa_lab.studies.onset.bound``: a hazard (one way to fail, its formula
and its check of an input's summary) and the checks a region of hazards answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Hazard:
    """One way to fail. ``check(m) -> (safe, margin)``: margin in log2 units (None for a
    structural hazard); ``exact``: the formula is the boundary itself (else sufficient);
    ``never``: the policy's or version's fields rule it out on every input; ``note``: why,
    or why no closed form holds."""

    name: str
    kind: str
    formula: str
    check: Callable = field(repr=False, compare=False)
    exact: bool = True
    never: bool = False
    note: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "formula": self.formula, "exact": self.exact,
                "never": self.never, "note": self.note}

    def over_parts(self) -> "Hazard":
        """This hazard checked on each part of a summary with ``parts`` (a call the kernel
        runs as independent dense pieces: sequences, splits): safe when it holds on every
        part; its margin the smallest part's."""
        def check(whole):
            safe, margins = True, []
            for m in whole.parts:
                ok, margin = self.check(m)
                safe = safe and ok
                if margin is not None:
                    margins.append(margin)
            return safe, (min(margins) if margins else None)
        return Hazard(self.name, self.kind, self.formula, check, exact=self.exact,
                      never=self.never, note=self.note)


class HazardChecks:
    """What a region with a ``hazards`` tuple answers about an input's summary ``m``: an
    input is inside when no live hazard applies."""

    hazards: tuple

    def violated(self, m) -> list[str]:
        """The hazards ``m`` lies outside of (names)."""
        return [h.name for h in self.hazards if not h.never and not h.check(m)[0]]

    def _described(self, head: str) -> str:
        """``head``, then one line per hazard: its kind, name and formula, and whether the
        formula is the boundary itself (exact), only sufficient, or ruled out (never)."""
        lines = [head]
        for h in self.hazards:
            tag = "never" if h.never else ("exact" if h.exact else "sufficient")
            lines.append(f"  [{h.kind}] {h.name}: {h.formula} ({tag})")
        return "\n".join(lines)

    def contains(self, m) -> bool:
        return not self.violated(m)

    def margins(self, m) -> dict:
        """Each continuous hazard's margin (log2 units, >= 0 inside) on ``m``."""
        return {h.name: h.check(m)[1] for h in self.hazards if not h.never
                and h.check(m)[1] is not None}
