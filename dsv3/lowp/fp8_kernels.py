"""Triton kernels that quantize the routed experts' operands for their FP8 grouped GEMMs
(`quant.fp8_rowwise_grouped_mm`, `quant.fp8_blockwise_grouped_mm`) where inductor cannot. Scales are powers of two,
2^⌊log2(448 / amax)⌋, as `quant.to_fp8_rowwise`'s and torchao's; the rowwise results are theirs bit for bit.

- Weights: W [M, K] scaled along K for the forward (whole rows in registers, one read, recording each column's amax)
  and Wᵀ scaled along M for the input gradient, cast with those amaxes.
- Blocks: one scale per 128×128 block, the same read transposed: one read writes W and Wᵀ in e4m3; at one GPU the
  optimizer writes them as it updates each block (`adamw_weight_blocks`).
- Tiles: one scale per 1×128 tile of a token row, the rows gathered from the dispatcher's source as they are read
  (`token_copies.TokenCopies`), recording per-128-row column amaxes; `fp8_tiles_of_weighted_rows` reads the output
  gradient as ∂y_t · g_t,k and makes ∂g_t,k = ⟨∂y_t, row⟩ on the way.
- Token groups: the weight gradient's operands scaled per column within each expert's group, column-major.
Why each kernel exists and what it saves: docs/precision.md#the-fp8-experts-kernels. Imported only when FP8 experts
run: it needs triton and a CUDA GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv3.lowp import BLOCK

TILE_ROWS, TILE_WARPS = 16, 2  # rows of one step of the 1×128 tile kernel (its programs take BLOCK rows), its warps
ROWS_PER_PROGRAM = 128  # rows of one expert per program of the forward kernel: its column amaxes are [E, M / 128, K]
ADAMW_ROWS, ADAMW_WARPS = 16, 16  # rows of one step of the blockwise AdamW's update, and its warps (of 21, H200)


@triton.jit
def _pow2_scale(amax):
    """2^⌊log2(448 / amax)⌋ for fp32 amax (at least 1e-12: an all-zero row gets a finite scale), exactly: the
    correctly rounded quotient with its mantissa bits cleared (an approximate log2 can be off by one at a power of
    two)."""
    quotient = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), tl.maximum(amax, 1e-12))
    return (quotient.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(x, scale):
    """x · scale in e4m3: computed in fp32 and clamped to the format's max (448) before the cast, as the torch
    expressions the kernels match bit for bit (`quant.to_fp8_rowwise`, torchao's) do; a NaN stays NaN, as through
    torch's clamp (Triton's default clamp makes it ±max)."""
    top: tl.constexpr = 448.0
    return tl.clamp(x.to(tl.float32) * scale, -top, top, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)


@triton.jit
def _fp8_weight_rows_kernel(w_ptr, out_ptr, scales_ptr, col_amax_ptr, M, K, programs_per_expert,
                            ROWS_PER_PROGRAM: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.program_id(0)
    program = tl.program_id(1)
    cols = tl.arange(0, BLOCK_K)
    col_mask = cols < K
    col_amax = tl.zeros([ROWS, BLOCK_K], tl.float32)  # reduced over its rows once, at the end
    first = program * ROWS_PER_PROGRAM
    for start in range(first, tl.minimum(first + ROWS_PER_PROGRAM, M), ROWS):
        rows = start + tl.arange(0, ROWS)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = (expert * M + rows).to(tl.int64)[:, None] * K + cols[None, :]
        w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        magnitude = tl.abs(w)
        col_amax = tl.maximum(col_amax, magnitude)
        scales = _pow2_scale(tl.max(magnitude, axis=1))
        w_fp8 = _to_e4m3(w, scales[:, None])
        tl.store(out_ptr + offsets, w_fp8, mask=mask)
        tl.store(scales_ptr + expert * M + rows, scales, mask=row_mask)
    tl.store(col_amax_ptr + (expert * programs_per_expert + program).to(tl.int64) * K + cols,
             tl.max(col_amax, axis=0), mask=col_mask)


@triton.jit
def _fp8_weight_cols_kernel(w_ptr, col_amax_ptr, out_ptr, scales_ptr, M, K,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < K
    mask = row_mask[:, None] & col_mask[None, :]
    scales = _pow2_scale(tl.load(col_amax_ptr + expert * K + cols, mask=col_mask, other=1.0))
    if tl.program_id(1) == 0:
        tl.store(scales_ptr + expert * K + cols, scales, mask=col_mask)
    w = tl.load(w_ptr + (expert * M + rows).to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
    w_fp8 = _to_e4m3(w, scales[None, :])
    tl.store(out_ptr + (expert * K + cols).to(tl.int64)[None, :] * M + rows[:, None], w_fp8, mask=mask)


@torch.library.custom_op("dsv3::fp8_weight_rows", mutates_args=())
def fp8_weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, M, K] contiguous → (e4m3 [E, M, K], scales [E, M], column amaxes [E, K]), w ≈ e4m3 / scale row by row.
    The column amaxes are `fp8_weight_cols`'s input."""
    n_experts, m, k = w.shape
    block_k = triton.next_power_of_2(k)
    rows = max(1, 8192 // block_k)  # 8K elements per iteration: 32 per thread of 8 warps
    programs_per_expert = triton.cdiv(m, ROWS_PER_PROGRAM)
    out = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(n_experts, m, dtype=torch.float32, device=w.device)
    partial_amax = torch.empty(n_experts, programs_per_expert, k, dtype=torch.float32, device=w.device)
    _fp8_weight_rows_kernel[(n_experts, programs_per_expert)](
        w, out, scales, partial_amax, m, k, programs_per_expert, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, ROWS=rows,
        BLOCK_K=block_k, num_warps=8)
    return out, scales, partial_amax.amax(dim=1)


@fp8_weight_rows.register_fake
def _(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_experts, m, k = w.shape
    return (torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
            w.new_empty(n_experts, m, dtype=torch.float32), w.new_empty(n_experts, k, dtype=torch.float32))


@torch.library.custom_op("dsv3::fp8_weight_cols", mutates_args=())
def fp8_weight_cols(w: torch.Tensor, col_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, M, K] contiguous and its column amaxes [E, K] → (e4m3 [E, K, M], scales [E, K]): wᵀ stored with M
    contiguous, wᵀ ≈ e4m3 / scale row by row."""
    n_experts, m, k = w.shape
    block_m, block_k = 128, 64
    out = torch.empty(n_experts, k, m, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(n_experts, k, dtype=torch.float32, device=w.device)
    _fp8_weight_cols_kernel[(n_experts, triton.cdiv(m, block_m), triton.cdiv(k, block_k))](
        w, col_amax, out, scales, m, k, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4)
    return out, scales


@fp8_weight_cols.register_fake
def _(w: torch.Tensor, col_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n_experts, m, k = w.shape
    return (torch.empty(n_experts, k, m, dtype=torch.float8_e4m3fn, device=w.device),
            w.new_empty(n_experts, k, dtype=torch.float32))


@triton.jit
def _fp8_weight_blocks_kernel(w_ptr, out_ptr, out_t_ptr, inv_scales_ptr, M, K, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    block_row = tl.program_id(1)
    block_col = tl.program_id(2)
    rows = block_row * BLOCK + tl.arange(0, BLOCK)
    cols = block_col * BLOCK + tl.arange(0, BLOCK)
    base = expert.to(tl.int64) * M * K
    w = tl.load(w_ptr + base + rows[:, None] * K + cols[None, :])
    scale = _pow2_scale(tl.max(tl.max(tl.abs(w.to(tl.float32)), axis=1), axis=0))
    tl.store(out_ptr + base + rows[:, None] * K + cols[None, :], _to_e4m3(w, scale))
    # transposed in bf16, then cast: transposing the e4m3 block was slower (H200)
    tl.store(out_t_ptr + base + cols[:, None] * M + rows[None, :], _to_e4m3(tl.trans(w), scale))
    tl.store(inv_scales_ptr + (expert * (M // BLOCK) + block_row) * (K // BLOCK) + block_col, 1.0 / scale)


@torch.library.custom_op("dsv3::fp8_weight_blocks", mutates_args=())
def fp8_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, M, K] contiguous, M and K multiples of 128 → (e4m3 [E, M, K], e4m3 [E, K, M], inverse scales
    [E, M/128, K/128]): one power-of-two scale per 128×128 block (DeepSeek-V3 §3.3.2), w and wᵀ from one read.
    A block's scale does not depend on which way it is read, so wᵀ's inverse scales are these, transposed."""
    n_experts, m, k = w.shape
    out = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    out_t = torch.empty(n_experts, k, m, dtype=torch.float8_e4m3fn, device=w.device)
    inv_scales = torch.empty(n_experts, m // BLOCK, k // BLOCK, dtype=torch.float32, device=w.device)
    _fp8_weight_blocks_kernel[(n_experts, m // BLOCK, k // BLOCK)](w, out, out_t, inv_scales, m, k, BLOCK=BLOCK,
                                                                    num_warps=4)
    return out, out_t, inv_scales


@fp8_weight_blocks.register_fake
def _(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_experts, m, k = w.shape
    return (torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
            torch.empty(n_experts, k, m, dtype=torch.float8_e4m3fn, device=w.device),
            w.new_empty(n_experts, m // BLOCK, k // BLOCK, dtype=torch.float32))


@triton.jit
def _mix32(x):
    """`dsv3.hashing.mix32` on int32: murmur3's finaliser, wrapping arithmetic, logical shifts by masking."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * -2048144789
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * -1028477387
    return x ^ ((x >> 16) & 0xFFFF)


@triton.jit
def _round_to_bf16_stochastically(x, noise):
    """`dsv3.optim.round_to_bf16_stochastically`: noise in [0, 2¹⁶) added to the fp32 bits, the low 16 cleared."""
    return ((x.to(tl.int32, bitcast=True) + noise) & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _adamw_weight_blocks_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, out_t_ptr, inv_scales_ptr,
                                step_size_ptr, decay_ptr, bias_correction2_sqrt_ptr, grad_scale_ptr, seed_ptr, salt_ptr,
                                beta1_complement, beta2, beta2_complement, eps, M, K,
                                ROWS: tl.constexpr, BLOCK: tl.constexpr, BF16_MOMENTS: tl.constexpr):
    block_col = tl.program_id(0)  # the fastest axis: programs side by side share rows of memory
    block_row = tl.program_id(1)
    expert = tl.program_id(2)
    step_size = tl.load(step_size_ptr)
    decay = tl.load(decay_ptr)
    bias_correction2_sqrt = tl.load(bias_correction2_sqrt_ptr)
    grad_scale = tl.load(grad_scale_ptr)
    seed = tl.load(seed_ptr) + tl.load(salt_ptr)
    cols = block_col * BLOCK + tl.arange(0, BLOCK)
    base = expert.to(tl.int64) * M * K  # the expert's first element; offsets within an expert fit in int32
    param_ptr += base
    grad_ptr += base
    exp_avg_ptr += base
    exp_avg_sq_ptr += base
    # `random_bits`' hash input, (index · stride + seed) mod 2³², in int32's wrapping arithmetic
    hash_base = base.to(tl.int32) * -1640531535 + seed.to(tl.int32)
    amax = tl.zeros([ROWS, BLOCK], tl.float32)  # reduced over its rows once, at the end, as the tiles' kernel does
    # The update rounds where eager CUDA's `adamw_update` does (launched without fp fusion; its fmas are explicit):
    # lerp is fma(w, end − start, start) below w = 0.5, else fma(w − 1, end − start, end); addcmul is
    # fma(value, t1·t2, self).
    lerp_from_start = beta1_complement < 0.5
    lerp_weight = tl.where(lerp_from_start, beta1_complement, beta1_complement - 1.0)
    for part in tl.range(0, BLOCK // ROWS):
        rows = block_row * BLOCK + part * ROWS + tl.arange(0, ROWS)
        index = rows[:, None] * K + cols[None, :]
        g = tl.load(grad_ptr + index).to(tl.float32) * grad_scale
        m = tl.load(exp_avg_ptr + index).to(tl.float32)
        m = tl.fma(lerp_weight, g - m, tl.where(lerp_from_start, m, g))
        v = tl.fma(beta2_complement, g * g, tl.load(exp_avg_sq_ptr + index).to(tl.float32) * beta2)
        p = tl.load(param_ptr + index) * decay
        p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps)
        tl.store(param_ptr + index, p)
        amax = tl.maximum(amax, tl.abs(p.to(tl.bfloat16).to(tl.float32)))
        if BF16_MOMENTS:
            bits = _mix32(index * -1640531535 + hash_base)  # one hash for both moments
            tl.store(exp_avg_ptr + index, _round_to_bf16_stochastically(m, bits & 0xFFFF))
            tl.store(exp_avg_sq_ptr + index, _round_to_bf16_stochastically(v, (bits >> 16) & 0xFFFF))
        else:
            tl.store(exp_avg_ptr + index, m)
            tl.store(exp_avg_sq_ptr + index, v)
    scale = _pow2_scale(tl.max(tl.max(amax, axis=1), axis=0))
    # The block's new weights again, from L2, whole, cast as `fp8_weight_blocks`' are: Wᵀ's rows are then written in
    # whole 128-byte lines (in 16-row steps, 16-byte pieces of them, the kernel had run slower)
    rows = block_row * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(param_ptr + rows[:, None] * K + cols[None, :]).to(tl.bfloat16)
    tl.store(out_ptr + base + rows[:, None] * K + cols[None, :], _to_e4m3(w, scale))
    tl.store(out_t_ptr + base + cols[:, None] * M + rows[None, :], _to_e4m3(tl.trans(w), scale))
    tl.store(inv_scales_ptr + (expert * (M // BLOCK) + block_row) * (K // BLOCK) + block_col, 1.0 / scale)


def adamw_weight_blocks(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], step_size: torch.Tensor,
                        decay: torch.Tensor, beta1: float, beta2: float, eps: float,
                        bias_correction2_sqrt: torch.Tensor, grad_scale: torch.Tensor, seed: torch.Tensor,
                        salt: torch.Tensor) -> None:
    """`dsv3.optim.adamw_update` (same arguments, eager CUDA's bits) of an expert stack `param` [E, M, K] fp32 in
    place, M and K multiples of 128, writing into `blocks` what `fp8_weight_blocks` makes of its bf16 copy (e4m3
    [E, M, K], [E, K, M], inverse scales [E, M/128, K/128]) as it holds each block, instead of the copy."""
    n_experts, m, k = param.shape
    out, out_t, inv_scales = blocks
    _adamw_weight_blocks_kernel[(k // BLOCK, m // BLOCK, n_experts)](
        param, grad, exp_avg, exp_avg_sq, out, out_t, inv_scales, step_size, decay, bias_correction2_sqrt,
        grad_scale, seed, salt, 1 - beta1, beta2, 1 - beta2, eps, m, k, ROWS=ADAMW_ROWS, BLOCK=BLOCK,
        BF16_MOMENTS=exp_avg.dtype == torch.bfloat16, num_warps=ADAMW_WARPS, enable_fp_fusion=False)


@triton.jit
def _source_rows(source_rows_ptr, rows, row_mask, GATHER: tl.constexpr):
    """The rows of x that hold `rows` of the operand, and which to read: with GATHER, x[source_rows[r]], a zero
    row where that is −1; else x[r] itself."""
    if GATHER:
        source = tl.load(source_rows_ptr + rows, mask=row_mask, other=-1)
        return source.to(tl.int64), source >= 0
    return rows.to(tl.int64), row_mask


@triton.jit
def _weighted(x, row_weights_ptr, rows, row_mask, dtype):
    """x [R, C] fp32 (rows of x's `dtype`) times each row's weight, rounded to `dtype` as torch's product is."""
    weight = tl.load(row_weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    return (x * weight[:, None]).to(dtype).to(tl.float32)


@triton.jit
def _fp8_tiles_kernel(x_ptr, source_rows_ptr, row_weights_ptr, dot_rows_ptr, dots_ptr, out_ptr, inv_scales_ptr,
                      block_amax_ptr, N, K, ROWS: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr,
                      WEIGHTED: tl.constexpr):
    block_row = tl.program_id(0)
    tile = tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    # reduced over its rows once, at the end: a column reduction per step of rows made the kernel slower (H200)
    col_amax = tl.zeros([ROWS, BLOCK], tl.float32)
    for part in tl.range(0, BLOCK // ROWS):
        rows = block_row * BLOCK + part * ROWS + tl.arange(0, ROWS)
        row_mask = rows < N
        x_rows, x_mask = _source_rows(source_rows_ptr, rows, row_mask, GATHER)
        x = tl.load(x_ptr + x_rows[:, None] * K + cols[None, :], mask=x_mask[:, None], other=0.0).to(tl.float32)
        offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
        if WEIGHTED:  # this tile's part of ⟨x row, dot_rows row⟩, then the row times its weight
            dot_rows = tl.load(dot_rows_ptr + offsets, mask=row_mask[:, None], other=0.0).to(tl.float32)
            tl.store(dots_ptr + tile * N + rows, tl.sum(x * dot_rows, axis=1), mask=row_mask)
            x = _weighted(x, row_weights_ptr, rows, row_mask, x_ptr.dtype.element_ty)
        magnitude = tl.abs(x)
        col_amax = tl.maximum(col_amax, magnitude)
        scales = _pow2_scale(tl.max(magnitude, axis=1))
        tl.store(out_ptr + offsets, _to_e4m3(x, scales[:, None]), mask=row_mask[:, None])
        tl.store(inv_scales_ptr + tile * N + rows, 1.0 / scales, mask=row_mask)
    tl.store(block_amax_ptr + block_row.to(tl.int64) * K + cols, tl.max(col_amax, axis=0))


# torch<2.14: `flexible_layout`, inductor hands the op the buffer that made x. Under its default (exact strides), an
# operand read by this op and saved for `fp8_group_cols` in the backward (then: the gathered token rows) was written
# twice by the kernel that made it (seen on torch 2.11). The ops make x contiguous themselves, a no-op for inductor's
# row-major buffers.
@torch.library.custom_op("dsv3::fp8_tiles", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def fp8_tiles(x: torch.Tensor, source_rows: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, K], K a multiple of 128 → (e4m3 [N, K], inverse scales [N, K/128] fp32 column-major as DeepGEMM reads
    them, column amaxes per 128 rows [⌈N/128⌉, K] fp32 for `fp8_group_cols`): a power-of-two scale per 1×128 tile
    (§3.3.2). With `source_rows` [N] (int64; −1: a zero row), x is [T, K] and the rows x[source_rows], gathered."""
    return _tiles(x, source_rows)[:3]


@fp8_tiles.register_fake
def _(x: torch.Tensor, source_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _tiles_like(x, source_rows)[:3]


@torch.library.custom_op("dsv3::fp8_tiles_of_weighted_rows", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def fp8_tiles_of_weighted_rows(x: torch.Tensor, source_rows: torch.Tensor, row_weights: torch.Tensor,
                               dot_rows: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fp8_tiles` of the rows x[source_rows] · row_weights (rounded to x's dtype), and the dots ⟨x[source_rows[i]],
    dot_rows[i]⟩ in parts [K/128, N] fp32 to sum over dim 0 (junk at −1 rows): y_t = Σ_k g_t,k · row's backward in one
    read of each operand (x = ∂y, row_weights the gate weights, dot_rows the rows, the dots ∂g)."""
    return _tiles(x, source_rows.contiguous(), row_weights.contiguous(), dot_rows.contiguous())


@fp8_tiles_of_weighted_rows.register_fake
def _(x: torch.Tensor, source_rows: torch.Tensor, row_weights: torch.Tensor, dot_rows: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _tiles_like(x, source_rows)


def _tiles_like(x: torch.Tensor, source_rows: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty outputs of the tile ops: e4m3 [N, K], inverse scales [K/128, N]ᵀ, column amaxes, dot parts [K/128, N]."""
    n, k = x.shape if source_rows is None else (source_rows.numel(), x.size(1))
    return (x.new_empty(n, k, dtype=torch.float8_e4m3fn),
            x.new_empty(k // BLOCK, n, dtype=torch.float32).t(),
            x.new_empty(triton.cdiv(n, BLOCK), k, dtype=torch.float32),
            x.new_empty(k // BLOCK, n, dtype=torch.float32))


def _tiles(x: torch.Tensor, source_rows: torch.Tensor | None, row_weights: torch.Tensor | None = None,
           dot_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_fp8_tiles_kernel` for both tile ops; with `row_weights` and `dot_rows`, `fp8_tiles_of_weighted_rows`."""
    x = x.contiguous()
    out, inv_scales_t, block_amax, dots = _tiles_like(x, source_rows)
    n, k = out.shape
    weighted = row_weights is not None
    _fp8_tiles_kernel[(triton.cdiv(n, BLOCK), k // BLOCK)](
        x, x if source_rows is None else source_rows, row_weights if weighted else x, dot_rows if weighted else x,
        dots, out, inv_scales_t, block_amax, n, k, ROWS=TILE_ROWS, BLOCK=BLOCK, GATHER=source_rows is not None,
        WEIGHTED=weighted, num_warps=TILE_WARPS)
    return out, inv_scales_t, block_amax, dots


@triton.jit
def _group_rows(x_ptr, source_rows_ptr, row_weights_ptr, rows, row_mask, cols, col_mask, F, GATHER: tl.constexpr,
                WEIGHTED: tl.constexpr):
    """The operand's `rows` at `cols` in fp32, zero where masked: x's own, or gathered (GATHER), times the rows'
    weights (WEIGHTED)."""
    x_rows, x_mask = _source_rows(source_rows_ptr, rows, row_mask, GATHER)
    x = tl.load(x_ptr + x_rows[:, None] * F + cols[None, :], mask=x_mask[:, None] & col_mask[None, :],
                other=0.0).to(tl.float32)
    if WEIGHTED:
        x = _weighted(x, row_weights_ptr, rows, row_mask, x_ptr.dtype.element_ty)
    return x


@triton.jit
def _fp8_group_cols_kernel(x_ptr, source_rows_ptr, row_weights_ptr, offsets_ptr, block_amax_ptr, out_ptr,
                           scales_ptr, N, F, BLOCK_ROWS: tl.constexpr, BLOCK_F: tl.constexpr,
                           AMAX_ROWS: tl.constexpr, GATHER: tl.constexpr, WEIGHTED: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    group = tl.program_id(1)
    col_mask = cols < F
    start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
    end = tl.load(offsets_ptr + group)
    if AMAX_ROWS:  # the amaxes of the group's blocks of AMAX_ROWS rows, made beside x's tiles (`fp8_tiles`)
        col_amax = tl.zeros([BLOCK_F], tl.float32)
        for block in range(start // AMAX_ROWS, end // AMAX_ROWS):
            col_amax = tl.maximum(col_amax, tl.load(block_amax_ptr + block * F + cols, mask=col_mask, other=0.0))
    else:
        amax = tl.zeros([BLOCK_ROWS, BLOCK_F], tl.float32)  # reduced over its rows once, at the end
        for first in range(start, end, BLOCK_ROWS):
            rows = first + tl.arange(0, BLOCK_ROWS)
            x = _group_rows(x_ptr, source_rows_ptr, row_weights_ptr, rows, rows < end, cols, col_mask, F, GATHER,
                            WEIGHTED)
            amax = tl.maximum(amax, tl.abs(x))
        col_amax = tl.max(amax, axis=0)
    scales = _pow2_scale(col_amax)
    tl.store(scales_ptr + group * F + cols, scales, mask=col_mask)
    for first in range(start, end, BLOCK_ROWS):
        rows = first + tl.arange(0, BLOCK_ROWS)
        x = _group_rows(x_ptr, source_rows_ptr, row_weights_ptr, rows, rows < end, cols, col_mask, F, GATHER,
                        WEIGHTED)
        x_fp8 = _to_e4m3(x, scales[None, :])
        tl.store(out_ptr + cols.to(tl.int64)[None, :] * N + rows[:, None], x_fp8,
                 mask=(rows < end)[:, None] & col_mask[None, :])


@torch.library.custom_op("dsv3::fp8_group_cols", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def fp8_group_cols(x: torch.Tensor, offsets: torch.Tensor, block_amax: torch.Tensor | None = None,
                   source_rows: torch.Tensor | None = None, row_weights: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, F], rows in groups ending at `offsets` [G] → (e4m3 [N, F] column-major, scales [G·F]), group g's column
    c ≈ e4m3 / scales[g·F + c], as `torch._scaled_grouped_mm` takes a weight gradient; `block_amax` (`fp8_tiles`',
    groups then whole 128-row blocks) spares x's amax pass; `source_rows`, `row_weights` as in the tile ops."""
    x = x.contiguous()
    n, f = x.shape if source_rows is None else (source_rows.numel(), x.size(1))
    block_f = 32
    out = torch.empty_strided((n, f), (1, n), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(offsets.numel() * f, dtype=torch.float32, device=x.device)
    _fp8_group_cols_kernel[(triton.cdiv(f, block_f), offsets.numel())](
        x, x if source_rows is None else source_rows, x if row_weights is None else row_weights, offsets,
        x if block_amax is None else block_amax, out, scales, n, f, BLOCK_ROWS=256, BLOCK_F=block_f,
        AMAX_ROWS=0 if block_amax is None else BLOCK, GATHER=source_rows is not None,
        WEIGHTED=row_weights is not None, num_warps=4)
    return out, scales


@fp8_group_cols.register_fake
def _(x: torch.Tensor, offsets: torch.Tensor, block_amax: torch.Tensor | None = None,
      source_rows: torch.Tensor | None = None, row_weights: torch.Tensor | None = None
      ) -> tuple[torch.Tensor, torch.Tensor]:
    n, f = x.shape if source_rows is None else (source_rows.numel(), x.size(1))
    return (torch.empty_strided((n, f), (1, n), dtype=torch.float8_e4m3fn, device=x.device),
            x.new_empty(offsets.numel() * f, dtype=torch.float32))
