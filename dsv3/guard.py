"""The divergence guard: a run stops at the first non-finite or spiking loss or grad norm. train.Run judges each
step with it and confirms the checkpoints that healthy steps vouch for (dsv3.checkpoint.confirm, discard_after)."""

from __future__ import annotations

import math


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

