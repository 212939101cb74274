"""The trainer end to end, in-process on CPU: it learns the bundled corpus, resumes loss for loss, survives a
crash mid-save, stops on a non-finite loss before checkpointing, saves and stops on SIGTERM or Ctrl-C (alone and
under torchrun), refuses bad input before building a model, and exports a model that loads on its own; plus its
schedules and gradient accumulation."""

import dataclasses
import fcntl
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import free_port, load_export, read_metrics, torchrun_vars
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader

import train
from dsv3 import checkpoint, export
from dsv3.config import FLAVORS, Config, DataConfig, ModelConfig, TrainConfig, UserError, load_config, run_main
from dsv3.hf import config_from_hf, config_to_hf, save_config
from dsv3.model import Transformer
from scripts import convert_hf, generate
from scripts import plot as plot_script

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "debug.toml")
DATA = ROOT / "data" / "stdlib"
# A few tiny steps of the debug model: a dense and an MoE layer (+ MTP), 32 tokens, 4 sequences in
# micro-batches of 2.
TINY = ["--model.n_layers=2", "--train.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2",
        "--train.val_every=0", "--checkpoint.export=false"]


def run(run_dir: Path, *overrides: str) -> dict[int, dict]:
    """train.py on the debug config and the bundled corpus, metrics logged every step; returns them by step."""
    train.main(["--config", CONFIG, f"--data.path={DATA}", f"--checkpoint.dir={run_dir}", "--log.every=1",
                *overrides])
    return read_metrics(run_dir)


def stop_at(monkeypatch: pytest.MonkeyPatch, at_step: int, action) -> None:
    """Run `action(model)` in train_step just before step `at_step`."""
    real_step = train.train_step

    def step_with_action(model, optimizer, batch, t, step, *args):
        if step == at_step:
            action(model)
        return real_step(model, optimizer, batch, t, step, *args)

    monkeypatch.setattr(train, "train_step", step_with_action)


class Interrupted(Exception):
    pass


def interrupt(model: Transformer) -> None:
    raise Interrupted


# --- it learns, and exports what it learned ------------------------------------------------------------

LEARN_STEPS = 100


@pytest.fixture(scope="module")
def learned(data, tmp_path_factory) -> Path:
    """The debug config for 100 steps, at seq_len 128 to fit a CI budget (~45 s on 2 cores)."""
    run_dir = tmp_path_factory.mktemp("learn")
    run(run_dir, f"--train.steps={LEARN_STEPS}", "--train.seq_len=128", "--train.val_every=25")
    return run_dir


def unigram_val_loss(seq_len: int, n_sequences: int) -> float:
    """Cross-entropy of the best context-free predictor (train-split token frequencies, add-one smoothed) on
    the validation tokens that `train.evaluate` scores: a model below it uses context."""
    train_tokens = np.fromfile(DATA / "train" / "shard_00000.bin", dtype=np.uint16)
    val_tokens = np.fromfile(DATA / "val" / "shard_00000.bin", dtype=np.uint16)
    counts = np.bincount(train_tokens, minlength=4096) + 1.0
    targets = np.concatenate([val_tokens[i * seq_len + 1:(i + 1) * seq_len + 1] for i in range(n_sequences)])
    return float(-np.log(counts[targets] / counts.sum()).mean())


@pytest.mark.slow
def test_debug_model_learns_bundled_corpus(learned):
    rows = read_metrics(learned)
    val = {step: row["val_loss"] for step, row in rows.items() if "val_loss" in row}
    assert sorted(val) == [25, 50, 75, 100]
    first, final = val[25], val[100]
    # global_batch 16 × val_batches 4 sequences of the val split, as configs/debug.toml sets them
    unigram = unigram_val_loss(128, 16 * 4)
    # measured: uniform 8.32 → unigram plateau ≈ 6.8 by step 25 → 6.07 at step 100 (unigram 6.9)
    assert final < math.log(4096) - 2.0, val
    assert final < unigram - 0.5, (val, unigram)
    assert final < first - 0.4, val
    assert all(math.isfinite(row["loss"]) for step, row in rows.items() if "loss" in row)
    assert sorted(s for s, row in rows.items() if "loss" in row) == list(range(1, LEARN_STEPS + 1))


@pytest.mark.slow
def test_export_loads_into_a_fresh_model_and_matches_the_last_checkpoint(learned):
    export = learned / "export"
    cfg = ModelConfig(**json.loads((export / "config.json").read_text()))
    assert cfg == FLAVORS["debug"]
    exported = Transformer(cfg)
    exported.load_state_dict(load_export(export), strict=True)

    last = checkpoint.checkpoints(learned)[-1]
    assert last.name == f"step-{LEARN_STEPS}"
    trained = Transformer(cfg)
    checkpoint.load(last, trained, train.build_optimizer(trained, TrainConfig(), torch.device("cpu")))
    assert checkpoint.read_train_state(last)["step"] == LEARN_STEPS

    trained_state = trained.state_dict()
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, trained_state[name], rtol=0, atol=0, msg=name)
    # the expert biases are training state and were trained (they start at zero)
    assert all(router.expert_bias.abs().sum() > 0 for router in exported.routers())
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(tokens), trained.eval()(tokens), rtol=0, atol=0)


@pytest.mark.slow
def test_init_from_starts_from_exported_weights(learned, tmp_path):
    # lr 1e-30 (lr must be > 0) is below fp32 resolution, and no bias update: one step must leave the imported
    # weights exactly as they were
    weights = f"--checkpoint.init_from={learned / 'export'}"
    with pytest.raises(UserError, match=r"of other shapes than --model.n_layers=2 makes: drop it, the model comes "
                                        r"from .*/export/config.json$"):
        run(tmp_path / "smaller", *TINY, weights)  # TINY has 2 layers, the export 3
    rows = run(tmp_path, *TINY[1:], "--train.steps=1", "--train.lr=1e-30", "--train.bias_update_speed=0", weights,
               "--checkpoint.every=0", "--checkpoint.export=true")
    assert rows[1]["loss"] < math.log(4096) - 1.5  # a trained model, not a fresh one
    assert checkpoint.checkpoints(tmp_path) == []  # every=0: no checkpoints at all
    before = load_export(learned / "export")
    after = load_export(tmp_path / "export")
    assert before.keys() == after.keys()
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)


def test_init_from_builds_the_saved_model_and_names_the_fields_overridden_without_a_shape_change(tmp_path):
    """The model comes from the weights' config.json, whatever the flavor says; an override that keeps every shape
    (RoPE, routing) is applied on top and named in the banner's line; a config.json cut short is one clear error."""
    export_dir = tmp_path / "export"
    export.export(export_dir, Transformer(FLAVORS["debug"]), FLAVORS["debug"])
    small_flavor = ["--flavor=16B", f"--checkpoint.init_from={export_dir}"]  # 16B: other shapes than the export
    assert load_config(CONFIG, small_flavor).model_config() == FLAVORS["debug"]
    line = export.check_init_from(load_config(CONFIG, small_flavor))
    assert line.startswith(f"init    weights and model from {export_dir} (config.json); unlike flavor 16B: "
                           "vocab_size 102400 -> 4096, dim 2048 -> 128, ") and "overridden" not in line
    assert export.check_init_from(load_config(CONFIG, small_flavor[1:])) == (
        f"init    weights and model from {export_dir} (config.json)")
    overridden = load_config(CONFIG, [*small_flavor[1:], "--model.route_scale=1.5", "--model.rope_theta=5e4",
                                      "--model.init_std=0.01"])
    assert overridden.model_config().route_scale == 1.5
    assert export.check_init_from(overridden).endswith(
        "; overridden by [model]: route_scale 2.5 -> 1.5, rope_theta 10000.0 -> 50000.0")
    cut = tmp_path / "cut"
    shutil.copytree(export_dir, cut)
    (cut / "config.json").write_text((export_dir / "config.json").read_text()[:40])
    with pytest.raises(UserError, match=r"config.json is not JSON .*export or convert it again"):
        load_config(CONFIG, [f"--checkpoint.init_from={cut}"])


# DeepSeek-V3's config.json as released on the Hugging Face hub (FP8 quantization_config left out)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rope_theta": 10000, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def test_a_converted_deepseek_release_needs_no_model_flag_even_under_the_debug_config(tmp_path):
    converted = tmp_path / "ckpt" / "v3"
    converted.mkdir(parents=True)
    save_config(config_from_hf(DEEPSEEK_V3), converted / "config.json")
    save_file({"embed.weight": torch.zeros(1)}, converted / "model-00001-of-00001.safetensors")  # names, not shapes
    cfg = load_config(CONFIG, [f"--checkpoint.init_from={converted}"])
    model = cfg.model_config()
    assert (model.vocab_size, model.n_layers, model.n_routed_experts, model.rope_factor) == (129280, 61, 256, 40)
    line = export.check_init_from(cfg)
    assert line.startswith(f"init    weights and model from {converted} (config.json); unlike flavor debug: "
                           "vocab_size 4096 -> 129280, dim 128 -> 7168, ")
    assert "rope_factor 1.0 -> 40" in line and "overridden" not in line
    with pytest.raises(UserError, match=r"other shapes than --model.vocab_size=4096 makes: drop it"):
        export.check_init_from(load_config(CONFIG, [f"--checkpoint.init_from={converted}", "--model.vocab_size=4096",
                                                    "--model.route_scale=1.0"]))

# --- resume, crashes, divergence --------------------------------------------------------------------

# warmup (steps 1-2) → constant (3-4) → cosine (5-8), batch 2 → 4 over steps 1-3, MTP λ switches at 5
SCHEDULE = [*TINY, "--train.steps=8", "--train.warmup_steps=2", "--train.decay_start=0.5",
            "--train.batch_ramp_steps=3", "--train.batch_ramp_start=2", "--train.mtp_lambda_switch=0.5",
            "--checkpoint.export=true"]


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])  # bf16: stochastically rounded moments, saved as bf16
@pytest.mark.slow
def test_resume_continues_exactly(data, tmp_path, monkeypatch, state_dtype):
    schedule = [*SCHEDULE, f"--train.optimizer_state_dtype={state_dtype}"]
    straight = run(tmp_path / "straight", *schedule)

    stop_at(monkeypatch, 5, interrupt)
    with pytest.raises(Interrupted):
        run(tmp_path / "resumed", *schedule, "--checkpoint.every=4")
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "resumed")] == ["step-4"]
    saved = dcp_metadata(tmp_path / "resumed" / "step-4")
    assert {m.properties.dtype for k, m in saved.items() if k.endswith("exp_avg_sq")} == {
        torch.float32 if state_dtype == "fp32" else torch.bfloat16}
    monkeypatch.undo()
    resumed = run(tmp_path / "resumed", *schedule, "--checkpoint.every=4", "--resume")

    assert sorted(straight) == list(range(1, 9))
    assert [straight[s]["global_batch"] for s in range(1, 9)] == [2, 2, 4, 4, 4, 4, 4, 4]
    assert_same_training(resumed, straight)
    final = load_export(tmp_path / "resumed" / "export")
    for name, value in load_export(tmp_path / "straight" / "export").items():
        assert torch.equal(final[name], value), name


def assert_same_training(resumed: dict[int, dict], straight: dict[int, dict]) -> None:
    """The same steps with every loss, lr, grad norm, expert load and bias stat equal: only the speed and the wall
    clock differ."""
    assert sorted(resumed) == sorted(straight)
    for step, row in straight.items():
        assert resumed[step].keys() == row.keys(), step
        for key, value in row.items():
            if not key.startswith("tokens_per_s") and key not in ("time", "elapsed_s"):
                assert resumed[step][key] == value, (step, key)


def dcp_metadata(path: Path) -> dict:
    """What a DCP checkpoint holds: its keys' storage metadata (dtype, shape)."""
    return FileSystemReader(str(path)).read_metadata().state_dict_metadata


@pytest.mark.parametrize("failing", ["dcp.save", "os.replace"])
@pytest.mark.slow
def test_crash_mid_save_keeps_previous_checkpoint(data, tmp_path, monkeypatch, failing):
    args = [*TINY, "--train.steps=4", "--checkpoint.every=2"]
    if failing == "dcp.save":  # half the shards written, then the disk fills
        real_save = checkpoint.dcp.save

        def save(state, checkpoint_id):
            if checkpoint_id.endswith("step-4.tmp"):
                os.makedirs(checkpoint_id, exist_ok=True)
                Path(checkpoint_id, "__0_0.distcp").write_bytes(b"half a shard")
                raise OSError("No space left on device")
            return real_save(state, checkpoint_id=checkpoint_id)

        monkeypatch.setattr(checkpoint.dcp, "save", save)
    else:  # everything written, killed before the rename
        real_replace = os.replace

        def replace(src, dst):
            if str(dst).endswith("step-4"):
                raise OSError("No space left on device")
            return real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)

    with pytest.raises(OSError, match="No space left"):
        run(tmp_path, *args)
    monkeypatch.undo()
    before_crash = read_metrics(tmp_path)  # steps 1-4 were logged before step 4's save
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-2"]
    assert not (tmp_path / "step-4.tmp").exists()  # on a full disk its space is needed by the resumed run

    after = run(tmp_path, *args, "--resume")  # from step-2: redoes steps 3-4
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-2", "step-4"]
    assert not (tmp_path / "step-4.tmp").exists()
    for step in (3, 4):
        assert after[step]["loss"] == before_crash[step]["loss"]


@pytest.mark.parametrize("log_every", [1, 100], ids=["logged-every-step", "found-at-checkpoint"])
@pytest.mark.slow
def test_nan_loss_stops_the_run_and_leaves_only_checkpoints_from_before_it(data, tmp_path, monkeypatch, log_every):
    def poison(model: Transformer) -> None:
        with torch.no_grad():
            model.embed.weight.fill_(float("nan"))

    args = [*TINY, "--train.steps=6", "--checkpoint.every=2"]
    stop_at(monkeypatch, 5, poison)  # as if step 4's update had produced these weights
    # log.every=100 defers the host sync: the check before step 6's save must still catch step 5
    with pytest.raises(FloatingPointError, match=rf"^loss is nan at step 5; .* newest left is {tmp_path / 'step-2'}"):
        run(tmp_path, *args, f"--log.every={log_every}")
    monkeypatch.undo()
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-2"]  # step 3 vouched for it, not step 4
    assert (tmp_path / "step-4.diverged").is_dir()

    resumed = run(tmp_path, *args, "--resume")  # the step-2 checkpoint is intact
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # rewound to step 2: no step twice (step 1 is always logged, the resumed run logs every step)
    assert logged == (list(range(1, 7)) if log_every == 1 else [1, 3, 4, 5, 6])
    assert all(math.isfinite(resumed[step]["loss"]) for step in range(3, 7))


@pytest.mark.slow
def test_a_divergence_before_any_checkpoint_says_to_start_again(data, tmp_path, monkeypatch):
    stop_at(monkeypatch, 2, lambda model: model.embed.weight.data.fill_(float("nan")))
    with pytest.raises(FloatingPointError, match=r"^loss is nan at step 2; .*, no checkpoint from before it is "
                                                 r"left: start the run again without --resume, e.g. with a lower "
                                                 r"--train.lr$"):
        run(tmp_path, *TINY, "--train.steps=3", "--checkpoint.every=100")


@pytest.mark.slow
def test_an_exploding_update_is_caught_before_its_weights_become_the_checkpoint_to_resume(data, tmp_path,
                                                                                          monkeypatch):
    """Step 6's update explodes the weights (finite, but huge) and step-6 is saved with them; only step 7's loss
    shows it. The run stops there, and what --resume loads is step-4, from before the divergence."""
    real_step = train.train_step

    def exploding_step(model, optimizer, batch, t, step, *rest):
        if step == 6:
            for group in optimizer.param_groups:
                group["lr"] = 30.0
        return real_step(model, optimizer, batch, t, step, *rest)

    monkeypatch.setattr(train, "train_step", exploding_step)
    args = [*TINY, "--train.steps=8", "--checkpoint.every=2", "--checkpoint.keep=1"]
    with pytest.raises(FloatingPointError, match=r"^loss spiked to .* at step 7, over train.loss_spike_factor=3 × "
                                                 rf"its running mean .* the newest left is {tmp_path / 'step-4'}:"):
        run(tmp_path, *args)
    monkeypatch.undo()
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-4"]  # keep=1 kept the confirmed one
    exploded = Transformer(dataclasses.replace(FLAVORS["debug"], n_layers=2))
    checkpoint.load(tmp_path / "step-6.diverged", exploded, train.build_optimizer(exploded, TrainConfig(),
                                                                                   torch.device("cpu")))
    assert exploded.embed.weight.abs().max() > 10  # finite but exploded: what the old guard saved

    resumed = run(tmp_path, *args, "--resume")
    assert all(resumed[step]["loss"] < math.log(4096) + 0.1 for step in range(5, 9))


@pytest.mark.slow
def test_resume_on_a_finished_run_says_so_and_trains_nothing(data, tmp_path, monkeypatch, capsys):
    run(tmp_path, *TINY, "--train.steps=1", "--checkpoint.every=1")
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    capsys.readouterr()
    run(tmp_path, *TINY, "--train.steps=1", "--checkpoint.every=1", "--resume")
    assert f"{tmp_path / 'step-1'} is the end of this run (train.steps=1): nothing to train" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_on_a_finished_run_whose_export_was_cut_short_writes_it(data, tmp_path, capsys):
    run(tmp_path, *TINY, "--train.steps=1", "--checkpoint.every=1", "--checkpoint.export=true")
    shutil.rmtree(tmp_path / "export")  # killed while exporting: export.tmp, or nothing, is left
    capsys.readouterr()
    rows = run(tmp_path, *TINY, "--train.steps=1", "--checkpoint.every=1", "--checkpoint.export=true", "--resume")
    assert "its export is missing: writing it" in capsys.readouterr().out
    assert (tmp_path / "export" / "config.json").is_file() and sorted(rows) == [1]  # no step trained again


@pytest.mark.slow
def test_a_finished_run_keeps_its_last_vouched_checkpoint_beside_the_unjudged_last_one(data, tmp_path):
    """No step judged the last checkpoint's weights: it stays unconfirmed, and pruning (keep 1) keeps the newest
    one a step vouched for, which a continued run that diverges at once falls back to."""
    run(tmp_path, *TINY, "--train.steps=4", "--checkpoint.every=2", "--checkpoint.keep=1")
    assert [(p.name, checkpoint.is_confirmed(p)) for p in checkpoint.checkpoints(tmp_path)] == [
        ("step-2", True), ("step-4", False)]


@pytest.mark.slow
def test_a_resumed_run_judges_its_first_steps_against_the_saved_running_means(data, tmp_path):
    """A fresh guard judges no spike before 5 healthy steps: resumed, a loss blown up at once went unnoticed."""
    run(tmp_path, *TINY, "--train.steps=6", "--checkpoint.every=6", "--train.loss_spike_factor=3")
    with pytest.raises(FloatingPointError, match="spiked to .* at step 8"):  # step 7's update at lr 30
        run(tmp_path, *TINY, "--train.steps=8", "--checkpoint.every=6", "--train.loss_spike_factor=3",
            "--train.lr=30", "--train.warmup_steps=0", "--resume")


@pytest.fixture(scope="module")
def two_sources(data, tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished 1-step run of TINY (2 layers, bf16 moments) on a mixture: the bundled corpus 0.7, a second name
    for it 0.3."""
    root = tmp_path_factory.mktemp("two_sources")
    (root / "other").symlink_to(DATA)
    sources = f"--data.sources={DATA}:0.7,{root / 'other'}:0.3"
    train.main(["--config", CONFIG, sources, f"--checkpoint.dir={root / 'run'}", *TINY, "--train.steps=1",
                "--checkpoint.every=1", "--checkpoint.export=true"])
    return root / "run", [f"--data.sources={DATA}:0.5,{root / 'other'}:0.5", *TINY[:-1], "--train.steps=1",
                          "--checkpoint.every=1", "--checkpoint.export=true"]


@pytest.mark.parametrize("override,message", [
    ("--model.n_layers=1", "saved with model.n_layers=2, this run has 1: resume with --model.n_layers=2"),
    ("--model.n_layers=3", "saved with model.n_layers=2, this run has 3: resume with --model.n_layers=2"),
    ("--model.inter_dim=256", "saved with model.inter_dim=320, this run has 256: resume with --model.inter_dim=320"),
    ("--model.score_func=softmax", "saved with model.score_func=sigmoid, this run has softmax: resume with "
                                   "--model.score_func=sigmoid"),
    ("--train.optimizer_state_dtype=fp32", "saved with train.optimizer_state_dtype=bf16, this run has fp32: resume "
                                           "with --train.optimizer_state_dtype=bf16"),
    ("--data.sources={DATA}:1", r"the checkpoint read the data sources \{'stdlib': .*'other': .*\}, this run has "
                                r"\{'stdlib': .*\}: resume with the same data.path or data.sources"),
], ids=["fewer-layers", "more-layers", "dim", "reinterpreted", "optimizer-state", "sources"])
def test_a_resume_that_would_drop_reshape_or_reinterpret_saved_state_is_one_line_before_building(
        two_sources, monkeypatch, override, message):
    run_dir, args = two_sources
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != "lock"}
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    refusal = f"^--resume: (the checkpoint was )?{message}.*start a new run in another --checkpoint.dir$"
    with pytest.raises(UserError, match=refusal):
        train.main(["--config", CONFIG, f"--checkpoint.dir={run_dir}", *args, override.format(DATA=DATA),
                    "--train.steps=2", "--resume"])
    after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != "lock"}
    assert after == before  # checkpoints, metrics and export untouched


def test_a_resume_names_each_safe_change_at_start_up(two_sources, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(two_sources[0], run_dir, symlinks=True)
    capsys.readouterr()
    train.main(["--config", CONFIG, f"--checkpoint.dir={run_dir}", *two_sources[1], "--train.steps=2",
                "--train.lr=1e-3", "--log.every=2", "--resume"])
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume: ")]
    assert said == ["resume: mixture weights changed: stdlib 0.7 → 0.5, other 0.3 → 0.5",
                    "resume: train.lr changed: 0.003 → 0.001", "resume: log.every changed: 10 → 2",
                    "resume: train.steps 1 → 2: lr schedule recomputed, export will be replaced"]


def test_resume_with_no_checkpoint_is_an_error_not_a_fresh_start(data, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(UserError, match=rf"--resume: checkpoint.dir={tmp_path / 'typo'} does not exist"):
        run(tmp_path / "typo", *TINY, "--resume")


# --- bad input fails fast, with a message that says what to change ----------------------------------


@pytest.mark.parametrize("overrides,error,message", [
    (["--flavor=huge"], UserError, "unknown flavor 'huge': choose one of debug, 16B, 671B"),
    (["--train.learning_rate=1e-3"], UserError, "unknown key train.learning_rate"),
    (["--model.dims=64"], UserError, r"unknown model key\(s\) \['dims'\]"),
    (["--train.lr"], UserError, "bad override '--train.lr': write --section.key=value"),
    (["train.lr=1e-3"], UserError, "bad override 'train.lr=1e-3'"),
    (["--train.lr=fast"], UserError, "train.lr must be a float"),
    (["--data.path=/nonexistent/corpus"], UserError, "scripts/prepare_data.py"),
    (["--model.vocab_size=1000"], UserError, "has 4096 tokens but model.vocab_size is 1000"),
    (["--train.global_batch=12", "--train.micro_batch=8"], UserError,
     r"global_batch \(12\) must be a multiple of train.micro_batch"),
    (["--train.seq_len=512"], UserError, r"seq_len \(512\) exceeds model.max_seq_len \(256\)"),
    (["--parallel.ep=2"], UserError, "parallel.ep=2 must divide the world size 1"),
    (["--checkpoint.init_from=/nonexistent/weights"], UserError, r"holds no \*.safetensors"),
    (["--log.every=0"], UserError, "log.every must be >= 1 and finite, got 0"),
    (["--train.val_batches=0"], UserError, "train.val_batches must be >= 1 and finite, got 0"),
    (["--train.bias_update_speed=inf"], UserError, "train.bias_update_speed must be >= 0 and finite, got inf"),
    (["--train.loss_spike_factor=0.5"], UserError, r"train.loss_spike_factor must be 0 \(off\) or > 1, got 0\.5"),
    (["--train.grad_norm_spike_factor=nan"], UserError, r"train.grad_norm_spike_factor must be 0 \(off\) or > 1"),
    (["--train.seq_len=1"], UserError, r"train.seq_len \(1\) must exceed model.n_mtp_layers \(1\)"),
    (["--checkpoint.dir=/dev/null/run"], UserError, "checkpoint.dir=/dev/null/run cannot be written"),
    (["--train.device=cpu", "--train.compile=true"], UserError,
     "^train.compile=true needs a CUDA GPU: .* use --train.compile=false$"),
], ids=["flavor", "key", "model-key", "no-value", "no-dashes", "type", "data", "vocab", "batch", "seq-len",
        "ep", "init-from", "log-every", "val-batches", "inf-speed", "spike-factor", "nan-spike-factor",
        "seq-len-mtp", "unwritable-dir", "compile-on-cpu"])
def test_bad_input_is_a_clear_error_before_the_model_is_built(data, tmp_path, monkeypatch, overrides, error,
                                                                message):
    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the input was checked")

    monkeypatch.setattr(train, "build_model", build_model)
    with pytest.raises(error, match=message):
        run(tmp_path, *overrides)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_damaged_tokenizer_in_the_dataset_stops_the_run_before_building(tmp_path, monkeypatch):
    dataset = tmp_path / "dataset"
    (dataset / "tokenizer").mkdir(parents=True)
    for split in ("train", "val"):
        (dataset / split).symlink_to(DATA / split)
    (dataset / "tokenizer" / "tokenizer.model").write_bytes((DATA / "tokenizer" / "tokenizer.model").read_bytes()[:99])
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(UserError, match=rf"^the dataset's tokenizer in {dataset / 'tokenizer'} does not open \(.*\); "
                                        r"restore it, or re-run scripts/prepare_data.py for the dataset$"):
        run(tmp_path / "run", *TINY, f"--data.path={dataset}")


def test_init_from_a_hugging_face_checkpoint_names_the_conversion_before_building(data, tmp_path, monkeypatch):
    hf_dir = tmp_path / "DeepSeek-V3-hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(config_to_hf(FLAVORS["debug"])))
    save_file({"model.embed_tokens.weight": torch.zeros(4096, 128)}, hf_dir / "model-00001-of-00001.safetensors")
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(UserError, match=rf"^{hf_dir} is a Hugging Face checkpoint: convert it "
                                        rf"first with python scripts/convert_hf.py --to-dsv3 {hf_dir} OUT_DIR, then "
                                        r"pass --checkpoint.init_from=OUT_DIR$"):
        run(tmp_path / "run", *TINY, f"--checkpoint.init_from={hf_dir}")


def test_wandb_without_the_package_is_one_line_naming_pip_install_before_building(data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(UserError, match=r"^log.wandb=true needs the wandb package: pip install wandb"):
        run(tmp_path, *TINY, "--log.wandb=true")


@pytest.mark.slow
def test_a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints(data, tmp_path, monkeypatch):
    """Rotation would delete the new run's own checkpoints (the old ones have higher steps), and a later
    --resume would pick up the old run: stop before anything is built."""
    (tmp_path / "step-300").mkdir()
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(UserError, match=r"already holds checkpoints \(step-300\).*--resume"):
        run(tmp_path, *TINY, "--train.steps=2", "--checkpoint.every=2")
    assert (tmp_path / "step-300").is_dir()


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_directory_is_refused_with_the_holders_pid_and_host(data, tmp_path,
                                                                                        monkeypatch):
    with open(tmp_path / "lock", "w") as live_run:  # as a run in another process holds it
        live_run.write("4242 gpu-node-7\n")
        live_run.flush()
        fcntl.flock(live_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
        monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
        for resume in ([], ["--resume"]):
            with pytest.raises(UserError, match=r"is in use by another run \(pid 4242 on host gpu-node-7\)"):
                run(tmp_path, *TINY, *resume)


# --- first contact: what a user sees on the command line -------------------------------------------


def train_py(*args: str, env: dict[str, str] | None = None, launcher: list[str] = ()) -> subprocess.Popen:
    """`python [LAUNCHER] train.py ARGS` in a fresh process, stdout and stderr captured."""
    return subprocess.Popen([sys.executable, *launcher, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_bad_config_value_is_one_line_on_stderr_and_exit_code_2():
    out, err = train_py("--config", CONFIG, "--train.lr=-1").communicate(timeout=120)
    assert err.splitlines() == ["error: train.lr must be > 0, got -1.0"]
    assert "Traceback" not in out + err


@pytest.mark.slow
def test_help_lists_every_section_and_exits_0():
    process = train_py("--help")
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and err == ""
    assert out.startswith("usage: ")
    assert all(f"[{section}]" in out for section in ("model", "train", "data", "parallel", "checkpoint", "log"))


@pytest.mark.slow
def test_error_after_the_process_group_exists_is_one_line_from_rank_0_and_no_rank_hangs(data):
    """parallel.ep=3 at world 2 is refused after init_process_group: both ranks leave with code 2, only rank 0
    says why, and tearing the group down prints nothing."""
    port = free_port()
    ranks = [train_py("--config", CONFIG, "--train.device=cpu", "--parallel.ep=3",
                      env=os.environ | torchrun_vars(rank, 2, port)) for rank in range(2)]
    (_, err0), (_, err1) = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2]
    assert err0.splitlines() == ["error: parallel.ep=3 must divide the world size 2: pick one of [1, 2]"]
    assert err1 == ""


@pytest.mark.slow
def test_short_run_prints_a_banner_then_step_1_and_no_warnings(data, tmp_path):
    """What a newcomer's first run shows: the banner, a first line at step 1, and no library warnings
    (the checkpoint and export paths included)."""
    process = train_py("--config", CONFIG, f"--checkpoint.dir={tmp_path}", *TINY[:-1], "--train.steps=3",
                       "--checkpoint.every=3", "--train.val_every=3", "--log.every=10")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert [line for line in err.splitlines() if "Warning" in line or "warn(" in line] == []
    lines = out.splitlines()
    assert lines[0].startswith("model   debug: ") and "activated per token" in lines[0]
    assert any(line.startswith("data    stdlib 100% (") for line in lines)
    assert f"run dir {tmp_path}" in lines
    assert [line.split(" |")[0] for line in lines if line.startswith("step ")] == ["step 1/3", "step 3/3", "step 3/3"]
    assert (tmp_path / "export" / "model.safetensors.index.json").is_file()



def test_a_finished_run_ends_naming_its_results_and_next_commands_that_run_as_printed(data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(run_dir, *TINY[:-1], "--train.steps=2")  # exported, and checkpointed at its last step
    out = capsys.readouterr().out
    summary = out[out.index(f"results in {run_dir}:"):].splitlines()
    assert summary[:5] == [f"results in {run_dir}:",
                           f"  metrics     {run_dir}/metrics.jsonl (expert_load.jsonl beside it)",
                           f"  checkpoint  {run_dir}/step-2",
                           f"  export      {run_dir}/export (config.json, *.safetensors, the tokenizer)", "next:"]
    plot, sample, to_hf, train_on = (shlex.split(line, comments=True) for line in summary[5:])
    assert plot == ["python", "scripts/plot.py", str(run_dir)]
    plot_script.main(plot[2:])
    assert f"{run_dir}/plots/loss.png" in capsys.readouterr().out.splitlines()
    assert sample[:3] == ["python", "scripts/generate.py", str(run_dir / "export")]
    generate.main(sample[2:] + ["--max-tokens=4"])
    assert capsys.readouterr().out.startswith("The")
    assert to_hf[:3] == ["python", "scripts/convert_hf.py", "--to-hf"]
    convert_hf.main(to_hf[2:])
    assert (run_dir / "hf-step-2" / "config.json").is_file()
    assert train_on[:2] == ["python", "train.py"] and train_on[-2:] == ["--resume", "--train.steps=4"]
    train.main(train_on[2:])
    assert max(read_metrics(run_dir)) == 4
    # the continued run's own next commands paste too: one --train.steps, a directory of its own for transformers
    out = capsys.readouterr().out
    *_, to_hf, train_on = (shlex.split(line, comments=True) for line in out[out.index("next:"):].splitlines()[1:])
    assert [a for a in train_on if a.startswith("--train.steps")] == ["--train.steps=8"]
    convert_hf.main(to_hf[2:])
    assert (run_dir / "hf-step-4" / "config.json").is_file()


def test_a_run_without_an_export_names_the_sampling_command_for_its_checkpoint(data, tmp_path, capsys):
    run(tmp_path, *TINY, "--train.steps=1")
    out = capsys.readouterr().out
    assert "  export      " not in out
    sample = next(shlex.split(line, comments=True) for line in out.splitlines() if "scripts/generate.py" in line)
    assert sample[:3] == ["python", "scripts/generate.py", str(tmp_path / "step-1")]
    generate.main(sample[2:] + ["--max-tokens=4", "--temperature=0"])
    assert capsys.readouterr().out.startswith("The")

# --- stopping like a cluster job: SIGTERM or Ctrl-C saves the step in flight -----------------------------

STOP = [*TINY, "--train.steps=8", "--checkpoint.every=100"]  # no checkpoint but the one a stop writes


def signal_after(process: subprocess.Popen, step: int, sig: signal.Signals) -> tuple[str, str]:
    """Send `sig` to `process` once it logs step `step`; its stdout and stderr, when it has ended."""
    head = []
    for line in process.stdout:
        head.append(line)
        if line.startswith(f"step {step}/"):
            process.send_signal(sig)
            break
    out, err = process.communicate(timeout=300)
    return "".join(head) + out, err


def stop_line(out: str, sig: signal.Signals, run_dir: Path) -> tuple[int, str]:
    """(step, resume command) of the line that ends a stopped run's output."""
    stopped = re.fullmatch(rf"stopped by {sig.name} after step (\d+) of 8: saved {run_dir}/step-(\d+); "
                           r"continue with: (.*)", out.splitlines()[-1])
    assert stopped and stopped[1] == stopped[2], out
    return int(stopped[1]), stopped[3]


@pytest.mark.slow
def test_ctrl_c_saves_the_step_in_flight_exits_130_and_the_printed_command_resumes_exactly(data, tmp_path):
    straight = run(tmp_path / "straight", *STOP)
    run_dir = tmp_path / "stopped"
    args = ["--config", CONFIG, f"--data.path={DATA}", f"--checkpoint.dir={run_dir}", "--log.every=1", *STOP]
    process = train_py(*args)
    out, err = signal_after(process, 2, signal.SIGINT)
    assert process.returncode == 130 and "Traceback" not in err, err
    step, command = stop_line(out, signal.SIGINT, run_dir)
    assert 2 <= step < 8
    assert command == shlex.join(["python", "train.py", *args, "--resume"])
    assert [p.name for p in checkpoint.checkpoints(run_dir)] == [f"step-{step}"]
    assert checkpoint.verify(run_dir / f"step-{step}") is None

    train.main(shlex.split(command)[2:])  # python train.py ARGS --resume, in this process
    assert_same_training(read_metrics(run_dir), straight)


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_ranks_after_one_step_saved_and_resumes_exactly(data, tmp_path):
    """torchrun passes the signal on to its workers (each in its own session, so a terminal's Ctrl-C reaches them
    this way too), waits for them, then exits 1 itself; rank 0 alone says where the run stopped."""
    def torchrun(run_dir: Path, *extra: str) -> subprocess.Popen:
        return train_py("--config", CONFIG, f"--checkpoint.dir={run_dir}", "--train.device=cpu", "--log.every=1",
                        *STOP, *extra, env=os.environ | {"OMP_NUM_THREADS": "1"},
                        launcher=["-m", "torch.distributed.run", f"--master_port={free_port()}", "--nproc_per_node=2"])

    reference = torchrun(tmp_path / "straight")
    assert reference.wait(timeout=300) == 0, reference.stderr.read()
    run_dir = tmp_path / "stopped"
    process = torchrun(run_dir)
    out, err = signal_after(process, 2, signal.SIGTERM)
    assert process.returncode == 1 and "got signal: 15" in err, err  # torchrun's own SignalException
    assert sum(line.startswith("stopped by") for line in out.splitlines()) == 1
    step, command = stop_line(out, signal.SIGTERM, run_dir)
    assert 2 <= step < 8
    assert command.startswith("torchrun --nproc_per_node=2 train.py ") and command.endswith(" --resume")
    assert checkpoint.verify(run_dir / f"step-{step}") is None

    resumed = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--master_port={free_port()}",
                              *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr
    assert_same_training(read_metrics(run_dir), read_metrics(tmp_path / "straight"))


@pytest.mark.slow
def test_signals_during_the_stops_save_change_nothing_and_the_checkpoint_before_stays_intact(data, tmp_path,
                                                                                             monkeypatch):
    """SIGTERM during step 3; a Ctrl-C and a second SIGTERM (Slurm's and torchrun's copies of one stop) while its
    checkpoint is written: the save completes, the run exits 143, and step-2, saved before, is untouched."""
    args = [*TINY, "--train.steps=5", "--checkpoint.every=2"]
    stop_at(monkeypatch, 3, lambda model: os.kill(os.getpid(), signal.SIGTERM))
    real_save = checkpoint.dcp.save

    def save(state, checkpoint_id):
        if checkpoint_id.endswith("step-3.tmp"):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint.dcp, "save", save)
    with pytest.raises(SystemExit) as stopped:
        run(tmp_path / "stopped", *args)
    assert stopped.value.code == 143
    monkeypatch.undo()
    saved = checkpoint.checkpoints(tmp_path / "stopped")
    assert [p.name for p in saved] == ["step-2", "step-3"]
    assert [checkpoint.verify(p) for p in saved] == [None, None]
    assert [checkpoint.is_confirmed(p) for p in saved] == [True, False]  # step 4 has not vouched for step-3 yet

    resumed = run(tmp_path / "stopped", *args, "--resume")
    assert sorted(resumed) == [1, 2, 3, 4, 5]


def test_ctrl_c_during_the_final_export_is_one_line_and_exit_code_130(data, tmp_path, monkeypatch, capsys):
    """DCP wraps the KeyboardInterrupt in its CheckpointException, which run_main did not know."""
    class InterruptedWriter(export.dcp.HuggingFaceStorageWriter):
        def write_data(self, plan, planner):
            raise KeyboardInterrupt

    monkeypatch.setattr(export.dcp, "HuggingFaceStorageWriter", InterruptedWriter)
    with pytest.raises(SystemExit) as stopped:
        run_main(lambda: run(tmp_path, *TINY, "--train.steps=1", "--checkpoint.every=1", "--checkpoint.export=true"))
    assert stopped.value.code == 130
    assert re.fullmatch(rf"interrupted \(Ctrl-C\); the last complete checkpoint is {tmp_path / 'step-1'}; continue: "
                        r"python train\.py .* --resume\n", capsys.readouterr().err)
    assert checkpoint.verify(tmp_path / "step-1") is None and not (tmp_path / "export").exists()


def test_ctrl_c_before_training_is_one_line_and_exit_code_130(data, tmp_path, monkeypatch, capsys):
    def build_model(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "build_model", build_model)
    with pytest.raises(SystemExit) as stopped:
        run_main(lambda: run(tmp_path, *TINY))
    assert stopped.value.code == 130
    assert re.fullmatch(r"interrupted \(Ctrl-C\); no checkpoint was written yet; start again: python train\.py .*\n",
                        capsys.readouterr().err)


# --- schedules ---------------------------------------------------------------------------------------


def test_lr_warms_up_holds_then_decays_to_min_lr_ratio():
    t = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, decay_start=0.8, min_lr_ratio=0.1)
    assert train.lr_at(0, t) == 0.0
    assert train.lr_at(5, t) == pytest.approx(5e-4)
    assert train.lr_at(10, t) == train.lr_at(50, t) == train.lr_at(80, t) == 1e-3
    assert train.lr_at(90, t) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half-way down the cosine
    assert train.lr_at(100, t) == pytest.approx(1e-4)
    decay = [train.lr_at(s, t) for s in range(80, 101)]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_batch_ramps_linearly_in_whole_micro_batches_per_rank():
    t = TrainConfig(global_batch=64, micro_batch=4, batch_ramp_steps=100, batch_ramp_start=16)
    world = 2  # unit: 4 sequences × 2 ranks
    assert [train.batch_at(s, t, world) for s in (0, 25, 50, 99, 100, 1000)] == [16, 24, 40, 56, 64, 64]
    assert all(train.batch_at(s, t, world) % 8 == 0 for s in range(101))
    assert train.batch_at(0, TrainConfig(global_batch=64, micro_batch=4, batch_ramp_steps=100,
                                         batch_ramp_start=2), world) == 8  # never below one micro-batch each
    assert train.batch_at(0, TrainConfig(global_batch=64, micro_batch=4), world) == 64  # no ramp


def test_mtp_lambda_switches_after_its_fraction_of_steps():
    t = TrainConfig(steps=100, mtp_lambda=0.3, mtp_lambda_final=0.1, mtp_lambda_switch=0.7)
    assert [train.mtp_lambda_at(s, t) for s in (1, 70, 71, 100)] == [0.3, 0.3, 0.1, 0.1]


def test_the_expert_bias_stops_moving_after_its_fraction_of_steps():
    t = TrainConfig(steps=100, bias_update_speed=1e-3, bias_update_stop=0.97)
    assert [train.bias_update_speed_at(s, t) for s in (1, 97, 98, 100)] == [1e-3, 1e-3, 0.0, 0.0]
    assert train.bias_update_speed_at(100, TrainConfig(steps=100)) == TrainConfig().bias_update_speed  # default: never


# --- gradient accumulation ---------------------------------------------------------------------------


def test_gradient_accumulation_matches_one_big_batch():
    cfg = FLAVORS["debug"]
    batch = torch.randint(0, cfg.vocab_size, (8, 33), generator=torch.Generator().manual_seed(0))
    results = []
    for micro_batch in (8, 2):
        torch.manual_seed(0)
        model = Transformer(cfg)
        t = TrainConfig(global_batch=8, micro_batch=micro_batch, seq_len=32, lr=1e-3, warmup_steps=0)
        optimizer = train.build_optimizer(model, t, torch.device("cpu"))
        grads = {}  # as the optimizer sees them: accumulated and clipped
        optimizer.register_step_pre_hook(
            lambda *_: grads.update({n: p.grad.clone() for n, p in model.named_parameters()}))
        values, tokens_per_expert = train.train_step(model, optimizer, batch, t, step=1)
        results.append((values, tokens_per_expert, grads, model.state_dict()))
    (values, counts, grads, params), (acc_values, acc_counts, acc_grads, acc_params) = results
    torch.testing.assert_close(acc_values, values, rtol=0, atol=1e-6)  # main, MTP, balance loss, grad norm
    assert torch.equal(acc_counts, counts)
    for name, grad in grads.items():  # measured: ≤ 8e-9 apart, summation order only
        torch.testing.assert_close(acc_grads[name], grad, rtol=1e-5, atol=1e-8, msg=name)
    # Adam's first step is lr·g/(|g| + eps): a gradient of ~eps turns 1e-10 of summation-order noise into
    # ~1e-6 of update (measured ≤ 5e-6 on a handful of elements), hence 1% of lr here.
    for name, param in params.items():
        torch.testing.assert_close(acc_params[name], param, rtol=0, atol=1e-5, msg=name)


def test_validation_scores_at_most_one_pass_over_the_split():
    """At seq_len 2048 the bundled val split holds 22 sequences: with global_batch 8, two whole batches, not
    val_batches = 8 batches that would score each sequence three times; the loss is their mean."""
    cfg = Config(model={"n_layers": 1, "max_seq_len": 2048},
                 train=TrainConfig(seq_len=2048, global_batch=8, micro_batch=8, val_batches=8),
                 data=DataConfig(path=str(DATA)))
    torch.manual_seed(0)
    model = Transformer(cfg.model_config())
    seen, losses = [], []

    def record(module, args, out) -> None:
        seen.append(args[0])
        losses.append(out.loss.item())

    model.register_forward_hook(record)
    loss = train.evaluate(model, cfg, 0, 1, torch.device("cpu"))["val_loss"]
    assert len(seen) == 2 and not torch.equal(seen[0], seen[1])
    assert loss == pytest.approx(sum(losses) / 2, rel=1e-6)


@pytest.mark.slow
def test_plot_draws_a_real_run(learned, tmp_path):
    from scripts.plot import plot_runs, read_jsonl

    counts = read_jsonl(learned / "expert_load.jsonl")
    assert list(counts) == [LEARN_STEPS]  # log.expert_load_every = 100 and the last step
    tokens_per_expert = counts[LEARN_STEPS]["tokens_per_expert"]  # [MoE layers + MTP blocks, E]
    cfg = ModelConfig(**json.loads((learned / "export" / "config.json").read_text()))
    # every routed copy of a token of the step's 16 × 128: MTP depth d predicts from the first 128 - d positions
    routed = [16 * 128] * (cfg.n_layers - cfg.n_dense_layers) + [16 * (128 - d) for d in range(1, cfg.n_mtp_layers + 1)]
    assert [sum(row) for row in tokens_per_expert] == [n * cfg.n_activated_experts for n in routed]
    written = plot_runs([str(learned)], str(tmp_path))
    assert {p.name for p in written} == {"loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png", "expert_load.png"}



@pytest.mark.slow
def test_a_run_from_init_from_records_the_model_it_built_and_resumes_without_that_directory(data, tmp_path,
                                                                                               monkeypatch):
    """The model an init_from run builds is read once: its checkpoints record it even when the init_from directory
    goes away mid-run, and the run resumes from its checkpoint without that directory; leaving init_from out of the
    resume names it as the fix."""
    weights = tmp_path / "weights"
    model_cfg = dataclasses.replace(FLAVORS["debug"], dim=96, n_layers=2)
    export.export(weights, Transformer(model_cfg), model_cfg)
    stop_at(monkeypatch, 2, lambda model: shutil.rmtree(weights))  # gone after the first checkpoint
    args = [*TINY[1:], f"--checkpoint.init_from={weights}", "--checkpoint.every=1"]
    run(tmp_path / "run", *args, "--train.steps=3")
    monkeypatch.undo()
    for step in (1, 2, 3):
        assert checkpoint.read_train_state(tmp_path / "run" / f"step-{step}")["config"]["model"]["dim"] == 96
    rows = run(tmp_path / "run", *args, "--train.steps=4", "--resume")
    assert max(rows) == 4
    with pytest.raises(UserError, match=rf"saved with model.dim=96, this run has 128: resume with "
                                        rf"--checkpoint.init_from={weights}, or start a new run"):
        run(tmp_path / "run", *TINY[1:], "--checkpoint.every=1", "--train.steps=5", "--resume")
