"""Low-precision training (paper §3.3), applied to the built model from outside, after it is built and before
expert parallelism, activation checkpointing, compile and FSDP2. torchao 0.18 is called directly, each call in one
function named for what it does, and imported only here, only when a mode needs it.

`train.precision` picks the dense linears' format: bf16 | fp8 (e4m3, scales per `train.fp8_recipe`: rowwise, or
tensorwise, whose FSDP2 all-gather needs `precompute_fp8_scales(model)` after every optimizer step) | mxfp8 (SM100) |
mxfp8-emulated (its numerics around bf16 GEMMs, any device); only linears with min(in, out) ≥ `fp8_min_features`
convert. `train.expert_precision` runs the routed experts' grouped GEMMs in that format (`low`, groups padded to
`GROUP_ALIGN` rows) or in DeepSeek-V3's blockwise recipe through DeepGEMM (`fp8-blockwise`, Hopper). Never
quantized: the embedding, the router gate, the norms, the output head (§3.3.1) and the MTP modules' dense linears
(B·(S−k) tokens fit neither fp8's nor MXFP8's token multiples); their routed experts follow `expert_precision`.
The modes, recipes and their measurements: docs/precision.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import torch
from torch import nn

from dsv3.config import EXPERT_PRECISIONS, FP8_RECIPES, PRECISIONS, UserError
from dsv3.lowp import BLOCK
from dsv3.moe import GroupedExperts, MoE, swiglu
from dsv3.token_copies import TokenCopies, row_of_slot, slot_gradients, sum_token_copies, weighted_row_sum

# Rows per token group the low-precision grouped GEMMs need: fp8 rowwise `_scaled_grouped_mm` takes groups in
# multiples of 16; MXFP8 quantizes the weight gradient's token dimension in blocks of 32 (emulated too, so that
# its blocks never straddle two experts, like the real kernel's).
GROUP_ALIGN = {"fp8": 16, "mxfp8": 32, "mxfp8-emulated": 32}
# Dense linears must have in and out features divisible by this to be converted (_scaled_mm / MX block size);
# so must the tokens of a micro-batch, the inner dim of their weight-gradient GEMM.
FEATURE_MULTIPLE = {"fp8": 16, "mxfp8": 32, "mxfp8-emulated": 32}
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


class _EnumRegisteredAsConstant(logging.Filter):  # torchao<0.19:
    """torchao 0.18 registers its MX config enums (KernelPreference, ScaleCalculationMode) as pytree constants when
    imported; torch 2.13 supports enums natively and logs a deprecation warning per class, addressed to torchao,
    not to whoever trains with it. Only those records are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_EnumRegisteredAsConstant())


def _check_modes(precision: str, expert_precision: str, fp8_recipe: str = "rowwise") -> None:
    for key, value, choices in (("precision", precision, PRECISIONS),
                                ("expert_precision", expert_precision, EXPERT_PRECISIONS),
                                ("fp8_recipe", fp8_recipe, FP8_RECIPES)):
        if value not in choices:
            raise UserError(f"unknown train.{key}={value!r}: choose one of {', '.join(choices)}")


def check_precision(precision: str, expert_precision: str, device: torch.device, tokens: int = 0,
                    fp8_recipe: str = "rowwise") -> None:
    """Fail at start-up, with what to do instead, if `device` cannot run the asked-for precision, or if the
    `tokens` of a micro-batch (micro_batch × seq_len; 0: not checked) cannot fill the low-precision GEMMs."""
    _check_modes(precision, expert_precision, fp8_recipe)
    if expert_precision == "fp8-blockwise":
        _check_deepgemm(device)
    if precision == "bf16":
        return
    if tokens % FEATURE_MULTIPLE[precision]:
        how = "in blocks of 32" if precision != "fp8" else "(inner dim of _scaled_mm)"
        raise UserError(f"train.precision={precision} needs train.micro_batch × train.seq_len ({tokens}) to be a "
                        f"multiple of {FEATURE_MULTIPLE[precision]}: the weight gradient's GEMM runs over the tokens "
                        f"{how}")
    if precision == "mxfp8":
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if capability is None or capability[0] != 10:
            where = f"compute capability {capability[0]}.{capability[1]}" if capability else "a CPU"
            raise UserError(f"train.precision=mxfp8 needs a compute-capability-10 GPU (B200/GB200), not {where}: "
                            "use --train.precision=fp8 (Hopper/Ada) or --train.precision=mxfp8-emulated "
                            "(MXFP8 numerics anywhere, no speed-up)")
    if precision == "fp8":
        if device.type != "cuda":
            raise UserError("train.precision=fp8 needs a CUDA GPU (compute capability >= 8.9): on a CPU use "
                            "--train.precision=bf16, or --train.precision=mxfp8-emulated for low-precision numerics")
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise UserError(f"train.precision=fp8 needs compute capability >= 8.9 (Ada, Hopper, Blackwell); this "
                            f"GPU has {capability[0]}.{capability[1]}: use --train.precision=bf16 or mxfp8-emulated")
    try:
        if precision == "fp8":
            import torchao.float8  # noqa: F401
        else:
            import torchao.prototype.moe_training.mxfp8_linear  # noqa: F401
    except ImportError as e:
        raise ImportError(f"train.precision={precision} needs torchao 0.18 (and numpy): "
                          f"pip install torchao==0.18.0 numpy ({e})") from e
    if precision == "fp8" and expert_precision == "low":
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise ImportError("train.expert_precision=low with fp8 runs dsv3's Triton kernels: pip install "
                              "triton, or use --train.expert_precision=bf16") from e
    if precision == "mxfp8" and expert_precision == "low":
        from torchao.prototype.moe_training import mxfp8_grouped_mm
        if not mxfp8_grouped_mm._SM100_KERNELS_AVAILABLE:
            raise UserError("train.expert_precision=low with mxfp8 needs torchao's SM100 kernels (a CUDA 12.8+ "
                            "build of torchao), which did not load: use --train.precision=mxfp8-emulated or "
                            "--train.expert_precision=bf16")


def _check_deepgemm(device: torch.device) -> None:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability[0] != 9:
        where = f"compute capability {capability[0]}.{capability[1]}" if capability else "a CPU"
        raise UserError(f"train.expert_precision=fp8-blockwise runs DeepGEMM's Hopper kernels (compute capability "
                        f"9.0), not on {where}: use --train.expert_precision=low (with --train.precision=fp8 or "
                        "mxfp8) or bf16")
    try:
        import deep_gemm  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError(f"train.expert_precision=fp8-blockwise needs DeepGEMM and triton: run "
                          f"scripts/install_deepgemm.sh and put the PYTHONPATH it prints in the environment ({e})"
                          ) from e


def convertible_linears(model: nn.Module, precision: str, fp8_min_features: int = 0) -> list[str]:
    """The dense linears `precision` may convert: every nn.Linear outside the output head and the MTP modules whose
    features divide by what its kernels need and, for fp8, whose min(in, out) reaches `fp8_min_features`, below which
    quantizing costs more than the FP8 GEMMs save (docs/precision.md#fp8-recipes-and-which-linears-convert)."""
    min_features = fp8_min_features if precision == "fp8" else 0
    multiple = FEATURE_MULTIPLE[precision]
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name != "head" and not name.startswith("mtp.")
            and m.in_features % multiple == 0 and m.out_features % multiple == 0
            and min(m.in_features, m.out_features) >= min_features]


def apply(model: nn.Module, precision: str, expert_precision: str = "bf16", fp8_recipe: str = "rowwise",
          skip: Sequence[str] = (), fsdp: bool = True, fp8_min_features: int = 0) -> list[str]:
    """Convert `model` (a meta-device one too) in place for `precision` and `expert_precision`, swapping modules but
    keeping their weight Parameters, so parameter names do not change; returns the names of the dense linears
    converted (the `convertible_linears` named by none of `skip`). `fsdp`: whether FSDP2 will shard the model."""
    _check_modes(precision, expert_precision, fp8_recipe)
    if expert_precision == "fp8-blockwise":
        _swap_experts(model, Fp8BlockwiseExperts, BLOCK, BLOCK, expert_precision)
    if precision == "bf16":
        return []
    eligible = convertible_linears(model, precision, fp8_min_features)
    for fragment in skip:
        if not any(fragment in name for name in eligible):
            raise UserError(f"train.precision_skip: {fragment!r} names none of the linears that {precision} "
                            f"converts, e.g. {', '.join(eligible[:4])}: fix the spelling or drop it")
    names = [name for name in eligible if not any(fragment in name for fragment in skip)]
    if precision == "fp8":
        convert_to_fp8_training(model, names, fp8_recipe, fp8_all_gather=fsdp)
    else:
        _swap_linears(model, names, functools.partial(to_mxfp8_linear, emulated=precision == "mxfp8-emulated"))
    if expert_precision == "low":
        if precision == "fp8":
            experts = Fp8RowwiseExperts
        else:
            experts = functools.partial(MXFP8Experts, emulated=precision == "mxfp8-emulated")
        _swap_experts(model, experts, FEATURE_MULTIPLE[precision], GROUP_ALIGN[precision], f"low with {precision}")
    return names


def _swap_linears(model: nn.Module, names: list[str], convert) -> None:
    """Replace each named linear of `model` by `convert(linear)`."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, convert(getattr(owner, child)))


def _swap_experts(model: nn.Module, experts_class, feature_multiple: int, align: int, what: str) -> None:
    """Replace each MoE's `GroupedExperts` by an `experts_class(n_experts, dim, inter_dim)` holding its weight
    Parameters (their names do not change), and have its dispatcher pad groups to `align` rows."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        n_experts, dim, inter_dim = moe.experts.w2.shape
        if dim % feature_multiple or inter_dim % feature_multiple:
            raise UserError(f"train.expert_precision={what} needs model.dim ({dim}) and model.moe_inter_dim "
                            f"({inter_dim}) divisible by {feature_multiple}: change them or use "
                            "--train.expert_precision=bf16")
        with torch.device("meta"):
            experts = experts_class(n_experts, dim, inter_dim)
        experts.w13, experts.w2 = moe.experts.w13, moe.experts.w2
        moe.experts = experts
        moe.dispatcher.align = align


def convert_to_fp8_training(model: nn.Module, names: list[str], recipe: str, fp8_all_gather: bool = True) -> None:
    """Swap the named linears for torchao's Float8Linear (dynamic scaling, e4m3 forward, e5m2 gradients). Under FSDP2
    (`fp8_all_gather`) a tensorwise one all-gathers its weights in fp8 (its scales are the only ones that can be:
    WeightWithDynamicFloat8CastTensor)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and fp8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    wanted = set(names)
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn in wanted, config=config)


def precompute_fp8_scales(model: nn.Module) -> None:
    """Tensorwise fp8 all-gather: the next step's weight scales, in one all-reduce; call after optimizer.step()."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def to_mxfp8_linear(linear: nn.Linear, emulated: bool) -> nn.Linear:
    """torchao's MXFP8Linear holding `linear`'s own weight (and bias) Parameters."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common import KernelPreference

    with torch.device("meta"):
        mx = MXFP8Linear(linear.in_features, linear.out_features, bias=False,
                         kernel_preference=KernelPreference.EMULATED if emulated else KernelPreference.AUTO)
    mx.weight, mx.bias = linear.weight, linear.bias
    return mx


def to_fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], scales [M] fp32) with x ≈ e4m3 / scale row by row; each scale is the power of two at
    or below 448 / amax(row), as torchao's. Plain torch ops, so that inside a compiled block inductor fuses the
    row reduction and the cast into one kernel, and into the op that made x (SwiGLU, silu's backward)."""
    amax = x.abs().amax(dim=-1).float().clamp(min=1e-12)
    scales = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    data = (x.float() * scales[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scales


def fp8_rowwise_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Routed-expert GEMM with e4m3 rowwise scales; groups must be multiples of 16 rows (the dispatcher pads them)."""
    return _Fp8RowwiseGroupedMM.apply(x, w, offsets)


class _Fp8RowwiseGroupedMM(torch.autograd.Function):
    """out = x·w per group, its three GEMMs in e4m3 (torch._scaled_grouped_mm, fp32 accumulation): the token rows
    scaled by `to_fp8_rowwise`, which inductor fuses into the ops that make them, the weights and the weight gradient
    by dsv3.lowp.fp8_kernels (docs/precision.md#the-fp8-experts-kernels)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # x [N, K] row-major; w [E, K, M], each expert's matrix column-major (a transposed view of [E, M, K])
        from dsv3.lowp.fp8_kernels import fp8_weight_rows

        x_fp8, x_scales = to_fp8_rowwise(x)
        w_rows = w.transpose(-2, -1).contiguous()  # [E, M, K]: the memory of w, no copy
        w_fp8, w_scales, w_col_amax = fp8_weight_rows(w_rows)  # along K; and the amaxes along M, for backward
        ctx.save_for_backward(x, w_rows, offsets, w_col_amax)
        return torch._scaled_grouped_mm(x_fp8, w_fp8.transpose(-2, -1), x_scales.reciprocal(), w_scales.reciprocal(),
                                        offsets, out_dtype=x.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        from dsv3.lowp.fp8_kernels import fp8_weight_cols

        x, w_rows, offsets, w_col_amax = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        # grad_x [N, K] = grad_out [N, M] · wᵀ: grad_out along M, w along M (stored transposed: column-major)
        g_fp8, g_scales = to_fp8_rowwise(grad_out)
        wt_fp8, wt_scales = fp8_weight_cols(w_rows, w_col_amax)  # [E, K, M]
        grad_x = torch._scaled_grouped_mm(g_fp8, wt_fp8.transpose(-2, -1), g_scales.reciprocal(),
                                          wt_scales.reciprocal(), offsets, out_dtype=grad_out.dtype,
                                          use_fast_accum=True)
        return grad_x, _fp8_rowwise_weight_grad(grad_out, x, offsets).transpose(-2, -1), None


def _fp8_rowwise_weight_grad(grad_out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                             grad_out_amax: torch.Tensor | None = None, x_amax: torch.Tensor | None = None,
                             x_source_rows: torch.Tensor | None = None,
                             grad_out_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """grad_w [E, M, K] = grad_outᵀ · x per group, both quantized along each group's tokens (`fp8_group_cols`): the
    `*_amax` are its `block_amax`, `x_source_rows` x's `source_rows`, `grad_out_rows` grad_out's (`source_rows`,
    `row_weights`)."""
    from dsv3.lowp.fp8_kernels import fp8_group_cols

    g_cols, g_col_scales = fp8_group_cols(grad_out, offsets, grad_out_amax, *(grad_out_rows or ()))
    x_cols, x_col_scales = fp8_group_cols(x, offsets, x_amax, x_source_rows)
    return torch._scaled_grouped_mm(g_cols.t(), x_cols, g_col_scales.reciprocal(), x_col_scales.reciprocal(),
                                    offsets, out_dtype=grad_out.dtype, use_fast_accum=True)


def group_of_row(offsets: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Each row's group (the expert whose weights it meets) from the groups' ends, −1 past the last group: the
    per-row layout of DeepGEMM's contiguous grouped GEMM, which skips the −1 rows' 128-row blocks."""
    group = torch.searchsorted(offsets, torch.arange(n_rows, device=offsets.device, dtype=offsets.dtype),
                               right=True)
    return torch.where(group < offsets.numel(), group, -1).to(torch.int32)


@torch.library.custom_op("dsv3::fp8_block_grouped_mm", mutates_args=(), device_types="cuda")
def fp8_block_grouped_mm(a: torch.Tensor, a_inv_scales: torch.Tensor, b: torch.Tensor, b_inv_scales: torch.Tensor,
                         groups: torch.Tensor) -> torch.Tensor:
    """out [N, M] bf16, row i = a[i] · b[groups[i]]ᵀ (a [N, K] e4m3 in 1×128 tiles, b [E, M, K] e4m3 in 128×128
    blocks): DeepGEMM's m-grouped contiguous FP8 GEMM. Rows of group −1 are not written."""
    import deep_gemm

    out = torch.empty(a.size(0), b.size(1), dtype=torch.bfloat16, device=a.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, a_inv_scales), (b, b_inv_scales), out, groups)
    return out


@fp8_block_grouped_mm.register_fake
def _(a, a_inv_scales, b, b_inv_scales, groups):
    return a.new_empty(a.size(0), b.size(1), dtype=torch.bfloat16)


def fp8_blockwise_grouped_mm(x: torch.Tensor | TokenCopies, w: torch.Tensor, offsets: torch.Tensor,
                             *w_blocks: torch.Tensor, sum_copies: TokenCopies | None = None) -> torch.Tensor:
    """Routed-expert GEMM in DeepSeek-V3's FP8 recipe, groups starting at multiples of 128 rows. x: the rows, or
    `TokenCopies` that the quantization gathers; `w_blocks`: w's `fp8_kernels.fp8_weight_blocks`, where something keeps
    them (w's values are then unread); `sum_copies`: return `sum_copies.sum` of the output rows, in its `order`."""
    source, order, topk = (x.source, x.order, x.topk) if isinstance(x, TokenCopies) else (x, None, 1)
    sum_order, sum_weights = (None, None) if sum_copies is None else (sum_copies.order, sum_copies.weights)
    return _Fp8BlockwiseGroupedMM.apply(source, w, offsets, order, topk, sum_order, sum_weights, *w_blocks)


class _Fp8BlockwiseGroupedMM(torch.autograd.Function):
    """out = x·w per group, in DeepSeek-V3's scales (§3.3.2) through DeepGEMM, the weight gradient in per-group column
    scales (docs/precision.md#the-fp8-experts-kernels). With `order`, x's rows are x[order // topk]; with `sum_order`,
    the output is y_t = Σ_k g_t,k · (out's row in slot (t, k)), both read so by the quantizations, never written."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor | None,
                topk: int, sum_order: torch.Tensor | None, sum_weights: torch.Tensor | None,
                *w_blocks: torch.Tensor) -> torch.Tensor:
        # x [N, K] row-major (with `order`: [T, K], the rows' source); w [E, K, M], each expert's matrix
        # column-major (a transposed view of [E, M, K])
        from dsv3.lowp.fp8_kernels import fp8_tiles, fp8_weight_blocks

        source_rows = None if order is None else order // topk  # padding: −1 // topk = −1
        x_fp8, x_inv_scales, x_amax = fp8_tiles(x, source_rows)
        # [E, M, K], [E, K, M], [E, M/128, K/128] (from [E, M, K]: w's memory)
        w_fp8, wt_fp8, w_inv_scales = w_blocks or fp8_weight_blocks(w.transpose(-2, -1).contiguous())
        groups = group_of_row(offsets, x_fp8.size(0))
        ctx.n_blocks, ctx.topk = len(w_blocks), topk
        # torch<2.14: DeepGEMM's output itself; returning an alias of it (`.to` of its own dtype) lost the gradient
        # under torch.compile (seen on torch 2.11)
        out = fp8_block_grouped_mm(x_fp8, x_inv_scales, w_fp8, w_inv_scales, groups)
        saved = (x, x_amax, wt_fp8, w_inv_scales, offsets, groups, order, source_rows)
        if sum_order is None:
            ctx.save_for_backward(*saved)
            return out
        rows_of_token = row_of_slot(sum_order, sum_weights.numel()).view(sum_weights.shape)
        y, slot_weights = weighted_row_sum(out, sum_weights, rows_of_token)
        ctx.save_for_backward(*saved, out, sum_order, slot_weights, rows_of_token)
        ctx.weights_dtype = sum_weights.dtype
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        from dsv3.lowp.fp8_kernels import fp8_tiles, fp8_tiles_of_weighted_rows

        x, x_amax, wt_fp8, w_inv_scales, offsets, groups, order, source_rows, *summed = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_out_rows = grad_sum_weights = None
        if not summed:
            g_fp8, g_inv_scales, g_amax = fp8_tiles(grad_out)
        else:  # grad_out is ∂y [T, M]: out's row in slot (t, k) has ∂y_t · g_t,k
            out, sum_order, slot_weights, rows_of_token = summed
            # a padding row's order, −1, reads the zero appended (T may be 0: EP, a rank that received no tokens)
            row_weights = torch.cat([slot_weights.flatten(), slot_weights.new_zeros(1)])[sum_order]
            grad_out_rows = (sum_order // rows_of_token.size(1), row_weights)  # padding: −1, read as a zero row
            g_fp8, g_inv_scales, g_amax, dots = fp8_tiles_of_weighted_rows(grad_out, *grad_out_rows, out)
            grad_sum_weights = slot_gradients(dots.sum(0), rows_of_token, ctx.weights_dtype)
        grad_x = fp8_block_grouped_mm(g_fp8, g_inv_scales, wt_fp8, w_inv_scales.transpose(-2, -1).contiguous(),
                                      groups)
        if order is not None:
            grad_x = sum_token_copies(grad_x, order, ctx.topk, x.size(0))
        grad_w = _fp8_rowwise_weight_grad(grad_out, x, offsets, g_amax, x_amax, source_rows,
                                          grad_out_rows).transpose(-2, -1)
        return grad_x, grad_w, None, None, None, None, grad_sum_weights, *(None,) * ctx.n_blocks


def mxfp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, emulated: bool) -> torch.Tensor:
    """Routed-expert GEMM in MXFP8 (torchao); groups must be multiples of 32 rows (the dispatcher pads them).
    Operands are quantized from bf16: fp32 ones (CPU runs) are cast, since the emulated kernel dequantizes to bf16."""
    from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    out = _to_mxfp8_then_scaled_grouped_mm(
        x.bfloat16(), w.bfloat16(), offsets, out_dtype=torch.bfloat16,
        kernel_preference=KernelPreference.EMULATED if emulated else KernelPreference.AUTO)
    return out.to(x.dtype)


class Fp8RowwiseExperts(GroupedExperts):
    """`GroupedExperts` with both grouped GEMMs in e4m3 rowwise (`fp8_rowwise_grouped_mm`): expert_precision=low
    with fp8."""

    def forward(self, x: torch.Tensor | TokenCopies, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        rows = x.gather() if isinstance(x, TokenCopies) else x  # [N, dim]
        w13, w2 = self.local_weights()
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        # SwiGLU's backward in plain ops: inductor fuses the row quantization of its output into them
        act = swiglu(fp8_rowwise_grouped_mm(rows, w13.transpose(-2, -1), offsets), triton_backward=False)
        out = fp8_rowwise_grouped_mm(act, w2.transpose(-2, -1), offsets)  # [N, dim]
        return x.sum(out) if isinstance(x, TokenCopies) and x.weights is not None else out


class MXFP8Experts(GroupedExperts):
    """`GroupedExperts` with both grouped GEMMs in MXFP8 (`mxfp8_grouped_mm`, `emulated` or not): expert_precision=low
    with mxfp8 or mxfp8-emulated."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, emulated: bool):
        super().__init__(n_experts, dim, inter_dim)
        self.emulated = emulated

    def forward(self, x: torch.Tensor | TokenCopies, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        rows = x.gather() if isinstance(x, TokenCopies) else x  # [N, dim]
        w13, w2 = self.local_weights()
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        act = swiglu(mxfp8_grouped_mm(rows, w13.transpose(-2, -1), offsets, self.emulated))  # [N, I]
        out = mxfp8_grouped_mm(act, w2.transpose(-2, -1), offsets, self.emulated)  # [N, dim]
        return x.sum(out) if isinstance(x, TokenCopies) and x.weights is not None else out


class Fp8BlockwiseExperts(GroupedExperts):
    """`GroupedExperts` in DeepSeek-V3's FP8 recipe (`fp8_blockwise_grouped_mm`): expert_precision=fp8-blockwise.
    The dispatcher's `TokenCopies` go to the first GEMM ungathered, its quantization gathers them as it reads them;
    with gate weights, the second GEMM sums its rows per token itself (`sum_copies`)."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int):
        super().__init__(n_experts, dim, inter_dim)
        # name → the GEMM's own FP8 form of the weight, where something keeps it up to date (one GPU: the optimizer,
        # through `WeightBlocks`), passed to the GEMM after the weight; empty: the GEMM quantizes the weights itself
        self.weight_blocks: dict[str, tuple[torch.Tensor, ...]] = {}

    def forward(self, x: torch.Tensor | TokenCopies, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        copies = x if isinstance(x, TokenCopies) and x.weights is not None else None
        w13, w2 = self.local_weights()
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        blocks = self.weight_blocks
        act = swiglu(fp8_blockwise_grouped_mm(x, w13.transpose(-2, -1), offsets, *blocks.get("w13", ())))  # [N, I]
        return fp8_blockwise_grouped_mm(act, w2.transpose(-2, -1), offsets, *blocks.get("w2", ()), sum_copies=copies)


class WeightBlocks:
    """The one-GPU compute copy (dsv3.optim.ComputeCopies) of a `Fp8BlockwiseExperts` weight stack [E, M, K]: the
    e4m3 blocks its GEMM reads (`fp8_kernels.fp8_weight_blocks`), handed to the experts' `weight_blocks`, in place of
    a bf16 copy; the optimizer writes them while it holds each block (`fp8_kernels.adamw_weight_blocks`)."""

    def __init__(self, experts: Fp8BlockwiseExperts, name: str, p: nn.Parameter):
        n_experts, m, k = p.shape
        self.blocks = (torch.empty(p.shape, dtype=torch.float8_e4m3fn, device=p.device),
                       torch.empty(n_experts, k, m, dtype=torch.float8_e4m3fn, device=p.device),
                       torch.empty(n_experts, m // BLOCK, k // BLOCK, dtype=torch.float32, device=p.device))
        experts.weight_blocks[name] = self.blocks

    def write(self, weight: torch.Tensor) -> None:
        """Remake the blocks from `weight`, the stack in the compute dtype."""
        from dsv3.lowp.fp8_kernels import fp8_weight_blocks

        for blocks, made in zip(self.blocks, fp8_weight_blocks(weight)):
            blocks.copy_(made)

    def adamw_update(self, p: nn.Parameter, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     *scalars) -> None:
        """`optim.adamw_update` of `p` (its `scalars` from step_size on), writing the blocks instead of a copy."""
        from dsv3.lowp.fp8_kernels import adamw_weight_blocks

        adamw_weight_blocks(p, grad.contiguous(), exp_avg, exp_avg_sq, self.blocks, *scalars)


def own_compute_copy(module: nn.Module, name: str, p: nn.Parameter) -> WeightBlocks | None:
    """What dsv3.optim.ComputeCopies keeps of `p` in place of a bf16 copy: the blockwise FP8 experts' `WeightBlocks`;
    None for every other parameter."""
    return WeightBlocks(module, name, p) if isinstance(module, Fp8BlockwiseExperts) else None
