"""The dashboards' caches: inputs, the fp32 reference, outputs and traces by their
parameters (least recently used first out), and figures by the data they draw."""

from __future__ import annotations

from collections import OrderedDict




class _LRU:
    """A small least-recently-used cache: dashboards revisit the same few settings."""

    def __init__(self, size: int):
        self.size = size
        self._d: OrderedDict = OrderedDict()

    def get(self, key, make):
        if key in self._d:
            self._d.move_to_end(key)
            return self._d[key]
        val = make()
        self._d[key] = val
        while len(self._d) > self.size:
            self._d.popitem(last=False)
        return val

    def clear(self):
        self._d.clear()


_CACHE = _LRU(24)


_FIGURES = _LRU(24)


def clear_cache():
    """Forget cached inputs, references, outputs and figures (frees their memory)."""
    _CACHE.clear()
    _FIGURES.clear()


def _figure(make, sources, *extra):
    """``make()``, memoised on the identity of ``sources`` (cached traces or outputs) and
    ``extra``: when a control leaves a figure's data alone, the same figure object comes
    back, and the dashboard skips redrawing it."""
    sources = sources if isinstance(sources, tuple) else (sources,)
    key = (tuple(id(s) for s in sources), *extra)
    srcs, fig = _FIGURES.get(key, lambda: (sources, make()))
    if any(a is not b for a, b in zip(srcs, sources)):  # an id reused after its object died
        fig = make()
        _FIGURES._d[key] = (sources, fig)
    return fig
