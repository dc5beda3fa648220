"""A small transformer trained under a policy: where a rescale policy first produces a
non-finite value when the attention logits grow.

``TinyTransformer`` is built in code (seeded random weights, nothing downloaded): token
and position embeddings, ``layers`` pre-norm blocks of causal self-attention (through
``torch.nn.functional.scaled_dot_product_attention``, in bf16, so that
``fa_lab.sdpa.patched`` routes it through fa_lab's kernels) and an MLP, then a tied
read-out. The model's own weights and arithmetic are fp32; only attention runs in bf16, as
under autocast.

The logit scale is a ``temperature`` buffer in every attention block that multiplies q
before SDPA: every score, hence every score spread, is ``temperature`` times the model's
own. ``train`` raises it geometrically from 1 to ``Config.scale`` over the run, as a stand-in
for the attention-logit growth that training meets (a temperature, or q/k norms that
grow), and records every non-finite event of the patched attention per step.

FlyDSL's policies (``lazy``, ``lazy_unfixed``, ...) run on the DUALWAVE_SWP model
(``kernel="swp_bf16"``); a copy's policy that no FlyDSL family runs (``primus-a6a16cdc``,
Primus-Turbo's fixed-max training forward) runs on the online-softmax model
(``kernel="online"``), the family that executes it (``kernel_for``).

The task is synthetic: a random token sequence of half the length, repeated; the loss is
next-token cross-entropy on the repeated half (a copy task an induction head solves).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fa_lab import sdpa, upstream


@dataclass(frozen=True)
class Config:
    """One training run. ``scale``: the logit scale reached at the last step (the
    temperature rises geometrically from 1); ``policy``: the rescale policy (a name);
    the rest sizes the model and the run. ``seq`` of 320 keys or more gives DUALWAVE_SWP
    KV tiles on which a lazy policy decides (tiles 1 .. N-4 of 64 keys)."""

    policy: str = "lazy_unfixed"
    scale: float = 32.0
    steps: int = 40
    seq: int = 384
    batch: int = 1
    vocab: int = 32
    d_model: int = 128
    heads: int = 2
    layers: int = 2
    lr: float = 3e-3
    seed: int = 0
    stop_at_nonfinite: bool = True

    def __post_init__(self):
        if self.d_model % self.heads or self.d_model // self.heads not in (64, 128):
            raise ValueError(f"d_model / heads = {self.d_model}/{self.heads}: fa_lab's kernels "
                             "take head dims 64 and 128")
        if self.seq % 2:
            raise ValueError(f"seq={self.seq} must be even (a sequence and its copy)")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"steps must be a positive int, got {self.steps!r}")
        if not self.scale >= 1:
            raise ValueError(f"scale must be >= 1 (the temperature rises from 1), got {self.scale}")

    def temperature(self, step: int) -> float:
        """The logit scale at ``step`` (0-based): 1 at the first step, ``scale`` at the last."""
        return self.scale ** (step / max(1, self.steps - 1))


LOG2E = 1.0 / math.log(2.0)


@torch.no_grad()
def score_stats(q: torch.Tensor, k: torch.Tensor) -> dict:
    """What one causal attention call's scores span, in log2 units (the kernel's:
    ``q.k / sqrt(D) * log2 e``, from the bf16 q and k in fp32; the kernel's own pre-scaled
    rounding is not applied): ``s_max`` the largest score of any row (the fixed max
    overflows once it reaches 128), ``best_min`` the smallest row maximum (a row whose
    maximum lies below -126 is a zero row under the fixed max), ``spread`` the largest
    row's max minus min over its visible keys. q, k: [B, H, S, D]."""
    S, D = q.shape[-2], q.shape[-1]
    s = (q.float() @ k.float().transpose(-1, -2)) * (LOG2E / math.sqrt(D))
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    hi = s.masked_fill(~causal, -math.inf).amax(-1)
    lo = s.masked_fill(~causal, math.inf).amin(-1)
    return {"s_max": float(hi.max()), "best_min": float(hi.min()),
            "spread": float((hi - lo).max())}


class Attention(nn.Module):
    """Causal self-attention through SDPA in bf16; q is multiplied by ``temperature``."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.register_buffer("temperature", torch.tensor(1.0))
        self.scores = None  # score_stats of the last forward

    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q = q * self.temperature
        qb, kb = q.bfloat16(), k.bfloat16()
        self.scores = score_stats(qb, kb)
        o = F.scaled_dot_product_attention(qb, kb, v.bfloat16(), is_causal=True)
        return self.out(o.float().transpose(1, 2).reshape(B, S, C))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Embeddings, ``layers`` blocks, a final norm and the tied read-out; seeded weights."""

    def __init__(self, cfg: Config):
        super().__init__()
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(cfg.seed)
            self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
            self.pos = nn.Embedding(cfg.seq, cfg.d_model)
            self.blocks = nn.ModuleList([Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers)])
            self.ln = nn.LayerNorm(cfg.d_model)
            for emb in (self.tok, self.pos):  # small embeddings: the tied read-out starts near uniform
                nn.init.normal_(emb.weight, std=0.02)

    def set_temperature(self, t: float) -> None:
        for b in self.blocks:
            b.attn.temperature.fill_(t)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.tok.weight.T


def kernel_for(policy: str) -> str:
    """The family a run under ``policy`` uses: the online-softmax model for a copy's
    policy (``upstream.COPY_POLICIES``), else DUALWAVE_SWP, the kernel FlyDSL trains with."""
    return "online" if policy in {p.name for p in upstream.COPY_POLICIES} else "swp_bf16"


def batch(cfg: Config, step: int) -> torch.Tensor:
    """The copy task's tokens for ``step``: [batch, seq], a random half repeated."""
    g = torch.Generator().manual_seed(cfg.seed * 100003 + step)
    half = torch.randint(cfg.vocab, (cfg.batch, cfg.seq // 2), generator=g)
    return torch.cat([half, half], 1)


def loss_fn(model: TinyTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the repeated half."""
    half = tokens.shape[1] // 2
    logits = model(tokens)[:, half - 1:-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, half:].reshape(-1))


def _event(e: sdpa.Event, cfg: Config) -> dict:
    d = asdict(e)
    d["rows"] = [list(r) for r in e.rows[:64]]
    d["n_rows"] = len(e.rows)
    d["temperature"] = cfg.temperature(e.step)
    return d


def train(cfg: Config, *, backend: str = "emulator", capture: bool = False) -> dict:
    """Train ``cfg``'s model under ``sdpa.patched(rescale=cfg.policy,
    kernel=kernel_for(cfg.policy))``.

    Returns the run: its config and kernel; ``losses`` per step; ``scores`` per step, one
    ``score_stats`` dict per layer (its forward's scores); ``first`` (the first non-finite
    event as a dict: step, call, module, phase, tensor, kind, rows, temperature; None if
    none), ``first_forward`` and ``first_backward``; ``events`` (all of them, rows cut at
    64 per event); ``step_s`` (mean seconds per step); with ``capture``, ``inputs``: each
    attention call's inputs (``sdpa.Recorder.inputs``). With
    ``cfg.stop_at_nonfinite`` the run stops after the step of the first event (its
    weights are poisoned from there)."""
    model = TinyTransformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    losses, scores, t0 = [], [], time.perf_counter()
    with sdpa.patched(rescale=cfg.policy, kernel=kernel_for(cfg.policy), backend=backend, model=model,
                      capture=capture) as rec:
        for step in range(cfg.steps):
            rec.step = step
            model.set_temperature(cfg.temperature(step))
            loss = loss_fn(model, batch(cfg, step))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            scores.append([b.attn.scores for b in model.blocks])
            if cfg.stop_at_nonfinite and rec.events:
                break
    steps_run = len(losses)
    out = {"config": asdict(cfg), "backend": backend, "kernel": kernel_for(cfg.policy),
           "steps_run": steps_run, "losses": losses, "scores": scores,
           "step_s": (time.perf_counter() - t0) / steps_run,
           "first": None, "first_forward": None, "first_backward": None,
           "events": [_event(e, cfg) for e in rec.events]}
    for key, phase in (("first", None), ("first_forward", "forward"), ("first_backward", "backward")):
        e = rec.first(phase)
        out[key] = None if e is None else _event(e, cfg)
    if capture:
        out["inputs"] = rec.inputs
    return out


def _finite_max(layers: list[dict]) -> float | None:
    """The largest finite ``s_max`` of a step's layers (a layer after a failing one reads
    NaN inputs), or None."""
    xs = [x["s_max"] for x in layers if math.isfinite(x["s_max"])]
    return max(xs) if xs else None


def first_nonfinite_table(runs: list[dict]) -> list[dict]:
    """One row per run: policy, scale, the first non-finite step (None if none), where
    (module, phase, tensor, kind, number of rows), the temperature it was reached at, the
    largest log2 score of any layer at that step (``s_max_at_first``) and at the last step
    run (``s_max_last``)."""
    rows = []
    for r in runs:
        f = r["first"]
        rows.append({"policy": r["config"]["policy"], "scale": r["config"]["scale"],
                     "steps": r["config"]["steps"], "steps_run": r["steps_run"],
                     "first_step": None if f is None else f["step"],
                     "module": None if f is None else f["module"],
                     "phase": None if f is None else f["phase"],
                     "tensor": None if f is None else f["tensor"],
                     "kind": None if f is None else f["kind"],
                     "n_rows": None if f is None else f["n_rows"],
                     "temperature": None if f is None else f["temperature"],
                     "s_max_at_first": None if f is None else _finite_max(r["scores"][f["step"]]),
                     "s_max_last": _finite_max(r["scores"][-1]),
                     "final_loss": r["losses"][-1] if r["losses"] else math.nan})
    return rows
