"""DeepSeek-V3 (arXiv 2412.19437), plain single-device PyTorch.

Notable: MLA with a decoupled shared-head RoPE key (§2.1.1) in its training ("naive") form; interleaved
RoPE, with YaRN only where the config asks for it (`rope_factor` > 1); DeepSeekMoE blocks after the first
`n_dense_layers` (dsv3.moe); D multi-token-prediction modules (§2.2) sharing the embedding and the output head.
`model(tokens)` gives logits; `model(tokens, targets)` gives the losses separately (`TrainOutput`); in eval mode
only the main loss is computed (no MTP modules, no balance loss).
Sharding, low precision, compile and activation checkpointing are applied from outside (train.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dsv3.config import ModelConfig
from dsv3.loss import linear_cross_entropy
from dsv3.moe import MLP, MoE

# d_v != d_qk rules out flash; cuDNN is much faster than the "efficient" fallback on H100 (docs/performance.md).
_CUDA_ATTENTION_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Rotation angle per (position, pair) [max_seq_len, d_r/2], with YaRN when rope_factor > 1."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if cfg.rope_factor > 1:
        # YaRN: keep high frequencies (fast rotations), interpolate low ones by rope_factor, ramp between.
        def correction_dim(n_rotations: float) -> float:
            return dim * math.log(cfg.original_seq_len / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    positions = torch.arange(cfg.max_seq_len, dtype=torch.float32)
    return torch.outer(positions, freqs)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of x [B, S, H, d_r] by cos/sin [S, d_r/2]; fp32 math:
    (x0, x1) → (x0·c − x1·s, x0·s + x1·c) = x·(c, c) + (x1, x0)·(−s, s). Written as that sum, inductor compiles it
    (with MLA's concatenations) to a faster kernel than a stack of the two rotated halves."""
    cos2 = torch.stack((cos, cos), dim=-1).flatten(-2)[:, None, :]  # [S, 1, d_r], broadcast over heads
    sin2 = torch.stack((-sin, sin), dim=-1).flatten(-2)[:, None, :]
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
    return (xf * cos2 + swapped * sin2).type_as(x)


class MLA(nn.Module):
    """Multi-head latent attention: low-rank q and kv, plus a RoPE key k_pe shared by all heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        qk_head_dim = cfg.qk_head_dim
        if self.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, self.n_heads * qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim),
                               bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_head_dim, cfg.dim, bias=False)
        self.softmax_scale = qk_head_dim ** -0.5
        if cfg.rope_factor > 1:  # YaRN's attention temperature
            mscale = 0.1 * cfg.mscale * math.log(cfg.rope_factor) + 1.0
            self.softmax_scale *= mscale * mscale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora_rank else self.wq(x)
        q = q.view(B, S, self.n_heads, -1)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)
        kv_latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin)  # [B, S, 1, d_r]: one RoPE key for all heads
        kv = self.wkv_b(self.kv_norm(kv_latent)).view(B, S, self.n_heads, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, d]
        if q.is_cuda:
            with sdpa_kernel(_CUDA_ATTENTION_BACKENDS, set_priority=True):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class Block(nn.Module):
    """Pre-norm: h = x + MLA(norm(x)); out = h + FFN(norm(h)), FFN dense or MoE.
    Returns (out, tokens_per_expert, balance_loss); the last two are None in dense blocks."""

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = MLA(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MLP(cfg.dim, cfg.inter_dim) if layer_id < cfg.n_dense_layers else MoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        h = x + self.attn(self.attn_norm(x), cos, sin)
        if isinstance(self.ffn, MLP):
            return h + self.ffn(self.ffn_norm(h)), None, None
        moe = self.ffn(self.ffn_norm(h))
        return h + moe.y, moe.tokens_per_expert, moe.balance_loss


class MTPModule(nn.Module):
    """Depth-k MTP module (§2.2): h' = W_eh·[RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)], one Block,
    its own final norm; embedding and head are the main model's."""

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(layer_id, cfg)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h: torch.Tensor, next_emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        h = self.eh_proj(torch.cat([self.enorm(next_emb), self.hnorm(h)], dim=-1))
        return self.block(h, cos, sin)


class TrainOutput(NamedTuple):
    loss: torch.Tensor  # main next-token cross-entropy
    mtp_losses: list[torch.Tensor]  # one cross-entropy per MTP depth k = 1..D; none in eval mode
    balance_loss: torch.Tensor  # Σ over MoE layers of the sequence-wise balance loss (unweighted by α); 0 in eval
    tokens_per_expert: torch.Tensor  # [n_moe_layers (+ MTP), E], this forward's routed token copies


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        # ModuleDict with string keys: stable FQNs for checkpoints, FSDP and per-block compile.
        self.layers = nn.ModuleDict({str(i): Block(i, cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(cfg.n_layers + k, cfg) for k in range(cfg.n_mtp_layers))
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.qk_rope_head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.qk_rope_head_dim // 2), persistent=False)
        if self.embed.weight.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, init_std) for every weight (paper), ones for norms, zero expert bias, RoPE tables.
        Call after `to_empty()` when the model was built on the meta device."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                nn.init.normal_(p, std=self.cfg.init_std)
        for name, b in self.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()
        angles = rope_frequencies(self.cfg).to(self.rope_cos.device)
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """tokens [B, S] → logits [B, S, vocab]; with targets [B, S] (tokens shifted by one) → TrainOutput."""
        S = tokens.size(1)
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        emb = self.embed(tokens)  # [B, S, D]; MTP depth k reuses emb[:, k:], the embedding of t_{i+k}
        h = emb
        tokens_per_expert, balance = [], []
        for layer in self.layers.values():
            h, counts, bal = layer(h, cos, sin)
            if counts is not None:
                tokens_per_expert.append(counts)
                balance.append(bal)
        if targets is None:
            return self.head(self.norm(h))
        loss = linear_cross_entropy(self.norm(h), self.head, targets)
        mtp_losses = []
        for k, mtp in enumerate(self.mtp if self.training else [], start=1):  # evaluation scores the main head
            # depth k at position i sees t_{i+k} (= tokens[i+k]) and predicts t_{i+k+1} (= targets[i+k])
            n = S - k
            h, counts, bal = mtp(h[:, :n], emb[:, k:], cos[:n], sin[:n])
            mtp_losses.append(linear_cross_entropy(mtp.norm(h), self.head, targets[:, k:]))
            if counts is not None:
                tokens_per_expert.append(counts)
                balance.append(bal)
        balance_loss = torch.stack(balance).sum() if balance else h.new_zeros(())
        counts = torch.stack(tokens_per_expert) if tokens_per_expert else tokens.new_zeros(0, 0)
        return TrainOutput(loss, mtp_losses, balance_loss, counts)

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks in order: the main layers', then each MTP module's."""
        return list(self.layers.values()) + [m.block for m in self.mtp]

    def routers(self) -> list:
        """The MoE routers in the order of TrainOutput.tokens_per_expert."""
        return [b.ffn.gate for b in self.blocks() if not isinstance(b.ffn, MLP)]
