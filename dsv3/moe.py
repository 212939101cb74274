"""DeepSeekMoE (paper §2.1.2): the group-limited router with aux-loss-free bias balancing, shared experts,
routed experts as stacked weights run by one grouped GEMM, and the sequence-wise balance loss (§2.1.2, eq. 17-20).

Tokens reach the routed experts through a *dispatcher*, the one seam for distribution: `LocalDispatcher`
sorts this process's tokens by expert; `dsv3.parallel` hands in an all-to-all or a DeepEP one from `dsv3.dispatch`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from dsv3.config import ModelConfig
from dsv3.token_copies import Dispatcher, LocalDispatcher, TokenCopies


class Routing(NamedTuple):
    topk_idx: torch.Tensor  # [T, K] int64 expert ids
    topk_weights: torch.Tensor  # [T, K] fp32 gate weights g_i
    scores: torch.Tensor  # [T, E] fp32 unbiased affinities s_i


class Router(nn.Module):
    """s = σ(x·Wᵀ) (or softmax); selection on s + b; gate weights from the unbiased s."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.topk = cfg.n_activated_experts
        self.n_groups = cfg.n_expert_groups
        self.topk_groups = cfg.n_limited_groups
        self.score_func = cfg.score_func
        self.route_norm = cfg.route_norm
        self.route_scale = cfg.route_scale
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        # b: steers selection only, learned by the sign rule in `update_expert_bias`, never by gradients.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        # [T, E]: the GEMM in the model dtype (tensor cores, fp32 accumulation, no fp32 copy of x kept for
        # backward), as DeepSeek's reference; scores, selection and gate weights in fp32
        logits = F.linear(x, self.weight).float()
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        biased = scores.detach() + self.expert_bias  # [T, E]
        if self.n_groups > 1:
            grouped = biased.view(-1, self.n_groups, self.n_experts // self.n_groups)  # [T, G, E/G]
            group_scores = grouped.topk(min(2, grouped.size(-1)), dim=-1).values.sum(dim=-1)  # [T, G]
            top_groups = group_scores.topk(self.topk_groups, dim=-1).indices  # [T, G_lim]
            group_mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, False)
            # -inf, not 0: with a negative bias a 0-filled masked group could still win.
            biased = grouped.masked_fill(group_mask.unsqueeze(-1), float("-inf")).flatten(1)
        topk_idx = biased.topk(self.topk, dim=-1).indices  # [T, K]
        return Routing(topk_idx, self.gate_weights(scores, topk_idx), scores)

    def gate_weights(self, scores: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """g [T, K]: the unbiased s at the chosen experts, normalised over them (sigmoid routing), scaled."""
        topk_weights = scores.gather(1, topk_idx)
        if self.route_norm:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights * self.route_scale


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights; one grouped GEMM per projection, no loop over experts.
    A low precision swaps in a subclass whose `forward` runs them in its format (dsv3.lowp.quant), holding the same
    weight Parameters, and sets the dispatcher's `align` to the row groups its GEMMs need."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int):
        super().__init__()
        # gate (w1) and up (w3) fused so one grouped GEMM reads the tokens once
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter_dim))

    def forward(self, x: torch.Tensor | TokenCopies, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: the rows [N, dim] sorted by expert, or a dispatcher's `TokenCopies` (tokens and `order`) to gather
        them from; tokens_per_expert [E] on device (zeros allowed). Returns the rows' outputs [N, dim], or, with
        `weights`, each token's gate-weighted sum of its rows [T, dim]."""
        rows = x.gather() if isinstance(x, TokenCopies) else x  # [N, dim]
        w13, w2 = self.local_weights()
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)  # group ends, as _grouped_mm wants
        act = swiglu(grouped_mm(rows, w13.transpose(-2, -1), offsets))  # [N, 2I] → [N, I]
        out = grouped_mm(act, w2.transpose(-2, -1), offsets)  # [N, dim]
        return x.sum(out) if isinstance(x, TokenCopies) and x.weights is not None else out

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2); under expert parallelism this rank's slice of the stacks."""
        if isinstance(self.w13, DTensor):
            return self.w13.to_local(), self.w2.to_local()
        return self.w13, self.w2


def swiglu(gate_up: torch.Tensor, triton_backward: bool = True) -> torch.Tensor:
    """silu(gate) · up of gate_up = [gate | up] [N, 2I]. On CUDA (below fp64), with `triton_backward`, its
    backward is one Triton kernel (`dsv3.swiglu_kernel`), faster than inductor's
    (docs/performance.md#what-makes-it-fast)."""
    if triton_backward and gate_up.is_cuda and gate_up.dtype != torch.float64:
        import dsv3.swiglu_kernel  # noqa: F401  registers torch.ops.dsv3.swiglu_backward before any tracing of it

        return _SwiGLU.apply(gate_up)
    return _silu_gate_times_up(gate_up)


def _silu_gate_times_up(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    """`swiglu` whose backward is `dsv3.swiglu_kernel.swiglu_backward`."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _silu_gate_times_up(gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        return torch.ops.dsv3.swiglu_backward(gate_up, grad)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The bf16 (or fp32) routed-expert GEMM: x [N, K] rows grouped by expert, w [E, K, M] → [N, M]."""
    return torch._grouped_mm(x, w.to(x.dtype), offs=offsets)


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEOutput(NamedTuple):
    y: torch.Tensor  # [B, S, D]
    tokens_per_expert: torch.Tensor  # [E] int64, counted once per real forward
    balance_loss: torch.Tensor  # scalar, Σ_i f_i P_i averaged over sequences (α is applied by the trainer); 0 in eval


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.topk = cfg.n_activated_experts
        self.score_func = cfg.score_func
        self.gate = Router(cfg)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim)
        self.shared_experts = (MLP(cfg.dim, cfg.n_shared_experts * cfg.moe_inter_dim)
                               if cfg.n_shared_experts else None)
        self.dispatcher: Dispatcher = LocalDispatcher()  # replaced from outside for expert parallelism

    def forward(self, x: torch.Tensor) -> MoEOutput:
        B, S, D = x.shape
        x_flat = x.view(-1, D)
        routing = self.gate(x_flat)
        flat_idx = routing.topk_idx.flatten()
        tokens_per_expert = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        tokens_per_expert.scatter_add_(0, flat_idx, torch.ones_like(flat_idx))  # no host sync, unlike bincount
        started = self.dispatcher.start(routing.topk_idx, tokens_per_expert)  # EP: the split sizes' copy to the host
        shared = None
        if self.shared_experts is not None and self.dispatcher.shared_experts_first:
            # the GPU's work while the host waits for that copy
            shared, started = self.dispatcher.run_during_copy(self.shared_experts, x_flat, started)
        copies, local_tokens_per_expert, ctx = self.dispatcher.dispatch(
            x_flat, routing.topk_idx, routing.topk_weights, started)
        expert_y = self.experts(copies, local_tokens_per_expert)
        y = self.dispatcher.combine(expert_y, ctx)  # may still be arriving (DeepEP): the shared experts overlap it
        if self.shared_experts is not None and shared is None:
            shared = self.shared_experts(x_flat)
        y = self.dispatcher.wait(y)
        if shared is not None:
            y = y + shared
        if self.training:
            balance = sequence_balance_loss(routing.scores.view(B, S, -1), routing.topk_idx.view(B, S, -1), self.topk)
        else:  # only training minimises it
            balance = routing.scores.new_zeros(())
        # Counts are an output, not module state: activation-checkpoint recomputation cannot double them.
        return MoEOutput(y.view(B, S, D), tokens_per_expert, balance)


def sequence_balance_loss(scores: torch.Tensor, topk_idx: torch.Tensor, topk: int) -> torch.Tensor:
    """L_bal = Σ_i f_i P_i per sequence (eq. 17-20), mean over sequences.
    f_i = E/(K·T)·count_i, P_i = mean_t s'_i,t with s' = s normalised over experts per token."""
    B, T, E = scores.shape
    counts = torch.zeros(B, E, device=scores.device, dtype=scores.dtype)
    counts.scatter_add_(1, topk_idx.view(B, -1), torch.ones_like(topk_idx.view(B, -1), dtype=scores.dtype))
    f = counts * E / (topk * T)  # [B, E]
    p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)  # [B, E]
    return (f * p).sum(dim=-1).mean()


@torch.no_grad()
def update_expert_bias(routers: list[Router], tokens_per_expert: torch.Tensor, speed: float) -> None:
    """Aux-loss-free balancing (eq. 16 ff.): b_i += γ·sign(mean load − load_i), centred so that Σ_i b_i stays 0
    (docs/training.md#the-objective-and-the-optimizer says why). `tokens_per_expert` [n_routers, E] must already be
    summed over the global batch (all ranks)."""
    for router, load in zip(routers, tokens_per_expert.float(), strict=True):
        step = torch.sign(load.mean() - load)  # [E]
        router.expert_bias += speed * (step - step.mean())
