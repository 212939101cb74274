"""Token copies: the rows the routed experts compute on, one copy of a token per expert its router chose, sorted by
expert for the grouped GEMMs, and the way back to the tokens. The words, used throughout:

    tokens       x [T, D], token t (under expert parallelism: what this rank received)
    slots        (t, k) = t·K + k, token t's k-th routed expert [T·K]; g_t,k its gate weight, topk_weights [T, K]
    rows         [N, D] the copies sorted by expert, each expert's group perhaps padded to `align` (`pad_order`)
    order        [N] the slot each row holds, −1 = a padding row (read as zeros, given no gradient)
    row_of_slot  [T, K] its inverse: the row holding each slot (a token's K rows), −1 where no row does

A dispatcher hands the experts `TokenCopies` (x and `order`); they gather the rows (`gather_token_copies`) and sum
them back per token with the gate weights (`combine_token_copies`), both backwards gathers where autograd would
scatter (docs/performance.md#the-routed-experts-token-copies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch


class Dispatcher(Protocol):
    """How a MoE layer's tokens reach its routed experts and come back: `LocalDispatcher` here, dsv3.dispatch's
    `AllToAllDispatcher` and `DeepEPDispatcher` for expert parallelism."""

    align: int  # every group of the copies starts at a multiple of it (`pad_order`); set by dsv3.lowp.quant
    shared_experts_first: bool  # before the dispatch, the GPU's work while the host waits for the split sizes; else
    # after the combine (under DeepEP's, in flight)

    def start(self, topk_idx: torch.Tensor, tokens_per_expert: torch.Tensor) -> Any:
        """What `dispatch` needs of the routing alone (topk_idx [T, K], tokens_per_expert [E]), begun early."""

    def run_during_copy(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                        started: Any) -> tuple[torch.Tensor, Any]:
        """With `shared_experts_first`: (fn(x), `started` for `dispatch`), fn's work queued while the split sizes
        travel to the host."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 started: Any) -> tuple[TokenCopies, torch.Tensor, Any]:
        """x [T, D], topk_idx/topk_weights [T, K], what `start` returned → (the experts' input rows grouped by local
        expert, tokens_per_local_expert [E_local] int64, what `combine` needs)."""

    def combine(self, expert_y: torch.Tensor, ctx: Any) -> torch.Tensor:
        """What the experts returned (their [N, D] rows, or, where the copies carry `weights`, the weighted sums per
        token they made) → y [T, D] = Σ_k g_k · FFN_k(x_t), perhaps still arriving (`wait`)."""

    def wait(self, y: torch.Tensor) -> torch.Tensor:
        """y, readable: a combine may return before its exchange ends, so that the shared experts overlap it."""


class LocalDispatcher:
    """All experts live in this process: sort token copies by expert, and undo it after the experts."""

    shared_experts_first = False

    def __init__(self, align: int = 1):
        self.align = align  # set by dsv3.lowp.quant for the low-precision grouped GEMMs

    def start(self, topk_idx: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return tokens_per_expert

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 tokens_per_expert: torch.Tensor) -> tuple[TokenCopies, torch.Tensor, Any]:
        flat_idx = topk_idx.flatten()  # [T·K] the expert of each slot
        order = argsort_small(flat_idx)  # [N = T·K] slots sorted by expert
        if pads_groups(self.align, x.device):
            order, tokens_per_expert = pad_order(order, flat_idx[order], tokens_per_expert, self.align)
        return TokenCopies(x, order, topk_idx.size(1), topk_weights), tokens_per_expert, None

    def combine(self, expert_y: torch.Tensor, ctx: Any) -> torch.Tensor:
        return expert_y  # the experts summed each token's rows (`TokenCopies.weights`)

    def wait(self, y: torch.Tensor) -> torch.Tensor:
        return y


def argsort_small(keys: torch.Tensor) -> torch.Tensor:
    """The stable argsort of `keys`, ids in [0, 2¹⁵) (experts, ranks): sorted as int16, so that CUDA's radix sort makes
    two passes over them where int64 keys took eight."""
    return keys.to(torch.int16).argsort(stable=True)


def pads_groups(align: int, device: torch.device) -> bool:
    """Whether a dispatcher hands the experts `pad_order`'s buffer: for the low-precision grouped GEMMs (align > 1),
    and wherever groups without rows break the bf16 one."""
    return align > 1 or _empty_groups_break_grouped_mm(device)


@torch.compiler.assume_constant_result  # pytorch #172439: drop when the B200 grouped GEMM zeroes empty groups
def _empty_groups_break_grouped_mm(device: torch.device) -> bool:
    """torch's bf16 `_grouped_mm` on compute capability 10.x (B200) gives groups of no rows non-zero weight
    gradients (pytorch #172439); Hopper and the CPU give zeros."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10


def pad_order(order: torch.Tensor, expert_of_row: torch.Tensor, counts: torch.Tensor, align: int,
              bucket: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`order` [N] (rows sorted by expert: expert_of_row [N], counts [E]) → (the `order` [M] of a buffer whose every
    group starts at a multiple of `align` and holds at least `align` rows, as the low-precision grouped GEMMs need;
    the padded counts [E]). M depends on N and E alone, so no count reaches the host (docs/performance.md)."""
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
    """What a dispatcher hands the experts: the rows source[order // topk], not yet gathered, so that a GEMM may gather
    them as it quantizes them (`lowp.quant.Fp8BlockwiseExperts`). With `weights`, the experts return each token's
    weighted sum of its rows (`sum`) instead of the rows."""
    source: torch.Tensor  # [T, D] the tokens
    order: torch.Tensor  # [N] the slot each row holds, −1 for a padding row
    topk: int  # K
    weights: torch.Tensor | None = None  # [T, K] the gate weight of each slot (junk where no row holds the slot)
    received: bool = False  # source is what an expert-parallel exchange received: on CUDA the gather, the sums and
    # the combine's backward run as hand-written kernels (dsv3.token_copies_kernels says why)

    def gather(self) -> torch.Tensor:
        return gather_token_copies(self.source, self.order, self.topk, self.received)

    def sum(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, D] in `order` → y [T, D], y_t = Σ_k g_t,k · (the row in slot (t, k))."""
        return combine_token_copies(rows, self.order, self.weights, self.received)


def gather_token_copies(x: torch.Tensor, order: torch.Tensor, topk: int, received: bool = False) -> torch.Tensor:
    """x [T, D] → the rows [N, D] in `order`, x[order // topk] (padding rows zero); slots `order` leaves out (DeepEP:
    experts on other ranks) get none. Backward, each token's gradient sums its rows', gathered (`_GatheredRows`).
    `received`: see `TokenCopies`."""
    return _GatheredRows.apply(x, order, topk, _by_kernels(received, x))


def _by_kernels(received: bool, x: torch.Tensor) -> bool:
    """Whether the token copies of `x` run through dsv3.token_copies_kernels: received tokens on CUDA, below fp64."""
    if received and x.is_cuda and x.dtype != torch.float64:
        import dsv3.token_copies_kernels  # noqa: F401  registers its torch.ops.dsv3 ops before any tracing of them

        return True
    return False


def row_of_slot(order: torch.Tensor, n_slots: int) -> torch.Tensor:
    """The inverse of `order`: for each of `n_slots` slots, the row that holds it, −1 where none does. Padding rows
    are written to a spare slot past the end, then dropped: scatter takes no mask."""
    rows = torch.full((n_slots + 1,), -1, dtype=order.dtype, device=order.device)
    slot = torch.where(order >= 0, order, n_slots)
    return rows.scatter(0, slot, torch.arange(order.numel(), device=order.device))[:n_slots]


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums of bf16 rows run in: fp32, and fp64 for fp64 rows (the tests' exact references)."""
    return torch.promote_types(dtype, torch.float32)


def _sum_rows_of_slots(rows: torch.Tensor, row_of_slot: torch.Tensor, slot_weights: torch.Tensor | None = None,
                       by_kernel: bool = False) -> torch.Tensor:
    """Σ_k rows[row_of_slot[:, k]] (· slot_weights[:, k]) [T, D], summed in fp32 (fp64 rows: fp64), in the rows'
    dtype; slots without a row (−1) add nothing. K gathers summed elementwise, one pointwise kernel under inductor
    (docs/performance.md#the-routed-experts-token-copies); `by_kernel`: dsv3.token_copies_kernels' (`_by_kernels`)."""
    if by_kernel:
        return torch.ops.dsv3.sum_rows(rows, row_of_slot, slot_weights)
    # torch<2.14: the K columns by unbind, not range(row_of_slot.size(1)): traced inside a checkpoint, torch 2.11's
    # dynamo returns every intermediate of an autograd.Function's forward, and fails (AssertionError) on that size
    weights = slot_weights.unbind(1) if slot_weights is not None else [None] * row_of_slot.size(1)
    total = 0
    for row, weight in zip(row_of_slot.unbind(1), weights):
        term = rows[row.clamp(min=0)].to(_at_least_fp32(rows.dtype))
        if weight is not None:
            term = term * weight[:, None]
        total = total + torch.where((row >= 0)[:, None], term, 0.0)  # not × 0: the row 0 an empty slot read may be inf
    return total.to(rows.dtype)


class _GatheredRows(torch.autograd.Function):
    """x[order // K], whose backward gathers each token's K rows (`row_of_slot`) and sums them in fp32 where autograd's
    would scatter them with atomic adds in bf16: one kernel, no zero fill, deterministic."""

    @staticmethod
    def forward(ctx, x, order, topk, by_kernel):
        ctx.save_for_backward(order)
        ctx.topk, ctx.n_tokens, ctx.by_kernel = topk, x.size(0), by_kernel
        if not x.size(0):  # an expert-parallel rank that received no tokens: padding rows only
            return x.new_zeros(order.numel(), x.size(1))
        if by_kernel:
            return torch.ops.dsv3.gather_rows(x, order, topk)
        return torch.where((order >= 0).unsqueeze(-1), x[order // topk], 0)  # slot −1 reads row −1, deselected

    @staticmethod
    def backward(ctx, grad_rows):
        (order,) = ctx.saved_tensors
        return _sum_of_rows(grad_rows, order, ctx.topk, ctx.n_tokens, ctx.by_kernel), None, None, None


def sum_token_copies(rows: torch.Tensor, order: torch.Tensor, topk: int, n_tokens: int,
                     received: bool = False) -> torch.Tensor:
    """rows [N, D] in `order` → [T, D], each token's sum of its rows (the gradient of `gather_token_copies`, and its
    inverse: its backward gathers). `received`: the rows are what an exchange received (see `TokenCopies`)."""
    return _SummedRows.apply(rows, order, topk, n_tokens, _by_kernels(received, rows))


def _sum_of_rows(rows: torch.Tensor, order: torch.Tensor, topk: int, n_tokens: int,
                 by_kernel: bool = False) -> torch.Tensor:
    if not rows.size(0):  # no row was gathered (EP: a rank that received no tokens): nothing to sum
        return rows.new_zeros(n_tokens, rows.size(1))
    rows_of_token = row_of_slot(order, n_tokens * topk).view(-1, topk)  # [T, K]
    return _sum_rows_of_slots(rows, rows_of_token, by_kernel=by_kernel)


class _SummedRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, order, topk, n_tokens, by_kernel):
        ctx.save_for_backward(order)
        ctx.topk, ctx.by_kernel = topk, by_kernel
        return _sum_of_rows(rows, order, topk, n_tokens, by_kernel)

    @staticmethod
    def backward(ctx, grad_y):
        (order,) = ctx.saved_tensors
        return _GatheredRows.apply(grad_y, order, ctx.topk, ctx.by_kernel), None, None, None, None


def combine_token_copies(rows: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
                         received: bool = False) -> torch.Tensor:
    """rows [N, D] in `order` → y [T, D], y_t = Σ_k g_t,k · (the row in slot (t, k)), g = topk_weights [T, K]. Slots
    no row holds (DeepEP: experts on other ranks, whose weights are junk) count as zero; T may be 0 (EP: a rank that
    received no tokens, its rows padding only, or none). `received`: see `TokenCopies`."""
    rows_of_token = row_of_slot(order, topk_weights.numel()).view(topk_weights.shape)
    return _WeightedRowSum.apply(rows, topk_weights, rows_of_token, order, _by_kernels(received, rows))


class _WeightedRowSum(torch.autograd.Function):
    """combine_token_copies (not twice differentiable): both directions gathers, which inductor fuses with the
    weighting into one kernel each (docs/performance.md#the-routed-experts-token-copies)."""

    @staticmethod
    def forward(ctx, rows, weights, row_of_slot, order, by_kernel):
        y, slot_weights = weighted_row_sum(rows, weights, row_of_slot, by_kernel)
        ctx.save_for_backward(rows, slot_weights, row_of_slot, order)
        ctx.weights_dtype, ctx.by_kernel = weights.dtype, by_kernel
        return y

    @staticmethod
    def backward(ctx, grad_y):
        rows, slot_weights, row_of_slot, order = ctx.saved_tensors
        if not grad_y.size(0):  # no tokens (EP: a rank that received none): the rows, padding only, get none
            return (torch.zeros_like(rows), grad_y.new_zeros(row_of_slot.shape, dtype=ctx.weights_dtype), None, None,
                    None)
        if ctx.by_kernel:
            grad_rows, grad_weight_of_row = torch.ops.dsv3.combine_rows_backward(grad_y, rows, slot_weights, order)
            return grad_rows, slot_gradients(grad_weight_of_row, row_of_slot, ctx.weights_dtype), None, None, None
        K = row_of_slot.size(1)
        grad_y_of_row = grad_y[order // K]  # [N, D]; a padding row (slot −1) reads the last slot's
        grad_rows = torch.where((order >= 0).unsqueeze(-1),
                                grad_y_of_row * slot_weights.flatten()[order].unsqueeze(-1), 0)
        # ∂g_t,k = ⟨∂y_t, row⟩, reduced row by row in the rows' order, beside grad_rows (one kernel reads both)
        wide = _at_least_fp32(rows.dtype)
        grad_weight_of_row = (grad_y_of_row.to(wide) * rows.to(wide)).sum(dim=-1)  # [N]
        return grad_rows, slot_gradients(grad_weight_of_row, row_of_slot, ctx.weights_dtype), None, None, None


def weighted_row_sum(rows: torch.Tensor, weights: torch.Tensor, row_of_slot: torch.Tensor, by_kernel: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t = Σ_k g_t,k · rows[row_of_slot[t, k]] [T, D], and the slots' weights [T, K] in the rows' dtype that it
    multiplied (0 where no row holds the slot: the junk weights of other ranks' experts under DeepEP)."""
    slot_weights = torch.where(row_of_slot >= 0, weights, 0.0).to(rows.dtype)
    return _sum_rows_of_slots(rows, row_of_slot, slot_weights, by_kernel), slot_weights


def slot_gradients(grad_of_row: torch.Tensor, row_of_slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-row values [N] (∂g = ⟨∂y_t, row⟩) → the slots' [T, K] in `dtype`, 0 where no row holds the slot."""
    return torch.where(row_of_slot >= 0, grad_of_row[row_of_slot.clamp(min=0)], 0.0).to(dtype)
