"""The traced mode of a faithful port, host side: which rows the kernel records and how its
per-step buffer becomes the recorder's records (``fa_lab.trace``).

The kernel gets a slot per distinct traced (batch, head, row), -1 for every other row,
and writes ``STEP_FIELDS`` (as fp32, booleans 0/1) for step s of slot i at
``buf[i, s]`` (the device side is ``faithful.record_step``). What a step is differs between
kernels, so the caller passes ``schedule``: for a traced row, its steps in order as
(first KV column, phase) pairs, exactly as that kernel's model records them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from fa_lab.trace import STEP_FIELDS, TraceRecorder

N_FIELDS = len(STEP_FIELDS)
_BOOL_FIELDS = {"vote", "fire", "swept", "o_finite", "l_finite"}

Key = tuple[int, int, int]  # (batch, head, query row)
Schedule = tuple[tuple[int, str], ...]  # ((col0, phase), ...) one per step


class TracePlan:
    """``slots`` [B, H, Sq] int32 and ``buf`` [slots, n_steps, N_FIELDS] fp32 for the
    kernel; ``emit`` hands the filled buffer to the recorder."""

    def __init__(self, recorder: TraceRecorder, shape_bhs: tuple[int, int, int],
                 schedule: Callable[[Key], Schedule], device):
        B, H, Sq = shape_bhs
        self.recorder = recorder
        keys = sorted(set(recorder.triples))
        for (b, h, s) in keys:
            if not (0 <= b < B and 0 <= h < H and 0 <= s < Sq):
                raise ValueError(f"recorder: traced row (batch {b}, head {h}, row {s}) is out of range")
        self.slot_of = {key: i for i, key in enumerate(keys)}
        self.schedule = {key: tuple(schedule(key)) for key in keys}
        self.n_steps = max([len(s) for s in self.schedule.values()] + [1])
        slots = torch.full((B, H, Sq), -1, dtype=torch.int32)
        for key, i in self.slot_of.items():
            slots[key] = i
        self.slots = slots.to(device)
        self.buf = torch.full((max(1, len(keys)), self.n_steps, N_FIELDS), float("nan"),
                              dtype=torch.float32, device=device)

    def emit(self, out: torch.Tensor, lse: torch.Tensor):
        """Record every traced lane's steps and its final output row and LSE
        (out [B, Sq, H, D], lse [B, H, Sq])."""
        rec = self.recorder
        buf = self.buf.cpu().numpy()
        by_schedule: dict[Schedule, list[int]] = {}
        for lane, key in enumerate(rec.triples):
            by_schedule.setdefault(self.schedule[key], []).append(lane)
        for sched, lanes in by_schedule.items():
            idx = np.array([self.slot_of[rec.triples[lane]] for lane in lanes])
            for step, (col0, phase) in enumerate(sched):
                vals = buf[idx, step]  # [lanes, fields]
                values = {name: (vals[:, f] != 0) if name in _BOOL_FIELDS else vals[:, f]
                          for f, name in enumerate(STEP_FIELDS)}
                rec.add_steps(lanes, step, col0, phase, values)
        out_cpu = out.float().cpu()
        lse_cpu = lse.cpu()
        for lane, (b, h, s) in enumerate(rec.triples):
            rec.set_final(lane, out_cpu[b, s, h].numpy(), float(lse_cpu[b, h, s]))
