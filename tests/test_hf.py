"""dsv3.hf and scripts/convert_hf.py against transformers' DeepseekV3 / DeepseekV2, built from tiny random
configs in fp32 (nothing downloaded).

Needs a transformers whose DeepseekV3 router masks unselected groups with -inf (transformers #45440);
`test_transformers_router_masks_groups_with_neg_inf` says so when it doesn't. Written against 5.23.0.
"""

import dataclasses
import json
import os
import shutil

import pytest
import torch
from conftest import ROOT
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

import scripts.convert_hf as convert_hf
from dsv3.config import FLAVORS, ModelConfig, UserError, load_config_json
from dsv3.hf import FromHF, config_from_hf, config_to_hf, save_config, state_dict_from_hf, state_dict_to_hf
from dsv3.model import Transformer
from dsv3.moe import Router

# MLA and MoE dims shared by the transformers models below (HF names)
HF_DIMS = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, initializer_range=0.1,
               attn_implementation="eager")
# ours, with MTP and group-limited routing, for the round trips
TINY = ModelConfig(vocab_size=64, dim=32, inter_dim=48, moe_inter_dim=16, n_layers=3, n_dense_layers=1, n_heads=2,
                   n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=2,
                   n_limited_groups=1, score_func="sigmoid", route_scale=2.5, route_norm=True, q_lora_rank=16,
                   kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_seq_len=32,
                   original_seq_len=32, n_mtp_layers=1)


def randomize(model: torch.nn.Module, bias_low: float = -1.5, bias_high: float = 0.5) -> None:
    """Every tensor random, norms and expert biases too (biases mostly negative: biased scores go below 0)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                t.copy_(torch.rand(t.shape, generator=g) * (bias_high - bias_low) + bias_low)
            elif "norm" in name:
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.1 * torch.randn(t.shape, generator=g))


def import_hf(hf_model: torch.nn.Module) -> Transformer:
    cfg = config_from_hf(hf_model.config.to_dict())
    ours = Transformer(cfg)
    ours.load_state_dict(state_dict_from_hf(hf_model.state_dict(), cfg), strict=True)
    return ours


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_matches_hf(hf_model: torch.nn.Module, seq_len: int = 16) -> Transformer:
    """Same logits (≤ 1e-5 of max |logit|) and the same gradients of a weighted logit sum, mapped through the
    same conversion, for every weight (attention, routed experts, router gate, embedding, ...)."""
    ours = import_hf(hf_model)
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(1))
    hf_logits = hf_model(tokens).logits
    logits = ours(tokens)
    assert max_rel_err(logits, hf_logits) <= 1e-5
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (hf_logits * w).sum().backward()
    (logits * w).sum().backward()
    hf_grads = {n: p.grad for n, p in hf_model.named_parameters()}
    hf_grads.update({n: torch.zeros_like(b) for n, b in hf_model.named_buffers() if "e_score" in n})
    mapped = state_dict_from_hf(hf_grads, ours.cfg)
    for name in ("embed.weight", "layers.1.attn.wkv_b.weight", "layers.1.ffn.experts.w13", "layers.1.ffn.gate.weight"):
        assert mapped[name].abs().sum() > 0, name  # a real gradient reaches it
    for name, p in ours.named_parameters():
        assert max_rel_err(p.grad, mapped[name]) <= 1e-4, name
    return ours


def v3_grouped_config(**overrides) -> DeepseekV3Config:
    dims = dict(HF_DIMS, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, max_position_embeddings=64,
                num_nextn_predict_layers=0)  # transformers' model has no MTP layers
    return DeepseekV3Config(**(dims | overrides))


def test_transformers_router_masks_groups_with_neg_inf():
    """All biased scores < 0: a 0.0 group-mask fill (transformers #45440) would pick experts of dropped groups."""
    torch.manual_seed(0)
    hf_cfg = v3_grouped_config()
    hf_router = DeepseekV3TopkRouter(hf_cfg)
    ours = Router(config_from_hf(hf_cfg.to_dict()))
    with torch.no_grad():
        ours.weight.normal_()
        hf_router.weight.copy_(ours.weight)
        ours.expert_bias.uniform_(-3.0, -2.0)
        hf_router.e_score_correction_bias.copy_(ours.expert_bias)
    x = torch.randn(64, hf_cfg.hidden_size)
    _, hf_weights, hf_idx = hf_router(x)
    routing = ours(x)
    assert torch.equal(hf_idx.sort(dim=-1).values, routing.topk_idx.sort(dim=-1).values), (
        "this transformers fills dropped expert groups with 0.0, not -inf (#45440): pin a fixed release")
    torch.testing.assert_close(hf_weights.gather(1, hf_idx.argsort(dim=-1)),
                               routing.topk_weights.gather(1, routing.topk_idx.argsort(dim=-1)))


def test_v3_sigmoid_group_limited_q_lora_matches_transformers():
    torch.manual_seed(0)
    hf_model = DeepseekV3ForCausalLM(v3_grouped_config())
    randomize(hf_model)
    ours = assert_matches_hf(hf_model)
    assert (ours.cfg.score_func, ours.cfg.n_expert_groups, ours.cfg.n_limited_groups) == ("sigmoid", 4, 2)
    assert ours.cfg.q_lora_rank == 32 and ours.cfg.route_norm and ours.cfg.route_scale == 2.5


def test_export_runs_in_transformers_with_the_same_logits():
    torch.manual_seed(0)
    ours = Transformer(config_from_hf(v3_grouped_config().to_dict()))
    randomize(ours)
    hf_model = DeepseekV3ForCausalLM(DeepseekV3Config(**config_to_hf(ours.cfg), attn_implementation="eager"))
    hf_model.load_state_dict(state_dict_to_hf(ours.state_dict(), ours.cfg, fused_experts=True), strict=True)
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 16))
    assert max_rel_err(ours(tokens), hf_model(tokens).logits) <= 1e-5


def test_v2_softmax_one_group_plain_q_matches_transformers():
    # transformers' V3 router is sigmoid only; V2 is the softmax one (greedy top-k, no renormalisation).
    # Its RoPE is the same interleaved-pair rotation (complex view of adjacent pairs), so no permutation.
    torch.manual_seed(0)
    hf_cfg = DeepseekV2Config(**HF_DIMS, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
                              topk_method="greedy", routed_scaling_factor=1.5, q_lora_rank=None,
                              max_position_embeddings=64)
    hf_model = DeepseekV2ForCausalLM(hf_cfg)
    randomize(hf_model)
    ours = assert_matches_hf(hf_model)
    assert (ours.cfg.score_func, ours.cfg.n_expert_groups, ours.cfg.q_lora_rank, ours.cfg.route_norm) == (
        "softmax", 1, 0, False)
    assert all(not r.expert_bias.any() for r in ours.routers())  # V2 has no bias: b = 0


def test_v2_greedy_routing_ignores_expert_groups_as_transformers_does():
    torch.manual_seed(0)
    hf_cfg = DeepseekV2Config(**HF_DIMS, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                              topk_method="greedy", n_group=4, topk_group=1, q_lora_rank=None,
                              max_position_embeddings=64)
    hf_model = DeepseekV2ForCausalLM(hf_cfg)
    randomize(hf_model)
    ours = assert_matches_hf(hf_model)
    assert (ours.cfg.n_expert_groups, ours.cfg.n_limited_groups) == (1, 1)


def test_yarn_matches_transformers():
    torch.manual_seed(0)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    hf_model = DeepseekV3ForCausalLM(v3_grouped_config(max_position_embeddings=128, rope_parameters=rope))
    randomize(hf_model)
    ours = assert_matches_hf(hf_model, seq_len=48)  # past original_max_position_embeddings
    assert (ours.cfg.original_seq_len, ours.cfg.rope_factor, ours.cfg.mscale) == (32, 4.0, 0.707)
    assert ours.layers["0"].attn.softmax_scale != ours.cfg.qk_head_dim ** -0.5  # YaRN is on


YARN = dataclasses.replace(TINY, max_seq_len=64, original_seq_len=16, rope_factor=4.0, mscale=0.707)
YARN_NO_MSCALE = dataclasses.replace(YARN, mscale=0.0)  # the softmax unscaled (an HF YaRN without mscale_all_dim)
# YaRN off (rope_factor 1), its unused parameters and the init std all off their defaults
YARN_OFF = dataclasses.replace(TINY, original_seq_len=4096, beta_fast=16, beta_slow=2, mscale=0.5, init_std=0.02)


@pytest.mark.parametrize("cfg", [FLAVORS["debug"], FLAVORS["16B"], FLAVORS["671B"], TINY, YARN, YARN_NO_MSCALE,
                                 YARN_OFF], ids=["debug", "16B", "671B", "tiny", "yarn", "yarn-no-mscale", "yarn-off"])
def test_config_round_trips_through_hf_and_transformers(cfg):
    assert config_from_hf(config_to_hf(cfg)) == cfg
    hf_class = DeepseekV3Config if cfg.score_func == "sigmoid" else DeepseekV2Config
    assert config_from_hf(hf_class(**config_to_hf(cfg)).to_dict()) == cfg


@pytest.mark.parametrize("cfg", [YARN, YARN_NO_MSCALE], ids=["yarn", "yarn-no-mscale"])
def test_exported_yarn_gives_our_logits_in_transformers(cfg):
    """Past the original length: transformers scales cos/sin by its attention factor unless told 1.0."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(cfg, n_mtp_layers=0)  # transformers' model has none
    ours = Transformer(cfg)
    randomize(ours)
    hf_model = DeepseekV3ForCausalLM(DeepseekV3Config(**config_to_hf(cfg), attn_implementation="eager"))
    hf_model.load_state_dict(state_dict_to_hf(ours.state_dict(), cfg, fused_experts=True), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48))
    assert max_rel_err(ours(tokens), hf_model(tokens).logits) <= 1e-5


def test_yarn_stays_off_when_an_hf_config_without_rope_scaling_outgrows_the_kept_original_length():
    """Plain RoPE in HF must stay plain RoPE here: a raised max_position_embeddings overrides the kept length, and
    a rope_factor kept beside it (exports kept the old default, 40, while YaRN was off) does not turn YaRN on."""
    d = config_to_hf(YARN_OFF) | {"max_position_embeddings": 8192}
    d["dsv3"]["rope_factor"] = 40.0
    cfg = config_from_hf(d)
    assert (cfg.max_seq_len, cfg.original_seq_len, cfg.rope_factor) == (8192, 8192, 1.0)
    assert Transformer(cfg).layers["0"].attn.softmax_scale == cfg.qk_head_dim ** -0.5
    assert config_from_hf(d | {"dsv3": {}}).original_seq_len == 8192  # an HF config of someone else's


def test_yarn_that_transformers_and_deepseek_would_disagree_on_is_refused():
    """YaRN up to a length within the original one: transformers stretches RoPE there, DeepSeek's code does not."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0}
    with pytest.raises(ValueError, match="DeepSeek's code does not"):
        config_from_hf(config_to_hf(TINY) | {"rope_scaling": yarn})  # max_position_embeddings 32


def test_config_json_round_trip(tmp_path):
    save_config(TINY, tmp_path / "config.json")
    assert load_config_json(tmp_path / "config.json") == TINY
    (tmp_path / "hf.json").write_text(json.dumps(config_to_hf(TINY)))
    with pytest.raises(ValueError, match="convert_hf.py --to-dsv3"):
        load_config_json(tmp_path / "hf.json")


def test_config_from_hf_rejects_what_dsv3_cannot_run():
    d = config_to_hf(TINY)
    with pytest.raises(ValueError, match="rope type 'linear'"):
        config_from_hf(d | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0,
            "mscale_all_dim": 0.5}
    with pytest.raises(ValueError, match="mscale == mscale_all_dim"):
        config_from_hf(d | {"rope_scaling": yarn})
    yarn = {"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    with pytest.raises(ValueError, match="lacks original_max_position_embeddings"):
        config_from_hf(d | {"rope_scaling": yarn, "max_position_embeddings": 64})


def random_ours(cfg: ModelConfig = TINY) -> dict[str, torch.Tensor]:
    model = Transformer(cfg)
    randomize(model)
    return model.state_dict()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("fused_experts", [False, True])
def test_round_trips_are_lossless_with_mtp_and_expert_bias(fused_experts):
    ours = random_ours()
    hf = state_dict_to_hf(ours, TINY, fused_experts)
    mtp = f"model.layers.{TINY.n_layers}"
    assert torch.equal(hf[f"{mtp}.embed_tokens.weight"], ours["embed.weight"])
    assert torch.equal(hf[f"{mtp}.shared_head.head.weight"], ours["head.weight"])
    assert torch.equal(hf[f"{mtp}.mlp.gate.e_score_correction_bias"], ours["mtp.0.block.ffn.gate.expert_bias"])
    per_expert = "model.layers.1.mlp.experts.7.up_proj.weight"
    assert (per_expert in hf) != fused_experts
    assert_same(state_dict_from_hf(hf, TINY), ours)
    assert_same(state_dict_to_hf(state_dict_from_hf(hf, TINY), TINY, fused_experts), hf)


def test_per_expert_layout_stacks_gate_rows_then_up_rows():
    hf = state_dict_to_hf(random_ours(), TINY)
    w13 = state_dict_from_hf(hf, TINY)["layers.2.ffn.experts.w13"]
    assert torch.equal(w13[5, :TINY.moe_inter_dim], hf["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(w13[5, TINY.moe_inter_dim:], hf["model.layers.2.mlp.experts.5.up_proj.weight"])


def test_importer_holds_an_expert_stack_until_its_last_expert():
    hf = state_dict_to_hf(random_ours(), TINY)
    importer = FromHF(TINY)
    downs = [f"model.layers.1.mlp.experts.{j}.down_proj.weight" for j in range(TINY.n_routed_experts)]
    for name in downs[:-1]:
        assert importer.add(name, hf[name]) == {}
    assert list(importer.add(downs[-1], hf[downs[-1]])) == ["layers.1.ffn.experts.w2"]
    assert importer.stacks == {}


def test_unknown_and_missing_keys_raise_one_error():
    hf = state_dict_to_hf(random_ours(), TINY)
    del hf["model.norm.weight"], hf["model.layers.1.mlp.experts.3.gate_proj.weight"]
    hf["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(1)  # experts in a dense layer
    hf.update({f"model.extra.{i}.weight": torch.zeros(1) for i in range(25)})
    with pytest.raises(ValueError) as e:
        state_dict_from_hf(hf, TINY)
    msg = str(e.value)
    assert "26 unknown" in msg and "(6 more)" in msg and "model.layers.0.mlp.experts.0.gate_proj.weight" in msg
    assert "2 missing: layers.1.ffn.experts.w13 (only 15 per-expert tensors), norm.weight" in msg
    ours = random_ours()
    ours["extra.weight"] = ours.pop("head.weight")
    with pytest.raises(ValueError, match=r"1 unknown: extra.weight; 1 missing: head.weight"):
        state_dict_to_hf(ours, TINY)


def test_wrong_shape_names_the_tensor():
    hf = state_dict_to_hf(random_ours(), TINY)
    hf["model.layers.2.mlp.experts.0.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"experts.0.down_proj.weight has shape \(3, 3\)"):
        state_dict_from_hf(hf, TINY)


def write_hf_checkpoint(path, sd: dict[str, torch.Tensor], config: dict, n_shards: int = 3) -> None:
    path.mkdir()
    names = list(sd)
    for i in range(n_shards):
        shard = {k: sd[k] for k in names[i::n_shards]}
        save_file(shard, path / f"model-{i:05d}.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))


def read_checkpoint(path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(path / shard, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert out.keys() == index.keys()
    return out


def test_convert_script_round_trips_sharded_checkpoints(tmp_path):
    ours = random_ours()
    hf = state_dict_to_hf(ours, TINY)
    write_hf_checkpoint(tmp_path / "hf", hf, config_to_hf(TINY))
    convert_hf.main(["--to-dsv3", str(tmp_path / "hf"), str(tmp_path / "dsv3"), "--max-shard-gb", "2e-5"])
    assert len(list((tmp_path / "dsv3").glob("model-*-of-*.safetensors"))) > 2  # bounded shards
    assert load_config_json(tmp_path / "dsv3" / "config.json") == TINY
    assert_same(read_checkpoint(tmp_path / "dsv3"), ours)
    convert_hf.main(["--to-hf", str(tmp_path / "dsv3"), str(tmp_path / "back")])
    assert_same(read_checkpoint(tmp_path / "back"), hf)
    assert config_from_hf(json.loads((tmp_path / "back" / "config.json").read_text())) == TINY
    convert_hf.main(["--to-hf", str(tmp_path / "dsv3"), str(tmp_path / "fused"), "--fused-experts"])
    assert_same(read_checkpoint(tmp_path / "fused"), state_dict_to_hf(ours, TINY, fused_experts=True))


def test_convert_script_round_trip_keeps_every_config_field(tmp_path):
    """--to-hf then --to-dsv3 of a model with YaRN off used to come back with original_seq_len = max_seq_len."""
    (tmp_path / "dsv3").mkdir()
    save_file(random_ours(YARN_OFF), tmp_path / "dsv3" / "model.safetensors")
    save_config(YARN_OFF, tmp_path / "dsv3" / "config.json")
    convert_hf.main(["--to-hf", str(tmp_path / "dsv3"), str(tmp_path / "hf")])
    convert_hf.main(["--to-dsv3", str(tmp_path / "hf"), str(tmp_path / "back")])
    assert load_config_json(tmp_path / "back" / "config.json") == YARN_OFF


def test_convert_script_errors_are_clear(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json not found"):
        convert_hf.main(["--to-dsv3", str(tmp_path / "empty"), str(tmp_path / "out")])
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config_to_hf(TINY)))
    with pytest.raises(UserError, match="no \\*.safetensors shards"):
        convert_hf.main(["--to-dsv3", str(tmp_path / "empty"), str(tmp_path / "out")])
    hf = state_dict_to_hf(random_ours(), TINY) | {"model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(1)}
    write_hf_checkpoint(tmp_path / "fp8", hf, config_to_hf(TINY))
    with pytest.raises(UserError, match="1 weight_scale_inv without an FP8 weight: .*q_a_proj.weight_scale_inv"):
        convert_hf.main(["--to-dsv3", str(tmp_path / "fp8"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # checked before anything is written


def dsv3_and_hf_checkpoints(tmp_path):
    """A dsv3 checkpoint of TINY at tmp_path/dsv3 and its HF conversion at tmp_path/hf."""
    (tmp_path / "dsv3").mkdir()
    save_file(random_ours(), tmp_path / "dsv3" / "model.safetensors")
    save_config(TINY, tmp_path / "dsv3" / "config.json")
    convert_hf.main(["--to-hf", str(tmp_path / "dsv3"), str(tmp_path / "hf")])
    return tmp_path / "dsv3", tmp_path / "hf"


def refused_before_any_shard_is_read(argv: list[str], match: str, monkeypatch) -> None:
    monkeypatch.setattr(convert_hf, "read_headers", lambda *a: pytest.fail("read the shards"))
    with pytest.raises(UserError, match=match):
        convert_hf.main(argv)


@pytest.mark.parametrize("direction", ["--to-hf", "--to-dsv3"])
def test_a_source_that_is_no_directory_is_named_before_anything_is_read(tmp_path, monkeypatch, direction):
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "out")
    refused_before_any_shard_is_read([direction, str(tmp_path / "nope"), out],
                                     r"^\S+nope does not exist; pass a checkpoint directory", monkeypatch)
    refused_before_any_shard_is_read([direction, str(tmp_path / "file"), out], r"^\S+file is not a directory",
                                     monkeypatch)


@pytest.mark.parametrize("direction", ["--to-hf", "--to-dsv3"])
def test_a_training_checkpoint_is_refused_naming_its_runs_export(tmp_path, monkeypatch, direction):
    """runs/NAME/step-N is DCP's format, which convert_hf.py does not read: the line names the export beside it."""
    step = tmp_path / "runs" / "debug" / "step-200"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "train.json").write_text("{}")
    refused_before_any_shard_is_read([direction, str(step), str(tmp_path / "out")],
                                     rf"^{step} is a training checkpoint.*convert its run's export, "
                                     rf"{tmp_path / 'runs' / 'debug' / 'export'} ", monkeypatch)


def test_each_direction_refuses_the_other_ones_format(tmp_path, monkeypatch):
    dsv3, hf = dsv3_and_hf_checkpoints(tmp_path)
    refused_before_any_shard_is_read(["--to-hf", str(hf), str(tmp_path / "out")],
                                     rf"^{hf} is a Hugging Face checkpoint \(model_type deepseek_v3\): convert it "
                                     rf"to dsv3's format with --to-dsv3 {hf} OUT_DIR$", monkeypatch)
    refused_before_any_shard_is_read(["--to-dsv3", str(dsv3), str(tmp_path / "out")],
                                     rf"^{dsv3} is in dsv3's format already .*--checkpoint.init_from={dsv3}, or "
                                     r"convert it for transformers with --to-hf$", monkeypatch)


def test_a_config_json_that_is_not_json_is_named(tmp_path, monkeypatch):
    dsv3, _ = dsv3_and_hf_checkpoints(tmp_path)
    (dsv3 / "config.json").write_text("{ oops")
    refused_before_any_shard_is_read(["--to-hf", str(dsv3), str(tmp_path / "out")],
                                     rf"^{dsv3 / 'config.json'} is not JSON \(.*\): restore it", monkeypatch)


@pytest.mark.parametrize("direction", ["--to-hf", "--to-dsv3"])
def test_an_output_that_exists_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch, direction):
    dsv3, hf = dsv3_and_hf_checkpoints(tmp_path)
    src, out = (dsv3, hf) if direction == "--to-hf" else (hf, dsv3)  # each the other's existing output
    monkeypatch.setattr(convert_hf, "read_tensors", lambda *a, **k: pytest.fail("read the tensors"))
    with pytest.raises(UserError, match=rf"^{out} already exists and is not an empty directory; pick a new"):
        convert_hf.main([direction, str(src), str(out)])


@pytest.mark.parametrize("direction", ["--to-hf", "--to-dsv3"])
def test_a_config_json_of_another_model_than_its_shards_is_named_before_any_tensor_is_read(tmp_path, monkeypatch,
                                                                                            direction):
    """The debug model's config.json beside TINY's shards: which tensor disagrees, said of that config.json, from
    the safetensors headers alone."""
    dsv3, hf = dsv3_and_hf_checkpoints(tmp_path)
    src = dsv3 if direction == "--to-hf" else hf
    if direction == "--to-hf":
        save_config(FLAVORS["debug"], src / "config.json")
    else:
        (src / "config.json").write_text(json.dumps(config_to_hf(FLAVORS["debug"])))
    monkeypatch.setattr(convert_hf, "read_tensors", lambda *a, **k: pytest.fail("read the tensors"))
    with pytest.raises(UserError, match=rf"^{src / 'config.json'} does not describe the shards beside it: "
                                        r"\S*(embed|lm_head)\.weight has shape \(64, 32\); the config needs "
                                        r"\(4096, 128\)"):
        convert_hf.main([direction, str(src), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_convert_script_reads_and_writes_transformers_checkpoints(tmp_path):
    """save_pretrained (per-expert shards, no MTP layers) → dsv3 → same logits → from_pretrained, both layouts."""
    torch.manual_seed(0)
    hf_model = DeepseekV3ForCausalLM(v3_grouped_config(num_nextn_predict_layers=1)).eval()
    randomize(hf_model)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    convert_hf.main(["--to-dsv3", str(tmp_path / "hf"), str(tmp_path / "dsv3")])
    cfg = load_config_json(tmp_path / "dsv3" / "config.json")
    assert cfg.n_mtp_layers == 0  # transformers saved none
    ours = Transformer(cfg)
    ours.load_state_dict(read_checkpoint(tmp_path / "dsv3"), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    reference = hf_model(tokens).logits
    assert max_rel_err(ours(tokens), reference) <= 1e-5
    for flags in ([], ["--fused-experts"]):
        out = tmp_path / f"back{len(flags)}"
        convert_hf.main(["--to-hf", str(tmp_path / "dsv3"), str(out), *flags])
        back = DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        assert torch.equal(back(tokens).logits, reference)


def save_tokenizer(path) -> PreTrainedTokenizerFast:
    words = ["<unk>", "<s>", "</s>", *"the quick brown fox jumps over a lazy dog".split()]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def test_convert_script_carries_the_tokenizer_both_ways(tmp_path):
    """A converted directory, and the HF one exported from it, load model and tokenizer in transformers."""
    hf_model = DeepseekV3ForCausalLM(v3_grouped_config())
    hf_model.generation_config.max_new_tokens = 7  # not a default: only the source's file has it
    hf_model.save_pretrained(tmp_path / "hf")  # + generation_config.json
    tokenizer = save_tokenizer(tmp_path / "hf")  # tokenizer.json, tokenizer_config.json
    shutil.copyfile(ROOT / "data" / "tokenizer.model", tmp_path / "hf" / "tokenizer.model")  # a sentencepiece one
    carried = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json"}
    assert carried <= {f.name for f in (tmp_path / "hf").iterdir()}
    convert_hf.main(["--to-dsv3", str(tmp_path / "hf"), str(tmp_path / "dsv3")])
    convert_hf.main(["--to-hf", str(tmp_path / "dsv3"), str(tmp_path / "back")])
    for out in ("dsv3", "back"):
        present = {f.name for f in (tmp_path / out).iterdir() if f.name in convert_hf.TOKENIZER_FILES}
        assert present == carried  # no special_tokens_map.json where the source had none
        for name in carried:
            assert (tmp_path / out / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), (out, name)
    text = "the lazy fox jumps"
    assert AutoTokenizer.from_pretrained(tmp_path / "back")(text).input_ids == tokenizer(text).input_ids
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "back").generation_config.max_new_tokens == 7


SOFTMAX = dataclasses.replace(TINY, score_func="softmax", route_norm=False)


def test_softmax_export_that_hf_cannot_represent_is_refused_unless_allowed():
    trained = random_ours(SOFTMAX)  # random, so non-zero expert biases
    with pytest.raises(UserError, match="non-zero expert bias.*--allow-lossy.*bias_update_speed=0"):
        state_dict_to_hf(trained, SOFTMAX)
    with pytest.raises(UserError, match="route_norm"):
        state_dict_to_hf(random_ours(SOFTMAX) | zero_biases(trained), dataclasses.replace(SOFTMAX, route_norm=True))
    with pytest.warns(UserWarning, match="exporting anyway"):
        assert state_dict_to_hf(trained, SOFTMAX, allow_lossy=True).keys() == state_dict_to_hf(
            trained | zero_biases(trained), SOFTMAX).keys()  # b = 0 and no route_norm: exact, no error


def zero_biases(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(t) for k, t in sd.items() if k.endswith("expert_bias")}


def test_convert_script_refuses_a_lossy_export_before_writing_and_writes_umask_modes(tmp_path):
    (tmp_path / "dsv3").mkdir()
    save_file(random_ours(SOFTMAX), tmp_path / "dsv3" / "model.safetensors")
    save_config(SOFTMAX, tmp_path / "dsv3" / "config.json")
    with pytest.raises(UserError, match="--allow-lossy"):
        convert_hf.to_hf(tmp_path / "dsv3", tmp_path / "hf", max_bytes=10**9, fused_experts=False)
    assert not (tmp_path / "hf").exists()
    umask = os.umask(0o022)
    try:
        with pytest.warns(UserWarning, match="exporting anyway"):
            convert_hf.main(["--to-hf", str(tmp_path / "dsv3"), str(tmp_path / "hf"), "--allow-lossy",
                             "--max-shard-gb", "2e-5"])
    finally:
        os.umask(umask)
    files = sorted(tmp_path.joinpath("hf").iterdir())
    assert len([f for f in files if f.suffix == ".safetensors"]) > 1
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: "0o644" for f in files}
