"""dsv3.optim.AdamW: torch.optim.AdamW's update exactly with fp32 moments, clipping folded into the step,
unbiased bf16 rounding of the moments, and bf16 moments that train the debug model like fp32 ones. ComputeCopies,
one GPU's mixed precision, built here on a CPU model: the model holds its fp32 parameters outside `active()`
whatever happens inside, and micro-batches' gradients add up in fp32 as backward produces them."""

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port, leave_process_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dsv3 import hashing, optim, parallel
from dsv3.config import FLAVORS, Config, TrainConfig
from dsv3.model import Transformer
from dsv3.moe import GroupedExperts
from train import build_model, build_optimizer, train_step


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(11, generator=g))]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]


def test_fp32_state_matches_torch_adamw_exactly():
    ours, theirs = _params(), _params()
    mine = optim.AdamW(_groups(ours), lr=1e-2, betas=(0.9, 0.95), state_dtype=torch.float32)
    reference = torch.optim.AdamW(_groups(theirs), lr=1e-2, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    for step in range(1, 8):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        for group in mine.param_groups + reference.param_groups:
            group["lr"] = 1e-2 * step / 7  # a schedule: lr changes every step
        mine.step()
        reference.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine.state[p][key], reference.state[q][key])


def test_grad_scale_in_the_step_equals_clip_then_step():
    ours, theirs = _params(), _params()
    mine = optim.AdamW(_groups(ours), lr=1e-2, state_dtype=torch.float32)
    reference = torch.optim.AdamW(_groups(theirs), lr=1e-2)
    for step in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.full(p.shape, 10.0 * (step + 1)) + torch.arange(p.numel()).view(p.shape)
            q.grad = p.grad.clone()
        norm = parallel.grad_norm([p.grad for p in ours])
        mine.step(grad_scale=parallel.clip_scale(norm, 1.0))
        assert torch.equal(parallel.clip_grad_norm_(theirs, 1.0), norm)  # the norm is still there to log
        reference.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


def test_stochastic_bf16_rounding_lands_on_a_neighbour_and_is_unbiased():
    x = torch.full((200_000,), 1.0 + 2 ** -9)  # a quarter of the way from 1 to the next bf16, 1 + 2⁻⁷
    noise = hashing.random_bits(x, torch.tensor(7)) & 0xFFFF
    rounded = optim.round_to_bf16_stochastically(x, noise).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(rounded.mean().item() - x[0].item()) < 2e-5  # nearest rounding would give 1.0 every time
    exact = torch.tensor([0.0, -3.0, 0.15625, 2.0 ** 100])  # already bf16: unchanged
    assert torch.equal(optim.round_to_bf16_stochastically(exact, noise[:4]).float(), exact)


def test_random_bits_are_uniform_in_both_halves_and_new_for_each_seed():
    like = torch.empty(1 << 16)
    bits = hashing.random_bits(like, torch.tensor(12345))
    for half in (bits & 0xFFFF, (bits >> 16) & 0xFFFF):  # m's and v's noise
        counts = torch.bincount(half >> 12, minlength=16).float()  # 16 buckets of 4096 each expected
        assert ((counts - 4096) ** 2 / 4096).sum() < 50  # χ², 15 degrees of freedom: 50 is p < 1e-5
    assert (bits != hashing.random_bits(like, torch.tensor(12346))).float().mean() > 0.99
    assert torch.equal(bits, hashing.random_bits(like, torch.tensor(12345)))


def _bf16_moments_after_one_step(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """m = 0.1·g lies between two bf16 values: the stochastic rounding decides every element."""
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = optim.AdamW(params, lr=1e-2, state_dtype=torch.bfloat16)
    optimizer.step()
    return [optimizer.state[p]["exp_avg"] for p in params]


def test_each_tensor_draws_its_own_rounding_noise():
    """The hash once read only (step, element index): two tensors rounded alike, their errors correlated."""
    first, second = _bf16_moments_after_one_step([torch.nn.Parameter(torch.zeros(4096)) for _ in range(2)])
    assert set(first.float().unique().tolist()) == {0.099609375, 0.10009765625}  # the two bf16 neighbours of 0.1
    assert (first != second).float().mean() > 0.3  # independent draws differ in about half the elements


def _sharded_moments_worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    param = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 512), mesh, [Shard(0)]))
    (moments,) = _bf16_moments_after_one_step([param])
    full = moments.full_tensor()
    if rank == 0:
        torch.save(full, out_path)
    leave_process_group()


@pytest.mark.slow
def test_shards_draw_the_noise_of_their_rows_of_the_whole_tensor(tmp_path):
    """At two ranks each shard once drew the stream of a tensor starting at element 0: the same noise on every
    rank. Now a shard hashes its elements' places in the whole tensor, so the sharded run rounds as one process."""
    out = tmp_path / "moments.pt"
    mp.spawn(_sharded_moments_worker, args=(free_port(), str(out)), nprocs=2)
    sharded = torch.load(out)
    (whole,) = _bf16_moments_after_one_step([torch.nn.Parameter(torch.zeros(8, 512))])
    assert torch.equal(sharded, whole)
    assert (whole[:4] != whole[4:]).float().mean() > 0.3  # the two shards' rows drew different noise


@pytest.mark.slow
def test_bf16_state_is_bf16_and_trains_the_debug_model_like_fp32_state():
    """50 steps on a fixed batch of the debug model: the loss curves agree within 2% of the starting loss at every
    step (stochastic rounding makes them differ a little, not drift apart)."""
    cfg = replace(FLAVORS["debug"], n_layers=2, max_seq_len=32)
    t = TrainConfig(global_batch=4, micro_batch=4, seq_len=32, lr=3e-3, warmup_steps=0, steps=50)
    batch = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    curves = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = Transformer(cfg)
        optimizer = build_optimizer(model, replace(t, optimizer_state_dtype=dtype), torch.device("cpu"))
        curves[dtype] = torch.stack([train_step(model, optimizer, batch, t, step)[0][0] for step in range(1, 51)])
        moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        assert {m.dtype for m in moments} == {torch.float32 if dtype == "fp32" else torch.bfloat16}
    assert curves["fp32"][-1] < 0.5 * curves["fp32"][0]  # it learns the batch, so the comparison means something
    torch.testing.assert_close(curves["bf16"], curves["fp32"], rtol=0, atol=0.02 * curves["fp32"][0].item())


def test_closure_is_refused():
    with pytest.raises(ValueError, match="closure"):
        optim.AdamW(_params()).step(lambda: 0.0)


def test_loading_a_state_dict_keeps_the_moments_bf16():
    """torch's Optimizer.load_state_dict casts state to the parameters' fp32: a resumed run would silently
    continue with fp32 moments."""
    params = _params()
    optimizer = optim.AdamW(_groups(params))
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    saved = {k: v.clone() for k, v in optimizer.state[params[0]].items()}
    optimizer.load_state_dict(optimizer.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        assert optimizer.state[params[0]][key].dtype == torch.bfloat16
        assert torch.equal(optimizer.state[params[0]][key], saved[key])


@pytest.mark.gpu
def test_one_gpu_trains_bf16_compute_copies_that_the_fused_update_writes():
    """On one GPU, train.build_model gives fp32 weights with bf16 compute copies (no FSDP); the compiled update
    writes each copy as its weight rounded to bf16, gradients of 2 micro-batches add up in fp32, the loss falls."""
    cfg = Config(model={"n_layers": 2, "max_seq_len": 64},
                 train=TrainConfig(global_batch=4, micro_batch=2, seq_len=64, lr=3e-3, warmup_steps=0, steps=20,
                                   optimizer_state_dtype="bf16"))
    device = torch.device("cuda")
    model, copies = build_model(cfg, 1, device)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {c.dtype for c in copies.copy_of.values()} == {torch.bfloat16}
    optimizer = build_optimizer(model, cfg.train, device, copies)
    batch = torch.randint(0, FLAVORS["debug"].vocab_size, (4, 65), device=device)
    losses = [train_step(model, optimizer, batch, cfg.train, step)[0][0].item() for step in range(1, 21)]
    assert losses[-1] < 0.8 * losses[0]
    for p, copy in copies.copy_of.items():
        assert torch.equal(copy, p.to(torch.bfloat16))


def _same_blocks(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> bool:
    """`fp8_weight_blocks`' outputs equal bit for bit (e4m3 compared as bytes: torch.equal has no e4m3 kernel)."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    return all(torch.equal(bits(a), bits(b)) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # lerp rounds otherwise from its weight 1 − β1 = 0.5 on
def test_the_blockwise_experts_update_is_adamw_update_writing_the_fp8_blocks_of_its_bf16_copy(state_dtype, beta1):
    """fp8_kernels.adamw_weight_blocks: θ and both moments bit for bit eager CUDA's adamw_update (stochastic
    rounding included), and, in place of the bf16 copy, fp8_weight_blocks of that copy, bit for bit."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs compute capability >= 8.9")
    from dsv3.lowp.fp8_kernels import adamw_weight_blocks, fp8_weight_blocks

    torch.manual_seed(0)
    shape = (3, 256, 384)
    param = torch.randn(shape, device="cuda") * 0.02
    grad = (torch.randn(shape, device="cuda") * 1e-3).bfloat16()
    exp_avg = (torch.randn(shape, device="cuda") * 1e-4).to(state_dtype)
    exp_avg_sq = (torch.rand(shape, device="cuda") * 1e-7).to(state_dtype)
    values = torch.tensor([1e-3 / (1 - 0.9 ** 3), 1 - 1e-3 * 0.1, (1 - 0.95 ** 3) ** 0.5, 0.7], device="cuda")
    step_size, decay, bias_correction2_sqrt, grad_scale = values.unbind()
    seed, salt = torch.tensor(1234567, device="cuda"), torch.tensor(optim.rounding_salt(5, param), device="cuda")
    expected = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    copy = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    optim.adamw_update(*(t.view(-1) for t in (expected[0], grad, expected[1], expected[2])), step_size, decay, beta1,
                       0.95, 1e-8, bias_correction2_sqrt, grad_scale, seed, salt, copy.view(-1))
    blocks = tuple(torch.empty_like(t) for t in fp8_weight_blocks(copy))
    adamw_weight_blocks(param, grad, exp_avg, exp_avg_sq, blocks, step_size, decay, beta1, 0.95, 1e-8,
                        bias_correction2_sqrt, grad_scale, seed, salt)
    for ours, theirs in zip((param, exp_avg, exp_avg_sq), expected):
        assert torch.equal(ours, theirs)
    assert _same_blocks(blocks, fp8_weight_blocks(copy))


@pytest.mark.gpu
def test_one_gpu_blockwise_experts_compute_with_fp8_blocks_the_optimizer_writes():
    """At one rank the blockwise FP8 experts' copies are the e4m3 blocks their GEMM reads, written by the update:
    their Parameters hold no values, the blocks always match the fp32 weights, gradients of 2 micro-batches add up,
    the loss falls."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("DeepGEMM's FP8 kernels here are Hopper's")
    pytest.importorskip("deep_gemm", reason="scripts/install_deepgemm.sh builds it")
    from dsv3.lowp.fp8_kernels import fp8_weight_blocks

    cfg = Config(model={"n_layers": 2, "max_seq_len": 64, "moe_inter_dim": 128},
                 train=TrainConfig(global_batch=4, micro_batch=2, seq_len=64, lr=3e-3, warmup_steps=0, steps=10,
                                   optimizer_state_dtype="bf16", expert_precision="fp8-blockwise"))
    device = torch.device("cuda")
    model, copies = build_model(cfg, 1, device)
    stacks = [m for m in model.modules() if isinstance(m, GroupedExperts)]  # the MoE layer's and the MTP module's
    assert len(stacks) == 2 and set(copies.own_of) == {p for m in stacks for p in (m.w13, m.w2)}
    assert all(copies.copy_of[p].stride() == (0, 0, 0) for p in copies.own_of)
    optimizer = build_optimizer(model, cfg.train, device, copies)
    batch = torch.randint(0, FLAVORS["debug"].vocab_size, (4, 65), device=device)
    losses = []
    for step in range(1, 11):
        losses.append(train_step(model, optimizer, batch, cfg.train, step)[0][0].item())
        for p, own in copies.own_of.items():
            assert _same_blocks(own.blocks, fp8_weight_blocks(p.to(torch.bfloat16)))
    assert losses[-1] < 0.8 * losses[0]


# ------------------------------------------------------------------------------------------ compute copies

def _with_copies() -> tuple[Transformer, optim.ComputeCopies]:
    torch.manual_seed(0)
    model = Transformer(replace(FLAVORS["debug"], n_layers=2, max_seq_len=32))
    return model, optim.ComputeCopies(model, torch.bfloat16)


def _micro_batches() -> torch.Tensor:
    return torch.randint(0, FLAVORS["debug"].vocab_size, (2, 2, 33), generator=torch.Generator().manual_seed(0))


def _total_loss(model: Transformer, micro: torch.Tensor) -> torch.Tensor:
    out = model(micro[:, :-1], micro[:, 1:])
    return out.loss + sum(out.mtp_losses) + out.balance_loss


def _holds_its_fp32_parameters(model: Transformer, optimizer: torch.optim.Optimizer | None = None) -> bool:
    """What a checkpoint needs: fp32 tensors in the state dict, the optimizer's own parameters by name."""
    state_is_fp32 = {v.dtype for v in model.state_dict().values() if v.is_floating_point()} == {torch.float32}
    params = {p for group in optimizer.param_groups for p in group["params"]} if optimizer else set()
    return state_is_fp32 and (optimizer is None or set(model.parameters()) == params)


def test_an_exception_inside_backward_leaves_the_fp32_parameters_in_the_model():
    """The copies were swapped out by a callback at the end of a backward that never ended: state_dict() returned
    bf16 copies, which the optimizer state could not map to names."""
    model, copies = _with_copies()
    t = TrainConfig(global_batch=4, micro_batch=2, seq_len=32, optimizer_state_dtype="bf16")
    optimizer = build_optimizer(model, t, torch.device("cpu"), copies)

    def fail(grad):
        raise RuntimeError("failed in backward")

    def fail_in_its_backward(module, args, out) -> None:
        out[0].register_hook(fail)

    hook = model.layers["1"].register_forward_hook(fail_in_its_backward)
    with pytest.raises(RuntimeError, match="failed in backward"):
        train_step(model, optimizer, _micro_batches().flatten(0, 1), t, 1)
    assert _holds_its_fp32_parameters(model, optimizer)
    hook.remove()
    optimizer.zero_grad()
    train_step(model, optimizer, _micro_batches().flatten(0, 1), t, 1)  # and trains on
    assert _holds_its_fp32_parameters(model, optimizer)


def test_a_forward_without_backward_leaves_the_fp32_parameters_in_the_model():
    model, copies = _with_copies()
    micro = _micro_batches()[0]
    model(micro[:, :-1], micro[:, 1:])  # outside `active()`: the plain fp32 model, never its copies
    assert _holds_its_fp32_parameters(model)
    with copies.active():
        loss = _total_loss(model, micro)  # a loss with a graph, never backpropagated
    assert loss.requires_grad and _holds_its_fp32_parameters(model)


def test_two_micro_batches_add_up_in_fp32_and_each_bf16_gradient_is_freed_as_soon_as_it_is_added():
    """Each copy's gradient goes into the fp32 sum when backward produces it: when backward reaches the embedding
    (every block done), no copy but the embedding's holds a gradient, where adding up after the whole backward kept
    every block's bf16 gradients alive at once. The sum is exactly the fp32 sum of the micro-batches' gradients."""
    model, copies = _with_copies()
    name_of = {p: name for name, p in model.named_parameters()}
    alone = []
    for micro in _micro_batches():
        with copies.active():
            _total_loss(model, micro).backward()
        alone.append({p: copies.copy_of[p].grad for p in name_of})
        copies.zero_grad()

    held_at_embedding = []

    def record_held(grad) -> None:
        held_at_embedding.append([name for p, name in name_of.items()
                                  if copies.copy_of[p].grad is not None and name != "embed.weight"])

    def probe_its_gradient(module, args, out) -> None:
        out.register_hook(record_held)

    model.embed.register_forward_hook(probe_its_gradient)
    for micro in _micro_batches():
        with copies.active(accumulate=True):
            _total_loss(model, micro).backward()

    assert held_at_embedding == [[], []]
    for p, name in name_of.items():
        assert copies.copy_of[p].grad is None, name
        grad = copies.grad(p)
        assert grad.dtype == torch.float32 and torch.equal(grad, alone[0][p].float() + alone[1][p].float()), name


def test_a_copy_is_remade_when_its_parameter_changed_outside_the_update():
    """In place (a load, an init) or by binding a new tensor to `p.data`; the update writes copies itself."""
    model, copies = _with_copies()
    micro = _micro_batches()[0]
    weight = model.head.weight
    for change in (lambda: weight.mul_(2), lambda: setattr(weight, "data", weight.data * 3)):
        with copies.active():
            model(micro[:, :-1])
        with torch.no_grad():
            change()
        with copies.active():
            model(micro[:, :-1])
        assert torch.equal(copies.copy_of[weight], weight.to(torch.bfloat16))
