"""Transformer specification: logits and training outputs, the MTP target shift, causality, the flavor sizes,
init, RoPE/YaRN and the MLA softmax scale, and gradient reaching every parameter (paper §2.1)."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from dsv3 import moe
from dsv3.config import FLAVORS, ModelConfig
from dsv3.model import MLA, TrainOutput, Transformer, rope_frequencies


def debug_config(**overrides) -> ModelConfig:
    return dataclasses.replace(FLAVORS["debug"], **overrides)


def debug_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(debug_config(**overrides))


def random_tokens(cfg: ModelConfig, *shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def plain_rope_angles(cfg: ModelConfig) -> torch.Tensor:
    """θ_{p,i} = p · theta^(-2i/d_r), no YaRN."""
    i = torch.arange(cfg.qk_rope_head_dim // 2, dtype=torch.float64)
    freqs = cfg.rope_theta ** (-2 * i / cfg.qk_rope_head_dim)
    return (torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None] * freqs).float()


# ---------------------------------------------------------------------------------------------- outputs


def test_model_call_returns_logits():
    model = debug_model()
    tokens = random_tokens(model.cfg, 2, 16)

    logits = model(tokens)

    assert logits.shape == (2, 16, model.cfg.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_training_call_returns_main_mtp_and_balance_losses_separately():
    model = debug_model(n_mtp_layers=2)
    cfg = model.cfg
    seq = random_tokens(cfg, 2, 17)
    tokens, targets = seq[:, :-1], seq[:, 1:]

    out = model(tokens, targets)

    assert isinstance(out, TrainOutput)
    assert out.loss.shape == () and out.balance_loss.shape == ()
    assert len(out.mtp_losses) == 2 and all(x.shape == () and torch.isfinite(x) for x in out.mtp_losses)
    torch.testing.assert_close(out.loss, F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()))
    # N(0, 0.006) init: logits are nearly flat, so every cross-entropy starts near ln(vocab)
    for loss in [out.loss, *out.mtp_losses]:
        assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.05
    n_moe = cfg.n_layers - cfg.n_dense_layers
    assert out.balance_loss.item() > 0
    # one row per MoE layer, then one per MTP depth k (which sees S - k positions)
    assert out.tokens_per_expert.shape == (n_moe + 2, cfg.n_routed_experts)
    assert len(model.routers()) == n_moe + 2
    rows = out.tokens_per_expert.sum(dim=-1).tolist()
    K = cfg.n_activated_experts
    assert rows == [2 * 16 * K] * n_moe + [2 * 15 * K, 2 * 14 * K]


def test_mtp_depth1_loss_is_cross_entropy_of_the_token_two_ahead():
    model = debug_model()
    cfg = model.cfg
    B, S = 2, 12
    seq = random_tokens(cfg, B, S + 1)  # t_0 .. t_S
    tokens, targets = seq[:, :S], seq[:, 1:]

    out = model(tokens, targets)

    # by hand: main trunk, then h'_i = W_eh·[RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)], one block, predict t_{i+2}
    angles = rope_frequencies(cfg)
    cos, sin = angles.cos(), angles.sin()
    h = model.embed(tokens)
    for layer in model.layers.values():
        h = layer(h, cos[:S], sin[:S])[0]
    mtp, n = model.mtp[0], S - 1
    h1 = mtp.eh_proj(torch.cat([mtp.enorm(model.embed(seq[:, 1:S])), mtp.hnorm(h[:, :n])], dim=-1))
    h1 = mtp.block(h1, cos[:n], sin[:n])[0]
    logits = model.head(mtp.norm(h1))  # [B, S-1, vocab]
    expected = F.cross_entropy(logits.flatten(0, 1), seq[:, 2:S + 1].flatten())

    torch.testing.assert_close(out.mtp_losses[0], expected)
    wrong_shift = F.cross_entropy(logits.flatten(0, 1), seq[:, 1:S].flatten())
    assert not torch.allclose(out.mtp_losses[0], wrong_shift)


def test_mtp_reuses_the_main_embedding_lookup():
    """Depth k's Emb(t_{i+k}) is a slice of the trunk's lookup, not a second one: the embedding runs once, and the
    depth-2 loss equals the one computed with its own lookup of the shifted tokens."""
    model = debug_model(n_mtp_layers=2)
    seq = random_tokens(model.cfg, 2, 17)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    lookups = []
    model.embed.register_forward_hook(lambda module, args, out: lookups.append(args[0].shape))

    out = model(tokens, targets)

    assert lookups == [tokens.shape]
    S, cos, sin = 16, model.rope_cos, model.rope_sin
    h = model.embed(tokens)
    for layer in model.layers.values():
        h = layer(h, cos[:S], sin[:S])[0]
    for k, mtp in enumerate(model.mtp, start=1):
        n = S - k
        h = mtp(h[:, :n], model.embed(seq[:, k:k + n]), cos[:n], sin[:n])[0]
    expected = F.cross_entropy(model.head(model.mtp[1].norm(h)).flatten(0, 1), seq[:, 3:].flatten())
    torch.testing.assert_close(out.mtp_losses[1], expected)


def test_eval_mode_scores_the_main_head_only(monkeypatch):
    """What evaluation discards is not computed: no MTP module runs and no balance loss, the main loss is the
    training call's."""
    model = debug_model(n_mtp_layers=1)
    seq = random_tokens(model.cfg, 2, 17)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    trained = model(tokens, targets)
    mtp_calls, balance_calls = [], []
    model.mtp[0].register_forward_hook(lambda *_: mtp_calls.append(1))
    real_balance_loss = moe.sequence_balance_loss
    monkeypatch.setattr(moe, "sequence_balance_loss", lambda *a: balance_calls.append(1) or real_balance_loss(*a))

    out = model.eval()(tokens, targets)

    assert mtp_calls == [] and balance_calls == []
    assert out.mtp_losses == [] and out.balance_loss.item() == 0.0
    torch.testing.assert_close(out.loss, trained.loss, rtol=0, atol=0)
    model.train()(tokens, targets)
    assert mtp_calls and balance_calls  # the hooks do see training calls


def test_main_head_is_causal():
    model = debug_model()
    j = 20
    tokens = random_tokens(model.cfg, 2, 32)
    changed = tokens.clone()
    changed[:, j] = (changed[:, j] + 1) % model.cfg.vocab_size

    before, after = model(tokens), model(changed)

    torch.testing.assert_close(after[:, :j], before[:, :j], rtol=0, atol=1e-5)
    assert not torch.allclose(after[:, j], before[:, j], rtol=0, atol=1e-5)
    assert not torch.allclose(after[:, -1], before[:, -1], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- sizes, init


@pytest.mark.parametrize("flavor,expected", [("671B", 671e9), ("16B", 15.7e9)])
def test_flavor_builds_on_meta_with_its_nominal_parameter_count(flavor, expected):
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])

    params = dict(model.named_parameters())
    assert all(p.is_meta for p in params.values())
    main = sum(p.numel() for name, p in params.items() if not name.startswith("mtp."))
    assert abs(main - expected) / expected < 0.01
    assert len(model.mtp) == FLAVORS[flavor].n_mtp_layers


@pytest.mark.parametrize("flavor,activated,mtp_module", [("671B", 37e9, 14e9), ("16B", 2.4e9, None)])
def test_flavor_activates_its_nominal_parameters_per_token(flavor, activated, mtp_module):
    """Activated = every matmul weight a token touches: all but the embedding lookup, routed experts at K/E.
    The published figures are rounded (37B, 2.4B, 14B), hence 3% and 5%; MTP's 14B counts the embedding and
    head copies that released checkpoints store in the MTP layer."""
    cfg = FLAVORS[flavor]
    with torch.device("meta"):
        model = Transformer(cfg)
    params = {name: p.numel() for name, p in model.named_parameters()}
    main = {name: n for name, n in params.items() if not name.startswith("mtp.")}
    routed = sum(n for name, n in main.items() if ".experts." in name)
    idle_routed = routed * (1 - cfg.n_activated_experts / cfg.n_routed_experts)
    per_token = sum(main.values()) - main["embed.weight"] - idle_routed
    assert abs(per_token - activated) / activated < 0.03
    if mtp_module:
        copies = main["embed.weight"] + main["head.weight"]
        mtp = sum(n for name, n in params.items() if name.startswith("mtp.")) + copies
        assert abs(mtp - mtp_module) / mtp_module < 0.05


def check_initialised(model: Transformer) -> None:
    cfg = model.cfg
    big = [model.head.weight, model.embed.weight, model.layers["1"].ffn.experts.w13, model.layers["0"].ffn.w1.weight]
    for weight in big:
        assert weight.numel() > 40_000
        assert weight.std().item() == pytest.approx(cfg.init_std, rel=0.03)
        assert weight.mean().abs().item() < cfg.init_std / 20
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert len(norms) >= 2 * cfg.n_layers + 2
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms)
    for router in model.routers():
        assert torch.equal(router.expert_bias, torch.zeros(cfg.n_routed_experts))
        assert router.expert_bias.dtype == torch.float32
    angles = rope_frequencies(cfg)
    torch.testing.assert_close(model.rope_cos, angles.cos())
    torch.testing.assert_close(model.rope_sin, angles.sin())


def test_init_weights_gives_init_std_for_weights_and_ones_for_norms():
    check_initialised(debug_model())


def test_init_weights_after_meta_to_empty_initialises_everything():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(debug_config())
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan"))  # whatever to_empty left behind must be overwritten

    model.init_weights()

    check_initialised(model)
    assert torch.isfinite(model(random_tokens(model.cfg, 1, 8))).all()


# ---------------------------------------------------------------------------------------------- RoPE / YaRN


@pytest.mark.parametrize("max_seq_len", [1024, 4096])
def test_rope_frequencies_are_plain_rope_up_to_original_seq_len(max_seq_len):
    cfg = ModelConfig(max_seq_len=max_seq_len, original_seq_len=4096)

    angles = rope_frequencies(cfg)

    assert angles.shape == (max_seq_len, cfg.qk_rope_head_dim // 2)
    torch.testing.assert_close(angles, plain_rope_angles(cfg))


def test_yarn_divides_low_frequencies_by_rope_factor_and_keeps_the_highest():
    cfg = ModelConfig(max_seq_len=16384, original_seq_len=4096, rope_factor=40.0)

    freqs = rope_frequencies(cfg)[1]  # angles at position 1 = the per-pair frequencies
    plain = plain_rope_angles(cfg)[1]

    ratio = freqs / plain
    assert ratio[0].item() == pytest.approx(1.0)  # highest frequency (pair 0) unchanged
    assert ratio[-1].item() == pytest.approx(1 / 40)  # lowest frequency interpolated by the factor
    assert (ratio[1:] <= ratio[:-1] + 1e-6).all()  # a monotone ramp between the two
    assert (ratio > 1 / 40 - 1e-6).all() and (ratio < 1 + 1e-6).all()
    assert ((ratio < 1 - 1e-3) & (ratio > 1 / 40 + 1e-3)).any()  # the ramp has interior points
    angles = rope_frequencies(cfg)
    torch.testing.assert_close(angles, torch.arange(16384.0)[:, None] * freqs, rtol=1e-5, atol=1e-3)


def test_a_longer_context_is_plain_rope_unless_rope_factor_asks_for_yarn():
    """Pretraining at 8K: the RoPE tables and the softmax scale of plain RoPE, whatever original_seq_len was."""
    cfg = debug_config(max_seq_len=8192, original_seq_len=8192)

    torch.testing.assert_close(rope_frequencies(cfg), plain_rope_angles(cfg))
    assert MLA(cfg).softmax_scale == cfg.qk_head_dim ** -0.5


def test_softmax_scale_gets_mscale_squared_only_with_yarn():
    base = debug_config(original_seq_len=4096, mscale=1.0)
    d_qk = base.qk_nope_head_dim + base.qk_rope_head_dim

    plain = MLA(dataclasses.replace(base, max_seq_len=4096))
    yarn = MLA(dataclasses.replace(base, max_seq_len=8192, rope_factor=40.0))

    assert plain.softmax_scale == pytest.approx(d_qk ** -0.5)
    m = 0.1 * math.log(40.0) + 1.0
    assert yarn.softmax_scale == pytest.approx(d_qk ** -0.5 * m * m)


def test_mla_matches_explicit_causal_attention_with_its_scale():
    cfg = debug_config(max_seq_len=8192, rope_factor=40.0)  # YaRN on, so the scale is not the default one
    torch.manual_seed(0)
    attn = MLA(cfg)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.05)
    B, S, H = 2, 10, cfg.n_heads
    x = torch.randn(B, S, cfg.dim)
    angles = rope_frequencies(cfg)[:S]
    cos, sin = angles.cos(), angles.sin()

    out = attn(x, cos, sin)

    def rope(t):  # t [B, S, h, d_r], rotate interleaved pairs as complex numbers
        z = torch.view_as_complex(t.float().unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)[None, :, None]).flatten(-2)

    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(B, S, H, -1)
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    kv_latent, k_pe = attn.wkv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    kv = attn.wkv_b(attn.kv_norm(kv_latent)).view(B, S, H, -1)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    k_pe = rope(k_pe[:, :, None])  # one RoPE key shared by all heads
    logits = (torch.einsum("bshd,bthd->bhst", q_nope, k_nope)
              + torch.einsum("bshd,bthd->bhst", rope(q_pe), k_pe.expand(-1, -1, H, -1))) * attn.softmax_scale
    logits = logits.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhst,bthd->bshd", logits.softmax(dim=-1), v)
    torch.testing.assert_close(out, attn.wo(o.flatten(2)), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- gradients


def test_one_training_backward_gives_every_parameter_a_gradient():
    model = debug_model()
    cfg = model.cfg
    seq = random_tokens(cfg, 4, 65)  # 256 tokens per layer: every expert gets some

    out = model(seq[:, :-1], seq[:, 1:])
    # the balance loss reaches the routers ...
    balance_grads = torch.autograd.grad(out.balance_loss, [r.weight for r in model.routers()], retain_graph=True)
    assert all(g.abs().sum() > 0 for g in balance_grads)
    # ... but even without it every parameter, router included (through the gate weights), learns
    (out.loss + 0.3 * sum(out.mtp_losses)).backward()

    assert (out.tokens_per_expert > 0).all()
    names = [name for name, _ in model.named_parameters()]
    assert not any("expert_bias" in name for name in names)  # the bias is a buffer, not learned by gradients
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    assert any(name.startswith("mtp.0.block.ffn.experts") for name in names)


@pytest.mark.parametrize("factor", [2.0, 1.0])
@pytest.mark.parametrize("chunk", [64, 256])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_chunked_linear_cross_entropy_is_the_full_one(device, chunk, factor):
    # 200 tokens in chunks of 64 (a short last chunk; on CUDA in bf16, the head's gradient summed over chunks in
    # fp32 by the GEMM itself) or in one chunk of 256; a loss gradient of 1 skips the scaling on CUDA
    from dsv3.loss import linear_cross_entropy

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(2, 100, 96, generator=generator).to(device, dtype).requires_grad_()
    head = torch.nn.Linear(96, 1000, bias=False).to(device, dtype)
    targets = torch.randint(0, 1000, (2, 100), generator=generator).to(device)
    loss = linear_cross_entropy(h, head, targets, chunk=chunk)
    (factor * loss).backward(retain_graph=True)  # the saved gradients are scaled by the incoming one
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # scaled in place once: a second backward would scale them again
    h_ref = h.detach().float().requires_grad_()
    weight_ref = head.weight.detach().float().requires_grad_()
    loss_ref = F.cross_entropy((h_ref @ weight_ref.t()).flatten(0, 1), targets.flatten())
    (factor * loss_ref).backward()
    tol = dict(rtol=2e-2, atol=1e-4) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss.float(), loss_ref, **tol)
    torch.testing.assert_close(h.grad.float(), h_ref.grad, **tol)
    torch.testing.assert_close(head.weight.grad.float(), weight_ref.grad, **tol)
