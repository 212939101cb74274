"""The run planner: per-GPU memory, itemised, and step time / tokens per second per GPU, from a Config, a GPU
count and a GPU kind, before anything is built. train.py checks the plan at start-up; scripts/plan.py prints it.

Memory follows what the trainer holds (bf16 compute over fp32 master weights, AdamW): sharded fp32 parameters
and gradients, two moments, the bf16 compute weights (FSDP2's unsharded buffers; on one GPU, without FSDP, bf16
copies of every weight, whose gradients stay bf16 unless micro-batches add up), the tensors each block saves for backward
by activation-checkpointing mode, the chunked loss, EP's receive buffers. The peak is taken over a sweep of the
backward pass: activations are freed block by block while sharded gradients appear.
Step time: FLOPs at measured kernel rates, memory-bound work over HBM bandwidth, and the exposed part of FSDP's
and EP's communication over stated link bandwidths. Every constant below is an assumption, said where it is set.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from dsv3.config import Config, ModelConfig, UserError
from dsv3.metrics import active_matmul_params, block_params, dense_and_expert_params, root_params

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    """One GPU kind: the memory torch can allocate, and the rates the trainer achieves on it."""

    memory_gib: float  # torch.cuda.get_device_properties().total_memory
    dense_tflops: float  # bf16 nn.Linear GEMMs, achieved
    grouped_tflops: float  # bf16 torch._grouped_mm (routed experts), achieved
    attention_tflops: float  # cuDNN SDPA, causal, counted as in metrics.flops_per_token
    hbm_tb_s: float  # datasheet HBM bandwidth
    nvlink_gb_s: float  # achievable per direction per GPU within a node
    gpus_per_node: int = 8


# H100 rates: measured in our 16B-cut profile (one H100, 4 × 4096). H200: the same chips, measured in the
# 671B-width-cut profile (one H200, 2 × 4096). B200: no measurement: the datasheet's 2.25 PFLOP/s dense bf16
# scaled by the efficiency measured on Hopper (÷ 989 TFLOP/s), HBM 8 TB/s, NVLink 5, and of its 180 GB an
# assumed 178 GiB visible to torch. Memory: what torch reports as total (80 GB H100: 79.1 GiB; H200: 139).
_B200_SCALE = 2250 / 989
GPUS: dict[str, GPU] = {
    "h100": GPU(memory_gib=79.1, dense_tflops=750, grouped_tflops=650, attention_tflops=346, hbm_tb_s=3.35,
                nvlink_gb_s=450),
    "h200": GPU(memory_gib=139.0, dense_tflops=763, grouped_tflops=721, attention_tflops=375, hbm_tb_s=4.8,
                nvlink_gb_s=450),
    "b200": GPU(memory_gib=178.0, dense_tflops=763 * _B200_SCALE, grouped_tflops=721 * _B200_SCALE,
                attention_tflops=375 * _B200_SCALE, hbm_tb_s=8.0, nvlink_gb_s=900),
}
INFINIBAND_GB_S = 40.0  # 400 Gb/s per GPU, ~40 GB/s achievable
# Calibrated against our five measured peaks (tests/test_plan.py pins them), one factor per term family:
# the saved-tensor count below is what eager autograd keeps; torch.compile keeps fewer (it recomputes cheap
# elementwise ops) while the caching allocator rounds and fragments: one factor absorbs both.
ACTIVATION_FACTOR = 0.75
# cuBLAS/cuDNN and compiled-kernel workspaces. The CUDA context is not in max_memory_allocated, nor in this plan:
# FIT_FRACTION leaves room for it and for the allocator's reserved-but-free blocks.
OVERHEAD_GIB = 0.5
# AdamW streams each state once: achieved fraction of HBM bandwidth, dsv3.optim's compiled update (one GPU, or
# bf16 moments) and torch's fused one (fp32 moments under FSDP2)
OPTIMIZER_HBM_EFFICIENCY = {"dsv3": 0.77, "torch": 0.53}
# elementwise ops, norms, copies, routing, permutation and the loss's softmax: the bytes of the activations the
# blocks write (the no-AC saved set) and, under FSDP, of its per-micro-batch casts of the unsharded parameters and
# gradients (fp32 → bf16 parameters, bf16 → fp32 gradients: 14 bytes each), at this fraction of HBM bandwidth
# (fitted to the one-GPU profiles' other + routing + loss + idle time)
OTHER_HBM_EFFICIENCY = 0.15
# our all_to_all reaches this fraction of the link bandwidth (one 16B MoE layer's four exchanges: 6.1 ms on
# 2 H200s); it blocks on the split sizes, so it is never overlapped with compute
ALL_TO_ALL_EFFICIENCY = 0.29
# routed tokens per rank vary around the balanced T·K: receive buffers and expert activations get headroom
EP_HEADROOM = 1.25
FIT_FRACTION = 0.95  # the plan must stay under this share of the GPU's memory
LOSS_CHUNK = 4096  # dsv3.model.linear_cross_entropy's chunk


def _saved_per_token(mc: ModelConfig, moe: bool, ep: int) -> dict[str, float]:
    """bf16 elements one block saves for backward per token, by AC mode (fp32 tensors count twice)."""
    d, H, K, I = mc.dim, mc.n_heads, mc.n_activated_experts, mc.moe_inter_dim
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
    copy = 2 * d + 3 * I
    token_side = d + 4 * mc.n_routed_experts + 3 * mc.n_shared_experts * I + d  # normed, fp32 scores, shared, out
    # inside a compiled MoE block SAC keeps grouped GEMM, SDPA and all-to-all outputs (parallel._selective_policy)
    exchange = 2 * d if ep > 1 else 0
    return {"none": attention + token_side + copies * copy,
            "selective": d + sdpa_out + copies * (2 * I + d + exchange), "full": d}


@dataclass
class Plan:
    """Per-GPU memory (GiB, itemised) and time (seconds per optimizer step, itemised) of a config on `gpus` GPUs."""

    gpus: int
    gpu: str
    capacity_gib: float
    memory: dict[str, float]
    time: dict[str, float]
    tokens_per_step_per_gpu: int
    assumptions: list[str]
    peak_at: str  # when in the step memory peaks: the memory lines hold what is allocated then

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
        return (f"plan: {self.memory_gib_per_gpu:.1f} GiB per GPU of {self.capacity_gib:.1f} (params "
                f"{m['parameters']:.1f}, grads {m['gradients']:.1f}, optimizer {m['optimizer states']:.1f}, "
                f"activations {m['activations'] + m['ep receive buffers']:.1f}, other "
                f"{m['bf16 compute weights'] + m['loss (chunked)'] + m['mtp'] + m['overhead']:.1f}), "
                f"~{self.tokens_per_s_per_gpu / 1e3:.1f}k tokens/s per GPU on {self.gpus} × {self.gpu}")

    def as_dict(self) -> dict:
        return {"gpus": self.gpus, "gpu": self.gpu, "capacity_gib": self.capacity_gib,
                "memory_gib_per_gpu": self.memory_gib_per_gpu, "fits": self.fits, "peak_at": self.peak_at,
                "memory_gib": self.memory, "step_s": self.step_s, "time_s": self.time,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "assumptions": self.assumptions}


def _link_gb_s(group: int, gpu: GPU) -> float:
    """A collective's per-GPU bandwidth: NVLink when the group sits in one node, else InfiniBand (ring-bound)."""
    return gpu.nvlink_gb_s if group <= gpu.gpus_per_node else INFINIBAND_GB_S


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
    kind, ep = GPUS[gpu], p.ep
    T = t.micro_batch * t.seq_len  # tokens per micro-batch per GPU
    micro_batches = t.global_batch // (t.micro_batch * gpus)
    state_bytes = {"fp32": 4, "bf16": 2}[t.optimizer_state_dtype]

    # --- memory: bytes per GPU
    dense, experts = dense_and_expert_params(mc)
    sharded = (dense + experts) / gpus
    is_moe = [i >= mc.n_dense_layers for i in range(mc.n_layers)] + [True] * mc.n_mtp_layers  # per block
    params_per_block = [block_params(mc, moe) for moe in is_moe]
    unsharded = [2 * (bd + be / ep) for bd, be in params_per_block]  # bf16, as all-gathered for compute
    # fp32, reduce-scattered; on one GPU the compute copies' bf16 gradients, unless summed over micro-batches in fp32
    grad_bytes = 2 if gpus == 1 and micro_batches == 1 else 4
    grads = [grad_bytes * (bd + be) / gpus for bd, be in params_per_block]
    saved = [_saved_per_token(mc, moe, ep) for moe in is_moe]
    saved_local = [_saved_per_token(mc, moe, 1) for moe in is_moe]  # the same tokens without EP
    mode = t.activation_checkpoint
    acts = [ACTIVATION_FACTOR * 2 * T * s[mode] for s in saved]
    ep_buffers = [ACTIVATION_FACTOR * 2 * T * (s[mode] - s1[mode]) for s, s1 in zip(saved, saved_local)]
    # AC recomputes one block at a time in backward, holding all it would have saved
    recompute = 0.0 if mode == "none" else max(ACTIVATION_FACTOR * 2 * T * s["none"] for s in saved)
    root = root_params(mc)
    unsharded_grads = 0.0
    if p.accumulate_unsharded_grads and micro_batches > 1:
        unsharded_grads = 4 * (dense + experts / ep)  # every rank holds the whole gradient until the step
    # the chunked loss: in forward one chunk's bf16 logits and gradient and the fp32 head gradient being
    # accumulated; to backward, the bf16 head and [T, D] input gradients (each MTP depth holds its own: mtp line)
    loss_transient = LOSS_CHUNK * mc.vocab_size * 2 * 2 + 4 * mc.vocab_size * mc.dim
    loss_saved = 2 * mc.vocab_size * mc.dim + 2 * T * mc.dim

    # The peak is the largest of: the end of forward; block i's backward, from the last (earlier blocks'
    # activations still saved, later blocks' sharded gradients there, block i's unsharded gradient in flight in
    # bf16 and in fp32 for the reduce-scatter, unsharded parameters: on one GPU all blocks not yet reached, kept
    # since forward, else block i and the prefetched i−1); the optimizer step (every gradient).
    def held(i: int) -> float:
        return sum(unsharded) if gpus == 1 else unsharded[i] + (unsharded[i - 1] if i else 0.0)

    def saved_through(i: int, loss: float) -> dict[str, float]:
        """What blocks 0..i hold for backward, the MTP blocks' share (and their own loss's) on its own line."""
        main, mtp = slice(0, min(i + 1, mc.n_layers)), slice(mc.n_layers, i + 1)
        return {"ep receive buffers": sum(ep_buffers[:i + 1]),
                "activations": sum(acts[main]) - sum(ep_buffers[main]),
                "mtp": sum(acts[mtp]) - sum(ep_buffers[mtp]) + mc.n_mtp_layers * loss_saved,
                "loss (chunked)": loss}

    n = len(is_moe)
    phases = [{"gradients": 0.0, "bf16 compute weights": held(n - 1),
               **saved_through(n - 1, loss_saved + loss_transient)}]
    phase_names = ["the end of forward (every activation saved, no gradient yet)"]
    for i in reversed(range(n)):
        block = f"block {i}" if i < mc.n_layers else f"MTP module {i - mc.n_layers}"
        phase_names.append(f"the backward pass at {block} (the gradients of the blocks after it, the activations "
                           f"of those before it)")
        # bf16 gradient, and its fp32 cast for the reduce-scatter (on one GPU: the bf16 one, if micro-batches add up)
        in_flight_bytes = 6 if gpus > 1 else 2 if micro_batches > 1 else 0
        in_flight = in_flight_bytes * (params_per_block[i][0] + params_per_block[i][1] / ep)
        phase = {"gradients": sum(grads[i + 1:]) + grad_bytes * root / gpus, "bf16 compute weights": held(i) + in_flight,
                 **saved_through(i, loss_saved)}
        phase["activations"] += recompute
        phases.append(phase)
    phases.append({"gradients": grad_bytes * sharded, "bf16 compute weights": held(0) if gpus == 1 else 0.0,
                   "ep receive buffers": 0.0,
                   "activations": 0.0, "mtp": 0.0, "loss (chunked)": 0.0})
    phase_names.append("the optimizer step (every gradient, no activation)")
    peak_at = max(range(len(phases)), key=lambda k: sum(phases[k].values()))
    peak = phases[peak_at]
    memory = {
        "parameters": 4 * sharded / GIB,
        "gradients": (peak["gradients"] + unsharded_grads) / GIB,
        "optimizer states": 2 * state_bytes * sharded / GIB,
        # the root (embedding, head) stays unsharded from forward to the end of backward (one GPU: always)
        "bf16 compute weights": (2 * root + peak["bf16 compute weights"]) / GIB,
        "ep receive buffers": peak["ep receive buffers"] / GIB,
        "activations": peak["activations"] / GIB,
        "loss (chunked)": peak["loss (chunked)"] / GIB,
        "mtp": peak["mtp"] / GIB,
        "overhead": OVERHEAD_GIB,
    }

    # --- time: seconds per optimizer step
    n_moe = sum(is_moe)
    expert_matmul = n_moe * mc.n_activated_experts * 3 * mc.dim * mc.moe_inter_dim
    dense_matmul = active_matmul_params(mc) - expert_matmul
    attention = 3 * len(is_moe) * mc.n_heads * (mc.qk_head_dim + mc.v_head_dim) * t.seq_len
    activation_bytes = T * 2 * (sum(s["none"] for s in saved) + (1 + mc.n_mtp_layers) * mc.vocab_size)
    other_bytes = activation_bytes + (14 * (dense + experts / ep) if gpus > 1 else 0)  # FSDP's casts
    dense_s = 6 * dense_matmul * T / (kind.dense_tflops * 1e12)
    expert_s = 6 * expert_matmul * T / (kind.grouped_tflops * 1e12)
    attention_s = attention * T / (kind.attention_tflops * 1e12)
    other_s = other_bytes / (OTHER_HBM_EFFICIENCY * kind.hbm_tb_s * 1e12)
    # recompute: a forward (a third of forward + backward) of what the mode drops; no parameter casts again
    recomputed_other_s = other_s * activation_bytes / other_bytes
    head = (1 + mc.n_mtp_layers) * mc.dim * mc.vocab_size
    blocks_dense_s = dense_s * (dense_matmul - head) / dense_matmul
    recompute_s = {"none": 0.0,
                   "selective": (blocks_dense_s * n_moe / len(is_moe) + recomputed_other_s) / 3,
                   "full": (blocks_dense_s + expert_s + attention_s + recomputed_other_s) / 3}[t.activation_checkpoint]
    compute_s = dense_s + expert_s + attention_s + other_s + recompute_s
    # AdamW reads parameter, gradient and moments and writes parameter and moments (one GPU: the gradient and the
    # written compute copy are bf16, the same bytes); dsv3.optim's update or torch's fused one
    efficiency = OPTIMIZER_HBM_EFFICIENCY["dsv3" if gpus == 1 or state_bytes == 2 else "torch"]
    optimizer_s = sharded * (3 * 4 + 4 * state_bytes) / (efficiency * kind.hbm_tb_s * 1e12)
    # FSDP: bf16 all-gather before forward and again before backward, fp32 reduce-scatter after backward (every
    # micro-batch, or once per step with accumulate_unsharded_grads); ring volume (n−1)/n per GPU
    efsdp = gpus // ep
    dense_group = dense - root  # the root's all-gather happens once per step, counted below
    gather_bytes = 2 * 2 * (dense_group * (gpus - 1) / gpus + experts / ep * (efsdp - 1) / efsdp)
    reduce_bytes = 4 * (dense * (gpus - 1) / gpus + experts / ep * (efsdp - 1) / efsdp)
    reduces = 1 if p.accumulate_unsharded_grads else micro_batches
    fsdp_s = (micro_batches * gather_bytes + reduces * reduce_bytes + 2 * root * (gpus - 1) / gpus) / (
        _link_gb_s(gpus, kind) * 1e9)
    # EP: dispatch and combine, forward and backward (full AC exchanges again in its recompute); copies to ranks
    # in the node go over NVLink, the rest over InfiniBand
    exchanges = 6 if t.activation_checkpoint == "full" else 4
    copy_bytes = T * mc.n_activated_experts * mc.dim * 2
    in_node = min(ep, kind.gpus_per_node)
    per_byte = ((in_node - 1) / ep / kind.nvlink_gb_s + (ep - in_node) / ep / INFINIBAND_GB_S) / 1e9
    ep_s = n_moe * exchanges * copy_bytes * per_byte / ALL_TO_ALL_EFFICIENCY if ep > 1 else 0.0
    time = {
        "dense GEMMs": micro_batches * dense_s,
        "expert GEMMs": micro_batches * expert_s,
        "attention": micro_batches * attention_s,
        "elementwise, routing, loss": micro_batches * other_s,
        "AC recompute": micro_batches * recompute_s,
        "optimizer": optimizer_s,
        # FSDP prefetches on its own stream: only what the compute cannot hide is exposed
        "FSDP exposed": max(0.0, fsdp_s - micro_batches * compute_s),
        "EP all-to-all": micro_batches * ep_s,
    }
    assumptions = [
        f"{gpu}: {kind.dense_tflops:.0f} / {kind.grouped_tflops:.0f} / {kind.attention_tflops:.0f} TFLOP/s "
        f"dense / grouped GEMM / attention, HBM {kind.hbm_tb_s} TB/s, {capacity_gib or kind.memory_gib:.1f} GiB",
        f"links: NVLink {kind.nvlink_gb_s:.0f} GB/s within {kind.gpus_per_node} GPUs, InfiniBand "
        f"{INFINIBAND_GB_S:.0f} GB/s per GPU across nodes; all-to-all at {ALL_TO_ALL_EFFICIENCY:.0%} of them",
        "FSDP collectives overlap compute (prefetch); EP's all-to-all does not (it waits for its split sizes)",
        f"EP receive buffers: a balanced router's T·K copies × {EP_HEADROOM} headroom",
        "bf16 GEMMs and the all_to_all dispatcher: fp8/mxfp8 and DeepEP, both faster, are not modelled",
    ]
    return Plan(gpus, gpu, capacity_gib or kind.memory_gib, memory, time, micro_batches * T, assumptions,
                phase_names[peak_at])


def gpu_kind(device_name: str) -> str:
    """The GPUS key for torch.cuda.get_device_name(); an unlisted GPU is planned with H100 rates."""
    name = device_name.lower()
    return next((kind for kind in ("b200", "h200", "h100") if kind in name), "h100")


def _fixes(cfg: Config, gpus: int, gpu: str, capacity_gib: float | None) -> list[tuple[str, Plan]]:
    """Single changes that make the plan fit, cheapest first: AC mode, then ep, then a smaller micro-batch."""
    t, p = cfg.train, cfg.parallel
    n_experts = cfg.model_config().n_routed_experts
    modes = ("none", "selective", "full")
    candidates = [("train", "activation_checkpoint", mode)
                  for mode in modes[modes.index(t.activation_checkpoint) + 1:]]
    candidates += [("parallel", "ep", ep) for ep in range(p.ep + 1, gpus + 1)
                   if gpus % ep == 0 and n_experts % ep == 0]
    candidates += [("train", "micro_batch", mb) for mb in range(t.micro_batch - 1, 0, -1)
                   if t.global_batch % (mb * gpus) == 0]
    fixes = []
    for section, key, value in candidates:
        changed = copy.deepcopy(cfg)
        setattr(getattr(changed, section), key, value)
        candidate = plan(changed, gpus, gpu, capacity_gib)
        if candidate.fits:
            fixes.append((f"--{section}.{key}={value}", candidate))
    return fixes


def fit_advice(cfg: Config, gpus: int, gpu: str, capacity_gib: float | None = None) -> str:
    """What to set so that a config that cannot fit does: up to three single changes, with their plans' memory."""
    fixes = _fixes(cfg, gpus, gpu, capacity_gib)
    if not fixes:
        return "no single change of AC mode, ep or micro-batch fits: use more GPUs"
    return "set " + "; or ".join(f"{flag} (plan: {fix.memory_gib_per_gpu:.1f} GiB)" for flag, fix in fixes[:3])


def check_fits(cfg: Config, gpus: int, device_name: str, total_memory_bytes: int) -> Plan:
    """The plan of `cfg` on this GPU; a UserError naming a fix (AC mode, ep, micro-batch) when it cannot fit."""
    kind, capacity_gib = gpu_kind(device_name), total_memory_bytes / GIB
    planned = plan(cfg, gpus, kind, capacity_gib)
    if planned.fits:
        return planned
    raise UserError(f"this config cannot fit the GPU: the plan needs {planned.memory_gib_per_gpu:.1f} GiB per GPU "
                    f"of {capacity_gib:.1f} ({FIT_FRACTION:.0%} usable): {fit_advice(cfg, gpus, kind, capacity_gib)}")
