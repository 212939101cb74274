import dataclasses
import json
import os
import sys

import pytest
import torch

import train
from dsv3.config import FLAVORS, UserError, load_config, run_main
from dsv3.model import Transformer
from dsv3.metrics import dense_and_expert_params
from dsv3.plan import FIT_FRACTION, GIB, check_fits, plan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import plan as plan_cli  # noqa: E402  (scripts/plan.py)

CUT_16B = "configs/16b_4layer.toml"
CUT_671B = ["--flavor=671B", "--model.n_layers=3", "--model.n_dense_layers=1", "--model.n_routed_experts=32",
            "--model.n_mtp_layers=0", "--train.micro_batch=2", "--train.global_batch=2", "--train.seq_len=4096"]


@pytest.mark.parametrize("mc", [FLAVORS["debug"], dataclasses.replace(FLAVORS["16B"], n_layers=4)],
                         ids=["debug", "16B-cut"])
def test_parameter_counts_match_a_built_model(mc):
    with torch.device("meta"):
        model = Transformer(mc)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    dense = sum(p.numel() for name, p in model.named_parameters() if ".experts." not in name)
    assert dense_and_expert_params(mc) == (dense, experts)


@pytest.mark.parametrize("gpus", [1, 2])
def test_parameter_and_optimizer_bytes_match_adamw_on_the_debug_model(gpus):
    cfg = load_config("configs/debug.toml", [f"--parallel.ep={gpus}", "--train.global_batch=16"])
    model = Transformer(cfg.model_config())
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes = sum(s.numel() * s.element_size() for state in optimizer.state.values()
                      for name, s in state.items() if name in ("exp_avg", "exp_avg_sq"))
    fp32 = plan(cfg, gpus, "h100")
    assert fp32.memory["parameters"] * GIB * gpus == pytest.approx(param_bytes, rel=1e-12)
    assert fp32.memory["optimizer states"] * GIB * gpus == pytest.approx(state_bytes, rel=1e-12)
    cfg.train.optimizer_state_dtype = "bf16"
    assert plan(cfg, gpus, "h100").memory["optimizer states"] * GIB * gpus == pytest.approx(state_bytes / 2, rel=1e-12)


# Our measurements (fp32 AdamW moments; peak = torch.cuda.max_memory_allocated): the calibration's specification.
MEASURED = [  # (config, overrides, GPUs, kind, GiB per GPU, tokens/s per GPU or None)
    (CUT_16B, [], 1, "h100", 41.8, 117.5e3),
    (CUT_16B, ["--train.optimizer_state_dtype=bf16"], 1, "h100", 33.4, 120.7e3),
    (CUT_16B, ["--train.optimizer_state_dtype=bf16", "--train.activation_checkpoint=selective"], 1, "h100", 28.5,
     114.8e3),
    (CUT_16B, ["--train.optimizer_state_dtype=bf16", "--train.activation_checkpoint=full"], 1, "h100", 27.4,
     103.0e3),
    (None, CUT_671B, 1, "h200", 93.4, 26.3e3),
    (None, CUT_671B + ["--train.optimizer_state_dtype=bf16"], 1, "h200", 72.1, 26.9e3),
    (CUT_16B, ["--parallel.ep=2", "--train.global_batch=8"], 2, "h200", 26.2, 104.7e3),
]


@pytest.mark.parametrize("path, overrides, gpus, kind, memory_gib, tokens_per_s", MEASURED,
                         ids=["16B-cut-h100", "16B-cut-h100-bf16-moments", "16B-cut-selective", "16B-cut-full",
                              "671B-cut-h200", "671B-cut-h200-bf16-moments", "16B-cut-ep2"])
def test_plan_matches_measurement(path, overrides, gpus, kind, memory_gib, tokens_per_s):
    planned = plan(load_config(path, overrides), gpus, kind)
    assert planned.memory_gib_per_gpu == pytest.approx(memory_gib, rel=0.10)
    if tokens_per_s is not None:
        assert planned.tokens_per_s_per_gpu == pytest.approx(tokens_per_s, rel=0.20)


def test_more_activation_checkpointing_means_less_activation_memory():
    activations = [plan(load_config("configs/16b.toml", [f"--train.activation_checkpoint={mode}"]), 8, "h100")
                   .memory["activations"] for mode in ("none", "selective", "full")]
    assert activations[0] > activations[1] > activations[2]


def test_more_expert_parallelism_means_fewer_unsharded_expert_bytes_per_gpu():
    buffers = [plan(load_config("configs/16b.toml", [f"--parallel.ep={ep}"]), 8, "h100")
               .memory["bf16 compute weights"] for ep in (1, 2, 8)]
    assert buffers[0] > buffers[1] > buffers[2]


def test_accumulating_unsharded_grads_holds_every_gradient_unsharded():
    cfg = load_config("configs/16b.toml", ["--train.global_batch=64"])  # 2 micro-batches per rank on 8 GPUs
    sharded = plan(cfg, 8, "h100")
    cfg.parallel.accumulate_unsharded_grads = True
    unsharded = plan(cfg, 8, "h100")
    dense, experts = dense_and_expert_params(cfg.model_config())
    extra = unsharded.memory["gradients"] - sharded.memory["gradients"]
    assert extra == pytest.approx(4 * (dense + experts) / GIB, rel=1e-9)  # ep = 1: every rank holds all experts


def test_mtp_memory_is_its_own_line():
    with_mtp = plan(load_config("configs/debug.toml", []), 1, "h100")
    without = plan(load_config("configs/debug.toml", ["--model.n_mtp_layers=0"]), 1, "h100")
    assert with_mtp.memory["mtp"] > 0 and without.memory["mtp"] == 0
    assert with_mtp.memory_gib_per_gpu > without.memory_gib_per_gpu


def test_a_config_that_cannot_fit_is_refused_with_the_fix():
    cfg = load_config(CUT_16B, [])
    selective = plan(load_config(CUT_16B, ["--train.activation_checkpoint=selective"]), 1, "h100")
    between = (selective.memory_gib_per_gpu + plan(cfg, 1, "h100").memory_gib_per_gpu) / 2 / FIT_FRACTION
    with pytest.raises(UserError, match="cannot fit.*--train.activation_checkpoint=selective"):
        check_fits(cfg, 1, "NVIDIA H100 80GB HBM3", int(between * GIB))
    with pytest.raises(UserError, match="use more GPUs"):
        check_fits(cfg, 1, "NVIDIA H100 80GB HBM3", int(20 * GIB))


def test_a_config_that_fits_gives_the_memory_line():
    planned = check_fits(load_config(CUT_16B, []), 1, "NVIDIA H100 80GB HBM3", int(79.1 * GIB))
    assert planned.summary().startswith(f"plan: {planned.memory_gib_per_gpu:.1f} GiB per GPU of 79.1 (params")


def test_the_shipped_671b_config_fits_its_stated_cluster():
    cfg = load_config("configs/671b.toml", [])
    assert plan(cfg, cfg.parallel.gpus, "h100").fits


def test_cli_json_has_memory_and_tokens_per_s(capsys):
    plan_cli.main(["--config", CUT_16B, "--gpus", "1", "--gpu", "h200", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["memory_gib_per_gpu"] > 0 and out["tokens_per_s_per_gpu"] > 0
    assert out["gpus"] == 1 and out["gpu"] == "h200"


def test_cli_says_when_memory_peaks_and_names_the_fix_train_py_would(capsys):
    """The 16B on 8 H100s without AC does not fit; the table says so with the change that makes it fit, and that its
    memory lines are what is allocated at the peak (in backward, only the gradients of the blocks done so far)."""
    plan_cli.main(["--config", "configs/16b.toml", "--gpus", "8", "--train.activation_checkpoint=none"])
    header, *lines = capsys.readouterr().out.splitlines()
    assert header == ("memory per GPU (8 × h100) at its peak, the backward pass at block 26 (the gradients of the "
                      "blocks after it, the activations of those before it):")
    total = next(line for line in lines if line.strip().startswith("total"))
    assert total.startswith("  total                         82.71 GiB of 79.1 (limit 95%): does NOT fit: set "
                            "--train.activation_checkpoint=selective (plan: 52.0 GiB); or ")


def test_cli_rejects_an_unknown_gpu_kind_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_main(lambda: plan_cli.main(["--config", CUT_16B, "--gpu", "a100"]))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "error: unknown GPU kind 'a100': choose one of h100, h200, b200"


def test_train_refuses_a_config_that_cannot_fit_before_building_the_model(monkeypatch):
    def build_model(*args):
        raise AssertionError("the model was built for a config that cannot fit")

    monkeypatch.setattr(train.parallel, "init_distributed", lambda device: (0, 1, torch.device("cuda")))
    monkeypatch.setattr(train, "check_setup", lambda cfg, world, device: None)  # it would look for a real GPU
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("Properties", (), {"total_memory": 20 * GIB})())
    monkeypatch.setattr(train, "build_model", build_model)
    with pytest.raises(UserError, match="cannot fit the GPU"):
        train.main(["--config", CUT_16B])
