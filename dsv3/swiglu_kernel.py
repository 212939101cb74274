"""The routed experts' SwiGLU backward in one Triton kernel (`moe.swiglu`): from [gate | up] [N, 2I] and ∂a [N, I],
∂gate = ∂a · up · σ(gate) · (1 + gate · (1 − σ(gate))) and ∂up = ∂a · silu(gate), written into one [N, 2I] buffer.
Inductor lowers that concatenation to one kernel whose every element selects its half, and in the training step it
ran at under half the bandwidth (H200); here each program reads its block of gate, up and ∂a once and writes both
halves.

Imported only on CUDA: it needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS, COLS, WARPS = 32, 128, 4  # the block of [N, I] one program takes, and its warps


@triton.jit
def _swiglu_backward_kernel(gate_up_ptr, grad_ptr, out_ptr, N, INTER, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    mask = (rows < N)[:, None] & (cols < INTER)[None, :]
    gate_at = rows.to(tl.int64)[:, None] * (2 * INTER) + cols[None, :]  # up at gate_at + INTER, in gate_up and out
    gate = tl.load(gate_up_ptr + gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + gate_at + INTER, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :], mask=mask,
                   other=0.0).to(tl.float32)
    sigmoid = 1.0 / (1.0 + tl.exp(-gate))
    grad_gate = grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
    grad_up = grad * gate * sigmoid
    tl.store(out_ptr + gate_at, grad_gate.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + gate_at + INTER, grad_up.to(out_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("dsv3::swiglu_backward", mutates_args=())
def swiglu_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """∂[gate | up] [N, 2I] of a = silu(gate) · up, from gate_up [N, 2I] and ∂a [N, I] (both made contiguous)."""
    gate_up, grad = gate_up.contiguous(), grad.contiguous()
    n, inter = grad.shape
    out = torch.empty_like(gate_up)
    _swiglu_backward_kernel[(triton.cdiv(n, ROWS), triton.cdiv(inter, COLS))](gate_up, grad, out, n, inter,
                                                                           ROWS=ROWS, COLS=COLS, num_warps=WARPS)
    return out


@swiglu_backward.register_fake
def _(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)
