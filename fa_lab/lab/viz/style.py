"""The colours, symbols and fixed axis ranges the lab's figures share: one per policy
(``fa_lab.policies``'s own colour), per implementation and per event."""

from __future__ import annotations



from fa_lab import policies


#: Colours of labels that are not registered policies (a policy's colour is its own,
#: ``fa_lab.policies``): the fp8 tables' variant labels and other output sets.
LABEL_COLORS = {
    "monotonic": policies.color("lazy"),     # the fp8 table's name for the fixed rule
    "unfixed": policies.color("lazy_unfixed"),
    "bound 8": "#b79ddf",
    "bound 16": "#7b4fb8",
    "bound 32": "#3f1d78",
    "fp8": "#ff7f0e",           # orange: any fp8 output set beside bf16 ones
    "reference": "#444444",
}


#: Colour for names that are neither policies nor in LABEL_COLORS.
OTHER_COLOR = "#8c8c8c"


#: One colour per benchmarked implementation (``fa_lab.studies.bench``'s ``impl`` names): a fast
#: kernel takes its policy's colour, so a policy looks the same in a timing chart as in an
#: accuracy one; split-K and varlen variants are shades of the fixed lazy kernel's blue.
IMPL_COLORS = {
    "fast_lazy": policies.color("lazy"),
    "fast_eager": policies.color("eager"),
    "fast_lazy_unfixed": policies.color("lazy_unfixed"),
    "fast_fp8_lazy": LABEL_COLORS["fp8"],
    "fast_fp8_eager": "#fdbf6f",
    "fast_fp8_lazy_vt": "#d95f02",
    "faithful_lazy": "#08306b",
    "fast_lazy_split2": "#6baed6",
    "fast_lazy_split4": "#4292c6",
    "fast_lazy_split8": "#2171b5",
    "fast_lazy_varlen": "#9ecae1",
    "sdpa_flash": "#393b79",
    "sdpa_cudnn": "#9c9ede",
    "flex": "#637939",
}


#: Marker symbols per policy, so that curves lying on top of each other stay apart
#: (the fixed lazy and the eager rescale agree closely).
POLICY_SYMBOLS = {
    "eager": "circle", "lazy": "diamond", "monotonic": "diamond", "lazy_unfixed": "square",
    "unfixed": "square", "lazy_capped": "triangle-up", "bound 8": "triangle-down",
    "bound 16": "triangle-up", "bound 32": "triangle-left", "fp8": "cross",
    "reference": "circle",
}


#: The fp8 seed table names its rows by policy and bound; the tables here by variant label.
_FP8_SEED_LABEL = {"lazy_unfixed": "unfixed", "lazy": "monotonic", "eager": "eager"}


NONFINITE_COLOR = "#000000"


#: Trace values a heatmap can show: column -> label.
TRACE_VALUES = {
    "m": "running max m",
    "mt": "tile max",
    "deficit": "deficit: true running max - m",
    "l": "log2(l)",
    "corr": "log2(corr)",
    "vote": "row voted",
    "fire": "wave fired",
    "swept": "row swept",
    "o_finite": "O finite",
    "l_finite": "l finite",
}


#: The 0/1 trace values, drawn in two colours: (colour of 0, colour of 1, label of 0, of 1).
_FLAG_COLORS = {
    "vote": ("#eeeeee", "#ff7f0e", "no", "voted"),
    "fire": ("#eeeeee", "#555555", "no", "fired"),
    "swept": ("#eeeeee", "#ff2d2d", "no", "swept"),
    "o_finite": ("#111111", "#eeeeee", "not finite", "finite"),
    "l_finite": ("#111111", "#eeeeee", "not finite", "finite"),
}


#: Colour ranges that do not move with the data (a slider move keeps the colour bar):
#: fp32 overflows once a deficit or log2(l) nears 128.
FIXED_RANGES = {"deficit": (0.0, 128.0), "l": (0.0, 128.0), "corr": (-128.0, 128.0)}


#: Colours of the mechanism's events, the same in every figure. A swept row is drawn by
#: what its policy did to it (``tracedata.SWEEP_OUTCOMES``): a drag in the colour of the
#: sweep itself, the fix's harmless sweep in grey.
EVENT_COLORS = {"vote": "#ff7f0e", "fire": "#555555", "swept": "#ff2d2d",
                "dragged": "#ff2d2d", "left_alone": "#7f7f7f", "rebased_up": "#9467bd",
                "true_max": "#000000", "deficit": "#8c564b", "l": "#2ca02c", "corr": "#ff7f0e"}


def policy_color(name) -> str:
    """The colour of a policy: a ``Policy``'s own (a variant a view runs keeps its
    policy's), a registered name's, or a label's (``LABEL_COLORS``; grey for others)."""
    if isinstance(name, policies.Policy):
        return policies.color(name) or LABEL_COLORS.get(name.name, OTHER_COLOR)
    return policies.color(str(name)) or LABEL_COLORS.get(str(name), OTHER_COLOR)


def impl_color(name: str) -> str:
    """The colour of a benchmarked implementation (``IMPL_COLORS``), else of a policy or
    label (``policy_color``)."""
    return IMPL_COLORS.get(str(name)) or policy_color(name)


def policy_symbol(name: str, hollow: bool = False) -> str:
    """The marker symbol of a policy or variant name; ``hollow`` for the seed's points."""
    sym = POLICY_SYMBOLS.get(str(name), "circle")
    return f"{sym}-open" if hollow else sym


def _policy_line(name: str) -> dict:
    return dict(color=policy_color(name), dash="dash" if name in ("lazy", "monotonic") else None)
