"""Counting: parameters (total, activated, per block), training FLOPs per token, and MFU against each GPU's
bf16 peak. The planner (dsv3.plan), the banner and the benchmarks count with these."""

from __future__ import annotations

from dsv3.config import ModelConfig


def active_matmul_params(cfg: ModelConfig) -> int:
    """N_matmul_active: the matmul weights one token passes through (forward), embedding lookup excluded: each
    layer's `layer_matmul_params`, the head d·vocab, and per MTP depth eh_proj (2d·d), one MoE block and the shared
    head once more."""
    d = cfg.dim
    head = d * cfg.vocab_size
    n_moe = cfg.n_layers - cfg.n_dense_layers
    # MTP blocks have layer ids >= n_layers >= n_dense_layers, so they are always MoE blocks.
    mtp = 2 * d * d + layer_matmul_params(cfg, moe=True) + head
    return (cfg.n_dense_layers * layer_matmul_params(cfg, moe=False) + n_moe * layer_matmul_params(cfg, moe=True)
            + head + cfg.n_mtp_layers * mtp)


def layer_matmul_params(cfg: ModelConfig, moe: bool) -> int:
    """One block's matmul weights a token passes through: the MLA projections (wq or wq_a+wq_b, wkv_a, wkv_b, wo)
    and a dense SwiGLU (3·d·inter) or the MoE (shared experts 3·d·n_shared·moe_inter, top-k routed experts
    K·3·d·moe_inter, router d·E)."""
    d = cfg.dim
    attn = attention_params(cfg) - cfg.q_lora_rank - cfg.kv_lora_rank  # less the q/kv latent norms' scales
    if not moe:
        return attn + 3 * d * cfg.inter_dim
    experts = cfg.n_shared_experts + cfg.n_activated_experts
    return attn + 3 * d * cfg.moe_inter_dim * experts + d * cfg.n_routed_experts


def layer_flops_per_token(cfg: ModelConfig, seq_len: int, moe: bool) -> float:
    """Training FLOPs per token of one block (dense or MoE), the two terms of `flops_per_token` for one layer: what a
    block costs in a model of any depth, without embedding, head and loss."""
    return float(6 * layer_matmul_params(cfg, moe) + attention_flops_per_token(cfg, seq_len))


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """3·H·(d_n + d_r + d_v)·S for one layer: the attention scores q·k (d_n+d_r per head) and the weighted sum of v
    (d_v), 2·S·d forward per token and head, halved because causal attention computes only half the S×S scores,
    times 3 for forward + backward."""
    return 3 * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token:

        6·N_matmul_active + 3·L·H·(d_n + d_r + d_v)·S,   L = n_layers + n_mtp_layers

    6·N: 2 FLOPs per multiply-add forward, 4 backward; then `attention_flops_per_token` per layer, MTP blocks
    included (depth k sees S-k positions, counted as S). The 16B cut's figure: docs/performance.md#performance."""
    n_attention_layers = cfg.n_layers + cfg.n_mtp_layers
    return float(6 * active_matmul_params(cfg) + n_attention_layers * attention_flops_per_token(cfg, seq_len))


def attention_params(mc: ModelConfig) -> int:
    """Parameters of one MLA attention: its projections and the q/kv latent norms."""
    d, H = mc.dim, mc.n_heads
    if mc.q_lora_rank:
        q = d * mc.q_lora_rank + mc.q_lora_rank + mc.q_lora_rank * H * mc.qk_head_dim  # wq_a, q_norm, wq_b
    else:
        q = d * H * mc.qk_head_dim
    kv = d * (mc.kv_lora_rank + mc.qk_rope_head_dim) + mc.kv_lora_rank  # wkv_a, kv_norm
    return q + kv + mc.kv_lora_rank * H * (mc.qk_nope_head_dim + mc.v_head_dim) + H * mc.v_head_dim * d


def block_params(mc: ModelConfig, moe: bool) -> tuple[int, int]:
    """(dense, routed-expert) parameters of one Block: norms, MLA, and a dense MLP or router + shared + experts."""
    d, inter = mc.dim, mc.moe_inter_dim
    dense = 2 * d + attention_params(mc)
    if not moe:
        return dense + 3 * d * mc.inter_dim, 0
    return dense + mc.n_routed_experts * d + 3 * d * mc.n_shared_experts * inter, 3 * mc.n_routed_experts * d * inter


def root_params(mc: ModelConfig) -> int:
    """Outside the blocks (the root FSDP unit): embedding, final norm, head, and each MTP depth's norms + eh_proj."""
    return 2 * mc.vocab_size * mc.dim + mc.dim + mc.n_mtp_layers * (3 * mc.dim + 2 * mc.dim * mc.dim)


def dense_and_expert_params(mc: ModelConfig) -> tuple[int, int]:
    """(dense parameters, routed-expert parameters) of Transformer(mc), exactly."""
    n_moe = mc.n_layers - mc.n_dense_layers + mc.n_mtp_layers  # MTP blocks are MoE blocks
    dense_block, _ = block_params(mc, moe=False)
    moe_dense, experts = block_params(mc, moe=True)
    return root_params(mc) + mc.n_dense_layers * dense_block + n_moe * moe_dense, n_moe * experts


def parameter_counts(mc: ModelConfig) -> tuple[int, int]:
    """(total, activated) parameters of `Transformer(mc)`. Activated: all but the routed experts a token is not
    sent to, (n_routed − top-k) per MoE block, MTP blocks included."""
    dense, experts = dense_and_expert_params(mc)
    idle = experts // mc.n_routed_experts * (mc.n_routed_experts - mc.n_activated_experts)
    return dense + experts, dense + experts - idle


# Dense (no sparsity) bf16 tensor-core peak per GPU, from the vendors' datasheets. Matched in order by
# case-insensitive substring of torch.cuda.get_device_name(), so a more specific name comes first:
# "GB200" contains "B200", "H100 PCIe" contains "H100", "L40S" contains "L4", "H200" contains "H20".
_PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("GB300", 2.5e15), ("B300", 2.25e15), ("GB200", 2.5e15), ("B200", 2.25e15), ("B100", 1.75e15),
    ("H200 NVL", 835e12), ("H200", 989e12),  # also GH200
    ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),  # "H100 80GB HBM3" is the SXM part
    ("H800 PCIe", 756e12), ("H800", 989e12), ("H20", 148e12),
    ("A100", 312e12), ("A800", 312e12),
    ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12),
    ("RTX 5090", 209.5e12), ("RTX 4090", 165.2e12), ("RTX 3090", 71e12),  # bf16 with fp32 accumulate
    ("MI355X", 2.5e15), ("MI325X", 1.307e15), ("MI300X", 1.307e15),
]


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device, or None when unknown (CPU, unlisted GPU): then no MFU."""
    name = device_name.lower()
    for key, flops in _PEAK_BF16_FLOPS:
        if key.lower() in name:
            return flops
    return None


def mfu(flops_per_token: float, tokens_per_s: float, n_gpus: int, peak: float) -> float:
    """Model FLOPs utilisation, a fraction: achieved FLOP/s over n_gpus·peak. tokens_per_s counts all GPUs."""
    return flops_per_token * tokens_per_s / (n_gpus * peak)
