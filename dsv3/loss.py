"""The training loss: cross-entropy of the output head's logits, fused with the head GEMM over chunks of tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU builds come without Triton
    triton = None


LOSS_CHUNK = 8192  # tokens per chunk of `linear_cross_entropy`: one chunk for a local batch of 2 × 4096


def linear_cross_entropy(h: torch.Tensor, head: nn.Linear, targets: torch.Tensor,
                         chunk: int = LOSS_CHUNK) -> torch.Tensor:
    """mean_t CE(h_t·Wᵀ, y_t) for h [B, S, D], targets [B, S]. With gradients on, computed chunk by chunk
    by `_LinearCrossEntropy`, so the [B·S, vocab] logits (3.4 GB in bf16 at 16k tokens × 102k, twice that
    in fp32) never exist in full."""
    h, targets = h.flatten(0, 1), targets.flatten(0, 1)
    if not (torch.is_grad_enabled() and (h.requires_grad or head.weight.requires_grad)):
        return sum(F.cross_entropy(head(h_c).float(), t_c, reduction="sum")
                   for h_c, t_c in zip(h.split(chunk), targets.split(chunk))) / h.size(0)
    return _LinearCrossEntropy.apply(h, head.weight, targets, chunk)


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, scale: float, dtype: torch.dtype):
    """Σ_t CE of one chunk (fp32 math), and dCE/dlogits·scale = (softmax − onehot)·scale in `dtype`."""
    logits = logits.float()
    lse = logits.logsumexp(dim=-1)  # [c]
    loss = (lse - logits.gather(1, targets[:, None]).squeeze(1)).sum()
    grad = (logits - lse[:, None]).exp()
    grad = grad - F.one_hot(targets, logits.size(-1)).float()
    return loss, (grad * scale).to(dtype)


# One fused pass over the chunk, its block sizes tuned by benchmarking at the first compile (a reduction over the whole
# vocabulary per row, which inductor's heuristics tile for less than the bandwidth).
_chunk_loss_and_grad_cuda = torch.compile(_chunk_loss_and_grad, dynamic=False,
                                          options={"coordinate_descent_tuning": True})


def _scale_(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return t.mul_(scale)


_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the kernel below multiplies in fp32

if triton is not None:
    @triton.jit
    def _scale_unless_one_kernel(t_ptr, scale_ptr, n, BLOCK: tl.constexpr):
        scale = tl.load(scale_ptr)
        if scale != 1.0:
            offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            t = tl.load(t_ptr + offsets, mask=mask)
            tl.store(t_ptr + offsets, (t.to(tl.float32) * scale).to(t.dtype), mask=mask)


def _scale_unless_one_cuda_(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`_scale_` whose blocks return at once when the scale is 1, as the loss's gradient is with one micro-batch
    (the multiply would read and write the whole head-weight gradient); no host sync to find out."""
    block = 4096
    _scale_unless_one_kernel[(triton.cdiv(t.numel(), block),)](t, scale.float(), t.numel(), BLOCK=block)
    torch.autograd.graph.increment_version(t)  # an in-place write, as `mul_` would record it
    return t


class _LinearCrossEntropy(torch.autograd.Function):
    """The head GEMM and the cross-entropy fused over token chunks; the backward is computed in the
    forward pass (only the [T, D] and [vocab, D] gradients are kept), as Liger's fused linear CE does."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        n_tokens = h.size(0)
        loss_and_grad = _chunk_loss_and_grad_cuda if h.is_cuda else _chunk_loss_and_grad
        # several chunks: their weight gradients summed in fp32; on CUDA in bf16 the GEMM adds its product into
        # that sum itself (out_dtype, β = 1), where a bf16 product would be written out and added by another kernel
        fp32_sum = n_tokens > chunk
        gemm_adds = h.is_cuda and h.dtype != torch.float32
        loss = torch.zeros((), device=h.device)
        grad_h = torch.empty_like(h)
        grad_weight = None
        for start in range(0, n_tokens, chunk):
            h_c, t_c = h[start:start + chunk], targets[start:start + chunk]
            chunk_loss, grad_logits = loss_and_grad(h_c @ weight.t(), t_c, 1.0 / n_tokens, h.dtype)  # [c, vocab]
            loss += chunk_loss
            grad_h[start:start + chunk] = grad_logits @ weight
            if not fp32_sum:
                grad_weight = grad_logits.t() @ h_c
            elif grad_weight is None:
                grad_weight = (torch.mm(grad_logits.t(), h_c, out_dtype=torch.float32) if gemm_adds
                               else (grad_logits.t() @ h_c).float())
            elif gemm_adds:
                torch.addmm(grad_weight, grad_logits.t(), h_c, out_dtype=torch.float32, out=grad_weight)
            else:
                grad_weight += grad_logits.t() @ h_c
            del grad_logits  # before the next chunk's logits: two [chunk, vocab] buffers at a time, not three
        ctx.save_for_backward(grad_h, grad_weight.to(weight.dtype))
        return loss / n_tokens

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_weight = ctx.saved_tensors  # scaled in place: a second backward through them is an error
        fast = triton is not None and grad_h.is_cuda and grad_h.dtype in _TRITON_DTYPES
        scale_ = _scale_unless_one_cuda_ if fast else _scale_
        return scale_(grad_h, grad_loss), scale_(grad_weight, grad_loss), None, None
