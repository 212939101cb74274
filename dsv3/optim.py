"""AdamW with its moments in fp32 or BF16 (paper §3.3, "low-precision storage"), and the bf16 compute copies a
one-rank run trains through instead of FSDP2's mixed precision.

Per parameter (its local shard under FSDP2), in fp32, with g = grad · grad_scale:
    θ ← θ·(1 − lr·λ);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
    θ ← θ − lr/(1−β1ᵗ) · m / (√v / √(1−β2ᵗ) + ε)
as torch.optim.AdamW. `grad_scale` folds gradient clipping into the step instead of a pass of its own over every
gradient. BF16 moments are read as bf16, updated in fp32 and rounded back to bf16 *stochastically* (unbiased):
rounded to nearest, an update of v smaller than half a bf16 ulp (2⁻⁹ to 2⁻⁸ of v) would be lost every step.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dsv3.hashing import STRIDE, mix32, random_bits
from dsv3.parallel import to_device


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _flat_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard as a 1-D view: updates write through, and parameters of one size share a compiled kernel
    whatever their shape."""
    return _local(t).view(-1)


def rounding_salt(index: int, param: torch.Tensor) -> int:
    """What `adamw_update` adds to the step's seed for this tensor: its `index` among the optimizer's parameters,
    hashed, plus its shard's global offset, so that tensors and shards draw unrelated rounding noise and a tensor
    rounds the same way however it is sharded (docs/training.md#the-objective-and-the-optimizer)."""
    offset = 0
    if isinstance(param, DTensor):
        first = param.__create_chunk_list__()[0].offsets  # this shard's first element, as DCP finds it
        offset = sum(o * math.prod(param.shape[d + 1:]) for d, o in enumerate(first))
    return (int(mix32(torch.tensor(index, dtype=torch.int32))) + offset * STRIDE) % 2**32


def round_to_bf16_stochastically(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 → bf16, the magnitude rounded up with probability (its distance to the bf16 below) / ulp, so that
    E[result] = x: `noise`, uniform in [0, 2¹⁶), is added to the fp32 bit pattern, whose 16 low bits are then
    truncated away."""
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # -65536 = 0xFFFF0000


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step_size: torch.Tensor, decay: torch.Tensor, beta1: float, beta2: float, eps: float,
                 bias_correction2_sqrt: torch.Tensor, grad_scale: torch.Tensor, seed: torch.Tensor, salt: torch.Tensor,
                 compute_copy: torch.Tensor | None = None) -> None:
    """One AdamW step of one tensor, in place, in fp32 whatever the moments' dtype; the step's scalars are fp32 tensors
    made on the host (`AdamW.step`): step_size = lr/(1−β1ᵗ), decay = 1 − lr·λ, √(1−β2ᵗ). `seed` and `salt`
    (`rounding_salt`) seed the stochastic rounding; `compute_copy`, if given, receives the new θ in its dtype."""
    g = grad.float() * grad_scale
    m = exp_avg.float().lerp(g, 1 - beta1)
    v = torch.addcmul(exp_avg_sq.float() * beta2, g, g, value=1 - beta2)
    param.mul_(decay)
    param.sub_(step_size * m / (v.sqrt() / bias_correction2_sqrt + eps))
    if compute_copy is not None:
        compute_copy.copy_(param)
    if exp_avg.dtype == torch.bfloat16:
        bits = random_bits(m, seed + salt)  # one hash for both moments: 16 bits each
        exp_avg.copy_(round_to_bf16_stochastically(m, bits & 0xFFFF))
        exp_avg_sq.copy_(round_to_bf16_stochastically(v, (bits >> 16) & 0xFFFF))
    else:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


# On CUDA: one fused kernel per tensor, compiled for its size (a static size gets aligned, vectorised loads).
# A model has a kernel per distinct size: `AdamW.step` raises dynamo's limit of 8 compiled variants per function
# to _COMPILED_VARIANTS; past it, a size runs eagerly.
_adamw_update_cuda = torch.compile(adamw_update, dynamic=False)
_COMPILED_VARIANTS = 64


class ComputeCopies:
    """FSDP2's mixed precision for the parameters FSDP does not shard (one rank: all; ep == world: the routed experts):
    inside `active()` the model computes with `dtype` copies the optimizer's update writes, outside it holds its fp32
    parameters. Write those in place under `torch.no_grad()`, never via `p.data` (docs/training.md#compute-copies)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype,
                 own_copy: Callable[[nn.Module, str, nn.Parameter], Any] | None = None,
                 params: Iterable[nn.Parameter] | None = None, grad_divisor: int = 1):
        chosen = set(params) if params is not None else None
        self.slots = [(module, name, p) for module in model.modules() for name, p in module._parameters.items()
                      if p is not None and (chosen is None or p in chosen)]
        self.grad_divisor = grad_divisor
        owns = {p: own_copy(module, name, p) for module, name, p in self.slots} if own_copy is not None else {}
        self.own_of = {p: own for p, own in owns.items() if own is not None}
        self.copy_of = {p: nn.Parameter(torch.zeros((), dtype=dtype, device=p.device).expand(p.shape)
                                        if p in self.own_of else torch.empty_like(_local(p), dtype=dtype),
                                        requires_grad=p.requires_grad)
                        for _, _, p in self.slots}
        self._written_at: dict[nn.Parameter, tuple[int, int, int]] = {}  # p → `_stamp(p)` at the write
        self._accumulate = False
        self._fp32_grad: dict[nn.Parameter, torch.Tensor] = {}  # p → its copies' gradients summed, when accumulating
        for p, copy in self.copy_of.items():
            if copy.requires_grad:
                copy.register_post_accumulate_grad_hook(functools.partial(self._on_grad, p))

    @staticmethod
    def _stamp(p: nn.Parameter) -> tuple[int, int, int]:
        # a DTensor's own version and pointer miss writes into its shard: its local tensor's count too
        return p._version, _local(p)._version, _local(p).data_ptr()

    @contextlib.contextmanager
    def active(self, accumulate: bool = False) -> Iterator[None]:
        """Compute with the copies inside (forward and backward: an activation-checkpointed block recomputes with
        them). `accumulate`: sum the gradients in fp32 on the parameters, instead of leaving bf16 ones on the copies."""
        with torch.no_grad():
            for p, copy in self.copy_of.items():
                if self._written_at.get(p) != self._stamp(p):
                    if p in self.own_of:
                        self.own_of[p].write(p.to(copy.dtype))
                    else:
                        copy.copy_(_local(p))
                    self._written_at[p] = self._stamp(p)
        for module, name, p in self.slots:
            module._parameters[name] = self.copy_of[p]
        self._accumulate = accumulate
        try:
            yield
        finally:
            self._accumulate = False
            for module, name, p in self.slots:
                module._parameters[name] = p

    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter, copy: nn.Parameter) -> None:
        if self._accumulate:  # divided in fp32, as FSDP's fp32 reduction does
            grad = copy.grad.float().div_(self.grad_divisor)
            total = self._fp32_grad.get(p)
            self._fp32_grad[p] = grad if total is None else total.add_(grad)
            copy.grad = None
        elif self.grad_divisor != 1:
            copy.grad.div_(self.grad_divisor)

    def grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """`p`'s gradient: its fp32 sum over micro-batches when they were accumulated, else its own where something
        set one (a parameter without a copy; DCP's zero gradients when it initialises the optimizer state), else its
        copy's (this rank's shard, for a DTensor)."""
        total = self._fp32_grad.get(p)
        if total is not None or p.grad is not None or p not in self.copy_of:
            return total if total is not None else p.grad
        return self.copy_of[p].grad

    def updates(self, params: Iterable[nn.Parameter]
                ) -> Iterator[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]]:
        """(weight, gradient, copy or None) of each of `params` that has a gradient, for an update that writes the
        weight and its copy in one pass; a copy counts as written once the update of the next one is asked for."""
        for p in params:
            grad = self.grad(p)
            if grad is not None:
                yield p, grad, self.copy_of.get(p)
                if p in self.copy_of:
                    self._written_at[p] = self._stamp(p)

    def zero_grad(self) -> None:
        self._fp32_grad.clear()
        for copy in self.copy_of.values():
            copy.grad = None


def _moments_back_to_state_dtype(optimizer: AdamW) -> None:
    """Optimizer.load_state_dict casts every floating state to its parameter's dtype (fp32): undo it
    (exactly, the values were bf16)."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = state[key].to(optimizer.state_dtype)


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update with moments kept in `state_dtype` and an optional `grad_scale` for `step`;
    with `compute_copies`, it reads their gradients and writes them the new weights in the same pass."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, state_dtype: torch.dtype = torch.bfloat16,
                 compute_copies: ComputeCopies | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype
        self.compute_copies = compute_copies
        params = [p for group in self.param_groups for p in group["params"]]
        self.salts = {p: torch.tensor(rounding_salt(i, p), device=_flat_local(p).device) for i, p in enumerate(params)}
        self.register_load_state_dict_post_hook(_moments_back_to_state_dtype)

    def _updates(self, params: list[nn.Parameter]) -> Iterable[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]]:
        """(weight, gradient, compute copy or None) of each parameter with a gradient."""
        if self.compute_copies is not None:
            return self.compute_copies.updates(params)
        return ((p, p.grad, None) for p in params if p.grad is not None)

    def grads(self) -> list[torch.Tensor]:
        """The gradients the next `step` applies."""
        copies = self.compute_copies
        grads = [p.grad if copies is None else copies.grad(p) for group in self.param_groups for p in group["params"]]
        return [g for g in grads if g is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.compute_copies is not None:
            self.compute_copies.zero_grad()

    @torch.no_grad()
    @torch._dynamo.config.patch(recompile_limit=_COMPILED_VARIANTS)
    def step(self, closure=None, grad_scale: torch.Tensor | None = None) -> None:
        """`grad_scale` (a 0-d tensor, e.g. the clipping factor) multiplies every gradient inside the update."""
        if closure is not None:
            raise ValueError("dsv3.optim.AdamW takes no closure")
        # (lr, λ, β1, β2, t, device) → (step_size, decay, √(1 − β2ᵗ), scale, seed) there, made once. Tensors, not
        # floats: a compiled update would recompile for every lr and t. Computed in doubles and rounded to fp32 once,
        # as torch.optim.AdamW's Python scalars are: no fp64 arithmetic per element, which slowed the fused update.
        scalars: dict = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, weight_decay = group["lr"], group["weight_decay"]
            for p, grad, copy in self._updates(group["params"]):
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["step"] += 1
                t = state["step"].item()
                param = _flat_local(p)
                key = (lr, weight_decay, beta1, beta2, t, param.device)
                if key not in scalars:
                    values = [lr / (1 - beta1 ** t), 1 - lr * weight_decay, (1 - beta2 ** t) ** 0.5]
                    scale = (torch.ones((), device=param.device) if grad_scale is None
                             else grad_scale.to(param.device))
                    seed = to_device(torch.tensor(int(t) * 0x2545F491 % 2**31), param.device)  # new rounding each step
                    values = to_device(torch.tensor(values, dtype=torch.float32), param.device)
                    scalars[key] = (*values.unbind(), scale, seed)
                step_size, decay, bias_correction2_sqrt, scale, seed = scalars[key]
                own = self.compute_copies.own_of.get(p) if self.compute_copies is not None else None
                if own is not None:
                    own.adamw_update(p, grad, state["exp_avg"], state["exp_avg_sq"], step_size, decay, beta1, beta2,
                                     group["eps"], bias_correction2_sqrt, scale, seed, self.salts[p])
                    continue
                update = _adamw_update_cuda if param.is_cuda else adamw_update
                update(param, _flat_local(grad), _flat_local(state["exp_avg"]), _flat_local(state["exp_avg_sq"]),
                       step_size, decay, beta1, beta2, group["eps"], bias_correction2_sqrt, scale, seed, self.salts[p],
                       None if copy is None else copy.view(-1))
