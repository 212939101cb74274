"""Distribution, applied from outside the plain model: process group and meshes, the expert-parallel
all-to-all dispatcher (or dsv3.deepep's), FSDP2 wrapping, activation checkpointing, per-block compile, and the
few collectives the trainer needs (gradient norm, expert-load sums).

Meshes: dense parameters are `fully_shard`ed over all ranks; routed-expert stacks are sharded Shard(0)
over `ep` and `fully_shard`ed over `efsdp = world / ep`, both from one 2-D (efsdp, ep) mesh.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from dsv3 import deepep
from dsv3.config import UserError
from dsv3.model import Transformer
from dsv3.moe import LocalDispatcher, MoE, combine_token_copies, pad_groups, pads_groups


def init_distributed(device: str = "auto") -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment; a single process when run plainly."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA GPU is visible: use --train.device=cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    this_device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        # The device before the group and the meshes: they, and barrier(), then know it instead of guessing.
        torch.cuda.set_device(this_device)
        torch.set_float32_matmul_precision("high")  # TF32 for the few fp32 matmuls left (compute is bf16)
    if "WORLD_SIZE" not in os.environ:
        if use_cuda and not dist.is_initialized():  # FSDP2 (our bf16 mixed precision) needs a group, even of one
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=this_device)
        return 0, 1, this_device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=this_device if use_cuda else None)
    return dist.get_rank(), dist.get_world_size(), this_device


def check_ep(ep: int, world: int, n_routed_experts: int) -> None:
    if ep < 1 or world % ep:
        raise UserError(f"parallel.ep={ep} must divide the world size {world}: pick one of "
                        f"{[d for d in range(1, world + 1) if world % d == 0]}")
    if n_routed_experts % ep:
        raise UserError(f"parallel.ep={ep} must divide model.n_routed_experts={n_routed_experts}")


@dataclass
class Meshes:
    dense: DeviceMesh  # all ranks, 1-D
    experts: DeviceMesh  # (efsdp, ep), 2-D


def build_meshes(device_type: str, world: int, ep: int) -> Meshes:
    dense = init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    experts = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    return Meshes(dense, experts)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
             group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all_single as a functional collective (a new output tensor, not a filled buffer), an op that
    selective AC can keep: recompute does not exchange again."""
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), out_splits, in_splits, group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


@torch.compiler.disable
def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """The differentiable exchange, kept out of torch.compile: traced, the NCCL collective lost its backward
    (the routed experts' gradients came out exactly zero on 2 H200s, torch 2.11); gloo was not affected."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatcher:
    """Expert parallelism over `group`: rank r holds experts [r·E_local, (r+1)·E_local).

    route → counts per expert → exchange counts → exchange token copies (uneven splits) → sort by local
    expert → grouped GEMM → the reverse. The split sizes must reach the host for all_to_all_single: that
    `.tolist()` is the one device→host sync per MoE layer. `align` > 1 pads each local expert's group
    (`pad_groups`), without another sync.
    """

    def __init__(self, group: dist.ProcessGroup, n_experts: int, align: int = 1):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.n_local = n_experts // self.ep
        self.align = align

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 tokens_per_expert: torch.Tensor):
        order = topk_idx.flatten().argsort(stable=True)  # by expert, hence by destination rank
        send_x = x[order // topk_idx.size(1)]
        # received[src, e]: copies rank src sends to our local expert e
        even = [self.n_local] * self.ep
        received = exchange(tokens_per_expert, even, even, self.group).view(self.ep, self.n_local)
        splits = torch.cat([tokens_per_expert.view(self.ep, self.n_local).sum(1), received.sum(1)])
        splits = splits.tolist()  # the one device→host sync of this layer
        send_splits, recv_splits = splits[:self.ep], splits[self.ep:]
        recv_x = all_to_all(send_x, recv_splits, send_splits, self.group)  # [src][local expert] order
        local_expert = torch.arange(self.n_local, device=x.device).repeat(self.ep)
        expert_of_row = local_expert.repeat_interleave(received.flatten(), output_size=recv_x.size(0))
        local_order = expert_of_row.argsort(stable=True)  # → [local expert][src] order
        expert_x, tokens_per_local_expert, rows = recv_x[local_order], received.sum(0), None
        # N varies by step: few buffer sizes (bucket); none received: zero rows for every expert
        if pads_groups(self.align, x.device) or not recv_x.size(0):
            expert_x, tokens_per_local_expert, rows = pad_groups(
                expert_x, expert_of_row[local_order], tokens_per_local_expert, self.align, bucket=True)
        return expert_x, tokens_per_local_expert, (order, topk_weights, local_order, rows, send_splits, recv_splits)

    def combine(self, expert_y: torch.Tensor, ctx: Any) -> torch.Tensor:
        order, topk_weights, local_order, rows, send_splits, recv_splits = ctx
        if rows is not None:
            expert_y = expert_y[rows]  # the real rows only
        recv_y = torch.empty_like(expert_y).index_copy_(0, local_order, expert_y)
        sorted_y = all_to_all(recv_y, send_splits, recv_splits, self.group)
        return combine_token_copies(sorted_y, order, topk_weights)

    def wait(self, y: torch.Tensor) -> torch.Tensor:
        return y


def moe_layers(model: Transformer) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def blocks(model: Transformer) -> list[nn.Module]:
    return list(model.layers.values()) + [m.block for m in model.mtp]


def check_ep_backend(backend: str, ep: int, device: torch.device, deepep_sms: int = 24) -> None:
    """`parallel.ep_backend=deepep` needs CUDA, an importable deep_ep and ep ∈ {2, 4, 8} on one host."""
    if backend == "deepep":
        deepep.check(ep, device, deepep_sms, local_world=int(os.environ.get("LOCAL_WORLD_SIZE", ep)))


def apply_expert_parallel(model: Transformer, meshes: Meshes, backend: str = "all_to_all",
                          deepep_sms: int = 24) -> None:
    """Shard each expert stack Shard(0) over `ep` and hand every MoE the `backend`'s dispatcher
    (keeping the group alignment that dsv3.quant may have set on the local one)."""
    ep_mesh = meshes.experts["ep"]
    if backend == "deepep":  # check_ep_backend ran at start-up
        buffer = deepep.get_buffer(ep_mesh.get_group(), model.cfg.dim, deepep_sms)
    for moe in moe_layers(model):
        for name, param in list(moe.experts.named_parameters()):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            setattr(moe.experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        if backend == "deepep":
            moe.dispatcher = deepep.DeepEPDispatcher(buffer, model.cfg.n_routed_experts, moe.dispatcher.align)
        else:
            moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), model.cfg.n_routed_experts,
                                                moe.dispatcher.align)


def apply_fsdp(model: Transformer, meshes: Meshes, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               ep: int) -> None:
    # forward inputs keep their dtype: the fp32 RoPE tables stay fp32 (`apply_rope` computes in fp32)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    world = meshes.dense.size()
    expert_mesh = meshes.experts["efsdp"] if ep > 1 else meshes.dense
    for block in blocks(model):
        if isinstance(block.ffn, MoE):
            # experts on a 1-rank FSDP mesh (ep == world) hold whole shards: resharding them after forward would
            # only cast and copy them again for backward
            fully_shard(block.ffn.experts, mesh=expert_mesh, mp_policy=mp,
                        reshard_after_forward=expert_mesh.size() > 1)
            # each expert's gradient sums the tokens of its whole EP group: average over all ranks, not efsdp
            block.ffn.experts.set_gradient_divide_factor(world)
            # gloo lacks the PREMUL_SUM that a custom factor uses (and a 1-rank mesh needs no reduction)
            if expert_mesh.device_type == "cpu" and expert_mesh.size() > 1:
                block.ffn.experts.set_force_sum_reduction_for_comms(True)
        # one rank: keep the bf16 copy from forward to backward instead of casting and copying it twice
        fully_shard(block, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=world > 1)
    fully_shard(model, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=False)
    if ep > 1:
        # EP's blocking split-size copy stalls FSDP's implicit prefetch: prefetch the next block explicitly.
        chain = blocks(model)
        for prev, nxt in zip(chain, chain[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])


# Selective AC keeps what is expensive to recompute (GEMM and attention outputs), recomputes the rest. It sees
# the ops that run, and inside a compiled MoE block inductor runs the dense GEMMs as `mm.out` into its own
# buffers, which SAC cannot hand back: there those are recomputed, the grouped GEMMs and attention kept.
# Under fp8 the GEMMs are the scaled ones (torchao's dense `_scaled_mm`, dsv3.quant's `_scaled_grouped_mm`); their
# scales come from amax reductions (tensorwise `max`, rowwise `amax`) whose small outputs are kept too, as torchtitan
# keeps `max`, so that recompute does not reduce whole activations again.
_SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default,
             torch.ops.aten._scaled_mm.default, torch.ops.aten._scaled_grouped_mm.default,
             torch.ops.aten.max.default, torch.ops.aten.amax.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # EP's exchanges, and the split sizes' copy to the host: kept, recompute neither talks to other ranks nor
    # waits for the GPU to drain
    if (op in _SAVE_OPS or op == torch.ops._c10d_functional.all_to_all_single.default
            or (op == torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"))):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """none | full (recompute each block) | selective (recompute each block but keep GEMM outputs)."""
    if mode == "none":
        return
    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(_selective_policy)
        # FSDP2's hooks in a block record profiler ranges a different number of times in forward and in recompute
        # (the routed experts are their own FSDP unit), and SAC replays ops by count: at ep > 1 the first backward
        # failed. SAC ignores them upstream since pytorch #196862; torch 2.11-2.13 need it said.
        SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                                torch.ops.profiler._record_function_exit._RecordFunction})
    for key, block in list(model.layers.items()):
        model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)
    for mtp in model.mtp:
        mtp.block = checkpoint_wrapper(mtp.block, preserve_rng_state=False, **kwargs)


def check_compile(enabled: bool, device: torch.device) -> None:
    """train.compile needs a GPU: on a CPU the model computes in fp32, and torch.compile traces the routed experts'
    torch._grouped_mm only in bf16."""
    if enabled and device.type != "cuda":
        raise UserError("train.compile=true needs a CUDA GPU: on a CPU the routed experts' grouped GEMM runs in "
                        "fp32, which torch.compile cannot trace; use --train.compile=false")


def apply_compile(model: Transformer, backend: str | Callable = "inductor") -> None:
    """torch.compile each block in place (module names, hence checkpoints, are unchanged).

    A checkpointed block is compiled around its checkpoint when it traces as one graph (dense blocks), and
    inside it when it cannot: a MoE block's graph breaks at its experts' FSDP hooks (and at EP's exchange), and
    dynamo runs a traced checkpoint with a graph break in it eagerly, whole. Inside, a recompile between a
    block's forward and its recompute (for the MTP block's shorter sequence, a new received-token count under EP)
    would make the recompute run another graph than the forward's, which selective AC rejects: where shapes
    change within a step, shapes are dynamic from the first compile. Only there: dynamic kernels cost 9% of a
    16B step on one H100 (selective AC, 82.1k against 89.8k tokens/s). Call after `apply_expert_parallel`."""
    # only the local dispatcher hands the experts the same number of rows every time
    shapes_change = len(model.mtp) > 0 or any(not isinstance(m.dispatcher, LocalDispatcher) for m in moe_layers(model))
    for block in blocks(model):
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        if inner is not None and isinstance(inner.ffn, MoE):
            inner.compile(backend=backend, dynamic=True if shapes_change else None)
        else:
            block.compile(backend=backend)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip FSDP's reduce-scatter on gradient-accumulation micro-steps."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


@torch.no_grad()
def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm (fp32) over sharded gradients. Every DTensor here is sharded, never replicated, so local
    squared sums add up over ranks exactly once, whatever mesh each lives on."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    total_sq = torch.stack(torch._foreach_norm(local, 2.0, dtype=torch.float32)).pow(2).sum()
    if dist.is_initialized() and any(isinstance(g, DTensor) for g in grads):
        dist.all_reduce(total_sq)
    return total_sq.sqrt()


def clip_scale(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that brings gradients of norm `total_norm` down to `max_norm` (1 when already below)."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm over sharded gradients (`grad_norm`), clipped to max_norm in place."""
    grads = [p.grad for p in params if p.grad is not None]
    total = grad_norm(grads)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(local, clip_scale(total, max_norm))
    return total


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t
