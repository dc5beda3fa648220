"""The kinds of sweep grid, and the one way to open a grid of any kind."""

from __future__ import annotations

from pathlib import Path

from .decode_grid import DecodeGrid
from .grid import Grid, GridError, read_yaml


#: The kinds of grid: ``policy`` (``Grid``: flash_attn_func under rescale policies) and
#: ``decode`` (``DecodeGrid``: the serving decode kernels).
KINDS = ("policy", "decode")


def open_grid(source, *, kind: str | None = None, name: str | None = None):
    """A grid of its kind from a YAML path, a mapping or a grid: the mapping's ``kind:``
    (default ``policy``), which ``kind`` given here must agree with (or supply)."""
    if isinstance(source, (Grid, DecodeGrid)):
        if kind is not None and kind != source.kind:
            raise GridError("kind", f"the grid is kind {source.kind!r}, not {kind!r}")
        return source
    if kind is not None and kind not in KINDS:
        raise GridError("kind", f"{kind!r} is not a kind of grid; choose one of {KINDS}")
    stem = None
    if isinstance(source, (str, Path)):
        source, stem = read_yaml(source)
    if not isinstance(source, dict):
        raise TypeError(f"a grid is a mapping of axis -> values, got {type(source).__name__}")
    said = source.get("kind")
    if said is not None and said not in KINDS:
        raise GridError("kind", f"{said!r} is not a kind of grid; choose one of {KINDS}")
    if said is not None and kind is not None and said != kind:
        raise GridError("kind", f"the grid says kind {said!r}, and {kind!r} was asked for")
    chosen = said or kind or "policy"
    spec = {k: v for k, v in source.items() if k != "kind"}
    name = name or spec.get("name") or stem
    return (DecodeGrid if chosen == "decode" else Grid)(spec, name=name)
