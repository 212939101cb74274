"""Distribution, applied from outside the plain model: process group and meshes, expert parallelism (expert
stacks sharded over `ep`, each MoE handed a dispatcher from dsv3.dispatch), FSDP2 wrapping, activation
checkpointing, per-block compile, and the few collectives the trainer needs (gradient norm, expert-load sums).

Meshes: dense parameters are `fully_shard`ed over all ranks; routed-expert stacks are sharded Shard(0)
over `ep` and `fully_shard`ed over `efsdp = world / ep`, both from one 2-D (efsdp, ep) mesh.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from dsv3 import dispatch
from dsv3.config import UserError
from dsv3.lowp import quant
from dsv3.model import Transformer
from dsv3.moe import MoE
from dsv3.token_copies import pads_groups


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
        # one GPU gets a group of one too (no FSDP2 there): barriers, DCP and all_reduce_sum run as on many ranks
        if use_cuda and not dist.is_initialized():
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


def moe_layers(model: Transformer) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def check_ep_backend(backend: str, ep: int, device: torch.device, deepep_sms: int = 24) -> None:
    """`parallel.ep_backend=deepep` needs CUDA, an importable deep_ep and ep ∈ {2, 4, 8} on one host."""
    if backend == "deepep":
        dispatch.check(ep, device, deepep_sms, local_world=int(os.environ.get("LOCAL_WORLD_SIZE", ep)))


def apply_expert_parallel(model: Transformer, meshes: Meshes, backend: str = "all_to_all",
                          deepep_sms: int = 24) -> None:
    """Shard each expert stack Shard(0) over `ep` and hand every MoE the `backend`'s dispatcher
    (keeping the group alignment that dsv3.lowp.quant may have set on the local one)."""
    ep_mesh = meshes.experts["ep"]
    if backend == "deepep":  # check_ep_backend ran at start-up
        buffer = dispatch.get_buffer(ep_mesh.get_group(), model.cfg.dim, deepep_sms)
    for moe in moe_layers(model):
        for name, param in list(moe.experts.named_parameters()):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            setattr(moe.experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        if backend == "deepep":
            moe.dispatcher = dispatch.DeepEPDispatcher(buffer, model.cfg.n_routed_experts, moe.dispatcher.align)
        else:
            moe.dispatcher = dispatch.AllToAllDispatcher(ep_mesh.get_group(), model.cfg.n_routed_experts,
                                                moe.dispatcher.align)


def apply_fsdp(model: Transformer, meshes: Meshes, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               ep: int) -> list[nn.Parameter]:
    """FSDP2 over the dense mesh for each block and the root, and over efsdp for the routed experts. At ep == world
    the experts would sit in a one-rank FSDP unit, whose hooks, casts and copies buy nothing: they are left out.
    Returns those parameters, for `optim.ComputeCopies` to give them compute copies and FSDP's gradient average."""
    # forward inputs keep their dtype: the fp32 RoPE tables stay fp32 (`apply_rope` computes in fp32)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    world = meshes.dense.size()
    expert_mesh = meshes.experts["efsdp"] if ep > 1 else meshes.dense
    unsharded: list[nn.Parameter] = []
    for block in model.blocks():
        ignored = None
        if isinstance(block.ffn, MoE) and expert_mesh.size() == 1:
            ignored = set(block.ffn.experts.parameters())
            unsharded += ignored
        elif isinstance(block.ffn, MoE):
            fully_shard(block.ffn.experts, mesh=expert_mesh, mp_policy=mp)
            # each expert's gradient sums the tokens of its whole EP group: average over all ranks, not efsdp
            block.ffn.experts.set_gradient_divide_factor(world)
            # gloo lacks the PREMUL_SUM that a custom factor uses
            if expert_mesh.device_type == "cpu":
                block.ffn.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=meshes.dense, mp_policy=mp, ignored_params=ignored)
    fully_shard(model, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=False,
                ignored_params=set(unsharded) or None)
    if ep > 1:
        # EP's blocking split-size copy stalls FSDP's implicit prefetch: prefetch the next block explicitly.
        chain = model.blocks()
        for prev, nxt in zip(chain, chain[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    return unsharded


# Selective AC keeps what is expensive to recompute: GEMM (bf16 and FP8) and attention outputs, and the FP8 scales'
# amax reductions, small outputs of whole activations (docs/training.md#memory-and-speed-switches).
_SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default,
             torch.ops.aten._scaled_mm.default, torch.ops.aten._scaled_grouped_mm.default,
             quant.fp8_block_grouped_mm._opoverload,
             torch.ops.aten.max.default, torch.ops.aten.amax.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default}


# EP's exchanges (all_to_all's functional collective, DeepEP's ops) and the split sizes' copy to the host: kept,
# recompute neither talks to other ranks nor waits for the GPU to drain
_EXCHANGE_OPS = {torch.ops._c10d_functional.all_to_all_single.default,
                 torch.ops._c10d_functional_autograd.all_to_all_single.default, torch.ops.dsv3.deepep_dispatch.default,
                 torch.ops.dsv3.deepep_combine.default, torch.ops.dsv3.start_copy_to_host.default,
                 torch.ops.dsv3.finish_copy_to_host.default}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _SAVE_OPS or op in _EXCHANGE_OPS:
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
        # failed. # torch<2.14: SAC ignores them upstream since pytorch #196862; torch 2.11-2.13 need it said.
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


def moe_blocks_compile_whole(world: int, ep: int, ep_backend: str, n_mtp_layers: int, pads_groups: bool) -> bool:
    """Whether checkpointed MoE blocks compile around their checkpoint, as one graph (`apply_compile`): nothing in
    them breaks the graph — no DeepEP call, no experts' FSDP unit (ep < world), no bucketed padding — and no MTP
    block (its shorter sequence made inductor's partitioner fail). docs/performance.md#what-makes-it-fast."""
    no_break = (ep == 1 and world == 1) or (ep == world and ep_backend == "all_to_all" and not pads_groups)
    return no_break and n_mtp_layers == 0


def apply_compile(model: Transformer, world: int, backend: str | Callable = "inductor") -> None:
    """torch.compile each block in place (module names, hence checkpoints, are unchanged); checkpointed MoE blocks
    around their checkpoint where `moe_blocks_compile_whole`, else inside it. Call after `apply_expert_parallel`."""
    dispatchers = [m.dispatcher for m in moe_layers(model)]
    deepep = any(isinstance(d, dispatch.DeepEPDispatcher) for d in dispatchers)
    expert_parallel = [d for d in dispatchers if isinstance(d, dispatch.AllToAllDispatcher | dispatch.DeepEPDispatcher)]
    ep = expert_parallel[0].ep if expert_parallel else 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the model may still be on meta
    pads = any(pads_groups(d.align, device) for d in expert_parallel)  # bucketed: a graph break in the block
    whole = moe_blocks_compile_whole(world, ep, "deepep" if deepep else "all_to_all", len(model.mtp), pads)
    # EP's split sizes (`dispatch.host_splits`) and DeepEP's received counts as unbacked SymInts: no graph break at
    # the exchange, no recompile
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    # Inside a checkpoint a recompile between a block's forward and its recompute would run another graph, which
    # selective AC rejects: sizes that change unmarked (the MTP block's sequence, the rows and split sizes after a
    # padding graph break or after the hooks of the experts' own FSDP unit at ep < world) are dynamic from the first
    # compile.
    dynamic = True if len(model.mtp) or pads or 1 < ep < world else None
    for block in model.blocks():
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        if inner is not None and isinstance(inner.ffn, MoE) and not whole:
            inner.compile(backend=backend, dynamic=dynamic)
        else:
            block.compile(backend=backend)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device` by way of pinned memory, so that the copy is queued like a kernel: from
    pageable memory it would make the CPU wait for all the GPU's queued work, and the GPU then idle."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip FSDP's reduce-scatter on gradient-accumulation micro-steps."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


@torch.no_grad()
def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm (fp32) over sharded gradients. Every DTensor here is sharded, never replicated, so local
    squared sums add up over ranks exactly once, whatever mesh each lives on."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    # one reduction kernel per tensor: on Hopper they read bf16 gradients faster than `_foreach_norm`'s one kernel
    total_sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in local]).pow(2).sum()
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
