"""The divergence guard and checkpoint confirmation: a run stops at the first non-finite or spiking loss or grad
norm, and a checkpoint is confirmed only once the step after it is seen healthy, so a diverged run falls back to
weights that trained well (dsv3.checkpoint keeps, confirms and moves aside)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dsv3 import checkpoint


class DivergenceGuard:
    """Stops a run whose loss or gradient norm jumps to more than its factor × its running mean (an exponential
    moving average over the healthy steps seen, judged once `warmup` of them are in); a factor 0 turns that
    check off. A NaN or inf in any value always stops it."""

    def __init__(self, loss_factor: float, grad_norm_factor: float, warmup: int = 5, decay: float = 0.9):
        self.factors = {"loss": loss_factor, "grad_norm": grad_norm_factor}
        self.warmup, self.decay = warmup, decay
        self.seen = 0
        self.means: dict[str, float] = {}

    def check(self, step: int, values: dict[str, float]) -> str | None:
        """Why `values` of `step` are unhealthy, or None (then they join the running means)."""
        for name, value in values.items():
            if not math.isfinite(value):
                return f"{name} is {value} at step {step}"
        if self.seen >= self.warmup:
            for name, factor in self.factors.items():
                if factor and values[name] > factor * self.means[name]:
                    return (f"{name} spiked to {values[name]:.4g} at step {step}, over "
                            f"train.{name}_spike_factor={factor:g} × its running mean {self.means[name]:.4g}")
        for name in self.factors:
            mean = self.means.get(name, values[name])
            self.means[name] = self.decay * mean + (1 - self.decay) * values[name]
        self.seen += 1
        return None

    def state_dict(self) -> dict[str, float]:
        """What a resumed run needs to judge its first steps as this one would have (fixed keys, for DCP)."""
        return {"seen": self.seen} | {name: self.means.get(name, 0.0) for name in self.factors}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.seen = int(state["seen"])
        self.means = {name: float(state[name]) for name in self.factors} if self.seen else {}


class Health:
    """Steps' values wait on the device (`add`) until `flush`, one host sync for all of them, judges them in order
    with `guard`: a bad step raises FloatingPointError after moving aside the checkpoints it cannot vouch for; a good
    one confirms the checkpoints saved before it (`saved`)."""

    def __init__(self, guard: DivergenceGuard, run_dir: Path, keep: int):
        self.guard, self.run_dir, self.keep = guard, run_dir, keep
        self.pending: list[tuple[int, torch.Tensor]] = []  # (step, [main, mtp, bal, gnorm] on device): no sync yet
        self.unconfirmed: list[int] = []  # saved checkpoints whose next step has not been seen healthy yet

    def add(self, step: int, values: torch.Tensor) -> None:
        self.pending.append((step, values))

    def saved(self, step: int) -> None:
        self.unconfirmed.append(step)

    def flush(self) -> list[float] | None:
        """Judge the steps since the last flush; the last one's values, or None when there were none."""
        values = torch.stack([v for _, v in self.pending]).tolist() if self.pending else []
        for (step, _), row in zip(self.pending, values):
            problem = self.guard.check(step, dict(zip(("loss", "mtp_loss", "balance_loss", "grad_norm"), row)))
            if problem:  # the weights after step s-1 produced step s's values: only those up to s-2 are vouched for
                kept = checkpoint.discard_after(self.run_dir, step - 2)
                again = (f"the newest left is {kept}: --resume from it" if kept else
                         "no checkpoint from before it is left: start the run again without --resume")
                raise FloatingPointError(f"{problem}; newer checkpoints were moved aside (*.diverged), {again}, e.g. "
                                         "with a lower --train.lr")
            while self.unconfirmed and self.unconfirmed[0] < step:
                checkpoint.confirm(self.run_dir, self.unconfirmed.pop(0), self.keep)
        self.pending.clear()
        return values[-1] if values else None
