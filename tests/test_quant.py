"""Low precision (paper §3.3, dsv3.lowp.quant): what gets converted, how close the numerics stay to bf16,
routed-expert token groups padded without changing results or reading anything on the host, the start-up
checks; on a GPU, short training runs in each mode."""

import copy
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import free_port, leave_process_group
from torch import nn

from dsv3 import moe as moe_module
from dsv3 import parallel, token_copies
from dsv3.config import FLAVORS, load_config
from dsv3.lowp import quant
from dsv3.model import RMSNorm, Transformer
from dsv3.moe import MLP, GroupedExperts, MoE, Router, grouped_mm
from dsv3.token_copies import TokenCopies, gather_token_copies, pad_order, row_of_slot

ROOT = Path(__file__).resolve().parents[1]
CFG = FLAVORS["debug"]  # every dim a multiple of 32: each precision converts every eligible linear
MTP_AND_HEAD = {"head", "mtp.0.eh_proj", "mtp.0.block.attn.wq_a", "mtp.0.block.attn.wq_b", "mtp.0.block.attn.wkv_a",
                "mtp.0.block.attn.wkv_b", "mtp.0.block.attn.wo", "mtp.0.block.ffn.shared_experts.w1",
                "mtp.0.block.ffn.shared_experts.w2", "mtp.0.block.ffn.shared_experts.w3"}


def converted_class(precision: str) -> type:
    if precision == "fp8":
        from torchao.float8.float8_linear import Float8Linear
        return Float8Linear
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    return MXFP8Linear


def moe_layer(align: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> MoE:
    """A debug-sized MoE with weights large enough that every expert's output matters."""
    torch.manual_seed(seed)
    moe = MoE(CFG).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.1)
    moe.dispatcher.align = align
    return moe


# -------------------------------------------------------------------------------------- what is converted


@pytest.mark.parametrize("precision,expert_precision", [("fp8", "low"), ("mxfp8", "low"), ("mxfp8-emulated", "bf16")])
def test_only_trunk_linears_are_converted_and_names_are_unchanged(precision, expert_precision):
    model = Transformer(CFG)
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}

    # one GPU; under FSDP2 tensorwise weights become fp8-all-gather subclasses (test_fp8_recipes_configure_torchao...)
    converted = quant.apply(model, precision, expert_precision, fsdp=False)

    assert set(converted) == linears - MTP_AND_HEAD
    modules = dict(model.named_modules())
    for name in converted:
        assert isinstance(modules[name], converted_class(precision)), name
    for name in MTP_AND_HEAD:  # output head and MTP modules: plain bf16 linears
        assert type(modules[name]) is nn.Linear, name
    assert type(model.embed) is nn.Embedding
    assert all(type(m) is Router for n, m in modules.items() if n.endswith("ffn.gate"))
    assert all(type(m) is RMSNorm for n, m in modules.items() if n.endswith("norm"))
    # the same Parameters under the same names: FSDP, the optimizer and checkpoints see no difference
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    low = expert_precision == "low"
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        assert moe.dispatcher.align == (quant.GROUP_ALIGN[precision] if low else 1)
        assert (type(moe.experts) is GroupedExperts) != low


def test_precision_skip_keeps_the_named_linears_bf16():
    cfg = load_config(None, ['--train.precision_skip=["attn", "shared_experts"]'])
    model = Transformer(CFG)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)} - MTP_AND_HEAD

    converted = quant.apply(model, "mxfp8-emulated", "bf16", skip=cfg.train.precision_skip)

    kept = {n for n in linears if ".attn." in n or ".shared_experts." in n}
    assert kept and converted and set(converted) == linears - kept
    assert all(type(model.get_submodule(n)) is nn.Linear for n in kept)


def test_precision_skip_fragment_naming_no_linear_is_one_clear_error():
    with pytest.raises(ValueError, match="'atn' names none of the linears"):
        quant.apply(Transformer(CFG), "mxfp8-emulated", "bf16", skip=["atn"])


def test_bf16_changes_nothing():
    model = Transformer(CFG)
    before = {n: type(m) for n, m in model.named_modules()}
    assert quant.apply(model, "bf16", "low") == []
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(m.dispatcher.align == 1 for m in model.modules() if isinstance(m, MoE))


@pytest.mark.parametrize("precision,recipe", [("mxfp8-emulated", "rowwise"), ("fp8", "tensorwise"), ("fp8", "rowwise")])
def test_conversion_on_the_meta_device_then_materialise(precision, recipe):
    """train.py converts the meta-device model (CUDA), then runs to_empty + init_weights."""
    with torch.device("meta"):
        model = Transformer(CFG)
    quant.apply(model, precision, "low", recipe)
    model.to_empty(device="cpu")
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.layers["0"].attn.wq_a.weight.std().item() == pytest.approx(CFG.init_std, rel=0.1)


def test_expert_dims_that_low_precision_cannot_take_are_a_clear_error():
    model = Transformer(replace(CFG, moe_inter_dim=48))
    with pytest.raises(ValueError, match="moe_inter_dim .48. divisible by 32.*expert_precision=bf16"):
        quant.apply(model, "mxfp8-emulated", "low")


def model_671b_cut() -> Transformer:
    """configs/671b_3layer.toml's model (1 dense + 2 MoE layers at the 671B's widths) on the meta device."""
    with torch.device("meta"):
        return Transformer(load_config(str(ROOT / "configs" / "671b_3layer.toml"), []).model_config())


def test_fp8_converts_only_linears_at_least_fp8_min_features_wide():
    model = model_671b_cut()
    trunk = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "head"}

    converted = set(quant.apply(model, "fp8", "bf16", "rowwise", fp8_min_features=2048))

    wide = {n for n, m in trunk.items() if min(m.in_features, m.out_features) >= 2048}
    assert converted == wide
    # at the 671B's widths: the dense FFN, the shared experts and wo are converted; MLA's low-rank projections
    # (q_lora_rank 1536, kv_lora_rank 512) are not
    assert {"layers.0.ffn.w1", "layers.0.ffn.w2", "layers.1.ffn.shared_experts.w2", "layers.1.attn.wo"} <= converted
    assert not converted & {"layers.0.attn.wq_a", "layers.0.attn.wq_b", "layers.0.attn.wkv_a", "layers.0.attn.wkv_b"}
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is nn.Linear for n in set(trunk) - converted)


def test_the_shape_rule_is_fp8_only():
    """MXFP8 and the others keep converting every linear their kernels can take."""
    model = model_671b_cut()
    assert "layers.0.attn.wkv_b" in quant.apply(model, "mxfp8-emulated", "bf16")


def test_fp8_recipes_configure_torchao_and_keep_the_weight_parameters():
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    def convert(recipe: str, fsdp: bool = True) -> tuple[nn.Parameter, nn.Module]:
        model = Transformer(CFG)
        weight = model.layers["0"].ffn.w1.weight
        quant.apply(model, "fp8", "bf16", recipe, fsdp=fsdp)
        return weight, model.layers["0"].ffn.w1

    weight, rowwise = convert("rowwise")
    assert rowwise.weight is weight and type(rowwise.weight) is nn.Parameter  # rowwise scales are not all-gathered
    assert rowwise.config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
    _, sharded = convert("tensorwise")  # FSDP2 all-gathers the weight in fp8
    assert isinstance(sharded.weight, WeightWithDynamicFloat8CastTensor)
    weight, unsharded = convert("tensorwise", fsdp=False)  # no FSDP: no all-gather, no weight subclass
    assert unsharded.weight is weight and type(unsharded.weight) is nn.Parameter
    assert type(unsharded) is Float8Linear  # torchao's, as under FSDP2


# ------------------------------------------------------------------------------------------- numerics

def _cpu_scaled_mm_takes_row_scales() -> bool:
    a = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


# MXFP8 and fp8 store e4m3: 3 mantissa bits, so each element is rounded by up to 2^-4 relative; one GEMM then
# differs from bf16 by ~0.04 relative (measured), SwiGLU experts (two GEMMs) by ~0.065. The logits
# differ less (measured 0.020-0.023 over seeds 0-3 and all three modes) because the residual stream carries the
# unquantized embedding: bound 0.05. Gradients: over all parameters together the cosine similarity measured
# 0.9997-1.0000, so > 0.999; per parameter the router gate's is the lowest (0.964-0.99, as a few tokens' top-k
# flips), so > 0.95. fp8 runs here through torchao's CPU `_scaled_mm`, as a numerics check only: check_precision
# still refuses fp8 training on a CPU (no speed-up, and its expert GEMM needs Triton).
@pytest.mark.parametrize("precision,expert_precision,recipe", [
    ("mxfp8-emulated", "bf16", "rowwise"), ("mxfp8-emulated", "low", "rowwise"),
    ("fp8", "bf16", "rowwise"), ("fp8", "bf16", "tensorwise")])
def test_low_precision_model_stays_close_to_bf16(precision, expert_precision, recipe):
    if precision == "fp8" and recipe == "rowwise" and not _cpu_scaled_mm_takes_row_scales():
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only (torch 2.11; 2.13 takes row scales)")
    torch.manual_seed(0)
    reference = Transformer(CFG).to(torch.bfloat16)  # MXFP8 emulation quantizes from bf16
    model = copy.deepcopy(reference)
    quant.apply(model, precision, expert_precision, recipe)
    tokens = torch.randint(0, CFG.vocab_size, (2, 65))  # 128 tokens: whole 32-token MXFP8 blocks

    logits_ref, logits = reference(tokens[:, :-1]).float(), model(tokens[:, :-1]).float()
    assert ((logits - logits_ref).norm() / logits_ref.norm()).item() < 0.05
    for m in (reference, model):
        out = m(tokens[:, :-1], tokens[:, 1:])
        (out.loss + sum(out.mtp_losses) + out.balance_loss).backward()
    grads_ref = [p.grad.float().flatten() for p in reference.parameters() if p.grad is not None]
    grads = [p.grad.float().flatten() for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(grads_ref)
    assert F.cosine_similarity(torch.cat(grads), torch.cat(grads_ref), dim=0).item() > 0.999
    for g, g_ref in zip(grads, grads_ref):
        assert F.cosine_similarity(g, g_ref, dim=0).item() > 0.95


def test_mxfp8_emulated_experts_follow_the_bf16_experts():
    torch.manual_seed(0)
    experts = GroupedExperts(8, CFG.dim, CFG.moe_inter_dim).to(torch.bfloat16)
    with torch.no_grad():
        experts.w13.normal_(std=0.05)
        experts.w2.normal_(std=0.05)
    low = quant.MXFP8Experts(8, CFG.dim, CFG.moe_inter_dim, emulated=True).to(torch.bfloat16)
    low.load_state_dict(experts.state_dict())
    x = torch.randn(256, CFG.dim, dtype=torch.bfloat16)
    counts = torch.tensor([64, 0, 32, 32, 0, 96, 0, 32])  # multiples of 32, empty experts included
    y_ref, y = experts(x, counts).float(), low(x, counts).float()
    assert 0 < ((y - y_ref).norm() / y_ref.norm()).item() < 0.1  # measured 0.065: two e4m3 GEMMs
    # fp32 operands (CPU training keeps fp32 weights) are quantized from bf16 and come back in fp32
    assert low.float()(x.float(), counts).dtype == torch.float32


@pytest.mark.slow
def test_mxfp8_emulated_imports_torchao_without_its_enum_deprecation_warnings():
    """torchao 0.18 registers its config enums as pytree constants, which torch 2.13 deprecates with a warning per
    enum when torchao is imported: a fresh process, so that nothing imported torchao before."""
    code = ("import torch; from dsv3.lowp import quant; from dsv3.config import FLAVORS;"
            "from dsv3.model import Transformer; model = Transformer(FLAVORS['debug']);"
            "quant.check_precision('mxfp8-emulated', 'low', torch.device('cpu'));"
            "quant.apply(model, 'mxfp8-emulated', 'low'); print(type(model.layers['0'].attn.wo).__name__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "MXFP8Linear\n", done.stderr
    assert "Enum subclass" not in done.stderr and "deprecated" not in done.stderr, done.stderr


def test_rowwise_fp8_scales_each_row_by_a_power_of_two_that_fills_e4m3():
    torch.manual_seed(0)
    x = torch.randn(64, 96, dtype=torch.bfloat16) * torch.logspace(-6, 6, 64)[:, None].bfloat16()
    x[3] = 0  # an all-zero row stays zero, with a finite scale
    data, scales = quant.to_fp8_rowwise(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape and scales.shape == (64,)
    assert torch.isfinite(scales).all() and (scales.log2() == scales.log2().round()).all()
    amax = data.float().abs().amax(dim=-1)
    nonzero = amax > 0
    # the largest element of each row lands in [224, 448]: the top binade of e4m3, never past it
    assert ((amax[nonzero] >= 224) & (amax[nonzero] <= 448)).all() and nonzero.sum() == 63
    dequantized = data.float() / scales[:, None]
    # e4m3 keeps 3 mantissa bits: each element within half an ulp (2^-4 relative) of the row's scale, or subnormal
    error = (dequantized - x.float()).abs()
    assert (error <= x.float().abs() * 2 ** -4 + 2 ** -10 / scales[:, None]).all()


# ------------------------------------------------------------------------------- padded expert groups


def pad_groups(x, expert_of_row, counts, align, bucket=False):
    """Rows x [N, D] sorted by expert, in `pad_order`'s buffer as the dispatchers fill it (padding rows zero), with
    the padded counts and the buffer row of each row of x."""
    order, padded_counts = pad_order(torch.arange(x.size(0)), expert_of_row, counts, align, bucket)
    return gather_token_copies(x, order, 1), padded_counts, row_of_slot(order, x.size(0))


def test_group_of_row_follows_the_group_ends_and_marks_the_rows_past_them():
    offsets = torch.tensor([128, 128, 384, 512], dtype=torch.int32)  # group 1 empty
    groups = quant.group_of_row(offsets, 768)
    assert groups.dtype == torch.int32
    expected = torch.cat([torch.full((128,), 0), torch.full((256,), 2), torch.full((128,), 3), torch.full((256,), -1)])
    assert torch.equal(groups, expected.int())


def test_fp8_blockwise_experts_swap_the_grouped_gemm_at_any_dense_precision():
    model = Transformer(replace(CFG, moe_inter_dim=128))
    assert quant.apply(model, "bf16", "fp8-blockwise") == []
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(type(m.experts) is quant.Fp8BlockwiseExperts for m in moes)
    assert all(m.dispatcher.align == 128 for m in moes)
    with pytest.raises(ValueError, match=r"expert_precision=fp8-blockwise needs model.dim \(128\) and "
                                         r"model.moe_inter_dim \(64\) divisible by 128"):
        quant.apply(Transformer(CFG), "fp8", "fp8-blockwise")


def test_fp8_blockwise_experts_need_hopper_and_name_the_deepgemm_install(monkeypatch):
    with pytest.raises(ValueError, match="fp8-blockwise runs DeepGEMM's Hopper kernels.*not on a CPU"):
        quant.check_precision("bf16", "fp8-blockwise", torch.device("cpu"))
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # B200
    with pytest.raises(ValueError, match="not on compute capability 10.0.*expert_precision=low"):
        quant.check_precision("fp8", "fp8-blockwise", gpu, tokens=4096)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # makes `import deep_gemm` raise ImportError
    with pytest.raises(ImportError, match="fp8-blockwise needs DeepGEMM.*scripts/install_deepgemm.sh"):
        quant.check_precision("fp8", "fp8-blockwise", gpu, tokens=4096)


def test_pad_order():
    """Every group starts at a multiple of `align` and holds at least `align` rows: an empty expert (1, and the
    last) gets a block of zero rows, never a group of none. The rows after the last group belong to no expert."""
    counts = torch.tensor([3, 0, 33, 1, 0])
    expert_of_row = torch.arange(5).repeat_interleave(counts)
    x = torch.arange(1.0, 38.0).unsqueeze(1).expand(37, 2)

    padded_x, padded_counts, rows = pad_groups(x, expert_of_row, counts, align=32)

    assert padded_x.shape == (224, 2)  # round_up(37 + 5·32, 32): a static size
    assert padded_counts.tolist() == [32, 32, 64, 32, 32]  # multiples of 32, none empty; 32 rows after them
    assert rows.tolist() == [0, 1, 2] + list(range(64, 97)) + [128]
    torch.testing.assert_close(padded_x[rows], x)
    keep = torch.zeros(224, dtype=torch.bool)
    keep[rows] = True
    assert (padded_x[~keep] == 0).all()


def test_bucketed_buffers_take_few_sizes_for_varying_token_counts():
    """Expert parallelism receives a different N every step; torchao autotunes its kernels per row count."""
    sizes = set()
    for n in range(2000, 4000):
        counts = torch.tensor([n - 15, 0, 12, 3])
        x = torch.ones(n, 1)
        expert_of_row = torch.arange(4).repeat_interleave(counts)
        padded_x, padded_counts, rows = pad_groups(x, expert_of_row, counts, 32, bucket=True)
        exact = -(-(n + 4 * 32) // 32) * 32
        assert exact <= padded_x.size(0) <= exact * 17 / 16 and padded_x.size(0) % 32 == 0
        assert padded_counts.sum().item() <= padded_x.size(0) and (padded_counts % 32 == 0).all()
        assert padded_x[rows].sum().item() == n and padded_x.sum().item() == n
        sizes.add(padded_x.size(0))
    assert len(sizes) <= 20  # one octave: 16 sizes (vs 63 multiples of 32)


def test_bucketed_buffers_compile_once_for_all_token_counts():
    """Under torch.compile a new received-token count recompiles once (static → dynamic), then never again:
    the bucket's octave (`bit_length`) once pinned the exact count and recompiled for every new one."""
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm

    padded = torch.compile(lambda x, expert_of_row, counts: pad_groups(x, expert_of_row, counts, 16, bucket=True),
                           backend=count)
    for step, n in enumerate((100, 130, 170, 260, 400, 1000)):
        expert_of_row = torch.randint(0, 4, (n,)).sort().values
        counts = torch.bincount(expert_of_row, minlength=4)
        x = torch.randn(n, 8)
        for got, want in zip(padded(x, expert_of_row, counts), pad_groups(x, expert_of_row, counts, 16, bucket=True)):
            assert torch.equal(got, want)
        if step == 1:
            compiled_for_two = len(graphs)
    assert len(graphs) == compiled_for_two


@pytest.mark.parametrize("align", [16, 32])
def test_padded_expert_groups_give_the_unpadded_result(align):
    moe, padded = moe_layer(align=1), moe_layer(align=align)
    for m in (moe, padded):  # experts 1, 5 and the last never chosen: empty groups, the last one included
        m.gate.expert_bias[[1, 5, 7]] = -100.0
    x = torch.randn(2, 40, CFG.dim)
    x_ref, x_pad = x.clone().requires_grad_(), x.clone().requires_grad_()

    out_ref, out = moe(x_ref), padded(x_pad)
    assert (out_ref.tokens_per_expert[[1, 5, 7]] == 0).all()
    r = torch.randn_like(out_ref.y)  # a real gradient: _grouped_mm's CPU backward rejects stride-0 ones
    (out_ref.y * r).sum().backward()
    (out.y * r).sum().backward()

    torch.testing.assert_close(out.y, out_ref.y, rtol=0, atol=1e-6)
    torch.testing.assert_close(x_pad.grad, x_ref.grad, rtol=0, atol=1e-6)
    for (name, p), q in zip(padded.named_parameters(), moe.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)


class _EmptyGroupsGetGradients(torch.autograd.Function):
    """torch._grouped_mm as on B200 (pytorch #172439): the weight gradient of a group of no rows is not zero."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets)
        return torch._grouped_mm(x, w, offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offsets = ctx.saved_tensors
        with torch.enable_grad():
            x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
            grad_x, grad_w = torch.autograd.grad(torch._grouped_mm(x, w, offs=offsets), (x, w), grad)
        empty = offsets.diff(prepend=offsets.new_zeros(1)) == 0
        return grad_x, grad_w.masked_fill(empty[:, None, None], 1.0), None


def b200_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _EmptyGroupsGetGradients.apply(x, w.to(x.dtype), offsets)


@pytest.mark.parametrize("align", [1, 16])
def test_experts_without_tokens_get_zero_weight_gradients_from_a_grouped_gemm_that_mishandles_empty_groups(
        align, monkeypatch):
    """Where the bf16 grouped GEMM needs it (B200, emulated here) and for the low-precision ones (align > 1), an
    expert without tokens gets a block of zero rows: its weight gradient is exactly zero and nothing else changes."""
    monkeypatch.setattr(token_copies, "_empty_groups_break_grouped_mm", lambda device: True)
    monkeypatch.setattr(moe_module, "grouped_mm", b200_grouped_mm)
    moe, padded = moe_layer(align=1), moe_layer(align=align)
    for m in (moe, padded):  # experts 1, 5 and the last never chosen
        m.gate.expert_bias[[1, 5, 7]] = -100.0
    x = torch.randn(2, 40, CFG.dim)
    r = torch.randn(2, 40, CFG.dim)
    with monkeypatch.context() as plain:  # the reference: the CPU's grouped GEMM, no padding
        plain.setattr(token_copies, "_empty_groups_break_grouped_mm", lambda device: False)
        plain.setattr(moe_module, "grouped_mm", grouped_mm)
        out_ref = moe(x)
        (out_ref.y * r).sum().backward()
    out = padded(x)
    (out.y * r).sum().backward()

    assert (out.tokens_per_expert[[1, 5, 7]] == 0).all()
    torch.testing.assert_close(out.y, out_ref.y, rtol=0, atol=1e-6)
    for name in ("w13", "w2"):
        grad = getattr(padded.experts, name).grad
        assert (grad[[1, 5, 7]] == 0).all(), name
        torch.testing.assert_close(grad, getattr(moe.experts, name).grad, rtol=0, atol=1e-6, msg=name)


def test_padding_reads_nothing_on_the_host():
    """Meta tensors have no values: any .item(), .tolist() or data-dependent shape would raise. The padded MoE
    runs forward and backward on them, so its buffer sizes and offsets never leave the device."""
    with torch.device("meta"):
        moe = MoE(CFG).to(torch.bfloat16)
        x = torch.randn(2, 24, CFG.dim, dtype=torch.bfloat16)
    moe.dispatcher.align = 32
    with pytest.raises(RuntimeError, match="meta"):
        x.sum().item()
    out = moe(x)
    (out.y * torch.randn_like(out.y)).sum().backward()
    assert out.y.shape == x.shape and moe.experts.w13.grad.shape == moe.experts.w13.shape


def test_padded_moe_compiles_into_one_graph():
    moe = moe_layer(align=32, dtype=torch.bfloat16)
    reference = copy.deepcopy(moe)
    reference.dispatcher.align = 1
    x = torch.randn(2, 24, CFG.dim, dtype=torch.bfloat16)
    out = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out.y, reference(x).y, rtol=0, atol=0)


def _ep_worker(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = replace(CFG, n_layers=2, n_mtp_layers=0, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(cfg)
    reference = copy.deepcopy(model)  # one process, unpadded groups
    for moe in parallel.moe_layers(model):
        moe.dispatcher.align = 32  # as dsv3.lowp.quant sets it, before expert parallelism
    parallel.apply_expert_parallel(model, parallel.build_meshes("cpu", world, world))
    tokens = torch.randint(0, cfg.vocab_size, (2 * world, 17), generator=torch.Generator().manual_seed(1))
    local = tokens[2 * rank:2 * rank + 2]
    out = model(local[:, :-1], local[:, 1:])
    out.loss.backward()
    for p in model.parameters():
        if not isinstance(p, dist.tensor.DTensor):  # the dense parameters: sum the ranks' gradients
            dist.all_reduce(p.grad)
    expected_loss = reference(local[:, :-1], local[:, 1:]).loss
    sum(reference(tokens[2 * r:2 * r + 2, :-1], tokens[2 * r:2 * r + 2, 1:]).loss for r in range(world)).backward()
    n_local = cfg.n_routed_experts // world
    errors = {"aligns": [m.dispatcher.align for m in parallel.moe_layers(model)],
              "loss": (out.loss - expected_loss).abs().item()}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.to_local() if isinstance(p, dist.tensor.DTensor) else p.grad
        expected = q.grad[rank * n_local:(rank + 1) * n_local] if isinstance(p, dist.tensor.DTensor) else q.grad
        errors[name] = (grad - expected).abs().max().item()
    if rank == 0:
        torch.save(errors, out_path)
    leave_process_group()


@pytest.mark.slow
def test_all_to_all_dispatcher_keeps_the_alignment_and_matches_one_process(tmp_path):
    out = tmp_path / "errors.pt"
    mp.spawn(_ep_worker, args=(2, free_port(), str(out)), nprocs=2)
    errors = torch.load(out)
    assert errors.pop("aligns") == [32]
    assert max(errors.values()) < 1e-5, errors


# ---------------------------------------------------------------------------------------- start-up checks


def test_modes_the_device_cannot_run_are_clear_errors(monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="mxfp8 needs a compute-capability-10 GPU.*not a CPU.*fp8.*mxfp8-emulated"):
        quant.check_precision("mxfp8", "bf16", cpu)
    with pytest.raises(ValueError, match="fp8 needs a CUDA GPU.*bf16.*mxfp8-emulated"):
        quant.check_precision("fp8", "low", cpu)
    with pytest.raises(ValueError, match="unknown train.precision='fp4'.*bf16, fp8, mxfp8, mxfp8-emulated"):
        quant.check_precision("fp4", "bf16", cpu)
    with pytest.raises(ValueError, match="unknown train.expert_precision='fp8'"):
        quant.check_precision("bf16", "fp8", cpu)
    with pytest.raises(ValueError, match="unknown train.fp8_recipe='deepseek'.*rowwise, tensorwise"):
        quant.apply(Transformer(CFG), "fp8", "bf16", "deepseek")
    with pytest.raises(ValueError, match=r"micro_batch × train.seq_len \(252\) to be a multiple of 32"):
        quant.check_precision("mxfp8-emulated", "bf16", cpu, tokens=4 * 63)
    quant.check_precision("bf16", "bf16", cpu, tokens=4 * 63)
    quant.check_precision("mxfp8-emulated", "low", cpu, tokens=4 * 64)

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # H100
    with pytest.raises(ValueError, match="not compute capability 9.0.*--train.precision=fp8"):
        quant.check_precision("mxfp8", "low", gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # A100
    with pytest.raises(ValueError, match="fp8 needs compute capability >= 8.9.*this GPU has 8.0"):
        quant.check_precision("fp8", "bf16", gpu)


def test_fp8_needs_a_gpu_and_whole_16_token_blocks(monkeypatch):
    with pytest.raises(ValueError, match="fp8 needs a CUDA GPU"):
        quant.check_precision("fp8", "bf16", torch.device("cpu"))
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match=r"fp8 needs .*\(4008\) to be a multiple of 16"):
        quant.check_precision("fp8", "bf16", gpu, tokens=8 * 501)
    quant.check_precision("fp8", "bf16", gpu, tokens=8 * 500, fp8_recipe="rowwise")  # 16 divides 4000


def test_fp8_experts_without_triton_name_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ImportError, match="expert_precision=low with fp8 runs dsv3's Triton kernels: pip install "
                                          "triton"):
        quant.check_precision("fp8", "low", torch.device("cuda", 0), tokens=4096)
    quant.check_precision("fp8", "bf16", torch.device("cuda", 0), tokens=4096)  # dense fp8 needs no Triton


def test_missing_torchao_names_the_install_command(monkeypatch):
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao...` raise ImportError
    with pytest.raises(ImportError, match="pip install torchao"):
        quant.check_precision("mxfp8-emulated", "bf16", torch.device("cpu"))
    quant.check_precision("bf16", "low", torch.device("cpu"))  # bf16 never needs torchao


# ------------------------------------------------------------------------------------------------ GPU


def _train(tmp_path, *overrides: str) -> list[dict]:
    """train.main on the debug model for 20 steps on tiny data; returns metrics.jsonl."""
    import train
    from scripts.prepare_data import prepare

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(120):
        (docs / f"{i}.txt").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(12)))
    data = tmp_path / "data"
    prepare([str(docs)], str(ROOT / "data" / "tokenizer.model"), str(data), progress=False)
    run = tmp_path / "run"
    # fp8_min_features=0: the debug model's narrow linears are converted too (a speed rule, not a numerics one)
    train.main(["--train.fp8_min_features=0", "--train.steps=20", "--train.global_batch=8", "--train.micro_batch=4",
                "--train.seq_len=64", "--train.warmup_steps=2", "--train.lr=1e-3", "--train.val_every=0",
                "--log.every=5", f"--data.path={data}", f"--checkpoint.dir={run}", "--checkpoint.export=false",
                *overrides])
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [
    ("--train.precision=fp8", "--train.fp8_recipe=tensorwise"),
    ("--train.precision=fp8",),  # rowwise
    ("--train.precision=fp8", "--train.expert_precision=low"),
    ("--train.precision=mxfp8-emulated", "--train.expert_precision=low"),
    ("--train.expert_precision=fp8-blockwise", "--model.moe_inter_dim=128"),
])
def test_low_precision_trains_on_cuda(tmp_path, overrides):
    if torch.cuda.get_device_capability() < (8, 9) and "--train.precision=fp8" in overrides:
        pytest.skip("fp8 needs compute capability >= 8.9")
    if "--train.expert_precision=fp8-blockwise" in overrides:
        if torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("DeepGEMM's FP8 kernels here are Hopper's")
        pytest.importorskip("deep_gemm", reason="scripts/install_deepgemm.sh builds it")
    metrics = _train(tmp_path, *overrides)  # train.main raises on the first non-finite loss
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses)))  # steps 1, 5, 10, 15, 20
    assert losses[-1] < losses[0]


@pytest.mark.gpu
def test_fp8_rowwise_experts_follow_the_bf16_experts_on_cuda():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    torch.manual_seed(0)
    experts = GroupedExperts(8, CFG.dim, CFG.moe_inter_dim).to("cuda", torch.bfloat16)
    with torch.no_grad():
        experts.w13.normal_(std=0.05)
        experts.w2.normal_(std=0.05)
    low = quant.Fp8RowwiseExperts(8, CFG.dim, CFG.moe_inter_dim).to("cuda", torch.bfloat16)
    low.load_state_dict(experts.state_dict())
    x = torch.randn(256, CFG.dim, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([64, 0, 32, 16, 16, 96, 0, 32], device="cuda")  # multiples of 16
    y_ref, y = experts(x, counts), low(x, counts)
    r = torch.randn_like(y)
    (y_ref * r).sum().backward()
    (y * r).sum().backward()
    assert 0 < ((y - y_ref).float().norm() / y_ref.float().norm()).item() < 0.1
    for p, q in zip(low.parameters(), experts.parameters()):
        assert F.cosine_similarity(p.grad.float().flatten(), q.grad.float().flatten(), dim=0).item() > 0.99


@pytest.mark.gpu
def test_fp8_tiles_scale_each_1x128_tile_by_a_power_of_two_that_fills_e4m3():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's e4m3 needs compute capability >= 8.9")
    from dsv3.lowp.fp8_kernels import fp8_tiles

    torch.manual_seed(0)
    # 326 rows: the last of 3 programs of 128 rows is part-filled, its last step of TILE_ROWS too
    x = (torch.randn(326, 384, device="cuda") * torch.logspace(-3, 3, 384, device="cuda")).bfloat16()
    x[3, 128:256] = 0  # an all-zero tile
    data, inv_scales, block_amax = fp8_tiles(x)
    assert data.dtype == torch.float8_e4m3fn and inv_scales.shape == (326, 3) and inv_scales.stride() == (1, 326)
    tiles = x.float().view(326, 3, 128)
    scales = torch.exp2(torch.floor(torch.log2(448 / tiles.abs().amax(-1).clamp(min=1e-12))))
    assert torch.equal(inv_scales, 1 / scales)
    expected = (tiles * scales[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(326, 384)
    assert torch.equal(data.view(torch.uint8), expected.view(torch.uint8))
    assert (data[3, 128:256].float() == 0).all()
    blocks = torch.nn.functional.pad(x.float().abs(), (0, 0, 0, 384 - 326)).view(3, 128, 384)
    assert torch.equal(block_amax, blocks.amax(1))  # each column's amax over each block of 128 rows


@pytest.mark.gpu
def test_fp8_weight_blocks_quantize_each_128x128_block_and_its_transpose_from_one_scale():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's e4m3 needs compute capability >= 8.9")
    from dsv3.lowp.fp8_kernels import fp8_weight_blocks

    torch.manual_seed(0)
    w = (torch.randn(3, 256, 384, device="cuda") * torch.logspace(-2, 2, 384, device="cuda")).bfloat16()
    w[1, :128, 256:] = 0  # an all-zero block
    w_fp8, wt_fp8, inv_scales = fp8_weight_blocks(w)
    blocks = w.float().view(3, 2, 128, 3, 128)
    scales = torch.exp2(torch.floor(torch.log2(448 / blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12))))
    assert torch.equal(inv_scales, 1 / scales)
    expected = (blocks * scales[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(3, 256, 384)
    assert torch.equal(w_fp8.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(wt_fp8.view(torch.uint8), expected.transpose(-2, -1).contiguous().view(torch.uint8))


@pytest.mark.gpu
def test_fp8_blockwise_experts_follow_the_bf16_experts_compiled_or_not():
    """DeepGEMM's grouped GEMM in DeepSeek-V3's block recipe: output and both gradients close to bf16's, eager and
    compiled (an output aliasing DeepGEMM's once lost its gradient under torch.compile)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("DeepGEMM's FP8 kernels here are Hopper's")
    pytest.importorskip("deep_gemm", reason="scripts/install_deepgemm.sh builds it")
    torch.manual_seed(0)
    dim, inter = 256, 384
    counts = torch.tensor([300, 0, 128, 517, 64, 129, 1, 250])
    padded = (counts.clamp(min=1) + 127) // 128 * 128
    offsets = padded.cumsum(0).to(torch.int32).cuda()
    real = torch.cat([torch.arange(n) < c for c, n in zip(counts.tolist(), padded.tolist())] +
                     [torch.zeros(256, dtype=torch.bool)]).cuda()  # rows past the last group: skipped (group −1)
    x = torch.randn(real.numel(), dim, device="cuda", dtype=torch.bfloat16) * real[:, None]
    w = (torch.randn(8, 2 * inter, dim, device="cuda") * 0.05).bfloat16().requires_grad_()
    grad = torch.randn(real.numel(), 2 * inter, device="cuda", dtype=torch.bfloat16) * real[:, None]

    def run(gemm):
        xx = x.clone().requires_grad_()
        w.grad = None
        y = gemm(xx, w.transpose(-2, -1), offsets)
        y.backward(grad)
        return y[real].float(), xx.grad[real].float(), w.grad.float()

    reference = run(lambda a, b, o: torch._grouped_mm(a, b, offs=o))
    for gemm in (quant.fp8_blockwise_grouped_mm, torch.compile(quant.fp8_blockwise_grouped_mm)):
        for ours, theirs in zip(run(gemm), reference):
            assert 0 < ((ours - theirs).norm() / theirs.norm()).item() < 0.06  # e4m3 on both operands


@pytest.mark.gpu
def test_fp8_rowwise_grouped_mm_matches_torchaos_compiled_or_not():
    """Same scales as torchao's _to_fp8_rowwise_then_scaled_grouped_mm, so the same GEMMs: output and both gradients
    agree, eager and compiled (where inductor fuses the row quantization)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    torch.manual_seed(0)
    w = (torch.randn(4, 2 * CFG.moe_inter_dim, CFG.dim, device="cuda") * 0.05).bfloat16().requires_grad_()
    x = torch.randn(160, CFG.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.tensor([32, 32, 112, 160], device="cuda", dtype=torch.int32)  # an empty group included
    grad = torch.randn(160, 2 * CFG.moe_inter_dim, device="cuda", dtype=torch.bfloat16)

    def run(gemm):
        x.grad = w.grad = None
        y = gemm(x, w.transpose(-2, -1), offsets)
        y.backward(grad)
        return y.float(), x.grad.float(), w.grad.float()

    reference = run(lambda *a: _to_fp8_rowwise_then_scaled_grouped_mm(*a, pad_token_groups_for_grouped_mm=False))
    for gemm in (quant.fp8_rowwise_grouped_mm, torch.compile(quant.fp8_rowwise_grouped_mm)):
        for ours, theirs in zip(run(gemm), reference):
            assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 300, 1000), (2, 130, 7168)])  # rows per program and column blocks left over
def test_fp8_weight_kernels_quantize_each_axis_as_to_fp8_rowwise(shape):
    """The experts' weights quantized along K (forward) and, from the column amaxes the first kernel records, along
    M and stored transposed (input gradient): bit for bit what `to_fp8_rowwise` makes of the rows of W and Wᵀ."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    from dsv3.lowp.fp8_kernels import fp8_weight_cols, fp8_weight_rows

    torch.manual_seed(0)
    n_experts, m, k = shape
    w = torch.randn(shape, device="cuda") * torch.logspace(-4, 4, m, device="cuda")[:, None]
    w[1, 7] = 0  # an all-zero row gets a finite scale
    w = w.bfloat16()
    for ours, layout in (fp8_weight_rows(w)[:2], w), (fp8_weight_cols(w, fp8_weight_rows(w)[2]), w.transpose(1, 2)):
        data, scales = ours
        expected_data, expected_scales = quant.to_fp8_rowwise(layout.reshape(-1, layout.size(-1)))
        assert data.shape == layout.shape and data.is_contiguous() and scales.shape == layout.shape[:2]
        assert torch.equal(data.view(torch.uint8).flatten(), expected_data.view(torch.uint8).flatten())
        assert torch.equal(scales.flatten(), expected_scales)


@pytest.mark.gpu
def test_fp8_group_kernel_quantizes_each_groups_columns_as_to_fp8_rowwise():
    """The weight gradient's operands: each expert's group of rows scaled per column and stored column-major, bit for
    bit what `to_fp8_rowwise` makes of the group's transposed rows; an empty group included."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    from dsv3.lowp.fp8_kernels import fp8_group_cols

    torch.manual_seed(0)
    sizes = [48, 0, 640, 16, 272]  # groups longer and shorter than the kernel's block of 256 rows
    x = (torch.randn(sum(sizes), 200, device="cuda") * torch.logspace(-4, 4, 200, device="cuda")).bfloat16()
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    data, scales = fp8_group_cols(x, offsets)
    assert data.shape == x.shape and data.stride() == (1, x.size(0)) and scales.shape == (len(sizes) * 200,)
    assert torch.isfinite(scales).all()
    for group, rows in enumerate(torch.arange(x.size(0), device="cuda").split(sizes)):
        if len(rows):
            expected_data, expected_scales = quant.to_fp8_rowwise(x[rows].t())
            assert torch.equal(data[rows].t().contiguous().view(torch.uint8), expected_data.view(torch.uint8))
            assert torch.equal(scales[group * 200:(group + 1) * 200], expected_scales)


@pytest.mark.gpu
def test_fp8_group_kernel_takes_its_scales_from_the_tiles_column_amaxes():
    """Blockwise experts: groups of whole 128-row blocks, each column's amax per block recorded by `fp8_tiles`; the
    group kernel's scales and data from those are bit for bit its own amax pass's. Rows past the last group (junk
    under DeepGEMM, here NaN) reach no scale."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    from dsv3.lowp.fp8_kernels import fp8_group_cols, fp8_tiles

    torch.manual_seed(0)
    sizes = [256, 128, 640, 128]
    x = (torch.randn(sum(sizes) + 128, 256, device="cuda") * torch.logspace(-4, 4, 256, device="cuda")).bfloat16()
    x[-128:] = float("nan")
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    real = int(offsets[-1])
    (data, scales), (data_own, scales_own) = fp8_group_cols(x, offsets, fp8_tiles(x)[2]), fp8_group_cols(x, offsets)
    assert torch.isfinite(scales).all() and torch.equal(scales, scales_own)
    assert torch.equal(data[:real].view(torch.uint8), data_own[:real].view(torch.uint8))


@pytest.mark.gpu
def test_fp8_quantization_kernels_gather_rows_as_they_read_them_bit_for_bit():
    """With `source_rows`, the tiles' and the group kernel's outputs are bit for bit theirs of the gathered rows
    (x[source_rows], zero rows at −1); the rows are never written out in bf16."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's e4m3 needs compute capability >= 8.9")
    from dsv3.lowp.fp8_kernels import fp8_group_cols, fp8_tiles

    torch.manual_seed(0)
    x = (torch.randn(200, 384, device="cuda") * torch.logspace(-3, 3, 384, device="cuda")).bfloat16()
    source_rows = torch.randint(0, 200, (640,), device="cuda")
    source_rows[torch.randperm(640, device="cuda")[:90]] = -1  # padding rows
    rows = torch.where((source_rows >= 0)[:, None], x[source_rows], 0)
    offsets = torch.tensor([256, 384, 640], device="cuda", dtype=torch.int32)  # whole 128-row blocks
    gathered, rows_first = fp8_tiles(x, source_rows), fp8_tiles(rows)
    for ours, theirs in zip(gathered + fp8_group_cols(x, offsets, gathered[2], source_rows),
                            rows_first + fp8_group_cols(rows, offsets, rows_first[2])):
        assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
        assert torch.equal(ours.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens, topk", [(300, 3), (300, 1), (0, 3)])  # topk 1: all-to-all; 0: EP, none received
def test_fp8_blockwise_experts_take_the_dispatchers_token_copies_bit_for_bit(n_tokens, topk):
    """`TokenCopies` (the rows gathered inside the GEMM's quantization) give the output and gradients of gathering
    the rows first, bit for bit, eager and compiled."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("DeepGEMM's FP8 kernels here are Hopper's")
    pytest.importorskip("deep_gemm", reason="scripts/install_deepgemm.sh builds it")
    torch.manual_seed(0)
    dim, inter = 256, 384
    counts = torch.bincount(torch.randint(0, 8, (n_tokens * topk,)), minlength=8)
    counts[1] = 0
    order = torch.randperm(n_tokens * topk)[:int(counts.sum())]
    order, padded = pad_order(order, torch.repeat_interleave(torch.arange(8), counts), counts, 128)
    order, offsets = order.cuda(), padded.cumsum(0).to(torch.int32).cuda()
    source = torch.randn(n_tokens, dim, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(8, 2 * inter, dim, device="cuda") * 0.05).bfloat16().requires_grad_()
    real = order >= 0  # rows past the last group are junk under DeepGEMM
    grad = torch.randn(order.numel(), 2 * inter, device="cuda", dtype=torch.bfloat16) * real[:, None]

    def run(gemm, gather_first):
        x = source.clone().requires_grad_()
        w.grad = None
        copies = TokenCopies(x, order, topk)
        y = gemm(copies.gather() if gather_first else copies, w.transpose(-2, -1), offsets)
        y.backward(grad)
        return y[real], x.grad, w.grad

    for gemm in (quant.fp8_blockwise_grouped_mm, torch.compile(quant.fp8_blockwise_grouped_mm)):
        for ours, theirs in zip(run(gemm, False), run(gemm, True)):
            assert torch.equal(ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens, topk", [(300, 3), (0, 3)])  # 0: EP, a rank that received no tokens
def test_fp8_blockwise_experts_sum_their_output_per_token_as_the_unfused_sum(n_tokens, topk):
    """`sum_copies` (the token sums made by the GEMM, whose backward quantizes ∂y_t · g_t,k as it reads ∂y) gives
    the output and the rows' and weights' gradients of summing the GEMM's output afterwards, bit for bit; the gate
    weights' within fp32 rounding (another order of summation), eager and compiled. Slots of expert 1 hold no row
    (DeepEP: another rank's expert), their weights junk."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("DeepGEMM's FP8 kernels here are Hopper's")
    pytest.importorskip("deep_gemm", reason="scripts/install_deepgemm.sh builds it")
    torch.manual_seed(0)
    dim, inter = 256, 384
    experts = torch.randint(0, 8, (n_tokens * topk,))
    counts = torch.bincount(experts, minlength=8)
    slots = torch.argsort(experts, stable=True)[:int(counts[0])].tolist() + \
        torch.argsort(experts, stable=True)[int(counts[:2].sum()):].tolist()  # expert 1's slots: no row
    counts[1] = 0
    order, padded = pad_order(torch.tensor(slots, dtype=torch.int64), torch.repeat_interleave(torch.arange(8), counts),
                              counts, 128)
    order, offsets = order.cuda(), padded.cumsum(0).to(torch.int32).cuda()
    x0 = torch.randn(order.numel(), inter, device="cuda", dtype=torch.bfloat16)
    gate0 = torch.rand(n_tokens, topk, device="cuda")
    gate0.view(-1)[torch.nonzero(experts == 1).squeeze(1).cuda()] = 7.0  # junk: no row holds these slots
    w = (torch.randn(8, dim, inter, device="cuda") * 0.05).bfloat16().requires_grad_()
    grad = torch.randn(n_tokens, dim, device="cuda", dtype=torch.bfloat16)

    def fused(x, w, copies):
        return quant.fp8_blockwise_grouped_mm(x, w.transpose(-2, -1), offsets, sum_copies=copies)

    def unfused(x, w, copies):
        return copies.sum(quant.fp8_blockwise_grouped_mm(x, w.transpose(-2, -1), offsets))

    def run(experts):
        x, gate = x0.clone().requires_grad_(), gate0.clone().requires_grad_()
        w.grad = None
        y = experts(x, w, TokenCopies(x0[:0], order, topk, gate))
        y.backward(grad)
        return y, x.grad[order >= 0], w.grad, gate.grad  # padding rows' gradients are junk under DeepGEMM

    # compiled: with the gate weights' rounding to bf16 kept, which inductor otherwise skips inside a kernel
    # where it sees the cast (here, in one of the two graphs but not the other: the sums then differ by that rounding)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        for wrap in (lambda f: f, torch.compile):
            *ours, ours_gate = run(wrap(fused))
            *theirs, theirs_gate = run(wrap(unfused))
            for a, b in zip(ours, theirs):
                assert torch.equal(a, b)
            torch.testing.assert_close(ours_gate, theirs_gate, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linears_never_wait_for_the_gpu(recipe):
    """No .item(), .tolist() or data-dependent branch in torchao's scaling: the host never waits for a step."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    torch.manual_seed(0)
    mlp = MLP(CFG.dim, CFG.inter_dim).to("cuda", torch.bfloat16)  # SwiGLU: three fp8 linears
    assert len(quant.apply(mlp, "fp8", "bf16", recipe, fsdp=False)) == 3
    x = torch.randn(256, CFG.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device→host copy or synchronize raises
    try:
        y = mlp(x)
        (y * torch.randn_like(y)).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(y).all() and torch.isfinite(mlp.w1.weight.grad).all()


@pytest.mark.gpu
def test_padded_moe_never_waits_for_the_gpu():
    moe = moe_layer(align=32, dtype=torch.bfloat16).cuda()
    x = torch.randn(2, 64, CFG.dim, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device→host copy or synchronize raises
    try:
        out = moe(x)
        (out.y * torch.randn_like(out.y)).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.y).all()


@pytest.mark.gpu
def test_mxfp8_below_compute_capability_10_is_refused_on_this_gpu():
    if torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("this GPU runs mxfp8")
    with pytest.raises(ValueError, match="mxfp8-emulated"):
        quant.check_precision("mxfp8", "bf16", torch.device("cuda", 0))
