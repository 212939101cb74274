"""AdamW with its moments stored in BF16 (paper §3.3, "low-precision storage"), for `train.optimizer_state_dtype=bf16`.

Per parameter (its local shard under FSDP2), in fp32, with g = grad · grad_scale:
    θ ← θ·(1 − lr·λ);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
    θ ← θ − lr/(1−β1ᵗ) · m / (√v / √(1−β2ᵗ) + ε)
as torch.optim.AdamW. `grad_scale` folds gradient clipping into the step instead of a pass of its own over every
gradient. The moments are read as bf16, updated in fp32 and rounded back to bf16 *stochastically* (unbiased):
rounded to nearest, an update of v smaller than half a bf16 ulp (2⁻⁹ to 2⁻⁸ of v) would be lost every step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def round_to_bf16_stochastically(x: torch.Tensor) -> torch.Tensor:
    """fp32 → bf16, the magnitude rounded up with probability (its distance to the bf16 below) / ulp, so that
    E[result] = x: random 16 low bits are added to the fp32 bit pattern, then truncated away."""
    bits = x.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # -65536 = 0xFFFF0000


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 lr: torch.Tensor, weight_decay: float, beta1: float, beta2: float, eps: float,
                 bias_correction1: torch.Tensor, bias_correction2_sqrt: torch.Tensor,
                 grad_scale: torch.Tensor) -> None:
    """One AdamW step of one tensor, in place; fp32 math whatever the moments' dtype."""
    g = grad.float() * grad_scale
    m = exp_avg.float().lerp(g, 1 - beta1)
    v = torch.addcmul(exp_avg_sq.float() * beta2, g, g, value=1 - beta2)
    param.mul_(1 - lr * weight_decay)
    param.sub_(lr / bias_correction1 * m / (v.sqrt() / bias_correction2_sqrt + eps))
    if exp_avg.dtype == torch.bfloat16:
        exp_avg.copy_(round_to_bf16_stochastically(m))
        exp_avg_sq.copy_(round_to_bf16_stochastically(v))
    else:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


# On CUDA: one fused kernel per tensor (read θ, g, m, v once, write θ, m, v once); dynamic shapes, so every
# parameter shape shares one compiled kernel.
_adamw_update_cuda = torch.compile(adamw_update, dynamic=True)


def _moments_back_to_state_dtype(optimizer: AdamW) -> None:
    """Optimizer.load_state_dict casts every floating state to its parameter's dtype (fp32): undo it
    (exactly, the values were bf16)."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = state[key].to(optimizer.state_dtype)


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update with moments kept in `state_dtype` and an optional `grad_scale` for `step`."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, state_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype
        self.register_load_state_dict_post_hook(_moments_back_to_state_dtype)

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None) -> None:
        """`grad_scale` (a 0-d tensor, e.g. the clipping factor) multiplies every gradient inside the update."""
        if closure is not None:
            raise ValueError("dsv3.optim.AdamW takes no closure")
        scalars: dict = {}  # (lr, β1, β2, t, device) → (lr, 1 − β1ᵗ, √(1 − β2ᵗ)) on that device, made once
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["step"] += 1
                t = state["step"].item()
                param = _local(p)
                key = (group["lr"], beta1, beta2, t, param.device)
                if key not in scalars:  # tensors, not floats: a compiled update would recompile for every lr and t
                    values = [group["lr"], 1 - beta1 ** t, (1 - beta2 ** t) ** 0.5]
                    scale = torch.ones((), device=param.device) if grad_scale is None else grad_scale.to(param.device)
                    scalars[key] = (*torch.tensor(values, dtype=torch.float64).to(param.device).unbind(), scale)
                lr, bias_correction1, bias_correction2_sqrt, scale = scalars[key]
                update = _adamw_update_cuda if param.is_cuda else adamw_update
                update(param, _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), lr,
                       group["weight_decay"], beta1, beta2, group["eps"], bias_correction1, bias_correction2_sqrt,
                       scale)
