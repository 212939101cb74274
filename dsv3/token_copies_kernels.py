"""Three of the token copies' kernels by hand, for tokens that an expert-parallel exchange received
(`token_copies.TokenCopies.received`). There inductor can fuse the gather with nothing that made the tokens, and
it sees the row count as an unbacked size, so its kernels index in int64, mask every element and are tuned for a
small default size (docs/performance.md#the-routed-experts-token-copies):

    gather_rows             rows[n] = x[order[n] // K], 0 for a padding row (order[n] = −1)
    combine_rows_backward   from ∂y [T, D], the rows [N, D] and the slots' gate weights [T·K]:
                            ∂rows[n] = g_slot · ∂y_t and ∂g_slot = ⟨∂y_t, rows[n]⟩ (fp32), t = slot // K,
                            one pass that reads ∂y_t and the row once for both
    sum_rows                y_t = Σ_k (g_t,k ·) rows[row_of_slot[t, k]] in fp32, slots without a row adding nothing:
                            the experts' weighted sum of a token's rows; unweighted, the gather's backward and
                            the combine's sum over ranks

Imported only on CUDA: it needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GATHER_ROWS, GATHER_COLS = 64, 128  # the block of [N, D] one gather program copies
COMBINE_ROWS, COMBINE_COLS = 8, 512  # the rows one backward program takes, and the columns of each step along D
SUM_ROWS, SUM_COLS = 16, 256  # the block of [T, D] one sum program writes
WARPS = 4


@triton.jit
def _gather_rows_kernel(x_ptr, order_ptr, out_ptr, N, D: tl.constexpr, TOPK: tl.constexpr, ROWS: tl.constexpr,
                        COLS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    in_rows, in_cols = rows < N, cols < D
    slot = tl.load(order_ptr + rows, mask=in_rows, other=-1)
    held = slot >= 0
    token = tl.where(held, slot // TOPK, 0).to(tl.int64)
    values = tl.load(x_ptr + token[:, None] * D + cols[None, :], mask=held[:, None] & in_cols[None, :], other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], values,
             mask=in_rows[:, None] & in_cols[None, :])


@torch.library.custom_op("dsv3::gather_rows", mutates_args=())
def gather_rows(x: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
    """x [T, D] (T > 0), order [N] → rows [N, D], rows[n] = x[order[n] // topk], zeros where order[n] < 0."""
    x, order = x.contiguous(), order.contiguous()
    n, dim = order.numel(), x.size(1)
    out = torch.empty(n, dim, dtype=x.dtype, device=x.device)
    if n:
        grid = (triton.cdiv(n, GATHER_ROWS), triton.cdiv(dim, GATHER_COLS))
        _gather_rows_kernel[grid](x, order, out, n, D=dim, TOPK=topk, ROWS=GATHER_ROWS, COLS=GATHER_COLS,
                                  num_warps=WARPS)
    return out


@gather_rows.register_fake
def _(x: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
    return x.new_empty(order.numel(), x.size(1))


@triton.jit
def _combine_rows_backward_kernel(grad_y_ptr, rows_ptr, slot_weights_ptr, order_ptr, grad_rows_ptr,
                                  grad_weight_ptr, N, D: tl.constexpr, TOPK: tl.constexpr, ROWS: tl.constexpr,
                                  COLS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < N
    slot = tl.load(order_ptr + rows, mask=in_rows, other=-1)
    held = slot >= 0
    token = tl.where(held, slot // TOPK, 0).to(tl.int64)
    weight = tl.load(slot_weights_ptr + slot, mask=held, other=0.0).to(tl.float32)  # in the rows' dtype
    row_at = rows.to(tl.int64)[:, None] * D
    dot = tl.zeros([ROWS], dtype=tl.float32)
    for start in range(0, D, COLS):
        cols = start + tl.arange(0, COLS)
        in_cols = cols < D
        grad = tl.load(grad_y_ptr + token[:, None] * D + cols[None, :], mask=held[:, None] & in_cols[None, :],
                       other=0.0).to(tl.float32)
        row = tl.load(rows_ptr + row_at + cols[None, :], mask=in_rows[:, None] & in_cols[None, :],
                      other=0.0).to(tl.float32)
        tl.store(grad_rows_ptr + row_at + cols[None, :], (grad * weight[:, None]).to(grad_rows_ptr.dtype.element_ty),
                 mask=in_rows[:, None] & in_cols[None, :])
        dot += tl.sum(grad * row, axis=1)
    tl.store(grad_weight_ptr + rows, dot, mask=in_rows)


@torch.library.custom_op("dsv3::combine_rows_backward", mutates_args=())
def combine_rows_backward(grad_y: torch.Tensor, rows: torch.Tensor, slot_weights: torch.Tensor,
                          order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of y_t = Σ_k g_t,k · rows[row of slot (t, k)]: grad_y [T, D] (T > 0), rows [N, D] in `order`
    [N], slot_weights [T, K] in the rows' dtype → (∂rows [N, D], zero for padding rows; ⟨∂y_t, row⟩ [N] fp32 per
    row, zero for padding rows)."""
    grad_y, rows, order = grad_y.contiguous(), rows.contiguous(), order.contiguous()
    slot_weights = slot_weights.contiguous()
    n, dim = rows.shape
    grad_rows = torch.empty_like(rows)
    grad_weight = torch.empty(n, dtype=torch.float32, device=rows.device)
    if n:
        _combine_rows_backward_kernel[(triton.cdiv(n, COMBINE_ROWS),)](
            grad_y, rows, slot_weights, order, grad_rows, grad_weight, n, D=dim, TOPK=slot_weights.size(1),
            ROWS=COMBINE_ROWS, COLS=COMBINE_COLS, num_warps=WARPS)
    return grad_rows, grad_weight


@combine_rows_backward.register_fake
def _(grad_y: torch.Tensor, rows: torch.Tensor, slot_weights: torch.Tensor,
      order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(rows, memory_format=torch.contiguous_format), rows.new_empty(rows.size(0),
                                                                                        dtype=torch.float32)


@triton.jit
def _sum_rows_kernel(rows_ptr, row_of_slot_ptr, slot_weights_ptr, out_ptr, T, D: tl.constexpr, TOPK: tl.constexpr,
                     WEIGHTED: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    in_tokens, in_cols = tokens < T, cols < D
    total = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for k in tl.static_range(TOPK):  # in k's order, as the torch op sums
        row = tl.load(row_of_slot_ptr + tokens * TOPK + k, mask=in_tokens, other=-1)
        held = row >= 0
        term = tl.load(rows_ptr + tl.where(held, row, 0).to(tl.int64)[:, None] * D + cols[None, :],
                       mask=held[:, None] & in_cols[None, :], other=0.0).to(tl.float32)
        if WEIGHTED:
            weight = tl.load(slot_weights_ptr + tokens * TOPK + k, mask=held, other=0.0).to(tl.float32)
            term = term * weight[:, None]
        total += tl.where(held[:, None], term, 0.0)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * D + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=in_tokens[:, None] & in_cols[None, :])


@torch.library.custom_op("dsv3::sum_rows", mutates_args=())
def sum_rows(rows: torch.Tensor, row_of_slot: torch.Tensor, slot_weights: torch.Tensor | None) -> torch.Tensor:
    """rows [N, D] (N > 0), row_of_slot [T, K] (−1: no row), slot_weights [T, K] in the rows' dtype or None →
    y [T, D] in the rows' dtype, y_t = Σ_k (slot_weights[t, k] ·) rows[row_of_slot[t, k]], summed in fp32."""
    rows, row_of_slot = rows.contiguous(), row_of_slot.contiguous()
    (n_tokens, topk), dim = row_of_slot.shape, rows.size(1)
    out = torch.empty(n_tokens, dim, dtype=rows.dtype, device=rows.device)
    if n_tokens:
        weights = slot_weights.contiguous() if slot_weights is not None else row_of_slot  # not read unweighted
        grid = (triton.cdiv(n_tokens, SUM_ROWS), triton.cdiv(dim, SUM_COLS))
        _sum_rows_kernel[grid](rows, row_of_slot, weights, out, n_tokens, D=dim, TOPK=topk,
                               WEIGHTED=slot_weights is not None, ROWS=SUM_ROWS, COLS=SUM_COLS, num_warps=WARPS)
    return out


@sum_rows.register_fake
def _(rows: torch.Tensor, row_of_slot: torch.Tensor, slot_weights: torch.Tensor | None) -> torch.Tensor:
    return rows.new_empty(row_of_slot.size(0), rows.size(1))
