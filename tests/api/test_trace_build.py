"""``TraceRecorder.build`` joins its recorded chunks column by column into one frame; the
result must be the frame built chunk by chunk (one DataFrame per chunk, joined by pandas),
dtypes included, for every model that records a trace."""

import numpy as np
import pandas as pd
import pytest

import fa_lab
from fa_lab.studies.experiments import bf16_inputs, fp8_inputs
from fa_lab.trace import STEP_FIELDS, TraceRecorder


def chunk_by_chunk(chunks) -> pd.DataFrame:
    """The frame one DataFrame per chunk at a time, joined by pandas."""
    frames = []
    for c in chunks:
        n = len(c["lane"])
        d = {"lane": c["lane"], "step": [c["step"]] * n, "col0": [c["col0"]] * n,
             "phase": [c["phase"]] * n}
        d.update({k: c[k] for k in STEP_FIELDS})
        frames.append(pd.DataFrame(d))
    return pd.concat(frames, ignore_index=True)


@pytest.fixture
def recorded(monkeypatch):
    """The recorders that ``fa_lab.trace`` builds traces from, as it builds them."""
    seen = []
    build = TraceRecorder.build

    def spy(self, **kw):
        seen.append(self)
        return build(self, **kw)

    monkeypatch.setattr(TraceRecorder, "build", spy)
    return seen


def _calls():
    q, k, v = bf16_inputs(1, 300, 2, 128, 48.0, seed=1)
    q64, k64, v64 = bf16_inputs(1, 400, 1, 64, 8.0, seed=2)
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 300, 1, 5000.0, seed=0)
    fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    return {
        "bf16": ((q, k, v), dict(rows=range(250, 290), rescale="lazy_unfixed")),
        "bf16 causal, two heads": ((q, k, v), dict(rows=[(0, 1, 7), (0, 0, 299)], causal=True)),
        "bf16 D=64": ((q64, k64, v64), dict(rows=range(0, 40), rescale="eager")),
        "generic kernel": ((q64, k64, v64), dict(rows=range(0, 40), kernel="generic")),
        "fp8": ((q8, k8, v8), dict(rows=range(0, 33), rescale="lazy_unfixed", **fp8)),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_build_joins_columns_as_pandas_joins_frames(recorded, name):
    (q, k, v), kw = _calls()[name]
    tr = fa_lab.trace(q, k, v, backend="emulator", **kw)
    (rec,) = recorded
    assert rec._chunks
    fast = rec._steps_frame()
    pd.testing.assert_frame_equal(fast, chunk_by_chunk(rec._chunks))
    assert len(tr.steps) == len(fast)


def test_mixed_chunks_are_joined_by_pandas():
    """Chunks whose types differ (a float field in one, a bool field in another) take the
    frame-by-frame path, so pandas's rules decide the dtypes, as they always did."""
    rec = TraceRecorder([(0, 0, 0), (0, 0, 1)], group_size=1)
    vals = {k: np.zeros(2, np.float32) for k in STEP_FIELDS}
    rec.add_steps([0, 1], 0, 0, "tile", vals)
    rec.add_steps([0, 1], 1, 64, "tile", dict(vals, vote=np.array([True, False])))
    pd.testing.assert_frame_equal(rec._steps_frame(), chunk_by_chunk(rec._chunks))
    assert rec._steps_frame()["vote"].tolist() == [0, 0, 1, 0]


def test_no_chunks_no_rows():
    rec = TraceRecorder([(0, 0, 0)], group_size=1)
    assert list(rec._steps_frame().columns) == ["lane", "step", "col0", "phase", *STEP_FIELDS]
    assert len(rec._steps_frame()) == 0
