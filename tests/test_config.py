"""Config specification: the flavors' published shapes, validation errors that name the field to change,
and TOML + `--section.key=value` loading."""

import dataclasses

import pytest

from dsv3.config import FLAVORS, Config, ModelConfig, TrainConfig, UserError, field_help, help_text, load_config

# DeepSeek-V3 (paper §4.2) and the V2-Lite-shaped 16B (torchtitan's "16B"); every flavor also has d_n 128,
# d_r 64, d_v 128, d_c 512.
FLAVOR_TABLE = {
    "16B": dict(vocab_size=102400, dim=2048, inter_dim=10944, moe_inter_dim=1408, n_layers=27, n_dense_layers=1,
                n_heads=16, n_routed_experts=64, n_shared_experts=2, n_activated_experts=6, n_expert_groups=1,
                n_limited_groups=1, score_func="softmax", route_scale=1.0, q_lora_rank=0),
    "671B": dict(vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_dense_layers=3,
                 n_heads=128, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8, n_expert_groups=8,
                 n_limited_groups=4, score_func="sigmoid", route_scale=2.5, q_lora_rank=1536),
}


def debug_with(**changes) -> ModelConfig:
    return dataclasses.replace(FLAVORS["debug"], **changes)


def problems_of(error: pytest.ExceptionInfo) -> list[str]:
    """The individual complaints of the one-line 'invalid model config: a; b' error."""
    return str(error.value).removeprefix("invalid model config: ").split("; ")


# ---------------------------------------------------------------------------------------------- flavors


def test_flavors_exist():
    assert {"debug", "16B", "671B"} <= set(FLAVORS)
    assert all(isinstance(cfg, ModelConfig) for cfg in FLAVORS.values())


@pytest.mark.parametrize("flavor", sorted(FLAVOR_TABLE))
def test_flavor_matches_the_design_table(flavor):
    cfg = FLAVORS[flavor]
    expected = dict(FLAVOR_TABLE[flavor], qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    kv_lora_rank=512)
    assert {key: getattr(cfg, key) for key in expected} == expected


def test_671B_routes_with_sigmoid_normalised_top_k_and_one_mtp_module():
    cfg = FLAVORS["671B"]
    assert cfg.route_norm and cfg.n_mtp_layers == 1
    assert cfg.max_seq_len <= cfg.original_seq_len  # pretraining at 4K: YaRN off


def test_debug_flavor_has_every_dim_a_multiple_of_32():
    cfg = FLAVORS["debug"]
    dims = dict(vocab_size=cfg.vocab_size, dim=cfg.dim, inter_dim=cfg.inter_dim, moe_inter_dim=cfg.moe_inter_dim,
                q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)
    assert {name: d for name, d in dims.items() if d % 32} == {}
    assert cfg.q_lora_rank > 0  # the low-rank query path is exercised too
    assert cfg.n_expert_groups > cfg.n_limited_groups >= 1  # so is group-limited routing


# ---------------------------------------------------------------------------------------------- validation


def test_experts_not_divisible_by_groups_is_one_clear_error():
    with pytest.raises(ValueError) as error:
        debug_with(n_routed_experts=10, n_expert_groups=4)
    [problem] = problems_of(error)
    assert "model.n_routed_experts" in problem and "model.n_expert_groups" in problem and "divisible" in problem


def test_more_limited_groups_than_groups_is_one_clear_error():
    with pytest.raises(ValueError) as error:
        debug_with(n_expert_groups=2, n_limited_groups=3)
    [problem] = problems_of(error)
    assert "model.n_limited_groups" in problem and "model.n_expert_groups" in problem


def test_top_k_larger_than_the_experts_in_the_limited_groups_is_one_clear_error():
    # 8 experts in 2 groups, 1 group kept: only 4 experts are reachable per token
    with pytest.raises(ValueError) as error:
        debug_with(n_routed_experts=8, n_expert_groups=2, n_limited_groups=1, n_activated_experts=5)
    [problem] = problems_of(error)
    assert "model.n_activated_experts" in problem and "4" in problem
    debug_with(n_routed_experts=8, n_expert_groups=2, n_limited_groups=1, n_activated_experts=4)  # the limit is fine


def test_unknown_score_function_is_one_clear_error():
    with pytest.raises(ValueError) as error:
        debug_with(score_func="relu")
    [problem] = problems_of(error)
    assert "model.score_func" in problem and "'relu'" in problem and "sigmoid" in problem


@pytest.mark.parametrize("field,value", [("dim", 0), ("n_heads", 0), ("moe_inter_dim", -64), ("vocab_size", 0),
                                         ("kv_lora_rank", 0), ("qk_nope_head_dim", -32)])
def test_non_positive_dim_is_one_error_naming_the_field(field, value):
    with pytest.raises(ValueError) as error:
        debug_with(**{field: value})
    [problem] = problems_of(error)
    assert f"model.{field}" in problem and str(value) in problem


# ---------------------------------------------------------------------------------------------- loading


@pytest.fixture
def toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('flavor = "debug"\n'
                    "[model]\nn_layers = 2\nroute_scale = 2\n"
                    "[train]\nlr = 1\nsteps = 7\nprecision = \"fp8\"\nseq_len = 128\n"
                    "[log]\nwandb = true\n")
    return str(path)


def test_load_config_layers_defaults_toml_and_overrides(toml_file):
    cfg = load_config(toml_file, ["--train.steps=9", "--train.lr=2e-4", "--model.n_mtp_layers=0",
                                  "--checkpoint.dir=runs/x", "--parallel.ep_backend=deepep"])

    assert cfg.flavor == "debug"
    assert cfg.train.steps == 9 and cfg.train.lr == 2e-4  # the command line wins over the file
    assert cfg.train.precision == "fp8" and cfg.train.seq_len == 128 and cfg.log.wandb is True  # from the file
    assert cfg.train.micro_batch == 8  # untouched default
    assert cfg.checkpoint.dir == "runs/x" and cfg.parallel.ep_backend == "deepep"
    model = cfg.model_config()
    assert model.n_layers == 2 and model.n_mtp_layers == 0
    assert model.dim == FLAVORS["debug"].dim  # everything else comes from the flavor


def test_load_config_coerces_int_to_float(toml_file):
    cfg = load_config(toml_file)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert isinstance(cfg.model_config().route_scale, float)
    cfg = load_config(None, ["--train.grad_clip=2", "--model.mscale=2"])
    assert cfg.train.grad_clip == 2.0 and isinstance(cfg.train.grad_clip, float)
    assert isinstance(cfg.model_config().mscale, float)


@pytest.mark.parametrize("override,field", [("--train.steps=1.5", "train.steps"), ("--train.lr=fast", "train.lr"),
                                            ("--log.wandb=1", "log.wandb"), ("--model.dim=wide", "model.dim"),
                                            ("--model.n_layers=2.5", "model.n_layers"),
                                            ("--train.precision_skip=[1]", "train.precision_skip"),
                                            ('--train.precision_skip=[""]', "train.precision_skip")])
def test_override_of_the_wrong_type_is_an_error_naming_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        load_config(None, [override])


def test_a_list_field_takes_comma_separated_items_on_the_command_line():
    assert load_config(None, ["--train.precision_skip=wo,wkv_b"]).train.precision_skip == ["wo", "wkv_b"]
    assert load_config(None, ['--train.precision_skip=["wo"]']).train.precision_skip == ["wo"]


def test_string_fields_take_the_override_text_as_written():
    cfg = load_config(None, ["--log.run_name=2024-06-01", "--log.project=42", "--data.path=data/v1.5"])
    assert (cfg.log.run_name, cfg.log.project, cfg.data.path) == ("2024-06-01", "42", "data/v1.5")


def test_unknown_flavor_is_an_error_listing_the_flavors(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('flavor = "7B"\n')
    for args in [(str(path), []), (None, ["--flavor=7B"])]:
        with pytest.raises(ValueError, match="7B") as error:
            load_config(*args)
        assert all(name in str(error.value) for name in FLAVORS)


def test_unknown_override_key_is_an_error_naming_the_valid_keys():
    with pytest.raises(ValueError, match="train.learning_rate") as error:
        load_config(None, ["--train.learning_rate=1e-3"])
    assert "lr" in str(error.value) and "warmup_steps" in str(error.value)

    with pytest.raises(ValueError, match="hidden_size") as error:
        load_config(None, ["--model.hidden_size=64"])
    assert "dim" in str(error.value) and "n_heads" in str(error.value)

    with pytest.raises(ValueError, match="optim") as error:
        load_config(None, ["--optim.lr=1e-3"])
    assert "train" in str(error.value)


@pytest.mark.parametrize("override,message", [
    ("--train.stpes=5", "unknown key train.stpes: did you mean train.steps?"),
    ("--checkpoint.evry=5", "unknown key checkpoint.evry: did you mean checkpoint.every?"),
    ("--model.n_layer=2",
     "unknown model key(s) ['n_layer']: did you mean model.n_layers or model.n_mtp_layers or model.n_dense_layers?"),
])
def test_a_mistyped_key_is_an_error_naming_the_keys_it_is_close_to(override, message):
    with pytest.raises(ValueError) as error:
        load_config(None, [override]).model_config()
    assert str(error.value) == message


def test_a_wrong_type_is_named_with_its_article():
    for override, message in (("--train.steps=1.5", "train.steps must be an int, got 1.5"),
                              ("--train.lr=fast", "train.lr must be a float, got 'fast'")):
        with pytest.raises(ValueError) as error:
            load_config(None, [override])
        assert str(error.value) == message


def test_unknown_key_in_the_toml_file_is_an_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nlearning_rate = 3e-4\n")
    with pytest.raises(ValueError, match="train.learning_rate"):
        load_config(str(path))


def test_bad_choice_value_is_an_error_listing_the_choices():
    with pytest.raises(ValueError, match="train.precision") as error:
        load_config(None, ["--train.precision=fp4"])
    assert all(choice in str(error.value) for choice in ("bf16", "fp8", "mxfp8", "mxfp8-emulated"))
    with pytest.raises(ValueError, match="parallel.ep_backend"):
        load_config(None, ["--parallel.ep_backend=nccl"])


def test_malformed_override_is_an_error_showing_the_syntax():
    for arg in ["train.lr=3e-4", "--train.lr"]:
        with pytest.raises(ValueError, match="--section.key=value"):
            load_config(None, [arg])


def test_invalid_model_override_is_caught_when_loading():
    with pytest.raises(ValueError, match="model.n_limited_groups"):
        load_config(None, ["--model.n_limited_groups=5"])
    with pytest.raises(ValueError, match="train.seq_len"):
        load_config(None, ["--train.seq_len=4096"])  # longer than the debug model's max_seq_len


@pytest.mark.parametrize("override", ["--model.norm_eps=nan", "--model.init_std=-1", "--model.rope_theta=-5",
                                      "--model.route_scale=inf"])
def test_a_non_positive_or_non_finite_model_scale_is_refused_when_loading(override):
    key, value = override[2:].split("=")
    with pytest.raises(UserError, match=rf"^invalid model config: {key} must be > 0 and finite, got {value}"):
        load_config(None, [override])


def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('flavor = "debug"\n# café\n'.encode("latin-1"))
    with pytest.raises(UserError, match=rf"^{path} is not UTF-8 text \(byte 22 is b'\\xe9'\): TOML files are UTF-8"):
        load_config(str(path))


def test_a_sequence_past_the_rope_tables_names_both_ways_to_reach_it():
    """The error once said only "raise max_seq_len", and doing so switched YaRN on (16B: softmax scale × 1.87,
    lowest RoPE frequency ÷ 40) without a word."""
    with pytest.raises(UserError, match=r"seq_len \(8192\) exceeds model.max_seq_len \(4096\): raise "
                                        r"model.max_seq_len; past model.original_seq_len \(4096\).*rope_factor > 1"):
        load_config(None, ["--flavor=16B", "--train.seq_len=8192"])
    with pytest.raises(UserError, match=r"model.max_seq_len \(8192\) exceeds model.original_seq_len \(4096\) with "
                                        r"plain RoPE"):
        load_config(None, ["--flavor=16B", "--train.seq_len=8192", "--model.max_seq_len=8192"])
    plain = load_config(None, ["--flavor=16B", "--train.seq_len=8192", "--model.max_seq_len=8192",
                               "--model.original_seq_len=8192"]).model_config()
    yarn = load_config(None, ["--flavor=16B", "--train.seq_len=8192", "--model.max_seq_len=8192",
                              "--model.rope_factor=2"]).model_config()
    assert (plain.rope_factor, yarn.rope_factor, yarn.original_seq_len) == (1.0, 2.0, 4096)


@pytest.mark.parametrize("overrides,message", [
    (dict(rope_factor=40.0), r"model.rope_factor \(40.0\) turns YaRN on.*model.max_seq_len \(4096\) does not go past"),
    (dict(max_seq_len=32768, rope_factor=4.0), r"max_seq_len \(32768\) exceeds the 16384 positions YaRN covers"),
    (dict(rope_factor=0.5), r"model.rope_factor must be >= 1"),
])
def test_yarn_settings_that_do_not_fit_together_are_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        ModelConfig(**overrides)


# ---------------------------------------------------------------------------------------------- [train] ranges


@pytest.mark.parametrize("override,field", [
    ("lr=0", "train.lr"), ("lr=-1", "train.lr"), ("lr=nan", "train.lr"), ("lr=inf", "train.lr"),
    ("min_lr_ratio=-0.1", "train.min_lr_ratio"), ("min_lr_ratio=1.5", "train.min_lr_ratio"),
    ("decay_start=-0.5", "train.decay_start"), ("decay_start=1.01", "train.decay_start"),
    ("mtp_lambda_switch=2", "train.mtp_lambda_switch"), ("mtp_lambda_switch=nan", "train.mtp_lambda_switch"),
    ("bias_update_stop=1.5", "train.bias_update_stop"),
    ("grad_clip=0", "train.grad_clip"), ("grad_clip=-1", "train.grad_clip"),
    ("weight_decay=-0.1", "train.weight_decay"), ("beta1=1", "train.beta1"), ("beta2=-0.1", "train.beta2"),
    ("bias_update_speed=-1e-3", "train.bias_update_speed"), ("balance_alpha=-1e-4", "train.balance_alpha"),
    ("mtp_lambda=-0.3", "train.mtp_lambda"), ("mtp_lambda_final=-0.1", "train.mtp_lambda_final"),
    ("seed=-1", "train.seed"), ("warmup_steps=-1", "train.warmup_steps"), ("steps=0", "train.steps"),
    ("batch_ramp_steps=-5", "train.batch_ramp_steps"),
])
def test_out_of_range_train_value_is_an_error_naming_it(override, field):
    with pytest.raises(UserError, match=f"^{field} "):
        load_config(None, [f"--train.{override}"])


@pytest.mark.parametrize("override", ["min_lr_ratio=0", "min_lr_ratio=1", "decay_start=0", "decay_start=1",
                                      "mtp_lambda_switch=0", "beta1=0", "weight_decay=0", "balance_alpha=0",
                                      "bias_update_speed=0", "mtp_lambda=0", "grad_clip=1e9", "warmup_steps=0"])
def test_boundary_train_values_are_accepted(override):
    load_config(None, [f"--train.{override}"])


# ---------------------------------------------------------------------------------------------- files and --help


def test_toml_syntax_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('flavor = "debug"\n[train]\nlr = = 3e-4\n')
    with pytest.raises(UserError, match=r"broken\.toml is not valid TOML: .*line 3"):
        load_config(str(path))


def test_missing_config_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(UserError, match=r"config file .*nope\.toml not found"):
        load_config(str(tmp_path / "nope.toml"))


def test_every_config_key_has_a_one_line_meaning():
    for cls in (Config, ModelConfig, TrainConfig, *(type(getattr(Config(), s)) for s in
                                                   ("data", "parallel", "checkpoint", "log"))):
        keys = [f.name for f in dataclasses.fields(cls) if cls is not Config or f.name in ("flavor", "model")]
        assert [key for key in keys if not field_help(cls).get(key)] == [], cls.__name__


def test_help_lists_every_section_key_with_its_default_and_meaning():
    text = help_text()
    assert text.startswith("usage: ")
    for section in ("[model]", "[train]", "[data]", "[parallel]", "[checkpoint]", "[log]"):
        assert section in text
    assert "  lr = 0.0003  # peak learning rate" in text
    assert '  precision = "bf16"  # bf16 | fp8' in text
    assert "  n_routed_experts = 64  # routed experts per MoE layer" in text
    assert "  resume = false  #" in text
