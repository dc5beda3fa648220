"""Static export of a figure to PNG through kaleido."""

from __future__ import annotations

import warnings
from pathlib import Path

import plotly.graph_objects as go



_SCOPE = None


def _kaleido_scope():
    """kaleido 0.2.1's scope, pointed at plotly's own plotly.js (it would fetch one from a
    CDN otherwise; plotly >= 6's write_image wants kaleido >= 1, which this repo pins out)."""
    global _SCOPE
    if _SCOPE is None:
        try:
            from kaleido.scopes.plotly import PlotlyScope
        except ImportError as e:  # pragma: no cover - kaleido is a dev dependency
            raise ImportError("to_png needs kaleido 0.2.1 (pip install 'kaleido==0.2.1')") from e
        import plotly
        js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
        _SCOPE = PlotlyScope(plotlyjs=str(js))
    return _SCOPE


def to_png(fig: go.Figure, path, *, width: int | None = None, height: int | None = None,
           scale: float = 1.0) -> Path:
    """Write ``fig`` as a PNG at ``path`` (written beside it, then renamed into place)."""
    if not isinstance(fig, go.Figure):
        raise TypeError(f"fig must be a plotly Figure, got {type(fig).__name__}")
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"path must end in .png, got {str(path)!r}")
    width = width or fig.layout.width or 1000
    height = height or fig.layout.height or 500
    with warnings.catch_warnings():  # kaleido 0.2.1 starts its thread the old way
        warnings.simplefilter("ignore", DeprecationWarning)
        png = _kaleido_scope().transform(fig, format="png", width=width, height=height,
                                         scale=scale)
    from fa_lab.results import atomic_write_bytes
    return atomic_write_bytes(path, png)
