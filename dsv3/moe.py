"""DeepSeekMoE (paper §2.1.2): the group-limited router with aux-loss-free bias balancing, shared experts,
routed experts as stacked weights run by one grouped GEMM, and the sequence-wise balance loss (§2.1.2, eq. 17-20).

Tokens reach the routed experts through a *dispatcher*, the one seam for distribution: `LocalDispatcher`
sorts this process's tokens by expert; `dsv3.parallel` hands in an all-to-all or a DeepEP one from `dsv3.dispatch`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from dsv3.config import ModelConfig
from dsv3.hashing import STRIDE, mix32


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
        # set (a 0-d int64 seed): experts chosen uniformly at random instead (train.balanced_routing, for benchmarks)
        self.register_buffer("uniform_seed", None, persistent=False)

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
        if self.uniform_seed is None:
            topk_idx = biased.topk(self.topk, dim=-1).indices  # [T, K]
        else:
            topk_idx = uniform_topk(self.uniform_seed, x.size(0), self.n_experts, self.topk)
        topk_weights = scores.gather(1, topk_idx)  # unbiased s at the chosen experts
        if self.route_norm:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return Routing(topk_idx, topk_weights * self.route_scale, scores)


def uniform_topk(seed: torch.Tensor, n_tokens: int, n_experts: int, topk: int) -> torch.Tensor:
    """[T, K] expert ids, each token's a uniform random K-subset: the K largest of E random keys, a hash of (seed,
    token, expert). What balanced routing looks like to the exchange and the experts (every expert and EP rank gets
    its share, a token fans out over ranks as a learned router's would); a recompute routes as the forward did."""
    slot = torch.arange(n_tokens * n_experts, device=seed.device).view(n_tokens, n_experts)
    return mix32((slot * STRIDE + seed).int()).topk(topk, dim=-1).indices


class LocalDispatcher:
    """All experts live in this process: sort token copies by expert, and undo it after the experts.

    Interface shared by every dispatcher:
      dispatch(x [T, D], topk_idx [T, K], topk_weights [T, K], tokens_per_expert [E] of these tokens)
          -> (copies: `TokenCopies` of the experts' [N, D] rows, grouped by local expert,
              tokens_per_local_expert [E_local] int64, ctx)
      combine(expert_y, ctx) -> y [T, D] = Σ_k g_k · (the experts' row of token t's k-th copy). expert_y is what
          the experts return: the weighted sums per token where the copies carry `weights` (this dispatcher,
          DeepEP's), else their [N, D] rows
      wait(y) -> y, readable: combine may return while its exchange is still in flight (DeepEP), so that
          the shared experts overlap it; a no-op for the others
      align: every group of the copies starts at a multiple of it (`pad_order`); 1 = no padding, unless
          `pads_groups` says the device needs it.
    """

    def __init__(self, align: int = 1):
        self.align = align  # set by dsv3.quant for the low-precision grouped GEMMs

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 tokens_per_expert: torch.Tensor) -> tuple[TokenCopies, torch.Tensor, Any]:
        flat_idx = topk_idx.flatten()
        order = flat_idx.argsort(stable=True)  # token copies sorted by expert
        if pads_groups(self.align, x.device):
            order, tokens_per_expert = pad_order(order, flat_idx[order], tokens_per_expert, self.align)
        return TokenCopies(x, order, topk_idx.size(1), topk_weights), tokens_per_expert, None

    def combine(self, expert_y: torch.Tensor, ctx: Any) -> torch.Tensor:
        return expert_y  # the experts summed each token's rows (`TokenCopies.weights`)

    def wait(self, y: torch.Tensor) -> torch.Tensor:
        return y


def pads_groups(align: int, device: torch.device) -> bool:
    """Whether a dispatcher hands the experts `pad_order`'s buffer: for the low-precision grouped GEMMs (align > 1),
    and wherever groups without rows break the bf16 one."""
    return align > 1 or _empty_groups_break_grouped_mm(device)


@torch.compiler.assume_constant_result
def _empty_groups_break_grouped_mm(device: torch.device) -> bool:
    """torch's bf16 `_grouped_mm` on compute capability 10.x (B200) gives groups of no rows non-zero weight
    gradients (pytorch #172439); Hopper and the CPU give zeros."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10


def pad_order(order: torch.Tensor, expert_of_row: torch.Tensor, counts: torch.Tensor, align: int,
              bucket: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`order` [N] (the slot each row holds; rows sorted by expert: expert_of_row [N], counts [E]) laid out in a
    buffer in which every expert's group starts at a multiple of `align`, as the low-precision grouped GEMMs need,
    and holds at least `align` rows: an expert without tokens gets zero rows, whose weight gradient is exactly zero,
    where a group of no rows gets a non-zero one from the bf16 `_grouped_mm` on B200 (pytorch #172439). torchao pads
    empty groups to the alignment the same way. The dispatchers pad the order, not the rows: `gather_token_copies`
    (or the blockwise FP8 GEMM's quantization, `TokenCopies`) then fills the buffer in one gather, padding rows (−1)
    zero.

    The buffer has M = round_up(N + E·align, align) rows, the most padding E groups can need, so no count reaches
    the host; an expert-parallel rank that received no tokens (N = 0) still runs its grouped GEMMs on real rows:
    their backward rejects an empty input on CUDA.
    `bucket` rounds M further up to one of 16 sizes per octave (at most 1/16 more rows), for
    dispatchers whose N changes every step: kernels specialised or autotuned per row count then see few of them.
    The rows after the last group (on average half the E·align rows kept for padding) belong to no expert: the
    grouped GEMMs skip them, leaving their outputs and gradients unwritten, and nothing reads those (the combine
    and the gather's backward take only rows that hold a slot). Given to the last expert, they would be computed:
    about 3% more expert rows at 32 experts and align 128. (torchtitan's padded permutation ends its groups so too.)
    Returns (the padded order [M], −1 at padding rows; padded counts [E], summing to M or less).
    """
    n_experts = counts.numel()
    size = order.numel() + n_experts * align
    size = _bucketed(size, align) if bucket else -(-size // align) * align
    padded = (counts.clamp(min=1) + align - 1) // align * align  # [E], an empty group a block of `align` rows
    starts = padded.cumsum(0) - padded  # [E] group starts in the buffer
    shift = starts - (counts.cumsum(0) - counts)  # [E] how far each group moves down
    rows = torch.arange(order.numel(), device=order.device) + shift[expert_of_row]  # [N] buffer row of each row
    return order.new_full((size,), -1).index_copy(0, rows, order), padded


@torch.compiler.disable
def _bucketed(size: int, align: int) -> int:
    """`size` rounded up to one of 16 sizes per octave (and to `align`). Eager: under torch.compile the octave,
    `bit_length`, would pin the row count and recompile for every new one."""
    quantum = max(align, 1 << max(size.bit_length() - 5, 0))  # powers of two
    return -(-size // quantum) * quantum


class TokenCopies(NamedTuple):
    """What a dispatcher hands the experts: their input rows as source[order // topk] (−1: a zero row), not yet
    gathered. `GroupedExperts` gathers them (`gather_token_copies`), or, where its GEMM quantizes its input
    (blockwise FP8: the GEMM has `takes_token_copies`), hands them to the GEMM, which gathers them as it quantizes
    them. With `weights`, the experts return, instead of their rows, each token's weighted sum of its copies' rows
    (`sum`), which a GEMM that quantizes its output's gradient (blockwise FP8: `sums_token_copies`) does itself, so
    that its backward reads the rows' gradient from the tokens' as it quantizes it."""
    source: torch.Tensor  # [T, D]
    order: torch.Tensor  # [N] the slot (token, k) of each row, −1 for a padding row
    topk: int
    weights: torch.Tensor | None = None  # [T, K] the gate weight of each slot (junk where no row holds the slot)

    def gather(self) -> torch.Tensor:
        return gather_token_copies(self.source, self.order, self.topk)

    def sum(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, D] rows in `order` → [T, D] token rows, y_t = Σ_k g_t,k · (the row in slot (t, k))."""
        return combine_token_copies(rows, self.order, self.weights)


def gather_token_copies(x: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
    """x [T, D] → its token copies [N, D] in `order` (the flat (token, k) slot of each row, −1: a row of zeros, as
    `pad_order`'s padding), as x[order // topk]. Slots that `order` leaves out (under DeepEP: experts on other
    ranks) get no row. Backward, each token's gradient is the sum of its copies' rows, gathered (`_GatheredRows`)."""
    return _GatheredRows.apply(x, order, topk)


def row_of_slot(order: torch.Tensor, n_slots: int) -> torch.Tensor:
    """The inverse of `order` (the slot each row holds, e.g. a flat (token, k) one): for each of `n_slots` slots,
    the row that holds it, −1 where none does. Rows of slot −1 (padding) are written to a spare slot past the end,
    then dropped: scatter takes no mask."""
    rows = torch.full((n_slots + 1,), -1, dtype=order.dtype, device=order.device)
    slot = torch.where(order >= 0, order, n_slots)
    return rows.scatter(0, slot, torch.arange(order.numel(), device=order.device))[:n_slots]


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums of bf16 rows run in: fp32, and fp64 for fp64 rows (the tests' exact references)."""
    return torch.promote_types(dtype, torch.float32)


def _sum_rows_of_slots(rows: torch.Tensor, row_of_slot: torch.Tensor,
                       slot_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k rows[row_of_slot[:, k]] (· slot_weights[:, k]) per token [T, D], summed in fp32 (fp64 rows: fp64) and
    returned in the rows' dtype; slots without a row (−1) add nothing. K gathers summed elementwise: one pointwise
    kernel under inductor, where a sum over a [T, K, D] gather is a reduction over K that it tiles into blocks of a
    few dozen outputs. An empty slot reads row 0 and is then deselected, not multiplied by 0: a non-finite row 0
    stays its own token's."""
    # the K columns by unbind, not range(row_of_slot.size(1)): traced inside a checkpoint, torch 2.11's dynamo
    # returns every intermediate of an autograd.Function's forward, and fails (AssertionError) on that size
    weights = slot_weights.unbind(1) if slot_weights is not None else [None] * row_of_slot.size(1)
    total = 0
    for row, weight in zip(row_of_slot.unbind(1), weights):
        term = rows[row.clamp(min=0)].to(_at_least_fp32(rows.dtype))
        if weight is not None:
            term = term * weight[:, None]
        total = total + torch.where((row >= 0)[:, None], term, 0.0)
    return total.to(rows.dtype)


class _GatheredRows(torch.autograd.Function):
    """x[order // K]. Autograd's backward of an index scatters the [N, D] gradient back with atomic adds into a zero
    buffer, in bf16; here each token gathers its K rows instead (`row_of_slot`) and sums them in fp32 (fp64 rows:
    fp64): one kernel, no atomics, no zero fill, deterministic."""

    @staticmethod
    def forward(ctx, x, order, topk):
        ctx.save_for_backward(order)
        ctx.topk, ctx.n_tokens = topk, x.size(0)
        if not x.size(0):  # an expert-parallel rank that received no tokens: padding rows only
            return x.new_zeros(order.numel(), x.size(1))
        return torch.where((order >= 0).unsqueeze(-1), x[order // topk], 0)  # slot −1 reads row −1, deselected

    @staticmethod
    def backward(ctx, grad_rows):
        (order,) = ctx.saved_tensors
        return sum_token_copies(grad_rows, order, ctx.topk, ctx.n_tokens), None, None


def sum_token_copies(grad_rows: torch.Tensor, order: torch.Tensor, topk: int, n_tokens: int) -> torch.Tensor:
    """The gradient of `gather_token_copies` [T, D]: each token's is the sum of its copies' rows' [N, D]."""
    if not grad_rows.size(0):  # no row was gathered (EP: a rank that received no tokens): nothing to sum
        return grad_rows.new_zeros(n_tokens, grad_rows.size(1))
    rows_of_token = row_of_slot(order, n_tokens * topk).view(-1, topk)  # [T, K]
    return _sum_rows_of_slots(grad_rows, rows_of_token)


def combine_token_copies(rows: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Undo the sort by expert and reduce each token's copies: y_t = Σ_k g_t,k · (the row in slot (t, k)).

    rows [N, D]; order [N]: the flat (token, k) slot of each row, −1 for a padding row (which gets no gradient);
    topk_weights [T, K]. Slots that hold no row (under DeepEP: experts on other ranks, whose weights are junk)
    count as zero. T = 0 (EP: a rank that received no tokens) takes padding rows only, or none."""
    rows_of_token = row_of_slot(order, topk_weights.numel()).view(topk_weights.shape)
    return _WeightedRowSum.apply(rows, topk_weights, rows_of_token, order)


class _WeightedRowSum(torch.autograd.Function):
    """combine_token_copies (not twice differentiable). Both directions are gathers, which inductor fuses with the
    weighting into one kernel each: the [T·K, D] token copies are never written out (a scatter back to token
    order would be), and each row's gradient is its one slot's g_t,k · ∂y_t. Elementwise, not bmm: a [1, K] ×
    [K, D] batched GEMM with K = 6 runs on a slow unaligned kernel."""

    @staticmethod
    def forward(ctx, rows, weights, row_of_slot, slot_of_row):
        y, slot_weights = weighted_row_sum(rows, weights, row_of_slot)
        ctx.save_for_backward(rows, slot_weights, row_of_slot, slot_of_row)
        ctx.weights_dtype = weights.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        rows, slot_weights, row_of_slot, slot_of_row = ctx.saved_tensors
        if not grad_y.size(0):  # no tokens (EP: a rank that received none): the rows, padding only, get none
            return torch.zeros_like(rows), grad_y.new_zeros(row_of_slot.shape, dtype=ctx.weights_dtype), None, None
        K = row_of_slot.size(1)
        grad_y_of_row = grad_y[slot_of_row // K]  # [N, D]; a padding row (slot −1) reads the last slot's
        grad_rows = torch.where((slot_of_row >= 0).unsqueeze(-1),
                                grad_y_of_row * slot_weights.flatten()[slot_of_row].unsqueeze(-1), 0)
        # ∂g_t,k = ⟨∂y_t, row⟩, reduced row by row in the rows' order, beside grad_rows (one kernel reads both)
        wide = _at_least_fp32(rows.dtype)
        grad_weight_of_row = (grad_y_of_row.to(wide) * rows.to(wide)).sum(dim=-1)  # [N]
        return grad_rows, slot_gradients(grad_weight_of_row, row_of_slot, ctx.weights_dtype), None, None


def weighted_row_sum(rows: torch.Tensor, weights: torch.Tensor, row_of_slot: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t = Σ_k g_t,k · rows[row_of_slot[t, k]] [T, D], and the slots' weights [T, K] in the rows' dtype that it
    multiplied (0 where no row holds the slot: the junk weights of other ranks' experts under DeepEP)."""
    slot_weights = torch.where(row_of_slot >= 0, weights, 0.0).to(rows.dtype)
    return _sum_rows_of_slots(rows, row_of_slot, slot_weights), slot_weights


def slot_gradients(grad_of_row: torch.Tensor, row_of_slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-row values [N] (∂g = ⟨∂y_t, row⟩) → the slots' [T, K] in `dtype`, 0 where no row holds the slot."""
    return torch.where(row_of_slot >= 0, grad_of_row[row_of_slot.clamp(min=0)], 0.0).to(dtype)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights; one grouped GEMM per projection, no loop over experts."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int):
        super().__init__()
        # gate (w1) and up (w3) fused so one grouped GEMM reads the tokens once
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter_dim))
        # (x [N, K], w [E, K, M] a transposed view of a contiguous [E, M, K] stack, group ends [E] int32) → [N, M]
        # (one with `sums_token_copies` also takes `sum_copies=` and returns its [T, M] token sums); dsv3.quant swaps
        # in a low-precision one (and sets the dispatcher's `align` to what it needs)
        self.grouped_mm = grouped_mm
        # name → that GEMM's own FP8 form of the weight, where something keeps it up to date (one GPU: the optimizer,
        # dsv3.optim.ComputeCopies), passed to the GEMM after the weight; empty: the GEMM quantizes the weights itself
        self.weight_blocks: dict[str, tuple[torch.Tensor, ...]] = {}

    def forward(self, x: torch.Tensor | TokenCopies, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [N, dim] sorted by expert, or a dispatcher's `TokenCopies` of such rows; tokens_per_expert [E] on
        device (zeros allowed). Returns [N, dim] rows, or, for copies with `weights`, [T, dim] token sums."""
        copies = x if isinstance(x, TokenCopies) and x.weights is not None else None
        if isinstance(x, TokenCopies) and not getattr(self.grouped_mm, "takes_token_copies", False):
            x = x.gather()
        w13, w2 = self.w13, self.w2
        if isinstance(w13, DTensor):  # expert parallelism: compute with this rank's slice of the stacks
            w13, w2 = w13.to_local(), w2.to_local()
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)  # group ends, as _grouped_mm wants
        blocks = self.weight_blocks
        gate_up = self.grouped_mm(x, w13.transpose(-2, -1), offsets, *blocks.get("w13", ()))  # [N, 2I]
        # a GEMM whose row quantization inductor fuses into SwiGLU's backward keeps that backward plain ops
        triton_backward = not getattr(self.grouped_mm, "quantizes_in_inductor", False)
        act = swiglu(gate_up, triton_backward)
        if copies is not None and getattr(self.grouped_mm, "sums_token_copies", False):
            return self.grouped_mm(act, w2.transpose(-2, -1), offsets, *blocks.get("w2", ()), sum_copies=copies)
        rows = self.grouped_mm(act, w2.transpose(-2, -1), offsets, *blocks.get("w2", ()))  # [N, dim]
        return rows if copies is None else copies.sum(rows)


def swiglu(gate_up: torch.Tensor, triton_backward: bool = True) -> torch.Tensor:
    """silu(gate) · up of gate_up = [gate | up] [N, 2I]. On CUDA (below fp64), with `triton_backward`, its
    backward is one Triton kernel (`dsv3.swiglu_kernel`), where inductor's ran at under half the bandwidth in the
    step."""
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
        self.dispatcher = LocalDispatcher()  # replaced from outside for expert parallelism

    def forward(self, x: torch.Tensor) -> MoEOutput:
        B, S, D = x.shape
        x_flat = x.view(-1, D)
        routing = self.gate(x_flat)
        flat_idx = routing.topk_idx.flatten()
        tokens_per_expert = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        tokens_per_expert.scatter_add_(0, flat_idx, torch.ones_like(flat_idx))  # no host sync, unlike bincount
        copies, local_tokens_per_expert, ctx = self.dispatcher.dispatch(
            x_flat, routing.topk_idx, routing.topk_weights, tokens_per_expert)
        expert_y = self.experts(copies, local_tokens_per_expert)
        y = self.dispatcher.combine(expert_y, ctx)  # may still be arriving: the shared experts overlap it
        shared = self.shared_experts(x_flat) if self.shared_experts is not None else None
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
    """Aux-loss-free balancing (eq. 16 ff.): b_i += γ·sign(mean load − load_i), after the optimizer step, centred
    over the layer's experts (as torchtitan does) so that Σ_i b_i stays 0. Uncentred, the biases' mean drifts by
    γ·(#under − #over)/E per step: no selection changes (top-k of s + b is shift-invariant), but over a long run the
    biases grow far past the scores s ∈ [0, 1] they are added to, and those fp32 sums lose resolution.
    `tokens_per_expert` [n_routers, E] must already be summed over the global batch (all ranks)."""
    for router, load in zip(routers, tokens_per_expert.float(), strict=True):
        step = torch.sign(load.mean() - load)  # [E]
        router.expert_bias += speed * (step - step.mean())
