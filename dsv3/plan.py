"""The run planner: per-GPU memory and step time from a Config, a GPU count and a GPU kind, before anything is
built. train.py checks the plan at start-up; scripts/plan.py prints it. `search` plans every layout (ep, micro-batch,
AC mode, moment dtype) a run accepts on the GPUs and ranks those that fit by planned tokens/s.

Memory is a table of what the trainer keeps alive, derived from the config: each `Tensor` has its bytes per GPU and
the phases of the step it lives through (each micro-batch's forward and backward block by block, its losses, the
optimizer step; with several micro-batches the first one and every later one, which carries the gradients of the
earlier ones, are phases of their own). The peak is the largest sum over the phases, so an allocation is either in
the table with its lifetime or visibly missing from it.

Step time: FLOPs at measured kernel rates, memory-bound work over HBM bandwidth, EP's all-to-all (never hidden: it
waits for its split sizes), and FSDP2's collectives where compute cannot hide them: a block's all-gather runs
behind the previous block's compute, a block's reduce-scatter behind the next block's backward, micro-batch by
micro-batch. Rates and link speeds are data with their sources (`GPUS`, `INFINIBAND_GB_S`).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from dsv3.config import Config, ModelConfig, UserError
from dsv3.dispatch import SUPPORTED_EP
from dsv3.flops import attention_params, block_params, dense_and_expert_params, root_params
from dsv3.loss import LOSS_CHUNK
from dsv3.lowp.quant import FEATURE_MULTIPLE
from dsv3.parallel import moe_blocks_compile_whole

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    """One GPU kind: the memory torch can allocate, the rates the trainer achieves on it, and where they come from."""

    memory_gib: float  # torch.cuda.get_device_properties().total_memory
    dense_tflops: float  # bf16 nn.Linear GEMMs, achieved
    grouped_tflops: float  # bf16 torch._grouped_mm (routed experts), achieved
    attention_tflops: float  # cuDNN SDPA, causal, counted as in flops.flops_per_token
    hbm_tb_s: float
    nvlink_gb_s: float  # per direction per GPU, within a node
    source: str
    gpus_per_node: int = 8
    pads_expert_groups: bool = False  # bf16 grouped GEMMs need padded groups (dsv3.token_copies.pads_groups)


_B200_OVER_H100 = 2250 / 989  # dense bf16 without sparsity, HGX B200 and H100 SXM datasheets
GPUS: dict[str, GPU] = {
    "h100": GPU(memory_gib=79.1, dense_tflops=750, grouped_tflops=650, attention_tflops=346, hbm_tb_s=3.35,
                nvlink_gb_s=450,
                source="rates measured (docs/performance.md: scripts/bench.py's phase split of the 16B cut on one "
                       "H100); HBM 3.35 TB/s and NVLink 900 GB/s both ways from the H100 SXM datasheet"),
    "h200": GPU(memory_gib=139.0, dense_tflops=763, grouped_tflops=721, attention_tflops=375, hbm_tb_s=4.8,
                nvlink_gb_s=450,
                source="rates measured (scripts/bench.py's phase split of configs/671b_3layer.toml on one H200, "
                       "docs/performance.md); HBM 4.8 TB/s and NVLink 900 GB/s both ways from the H200 datasheet"),
    "b200": GPU(memory_gib=178.0, dense_tflops=763 * _B200_OVER_H100, grouped_tflops=721 * _B200_OVER_H100,
                attention_tflops=375 * _B200_OVER_H100, hbm_tb_s=8.0, nvlink_gb_s=900,
                source="NOT measured: the H200 rates × 2250/989 (datasheet dense bf16 over H100's: Hopper's "
                       "efficiency assumed on Blackwell); HBM 8 TB/s and NVLink 5 1.8 TB/s both ways from the HGX "
                       "B200 datasheet; 178 of its 180 GB assumed visible to torch",
                pads_expert_groups=True),
}
# one 400 Gb/s NIC (ConnectX-7) per GPU in DGX/HGX H100 and B200 nodes: 50 GB/s per direction
INFINIBAND_GB_S = 50.0
# assumed, not measured here: the share of a link's rate NCCL's ring all-gather and reduce-scatter reach
COLLECTIVE_EFFICIENCY = 0.8
# measured: our all_to_all reaches this share of the link rate (docs/deepep.md: one 16B layer's four exchanges on
# 2 H200s)
ALL_TO_ALL_EFFICIENCY = 0.29
# Calibrated against the measured peaks (tests/test_plan.py pins them): the saved-tensor count below is what eager
# autograd keeps; torch.compile keeps fewer (it recomputes cheap elementwise ops) while the caching allocator rounds
# and fragments: one factor absorbs both.
ACTIVATION_FACTOR = 0.75
# cuBLAS/cuDNN and compiled-kernel workspaces. The CUDA context is not in max_memory_allocated, nor in this plan:
# FIT_FRACTION leaves room for it and for the allocator's reserved-but-free blocks.
OVERHEAD_GIB = 0.5
# AdamW streams each state once: achieved share of HBM bandwidth, dsv3.optim's compiled update (one GPU, or bf16
# moments) and torch's fused one (fp32 moments under FSDP2)
OPTIMIZER_HBM_EFFICIENCY = {"dsv3": 0.77, "torch": 0.53}
# elementwise ops, norms, copies, routing, permutation and the loss's softmax: the bytes of the activations the
# blocks write (the no-AC saved set) at this share of HBM bandwidth (fitted to the one-GPU profiles' other + routing +
# loss + idle time)
OTHER_HBM_EFFICIENCY = 0.15
# FSDP2's per-micro-batch casts and copies of the parameters into its unsharded buffers and of the gradients out
# (fp32 → bf16 parameters, bf16 → fp32 gradients: 14 bytes each) reach this share: measured in a step of the 16B
# cut (2.26B parameters) on one H100 when it still ran under FSDP2 (docs/planning.md)
FSDP_CAST_HBM_EFFICIENCY = 0.43
# routed tokens per rank vary around the balanced T·K: receive buffers and expert activations get headroom
EP_HEADROOM = 1.25
FIT_FRACTION = 0.95  # the plan must stay under this share of the GPU's memory


def _exchange_kept_per_token(mc: ModelConfig, ep: int, backend: str) -> float:
    """bf16 elements per token that selective AC keeps of a MoE layer's two exchanges (`parallel._EXCHANGE_OPS`).
    all_to_all receives the copies routed to this rank's experts (T·K, with headroom) and gets its own T·K back;
    DeepEP sends a token once to every rank that holds one of its experts and returns one combined row."""
    d, K = mc.dim, mc.n_activated_experts
    if ep == 1:
        return 0.0
    if backend == "deepep":
        return (ep * (1 - _rank_missed(mc, ep)) * EP_HEADROOM + 1) * d
    return (K * EP_HEADROOM + K) * d


def _rank_missed(mc: ModelConfig, ep: int) -> float:
    """The chance that none of a token's K experts is on a given EP rank, the K a uniform random choice among the
    experts of the router's groups (uniform too: `n_limited_groups` of `n_expert_groups`). A rank holds whole groups
    when ep divides the group count; otherwise groups are not modelled."""
    E, K, G, M = mc.n_routed_experts, mc.n_activated_experts, mc.n_expert_groups, mc.n_limited_groups
    if G <= 1 or G % ep:
        return math.comb(E - E // ep, K) / math.comb(E, K)
    g, per_group = G // ep, E // G  # groups per rank, experts per group
    # j of the rank's g groups among the M chosen: none of the K experts (among M·per_group) in those j groups
    return sum(math.comb(g, j) * math.comb(G - g, M - j) / math.comb(G, M)
               * math.comb((M - j) * per_group, K) / math.comb(M * per_group, K) for j in range(min(g, M) + 1))


def _around_checkpoint(cfg: Config, gpus: int, kind: GPU) -> bool:
    """Whether MoE blocks compile around their checkpoint (parallel.moe_blocks_compile_whole); low-precision experts
    pad their groups, as bf16 ones do on some GPUs."""
    p, pads = cfg.parallel, cfg.train.expert_precision != "bf16" or kind.pads_expert_groups
    return moe_blocks_compile_whole(gpus, p.ep, p.ep_backend, cfg.model_config().n_mtp_layers, pads)


def _saved_per_token(mc: ModelConfig, moe: bool, ep: int, backend: str = "all_to_all",
                     around: bool = False) -> dict[str, float]:
    """bf16 elements one block saves for backward per token, by AC mode (fp32 tensors count twice); `around`: a
    MoE block compiles around its checkpoint (parallel.apply_compile)."""
    d, H, K, inter = mc.dim, mc.n_heads, mc.n_activated_experts, mc.moe_inter_dim
    q = H * mc.qk_head_dim
    kv = (mc.kv_lora_rank + mc.qk_rope_head_dim) + mc.kv_lora_rank + H * (mc.qk_nope_head_dim + mc.v_head_dim)
    sdpa_out = H * mc.v_head_dim + 2 * H  # o, and its fp32 logsumexp
    # block input, normed input, wq_a output and its norm, q, latents + k/v up-projection, RoPE'd q and k, o,
    # o reshaped for wo, residual
    attention = 2 * d + 2 * mc.q_lora_rank + q + kv + 2 * q + 2 * sdpa_out + d
    attention_gemms = mc.q_lora_rank + q + kv + sdpa_out + d  # mm and SDPA outputs
    if not moe:
        none = attention + d + 3 * mc.inter_dim  # normed input, w1 and w3 outputs, their product
        # a dense block compiles around its checkpoint: selective keeps every mm output (w1, w3, w2 too)
        return {"none": none, "selective": d + attention_gemms + 2 * mc.inter_dim + d, "full": d}
    # routed copies per rank vary around a balanced router's T·K under EP: headroom
    copies = K * (EP_HEADROOM if ep > 1 else 1.0)
    # per routed copy: the sorted expert input, gate/up output, SwiGLU product, and the rows combine gathers
    # (under EP the received copies replace the local ones: backward needs no exchange input)
    copy = 2 * d + 3 * inter
    token_side = d + 4 * mc.n_routed_experts + 3 * mc.n_shared_experts * inter + d  # normed, fp32 scores, shared, out
    # inside a compiled MoE block SAC keeps grouped GEMM, SDPA and exchange outputs (parallel._selective_policy);
    # compiled around it, every GEMM output as in a dense block: the router's and the shared experts' too
    selective = (d + attention_gemms + mc.n_routed_experts + 2 * mc.n_shared_experts * inter + d if around
                 else d + sdpa_out) + _exchange_kept_per_token(mc, ep, backend)
    return {"none": attention + token_side + copies * copy, "selective": selective + copies * (2 * inter + d),
            "full": d}


@dataclass(frozen=True)
class Tensor:
    """An allocation the trainer holds: `bytes` per GPU, alive from phase `first` through phase `last` (indices into
    Plan.phases); `line` is the memory line it counts in."""

    line: str
    name: str
    bytes: float
    first: int
    last: int


class _Timeline:
    """The phases of one optimizer step in order: per micro-batch the blocks' forwards, the losses, the backwards from
    the last block, each followed by its gradients' hand-over, and the embedding's; then the optimizer step. The
    micro-batches after the first hold the same tensors: one set of phases stands for them all."""

    def __init__(self, n_layers: int, n_mtp: int, micro_batches: int):
        self.n_layers, self.n_blocks = n_layers, n_layers + n_mtp
        kinds = ["micro-batch 1"]
        if micro_batches > 1:
            kinds.append("micro-batch 2" if micro_batches == 2 else f"each of micro-batches 2 to {micro_batches}")
        self.phases: list[str] = []
        self.forward, self.loss, self.backward, self.handed_on, self.embedding = [], [], [], [], []
        for kind in kinds:
            forward, loss, backward, handed_on = {}, {}, {}, {}
            for b in range(n_layers):
                forward[b] = self._add(f"{kind}, forward of {self.name(b)}")
            loss[0] = self._add(f"{kind}, main loss")
            for k in range(1, n_mtp + 1):
                forward[n_layers + k - 1] = self._add(f"{kind}, forward of {self.name(n_layers + k - 1)}")
                loss[k] = self._add(f"{kind}, MTP loss {k}")
            for b in reversed(range(self.n_blocks)):
                backward[b] = self._add(f"{kind}, backward of {self.name(b)}")
                handed_on[b] = self._add(f"{kind}, gradients of {self.name(b)} handed on")
            self.forward.append(forward)
            self.loss.append(loss)
            self.backward.append(backward)
            self.handed_on.append(handed_on)
            self.embedding.append(self._add(f"{kind}, backward of the embedding"))
        self.step = self._add("optimizer step")

    def _add(self, phase: str) -> int:
        self.phases.append(phase)
        return len(self.phases) - 1

    def name(self, b: int) -> str:
        return f"block {b}" if b < self.n_layers else f"MTP block {b - self.n_layers + 1}"


@dataclass(frozen=True)
class _Shares:
    """What one GPU's plan is made of: its tokens per micro-batch and the parameter counts it holds."""

    T: int  # tokens per micro-batch per GPU
    total: int  # every parameter
    root: int  # embedding, output head, final norm
    embedding: int
    blocks: list[tuple[int, int]]  # (dense, routed experts) per block, MTP blocks (MoE) last
    local: list[float]  # per block, the parameters a GPU computes with
    shard: list[float]  # per block, a GPU's share of the parameters
    sharded_total: float  # a GPU's share of every parameter


def _shares(cfg: Config, gpus: int, n_blocks: int) -> _Shares:
    mc, t, ep = cfg.model_config(), cfg.train, cfg.parallel.ep
    dense, experts = dense_and_expert_params(mc)
    root = root_params(mc)
    blocks = [block_params(mc, b >= mc.n_dense_layers) for b in range(n_blocks)]
    # FSDP2 splits an expert stack's E/ep experts over its gpus/ep ranks with torch.chunk and pads every rank's share
    # to the largest: ceil((E/ep) / (gpus/ep)) experts, more than an even split where gpus/ep does not divide E/ep
    rank_experts = -(-mc.n_routed_experts // ep // (gpus // ep))
    shard = [bd / gpus + be / max(mc.n_routed_experts, 1) * rank_experts for bd, be in blocks]
    return _Shares(T=t.micro_batch * t.seq_len, total=dense + experts, root=root, embedding=mc.vocab_size * mc.dim,
                   blocks=blocks, local=[bd + be / ep for bd, be in blocks], shard=shard,
                   sharded_total=root / gpus + sum(shard))


_Add = Callable[[str, str, float, int, int], None]  # (line, name, bytes, first phase, last phase)


def _memory_table(cfg: Config, gpus: int, kind: GPU, tl: _Timeline) -> list[Tensor]:
    """Everything the trainer keeps alive on one GPU, with its lifetime (see the module docstring)."""
    shares = _shares(cfg, gpus, tl.n_blocks)
    table: list[Tensor] = []

    def add(line: str, name: str, nbytes: float, first: int, last: int) -> None:
        if nbytes:
            table.append(Tensor(line, name, nbytes, first, last))

    _add_state(add, cfg, gpus, tl, shares)
    _add_compute_weights(add, cfg, gpus, tl, shares)
    if gpus > 1:
        _add_fsdp_gradients(add, cfg, gpus, tl, shares)
    else:
        _add_one_gpu_gradients(add, tl, shares)
    _add_activations(add, cfg, gpus, kind, tl, shares)
    _add_loss(add, cfg, tl, shares)
    return table


def _add_state(add: _Add, cfg: Config, gpus: int, tl: _Timeline, s: _Shares) -> None:
    """What lives through the whole step: fp32 parameters, AdamW's moments, library workspaces."""
    dtype = cfg.train.optimizer_state_dtype
    state_bytes = {"fp32": 4, "bf16": 2}[dtype]
    add("parameters", f"fp32 parameters, sharded over {gpus}", 4 * s.sharded_total, 0, tl.step)
    add("optimizer states", f"AdamW's two moments in {dtype}", 2 * state_bytes * s.sharded_total, 0, tl.step)
    add("overhead", "cuBLAS, cuDNN and compiled-kernel workspaces", OVERHEAD_GIB * GIB, 0, tl.step)


def _add_compute_weights(add: _Add, cfg: Config, gpus: int, tl: _Timeline, s: _Shares) -> None:
    """bf16 compute weights: on one GPU the compute copies, kept across steps; under FSDP2 the root through its forward
    and backward, each block from the previous block's forward and from the next one's backward through its own,
    and its routed experts as docs/planning.md#what-it-counts says."""
    ep, n, line = cfg.parallel.ep, tl.n_blocks, "bf16 compute weights"
    if gpus == 1:
        add(line, "bf16 copies of every weight", 2 * s.total, 0, tl.step)
        return
    for k in range(len(tl.forward)):
        forward, backward, handed_on = tl.forward[k], tl.backward[k], tl.handed_on[k]
        add(line, "root, unsharded", 2 * s.root, forward[0], tl.embedding[k])
        for b, (bd, be) in enumerate(s.blocks):
            ahead = bd + (be if ep == 1 else 0)
            add(line, f"{tl.name(b)}, unsharded for forward", 2 * ahead, forward[max(b - 1, 0)], forward[b])
            add(line, f"{tl.name(b)}, unsharded for backward", 2 * ahead, backward[min(b + 1, n - 1)], handed_on[b])
            if ep > 1 and gpus > ep:
                add(line, f"{tl.name(b)}, experts unsharded for forward", 2 * be / ep, forward[b], forward[b])
                add(line, f"{tl.name(b)}, experts unsharded for backward", 2 * be / ep, backward[b], handed_on[b])
            elif ep > 1:
                add(line, f"{tl.name(b)}, experts kept unsharded", 2 * be / ep, forward[b], handed_on[b])


def _add_one_gpu_gradients(add: _Add, tl: _Timeline, s: _Shares) -> None:
    """One GPU: bf16 gradients on the compute copies (one micro-batch) or fp32 accumulators that each folds into as
    autograd writes it (several), block by block from the last; the head's gradient comes with the first block's (the
    chunked loss makes it in forward), the embedding's at the end."""
    n, kinds, step = tl.n_blocks, range(len(tl.forward)), tl.step
    rest = s.root - s.embedding
    if len(kinds) == 1:
        for b in range(n):
            add("gradients", f"{tl.name(b)}: bf16 gradient", 2 * s.local[b], tl.backward[0][b], step)
        add("gradients", "root: bf16 gradient but the embedding's", 2 * rest, tl.backward[0][n - 1], step)
        add("gradients", "embedding: bf16 gradient", 2 * s.embedding, tl.embedding[0], step)
        return
    for b in range(n):
        add("gradients", f"{tl.name(b)}: fp32 accumulator", 4 * s.local[b], tl.backward[0][b], step)
        for k in kinds:
            add("gradients", f"{tl.name(b)}: bf16 gradient until folded", 2 * s.local[b], tl.backward[k][b],
                tl.backward[k][b])
    add("gradients", "root: fp32 accumulators but the embedding's", 4 * rest, tl.backward[0][n - 1], step)
    add("gradients", "embedding: fp32 accumulator", 4 * s.embedding, tl.embedding[0], step)
    for k in kinds:
        add("gradients", "embedding: bf16 gradient until folded", 2 * s.embedding, tl.embedding[k], tl.embedding[k])


def _add_fsdp_gradients(add: _Add, cfg: Config, gpus: int, tl: _Timeline, s: _Shares) -> None:
    """FSDP2: a block's unsharded bf16 gradient, then its fp32 reduce-scatter input, in flight through the next
    block's backward (torch keeps one); the fp32 sharded gradients sum over micro-batches until the step. With
    accumulate_unsharded_grads, every micro-batch but the last adds into fp32 unsharded gradients instead."""
    n, kinds, step = tl.n_blocks, range(len(tl.forward)), tl.step
    later = kinds[-1]  # the last micro-batch's phases (the first one's, with one micro-batch)
    unsharded = cfg.parallel.accumulate_unsharded_grads and len(kinds) > 1

    def next_after(k: int, b: int) -> int:  # the phase after block b's hand-over
        return tl.backward[k][b - 1] if b else tl.embedding[k]

    for b in range(n):
        for k in kinds:
            add("gradients", f"{tl.name(b)}: unsharded bf16 gradient", 2 * s.local[b], tl.backward[k][b],
                tl.handed_on[k][b])
            if k == later or not unsharded:
                add("gradients", f"{tl.name(b)}: fp32 reduce-scatter input", 4 * s.local[b], tl.handed_on[k][b],
                    next_after(k, b))
        reduced_at = tl.handed_on[later if unsharded else 0][b]
        if unsharded:
            add("gradients", f"{tl.name(b)}: fp32 unsharded accumulator", 4 * s.local[b], tl.handed_on[0][b],
                reduced_at)
        add("gradients", f"{tl.name(b)}: fp32 sharded gradient", 4 * s.shard[b], reduced_at, step)
    for k in kinds:
        add("gradients", "root: unsharded bf16 gradient but the embedding's", 2 * (s.root - s.embedding),
            tl.backward[k][n - 1], tl.embedding[k])
        add("gradients", "embedding: unsharded bf16 gradient", 2 * s.embedding, tl.embedding[k], tl.embedding[k])
        if k == later or not unsharded:
            add("gradients", "root: fp32 reduce-scatter input", 4 * s.root, tl.embedding[k], tl.embedding[k])
    if unsharded:
        add("gradients", "root: fp32 unsharded accumulator", 4 * s.root, tl.embedding[0], tl.embedding[later])
    add("gradients", "root: fp32 sharded gradient", 4 * s.root / gpus, tl.embedding[later if unsharded else 0], step)


def _add_activations(add: _Add, cfg: Config, gpus: int, kind: GPU, tl: _Timeline, s: _Shares) -> None:
    """What each block saves for backward by AC mode, from its forward to its backward; under AC, its recompute
    restores the whole no-AC set in its own backward. EP's received token copies on a line of their own."""
    mc, mode = cfg.model_config(), cfg.train.activation_checkpoint
    ep, backend, around = cfg.parallel.ep, cfg.parallel.ep_backend, _around_checkpoint(cfg, gpus, kind)
    for b in range(tl.n_blocks):
        moe = b >= mc.n_dense_layers
        saved, saved_local = (_saved_per_token(mc, moe, e, backend, around) for e in (ep, 1))
        kept, kept_local = (ACTIVATION_FACTOR * 2 * s.T * per_token[mode] for per_token in (saved, saved_local))
        recomputed = ACTIVATION_FACTOR * 2 * s.T * saved["none"] - kept
        line = "activations" if b < tl.n_layers else "mtp"
        for k in range(len(tl.forward)):
            first, last = tl.forward[k][b], tl.backward[k][b]
            add(line, f"{tl.name(b)}: saved for backward ({mode} AC)", kept_local, first, last)
            add("ep receive buffers", f"{tl.name(b)}: received token copies", kept - kept_local, first, last)
            if mode != "none":
                add(line, f"{tl.name(b)}: recomputed in backward", recomputed, last, last)


def _add_loss(add: _Add, cfg: Config, tl: _Timeline, s: _Shares) -> None:
    """The chunked loss (dsv3.loss.linear_cross_entropy): in its forward one chunk's bf16 logits and their gradient
    and, over several chunks, the head gradient accumulating in fp32; kept for backward its [T, D] input gradient
    and bf16 head gradient, until autograd reaches it (the MTP losses first, then the main one)."""
    mc = cfg.model_config()
    d, V = mc.dim, mc.vocab_size
    chunk, fp32_sum = min(s.T, LOSS_CHUNK), s.T > LOSS_CHUNK
    in_forward = "chunk logits and fp32 head gradient" if fp32_sum else "logits and their gradient"
    for k in range(len(tl.forward)):
        for depth in range(mc.n_mtp_layers + 1):
            line = "mtp" if depth else "loss (chunked)"
            reached = tl.backward[k][tl.n_layers - 1 + depth]
            add(line, f"loss {depth}: {in_forward}",
                2 * 2 * chunk * V + 4 * V * d * fp32_sum, tl.loss[k][depth], tl.loss[k][depth])
            add(line, f"loss {depth}: input and head gradients for backward", 2 * s.T * d + 2 * V * d,
                tl.loss[k][depth], reached)


def exchanges_per_moe_layer(activation_checkpoint: str) -> int:
    """EP exchanges a MoE layer makes per micro-batch, as dsv3.dispatch runs them: dispatch and combine forward, each
    other's gradients backward; full AC's recompute exchanges the forward's two again, selective AC keeps them
    (`parallel._EXCHANGE_OPS`)."""
    return 6 if activation_checkpoint == "full" else 4


def _step_time(cfg: Config, gpus: int, kind: GPU, micro_batches: int) -> dict[str, float]:
    """Seconds per optimizer step, itemised: compute per block, the optimizer, EP's exchanges, and what of FSDP2's
    collectives the neighbouring block's compute cannot hide."""
    blocks = _block_times(cfg, gpus, kind)
    time = {item: micro_batches * sum(s) for item, s in blocks.items.items()}
    time["elementwise, routing, loss"] += micro_batches * _head_and_loss_s(cfg, gpus, kind)
    time["optimizer"], time["gradient accumulation"] = _optimizer_s(cfg, gpus, kind, micro_batches)
    reducing = 1 if cfg.parallel.accumulate_unsharded_grads else micro_batches
    time["FSDP exposed"] = (reducing * _fsdp_exposed_s(cfg, gpus, kind, blocks, reduce=True)
                            + (micro_batches - reducing) * _fsdp_exposed_s(cfg, gpus, kind, blocks, reduce=False))
    time["EP all-to-all"] = micro_batches * _ep_exchange_s(cfg, kind)
    return time


@dataclass
class _BlockTimes:
    """Per block, one micro-batch: forward + backward seconds by kind of work, and the bytes FSDP2 moves for it."""

    items: dict[str, list[float]]
    prefetched: list[float]  # all-gathered with the blocks (bf16)
    gathered_late: list[float]  # experts all-gathered only when they run (EP; bf16)
    reduces: list[float]  # reduce-scattered (fp32)

    @property
    def forward(self) -> list[float]:
        compute = [sum(s) for s in zip(*self.items.values())]
        return [(c - r) / 3 for c, r in zip(compute, self.items["AC recompute"])]

    @property
    def backward(self) -> list[float]:
        return [sum(s) - f for s, f in zip(zip(*self.items.values()), self.forward)]


def _block_times(cfg: Config, gpus: int, kind: GPU) -> _BlockTimes:
    """FLOPs at the kind's measured rates, memory-bound work over HBM bandwidth, each block's recompute."""
    mc, t, ep = cfg.model_config(), cfg.train, cfg.parallel.ep
    T, d, hbm = t.micro_batch * t.seq_len, mc.dim, kind.hbm_tb_s * 1e12
    attention_matmul = attention_params(mc) - mc.q_lora_rank - mc.kv_lora_rank  # less the latent norms' scales
    expert_matmul = mc.n_activated_experts * 3 * d * mc.moe_inter_dim
    attention_flops = 3 * mc.n_heads * (mc.qk_head_dim + mc.v_head_dim) * t.seq_len * T  # forward + backward
    times = _BlockTimes({"dense GEMMs": [], "expert GEMMs": [], "attention": [], "elementwise, routing, loss": [],
                         "AC recompute": []}, [], [], [])
    for b in range(mc.n_layers + mc.n_mtp_layers):
        moe = b >= mc.n_dense_layers
        block_dense, block_experts = block_params(mc, moe)
        matmul = attention_matmul + (block_dense - 2 * d - attention_params(mc) if moe else 3 * d * mc.inter_dim)
        if b >= mc.n_layers:
            matmul += 2 * d * d  # the MTP depth's eh_proj
        activation_bytes = 2 * T * _saved_per_token(mc, moe, ep)["none"]
        dense_s = 6 * matmul * T / (kind.dense_tflops * 1e12)
        expert_s = 6 * expert_matmul * T / (kind.grouped_tflops * 1e12) if moe else 0.0
        attention_s = attention_flops / (kind.attention_tflops * 1e12)
        activation_s = activation_bytes / (OTHER_HBM_EFFICIENCY * hbm)
        casts_s = 14 * (block_dense + block_experts / ep) / (FSDP_CAST_HBM_EFFICIENCY * hbm) if gpus > 1 else 0.0
        # recompute is a forward (a third of forward + backward) of what the mode drops: selective AC in a MoE block
        # compiled inside its checkpoint (where parallel.moe_blocks_compile_whole says no) recomputes its dense
        # GEMMs, full AC the whole block
        inside = moe and not _around_checkpoint(cfg, gpus, kind)
        recompute = {"none": 0.0, "selective": ((dense_s if inside else 0.0) + activation_s) / 3,
                     "full": (dense_s + expert_s + attention_s + activation_s) / 3}[t.activation_checkpoint]
        for item, s in zip(times.items, (dense_s, expert_s, attention_s, activation_s + casts_s, recompute)):
            times.items[item].append(s)
        # elements a GPU receives in the ring all-gather (bf16) and sends in the reduce-scatter (fp32)
        dense_moved = block_dense * (gpus - 1) / gpus
        experts_moved = block_experts / ep * (gpus // ep - 1) / (gpus // ep)
        if ep == 1:
            dense_moved, experts_moved = dense_moved + experts_moved, 0.0
        times.prefetched.append(2 * dense_moved)
        times.gathered_late.append(2 * experts_moved)
        times.reduces.append(4 * (dense_moved + experts_moved))
    return times


def _head_and_loss_s(cfg: Config, gpus: int, kind: GPU) -> float:
    """One micro-batch: the output head's GEMMs (main and each MTP depth), the loss's softmax over the vocabulary,
    the root's casts."""
    mc, t = cfg.model_config(), cfg.train
    T, hbm, heads = t.micro_batch * t.seq_len, kind.hbm_tb_s * 1e12, 1 + mc.n_mtp_layers
    return (6 * heads * mc.dim * mc.vocab_size * T / (kind.dense_tflops * 1e12)
            + 2 * T * heads * mc.vocab_size / (OTHER_HBM_EFFICIENCY * hbm)
            + (14 * root_params(mc) / (FSDP_CAST_HBM_EFFICIENCY * hbm) if gpus > 1 else 0.0))


def _fsdp_exposed_s(cfg: Config, gpus: int, kind: GPU, blocks: _BlockTimes, reduce: bool) -> float:
    """FSDP2's collectives per micro-batch not hidden behind a neighbour block's compute: the forward's first
    all-gathers (root, block 0), the first backward block's again, the last reduce-scatters (block 0, root) and under
    EP the experts' all-gathers. A micro-batch that does not reduce moves no reduce-scatter (docs/planning.md)."""
    if gpus == 1:
        return 0.0
    link = (kind.nvlink_gb_s if gpus <= kind.gpus_per_node else INFINIBAND_GB_S) * 1e9 * COLLECTIVE_EFFICIENCY
    root_moved = root_params(cfg.model_config()) * (gpus - 1) / gpus
    prefetched, forward, backward, n = blocks.prefetched, blocks.forward, blocks.backward, len(blocks.prefetched)
    rs = blocks.reduces if reduce else [0.0] * n
    exposed = (2 * root_moved + prefetched[0] + prefetched[-1] + 2 * sum(blocks.gathered_late)) / link
    exposed += sum(max(0.0, prefetched[b + 1] / link - forward[b]) for b in range(n - 1))
    exposed += sum(max(0.0, ((prefetched[b - 1] if b else 0.0) + (rs[b + 1] if b + 1 < n else 0.0)) / link
                       - backward[b]) for b in range(n))
    return exposed + (rs[0] + (4 * root_moved if reduce else 0.0)) / link


def _ep_exchange_s(cfg: Config, kind: GPU) -> float:
    """EP per micro-batch: dispatch and combine, forward and backward (full AC exchanges again in its recompute);
    copies to ranks in the node go over NVLink, the rest over InfiniBand."""
    mc, t, ep = cfg.model_config(), cfg.train, cfg.parallel.ep
    if ep == 1:
        return 0.0
    in_node = min(ep, kind.gpus_per_node)
    per_byte = ((in_node - 1) / ep / kind.nvlink_gb_s + (ep - in_node) / ep / INFINIBAND_GB_S) / 1e9
    moved = t.micro_batch * t.seq_len * mc.n_activated_experts * mc.dim * 2  # bf16 token copies per exchange
    n_moe = mc.n_layers + mc.n_mtp_layers - mc.n_dense_layers
    return n_moe * exchanges_per_moe_layer(t.activation_checkpoint) * moved * per_byte / ALL_TO_ALL_EFFICIENCY


def _optimizer_s(cfg: Config, gpus: int, kind: GPU, micro_batches: int) -> tuple[float, float]:
    """The optimizer step and (one GPU, several micro-batches) the gradients' folds into fp32 accumulators, both
    streams over HBM: AdamW reads θ, the gradient and the moments and writes θ and the moments (one GPU: and the
    bf16 copy); the first micro-batch writes each accumulator, every later one reads and writes it too."""
    params, hbm = sum(dense_and_expert_params(cfg.model_config())), kind.hbm_tb_s * 1e12
    state_bytes = {"fp32": 4, "bf16": 2}[cfg.train.optimizer_state_dtype]
    grad_bytes = 2 if gpus == 1 and micro_batches == 1 else 4
    step_bytes = 8 + grad_bytes + 4 * state_bytes + (2 if gpus == 1 else 0)  # θ and the moments read and written
    efficiency = OPTIMIZER_HBM_EFFICIENCY["dsv3" if gpus == 1 or state_bytes == 2 else "torch"]
    folded_bytes = 6 + 10 * (micro_batches - 1) if gpus == 1 and micro_batches > 1 else 0  # 2 + 4, then 2 + 8
    return (params / gpus * step_bytes / (efficiency * hbm),
            params * folded_bytes / (OPTIMIZER_HBM_EFFICIENCY["dsv3"] * hbm))


@dataclass
class Plan:
    """Per-GPU memory (the table of live tensors, and its peak) and time per optimizer step (itemised, seconds) of a
    config on `gpus` GPUs."""

    gpus: int
    gpu: str
    capacity_gib: float
    phases: list[str]
    tensors: list[Tensor]
    time: dict[str, float]
    tokens_per_step_per_gpu: int
    assumptions: list[str]

    def alive(self, phase: int) -> list[Tensor]:
        return [x for x in self.tensors if x.first <= phase <= x.last]

    @cached_property
    def peak_phase(self) -> int:
        """The phase at which the most bytes are alive (the first, of equals)."""
        totals = [sum(x.bytes for x in self.alive(phase)) for phase in range(len(self.phases))]
        return totals.index(max(totals))

    @property
    def memory(self) -> dict[str, float]:
        """GiB per memory line at the peak."""
        lines = dict.fromkeys(["parameters", "gradients", "optimizer states", "bf16 compute weights",
                               "ep receive buffers", "activations", "loss (chunked)", "mtp", "overhead"], 0.0)
        for x in self.alive(self.peak_phase):
            lines[x.line] += x.bytes / GIB
        return lines

    @property
    def memory_gib_per_gpu(self) -> float:
        return sum(self.memory.values())

    @property
    def step_s(self) -> float:
        return sum(self.time.values())

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step_per_gpu / self.step_s

    @property
    def fits(self) -> bool:
        return self.memory_gib_per_gpu <= FIT_FRACTION * self.capacity_gib

    def summary(self) -> str:
        m = self.memory
        return (f"plan: {self.memory_gib_per_gpu:.1f} GiB per GPU of {self.capacity_gib:.1f} at its peak "
                f"({self.phases[self.peak_phase]}: params {m['parameters']:.1f}, grads {m['gradients']:.1f}, "
                f"optimizer {m['optimizer states']:.1f}, activations {m['activations'] + m['ep receive buffers']:.1f}, "
                f"other {m['bf16 compute weights'] + m['loss (chunked)'] + m['mtp'] + m['overhead']:.1f}), "
                f"~{self.tokens_per_s_per_gpu / 1e3:.1f}k tokens/s per GPU on {self.gpus} × {self.gpu}")

    def as_dict(self) -> dict:
        return {"gpus": self.gpus, "gpu": self.gpu, "capacity_gib": self.capacity_gib,
                "memory_gib_per_gpu": self.memory_gib_per_gpu, "fits": self.fits,
                "peak_phase": self.phases[self.peak_phase], "memory_gib": self.memory, "step_s": self.step_s,
                "time_s": self.time, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "assumptions": self.assumptions,
                "tensors_at_peak": [{"name": x.name, "line": x.line, "gib": x.bytes / GIB,
                                     "from": self.phases[x.first], "until": self.phases[x.last]}
                                    for x in self.alive(self.peak_phase)]}


def plan(cfg: Config, gpus: int, gpu: str, capacity_gib: float | None = None) -> Plan:
    """The plan of `cfg` on `gpus` GPUs of kind `gpu` (a GPUS key); `capacity_gib` overrides the kind's memory."""
    if gpu not in GPUS:
        raise UserError(f"unknown GPU kind {gpu!r}: choose one of {', '.join(GPUS)}")
    mc, t, p = cfg.model_config(), cfg.train, cfg.parallel
    if gpus < 1 or gpus % p.ep:
        raise UserError(f"parallel.ep={p.ep} must divide the GPU count {gpus}: pass --gpus as a multiple of it")
    if t.global_batch % (t.micro_batch * gpus):
        raise UserError(f"train.global_batch ({t.global_batch}) must be a multiple of train.micro_batch × GPUs "
                        f"({t.micro_batch} × {gpus})")
    kind = GPUS[gpu]
    micro_batches = t.global_batch // (t.micro_batch * gpus)
    timeline = _Timeline(mc.n_layers, mc.n_mtp_layers, micro_batches)
    link = "NVLink" if gpus <= kind.gpus_per_node else "InfiniBand"
    assumptions = [
        f"{gpu}: {kind.dense_tflops:.0f} / {kind.grouped_tflops:.0f} / {kind.attention_tflops:.0f} TFLOP/s dense / "
        f"grouped GEMM / attention, HBM {kind.hbm_tb_s} TB/s, {capacity_gib or kind.memory_gib:.1f} GiB; {kind.source}",
        f"links: NVLink {kind.nvlink_gb_s:.0f} GB/s within {kind.gpus_per_node} GPUs, InfiniBand {INFINIBAND_GB_S:.0f} "
        f"GB/s per GPU across nodes (one 400 Gb/s NIC per GPU); FSDP's collectives over {link} at "
        f"{COLLECTIVE_EFFICIENCY:.0%} of it (assumed), our all-to-all at {ALL_TO_ALL_EFFICIENCY:.0%} (measured)",
        "FSDP: a block's all-gather hides behind the previous block's compute, its reduce-scatter behind the next "
        "block's backward, or is exposed; under EP the experts' all-gathers are exposed (not prefetched); EP's "
        "all-to-all is never hidden (it waits for its split sizes)",
        "one GPU, several micro-batches: each bf16 gradient is folded into an fp32 accumulator as soon as autograd "
        "writes it",
        f"EP receive buffers: a balanced router's T·K copies (all_to_all), or each token once per rank it reaches "
        f"(DeepEP), × {EP_HEADROOM} headroom",
        "bf16 GEMMs: fp8/mxfp8, faster, are not modelled; DeepEP's exchange takes all_to_all's time (the 16B cut "
        "at EP 4: measured within 2% of each other), its kept buffers their own size",
    ]
    if not t.compile:  # the activation terms were measured on compiled blocks, which recompute more under AC
        assumptions.append("train.compile is off: eager blocks save more for backward than this plan counts "
                           "(measured compiled; selective AC keeps every matmul's output)")
    return Plan(gpus, gpu, capacity_gib or kind.memory_gib, timeline.phases, _memory_table(cfg, gpus, kind, timeline),
                _step_time(cfg, gpus, kind, micro_batches), micro_batches * t.micro_batch * t.seq_len, assumptions)


def gpu_kind(device_name: str) -> str:
    """The GPUS key for torch.cuda.get_device_name(); an unlisted GPU is planned with H100 rates."""
    name = device_name.lower()
    return next((kind for kind in ("b200", "h200", "h100") if kind in name), "h100")


# What --search varies: the layout of a run on given GPUs, every other setting as the config has it
LAYOUT = (("parallel", "ep"), ("train", "micro_batch"), ("train", "activation_checkpoint"),
          ("train", "optimizer_state_dtype"))
_AC_MODES = ("none", "selective", "full")


def layout_flags(cfg: Config) -> str:
    """The config's layout as the overrides that select it: `--parallel.ep=1 --train.micro_batch=4 ...`."""
    return " ".join(f"--{section}.{key}={getattr(getattr(cfg, section), key)}" for section, key in LAYOUT)


def _accepted(cfg: Config, gpus: int) -> dict[str, list]:
    """Per LAYOUT key, the values the run accepts on `gpus` GPUs: an ep dividing the GPUs and the experts (with
    DeepEP, one its kernels support), a micro-batch dividing each GPU's share of the global batch (in whole blocks
    of the low-precision GEMMs' token multiple), every AC mode, both moment dtypes."""
    t, backend = cfg.train, cfg.parallel.ep_backend
    n_experts = cfg.model_config().n_routed_experts
    multiple = FEATURE_MULTIPLE.get(t.precision, 1)
    return {"ep": [ep for ep in range(1, gpus + 1) if gpus % ep == 0 and n_experts % ep == 0
                   and (ep == 1 or backend != "deepep" or ep in SUPPORTED_EP)],
            "micro_batch": [mb for mb in range(1, t.global_batch // gpus + 1)
                            if t.global_batch % (mb * gpus) == 0 and mb * t.seq_len % multiple == 0],
            "activation_checkpoint": list(_AC_MODES), "optimizer_state_dtype": ["fp32", "bf16"]}


def _changed(cfg: Config, changes: dict[str, object]) -> Config:
    changed = copy.deepcopy(cfg)
    for section, key in LAYOUT:
        if key in changes:
            setattr(getattr(changed, section), key, changes[key])
    return changed


def search(cfg: Config, gpus: int, gpu: str, capacity_gib: float | None = None) -> list[tuple[Config, Plan]]:
    """Every layout of `cfg` the run accepts on `gpus` GPUs (LAYOUT's keys; each other setting as `cfg` has it) that
    fits, the most planned tokens/s first."""
    accepted = _accepted(cfg, gpus)
    found = []
    for values in itertools.product(*accepted.values()):
        layout = _changed(cfg, dict(zip(accepted, values)))
        planned = plan(layout, gpus, gpu, capacity_gib)
        if planned.fits:
            found.append((layout, planned))
    return sorted(found, key=lambda found: -found[1].tokens_per_s_per_gpu)


def bottleneck(p: Plan) -> str:
    """The largest item of the step time and its share."""
    item = max(p.time, key=p.time.get)
    return f"{item} {p.time[item] / p.step_s:.0%}"


def train_hours(cfg: Config, p: Plan) -> float:
    """Hours for `train.steps` at the plan's tokens/s; a batch ramp's steps counted at its mean batch."""
    t = cfg.train
    ramp = min(t.batch_ramp_steps, t.steps)
    sequences = ramp * (t.batch_ramp_start + t.global_batch) / 2 + (t.steps - ramp) * t.global_batch
    return sequences * t.seq_len / (p.tokens_per_s_per_gpu * p.gpus) / 3600


def _fixes(cfg: Config, gpus: int, gpu: str, capacity_gib: float | None = None) -> list[tuple[str, Plan]]:
    """Single changes that make the plan fit (more AC, a larger ep, a smaller micro-batch) and that the run accepts
    (`_accepted`), the fastest planned step first."""
    t, accepted = cfg.train, _accepted(cfg, gpus)
    candidates = [("activation_checkpoint", mode) for mode in _AC_MODES[_AC_MODES.index(t.activation_checkpoint) + 1:]]
    candidates += [("ep", ep) for ep in accepted["ep"] if ep > cfg.parallel.ep]
    candidates += [("micro_batch", mb) for mb in reversed(accepted["micro_batch"]) if mb < t.micro_batch]
    found = []
    for key, value in candidates:
        candidate = plan(_changed(cfg, {key: value}), gpus, gpu, capacity_gib)
        if candidate.fits:
            section = "parallel" if key == "ep" else "train"
            found.append((f"--{section}.{key}={value}", candidate))
    return sorted(found, key=lambda fix: fix[1].step_s)


def advice(cfg: Config, gpus: int, gpu: str, capacity_gib: float | None = None) -> str:
    """What to set when the plan cannot fit: up to three single changes that do, with their plans' memory; then the
    fastest layouts that fit (`search`)."""
    found = _fixes(cfg, gpus, gpu, capacity_gib)
    single = ("set " + "; or ".join(f"{flag} (plan: {fix.memory_gib_per_gpu:.1f} GiB)" for flag, fix in found[:3])
              if found else "no single change of AC mode, ep or micro-batch fits")
    layouts = search(cfg, gpus, gpu, capacity_gib)
    if not layouts:
        return f"{single}, and no layout of {', '.join(key for _, key in LAYOUT)} does: use more GPUs"
    return (f"{single}; the fastest layouts that fit (scripts/plan.py --search):\n"
            + "\n".join(f"  {layout_flags(layout)}  ({p.memory_gib_per_gpu:.1f} GiB, "
                        f"{p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU)" for layout, p in layouts[:3]))


def check_fits(cfg: Config, gpus: int, device_name: str, total_memory_bytes: int) -> Plan:
    """The plan of `cfg` on this GPU; a UserError naming the fixes (`advice`) when it cannot fit."""
    kind, capacity_gib = gpu_kind(device_name), total_memory_bytes / GIB
    planned = plan(cfg, gpus, kind, capacity_gib)
    if planned.fits:
        return planned
    raise UserError(f"this config cannot fit the GPU: the plan needs {planned.memory_gib_per_gpu:.1f} GiB per GPU "
                    f"of {capacity_gib:.1f} ({FIT_FRACTION:.0%} usable): {advice(cfg, gpus, kind, capacity_gib)}")
