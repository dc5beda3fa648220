"""How much rescale work a policy does: counted over every wave of a run.

A ``RescaleCounter`` stands where a ``TraceRecorder`` would (the models call it once per
step with every row's state) and counts, over the main loop's (wave, tile) steps, how
often the wave's O multiply runs (eager: always; a lazy policy: when its ballot fired,
which is also when FA4's warp-uniform skip does not apply), how many rows were swept (their
wave fired while their tile max sat below their base: harmless under the fix) and how many
were scaled *up* (corr > 1, the unfixed rebase's signature: a swept row dragged down).
"""

from __future__ import annotations


from fa_lab.kernels._common.geometry import WAVE_ROWS


class RescaleCounter:
    """Pass as ``recorder`` to a model's forward; read ``summary()`` afterwards."""

    active = True

    def __init__(self, policy):
        self.eager = not policy.lazy
        self.wave_steps = 0
        self.o_multiplies = 0
        self.row_steps = 0
        self.rows_swept = 0
        self.rows_scaled_up = 0

    def bind_group(self, rows):
        pass

    def finish_group(self, out, lse):
        pass

    def record(self, step, col0, phase, *, m, mt, vote, fire, swept, corr, l, O):
        if phase != "loop":
            return
        waves = fire.reshape(*fire.shape[:-1], -1, WAVE_ROWS)[..., 0]
        self.wave_steps += waves.numel()
        self.o_multiplies += waves.numel() if self.eager else int(waves.sum())
        self.row_steps += fire.numel()
        self.rows_swept += int(swept.sum())
        self.rows_scaled_up += int((corr > 1).sum())

    def summary(self) -> dict:
        n = max(self.wave_steps, 1)
        return {
            "loop_wave_steps": self.wave_steps,
            "o_multiplies": self.o_multiplies,
            "o_rescale_skip_frac": 1.0 - self.o_multiplies / n,
            "rows_swept": self.rows_swept,
            "rows_scaled_up": self.rows_scaled_up,
            "row_steps": self.row_steps,
        }
