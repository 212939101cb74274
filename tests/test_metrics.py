import dataclasses
import glob
import json
import os
import re
import struct
import subprocess
import sys
import time

import pytest
import torch

from dsv3.config import FLAVORS, UserError, load_config
from dsv3.flops import active_matmul_params, flops_per_token, layer_flops_per_token, mfu, parameter_counts, peak_flops
from dsv3.guard import DivergenceGuard
from dsv3.metrics import MetricsLogger, _wandb_mode, expert_load_stats, startup_banner
from dsv3.model import Transformer
from dsv3.plan import plan


def test_16b_cut_to_4_layers_is_3_49_gflop_per_token():
    # the anchor from the issue tracker: 1 dense + 3 MoE layers, no MTP, S = 4096
    cfg = dataclasses.replace(FLAVORS["16B"], n_layers=4, n_dense_layers=1, n_mtp_layers=0)
    assert flops_per_token(cfg, 4096) == pytest.approx(3.49e9, rel=0.01)


@pytest.mark.parametrize("flavor", ["debug", "671B"])  # debug: q_lora + MTP; 671B: q_lora, 3 dense layers, MTP
def test_active_params_match_the_model_weights(flavor):
    cfg = FLAVORS[flavor]
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name == "embed.weight":  # norms; the embedding is a lookup
            continue
        share = cfg.n_activated_experts / cfg.n_routed_experts if ".experts." in name else 1.0
        expected += p.numel() * share
    expected += cfg.n_mtp_layers * model.head.weight.numel()  # the head runs again at each MTP depth
    assert active_matmul_params(cfg) == expected


@pytest.mark.parametrize("flavor,changes", [
    ("debug", {}), ("debug", dict(q_lora_rank=0, n_shared_experts=0, n_mtp_layers=2)),
    ("16B", {}), ("671B", {}),
])
def test_parameter_counts_from_the_config_match_the_built_model(flavor, changes):
    cfg = dataclasses.replace(FLAVORS[flavor], **changes)
    with torch.device("meta"):
        model = Transformer(cfg)
    idle_experts = 0  # the routed experts a token is not sent to, in every MoE block (MTP's included)
    for name, p in model.named_parameters():
        if ".experts." in name:
            idle_experts += p.numel() * (cfg.n_routed_experts - cfg.n_activated_experts) // cfg.n_routed_experts
    total = sum(p.numel() for p in model.parameters())
    assert parameter_counts(cfg) == (total, total - idle_experts)


def test_banner_says_what_trains_how_and_where():
    cfg = load_config(None, ["--flavor=671B", "--train.global_batch=64", "--train.micro_batch=2",
                             "--parallel.ep=8", "--data.path=data/web", "--checkpoint.dir=runs/big"])
    banner = startup_banner(cfg, 16, torch.device("cuda", 0), plan(cfg, 16, "h200", 139.0).summary(),
                            "web 100% (data/web: 1,000M tokens, 0.5 epochs in this run)")
    assert "671B: 683B parameters, 38.2B activated per token" in banner
    assert "64 sequences × 256 tokens = 16,384 tokens/step" in banner
    assert "2 × 2 sequences per rank and step" in banner  # 64 / (2 × 16 ranks) micro-batches
    assert "world 16 on cuda, ep 8 (all_to_all); precision bf16;" in banner
    assert re.search(r"\nmemory  plan: [\d.]+ GiB per GPU of 139\.0", banner)
    assert "\ndata    web 100% (data/web: 1,000M tokens, 0.5 epochs in this run)\nrun dir runs/big" in banner
    assert "GiB" not in startup_banner(cfg, 16, torch.device("cuda", 0), None, "")  # no planner estimate, no line
    assert "vocab" not in banner  # 3.7B of 683B parameters


def test_banner_says_when_the_vocabulary_outweighs_the_model():
    """DeepSeek's 129k tokenizer on the debug model: 97% of its 34M parameters are the embedding and head, which a
    step on a CPU spends most of its time in; the banner says so and how to change it."""
    big = load_config(None, ["--flavor=debug", "--model.vocab_size=129280"])
    banner = startup_banner(big, 1, torch.device("cpu"), None, "")
    assert "debug: 34.2M parameters" in banner
    assert ("\nvocab   129,280 tokens: the embedding and output head are 97% of the parameters and most of each step; "
            "for a faster run, tokenize with a smaller vocabulary (scripts/train_tokenizer.py --vocab-size 4096, then "
            "scripts/prepare_data.py --tokenizer)\nbatch ") in banner
    assert "vocab" not in startup_banner(load_config(None, ["--flavor=debug"]), 1, torch.device("cpu"), None, "")


def test_flops_grow_with_seq_len_by_exactly_the_attention_term():
    cfg = FLAVORS["671B"]
    L = cfg.n_layers + cfg.n_mtp_layers
    per_extra_position = 3 * L * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    assert flops_per_token(cfg, 8192) - flops_per_token(cfg, 4096) == per_extra_position * 4096
    assert flops_per_token(cfg, 4096) == 6 * active_matmul_params(cfg) + per_extra_position * 4096


@pytest.mark.parametrize("flavor", ["16B", "671B"])
def test_the_layers_flops_and_the_head_make_up_the_whole_model(flavor):
    cfg = dataclasses.replace(FLAVORS[flavor], n_mtp_layers=0)
    n_moe = cfg.n_layers - cfg.n_dense_layers
    layers = (cfg.n_dense_layers * layer_flops_per_token(cfg, 4096, moe=False)
              + n_moe * layer_flops_per_token(cfg, 4096, moe=True))
    assert flops_per_token(cfg, 4096) == layers + 6 * cfg.dim * cfg.vocab_size


def test_mfu_is_achieved_over_peak():
    # 1e9 FLOP/token at 400k tok/s on 8 GPUs of 1e14 FLOP/s: 4e14 / 8e14
    assert mfu(1e9, 4e5, 8, 1e14) == pytest.approx(0.5)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA GH200 480GB", 989e12), ("NVIDIA B200", 2.25e15), ("NVIDIA GB200", 2.5e15),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", 165.2e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA L4", 121e12), ("NVIDIA H20", 148e12),
])
def test_peak_flops_by_device_name(name, peak):
    assert peak_flops(name) == peak


def test_unknown_device_has_no_peak():
    assert peak_flops("cpu") is None
    assert peak_flops("Tesla K80") is None


def test_expert_load_stats_on_a_hand_made_load():
    tokens_per_expert = torch.tensor([[4, 4, 4, 4], [10, 2, 2, 2]])  # balanced; one expert at 2.5x mean
    biases = [torch.tensor([0.0, 0.0, 0.0, 0.0]), torch.tensor([-0.003, 0.001, 0.001, 0.001])]
    stats = expert_load_stats(tokens_per_expert, biases)
    assert stats["moe/layer0/load_max_over_mean"] == 1.0
    assert stats["moe/layer1/load_max_over_mean"] == pytest.approx(2.5)
    assert stats["moe/load_max_over_mean"] == pytest.approx(2.5)
    assert stats["moe/layer1/bias_min"] == pytest.approx(-0.003)
    assert stats["moe/layer1/bias_max"] == pytest.approx(0.001)
    assert stats["moe/layer1/bias_std"] == pytest.approx(3e-6 ** 0.5)  # mean 0, variance (9 + 3·1)e-6 / 4
    assert stats["moe/layer0/bias_std"] == 0.0
    assert expert_load_stats(torch.stack(biases), torch.stack(biases)).keys() == stats.keys()  # [L, E] biases
    assert expert_load_stats(torch.zeros(0, 0), []) == {}  # a model without MoE layers


def test_log_appends_parseable_jsonl_lines(tmp_path):
    logger = MetricsLogger(str(tmp_path), {}, total_steps=100)
    logger.log(10, {"loss": 5.5, "lr": 3e-4, "moe/load_max_over_mean": 1.7})
    logger.log(20, {"loss": torch.tensor(5.25)})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stamps = [(row.pop("time"), row.pop("elapsed_s")) for row in rows]
    assert rows == [{"step": 10, "loss": 5.5, "lr": 3e-4, "moe/load_max_over_mean": 1.7}, {"step": 20, "loss": 5.25}]
    assert all(abs(wall - time.time()) < 60 and 0 <= elapsed < 60 for wall, elapsed in stamps)
    assert stamps[0][1] <= stamps[1][1]


def test_a_resumed_run_rewinds_metrics_jsonl_and_continues_its_elapsed_time(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "elapsed_s": 100.0 * s}) + "\n"
                                                    for s in range(1, 6))  # a run that crashed after step 5,
                                            + '{"step": 6, "loss": 1.')  # killed while writing step 6's row
    logger = MetricsLogger(str(tmp_path), {}, total_steps=10, start_step=2)  # resumed from step-2
    logger.log(3, {"loss": 0.5})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert 200 <= rows[-1]["elapsed_s"] < 260


def test_a_resume_skips_bad_metrics_lines_with_one_warning(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 1.0}\nnot json\n\xff\xfe garbage\n[1, 2]\n'
                                             b'{"loss": 2.0}\n{"step": 2, "loss": 1.0}\n{"step": 3, "loss": 1.0}\n')
    logger = MetricsLogger(str(tmp_path), {}, total_steps=10, start_step=2)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert capsys.readouterr().err == f"warning: {tmp_path / 'metrics.jsonl'}: skipped 4 unreadable line(s)\n"


def test_eta_is_on_the_first_line_then_the_average_rate_since_it(tmp_path, capsys, monkeypatch):
    """The first line's rate is its own steps' since the logger started (warm-up included), the later lines' the
    average since the first line, which leaves the warm-up out."""
    clock = iter([0.0, 5.0, 10.0, 11.0, 100.0])  # the logger's start, then steps 10, 20, 30 and 40
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    logger = MetricsLogger(str(tmp_path), {}, total_steps=100)
    for step in (10, 20, 30, 40):
        logger.log(step, {"loss": 1.0})
    etas = [line.split("eta ")[-1] for line in capsys.readouterr().out.splitlines()]
    # 0.5 s a step over the first 10; since step 10: 5 s, 6 s and 95 s, i.e. 0.5, 0.3 and 3.17 s a step
    assert etas == ["0:00:45", "0:00:40", "0:00:21", "0:03:10"]


def test_a_resumed_run_has_an_eta_from_its_first_step(tmp_path, capsys, monkeypatch):
    clock = iter([0.0, 3.0])  # the logger's start, then step 501, the first this run trains
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    MetricsLogger(str(tmp_path), {}, total_steps=1000, start_step=500).log(501, {"loss": 1.0})
    assert capsys.readouterr().out.endswith(" | eta 0:24:57\n")  # 499 steps left at 3 s


def test_divergence_guard_stops_on_a_spike_against_the_running_mean_or_a_nan():
    guard = DivergenceGuard(loss_factor=3, grad_norm_factor=10, warmup=3)
    healthy = [{"loss": 8.0 - 0.1 * s, "grad_norm": 1.0 + 0.5 * (s % 2)} for s in range(6)]
    assert all(guard.check(step, values) is None for step, values in enumerate(healthy))
    assert guard.check(6, {"loss": 7.5, "grad_norm": 9.0}) is None  # an early-training gnorm blip is no stop
    mean = guard.means["grad_norm"]
    assert guard.check(7, {"loss": 7.5, "grad_norm": 30.0}) == (
        f"grad_norm spiked to 30 at step 7, over train.grad_norm_spike_factor=10 × its running mean {mean:.4g}")
    loss_mean = guard.means["loss"]
    assert guard.check(7, {"loss": 30.0, "grad_norm": 1.0}) == (
        f"loss spiked to 30 at step 7, over train.loss_spike_factor=3 × its running mean {loss_mean:.4g}")
    assert guard.check(7, {"loss": 7.5, "grad_norm": 1.0, "mtp_loss": float("nan")}) == "mtp_loss is nan at step 7"
    off = DivergenceGuard(loss_factor=0, grad_norm_factor=0, warmup=0)
    assert off.check(1, {"loss": 1.0, "grad_norm": 1.0}) is None
    assert off.check(2, {"loss": 1e9, "grad_norm": 1e9}) is None
    early = DivergenceGuard(loss_factor=3, grad_norm_factor=10, warmup=3)  # not judged before `warmup` steps
    assert early.check(1, {"loss": 8.0, "grad_norm": 1.0}) is None
    assert early.check(2, {"loss": 800.0, "grad_norm": 1.0}) is None


def test_console_line_shows_the_logged_values(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), {}, total_steps=1000)
    full = {"loss": 5.1234, "mtp_loss": 5.4, "balance_loss": 1.02, "lr": 3e-4, "grad_norm": 0.912,
            "tokens_per_s": 12345.0, "mfu": 0.312, "memory/peak_allocated_gib": 42.13}
    logger.log(110, full)
    logger.log(120, full)
    logger.close()
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("step 110/1000 | loss 5.123 mtp 5.400 bal 1.02 | lr 3.0e-04 | gnorm 0.91 | 12.3k tok/s"
                            " | mfu 31.2% | mem 42.1 GiB | eta 0:")
    assert second.startswith("step 120/1000 | loss 5.123") and " | eta 0:" in second


def test_console_line_shows_only_keys_present(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), {})
    logger.log(3, {"loss": 2.0, "tokens_per_s": 950.0, "moe/layer0/bias_min": 0.0})
    assert capsys.readouterr().out.strip() == "step 3 | loss 2.000 | 950 tok/s"


def test_disabled_logger_writes_nothing(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path / "run"), {}, enabled=False, use_wandb=True)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists() and capsys.readouterr().out == ""


def test_missing_wandb_is_a_clear_error_only_when_enabled(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    MetricsLogger(str(tmp_path), {}).close()
    with pytest.raises(UserError, match="pip install wandb"):
        MetricsLogger(str(tmp_path), {}, use_wandb=True)


@pytest.mark.slow
def test_metrics_module_does_not_import_wandb():
    code = "import sys; import dsv3.metrics; assert 'wandb' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_wandb_goes_offline_without_an_api_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    assert _wandb_mode() == "offline"
    netrc_file = tmp_path / ".netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    netrc_file.chmod(0o600)
    assert _wandb_mode() is None
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")  # a self-hosted server: its own login
    assert _wandb_mode() == "offline"
    netrc_file.write_text("machine wandb.example.org\n  login user\n  password abc123\n")
    assert _wandb_mode() is None
    monkeypatch.delenv("WANDB_BASE_URL")
    netrc_file.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "abc123")
    assert _wandb_mode() is None
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the user's choice wins
    assert _wandb_mode() is None


def read_wandb_history(path: str) -> dict[int, dict[str, float]]:
    """History rows {step: {key: value}} from an offline run's .wandb file: a LevelDB-style log (7-byte file
    header, 32 KiB blocks, records = crc32 + uint16 length + type byte) of wandb `Record` protobufs.
    Read by hand because wandb >= 0.2x no longer ships a Python reader for it."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    rows, pos, block, chunks = {}, 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                rows[items["_step"]] = items
    return rows


@pytest.mark.slow
def test_offline_wandb_run_records_the_logged_metrics(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    logger = MetricsLogger(str(run_dir), {"train": {"lr": 3e-4}}, use_wandb=True, run_name="test")
    logger.log(5, {"loss": 4.25, "moe/layer0/load_max_over_mean": 1.5})
    logger.log(10, {"loss": 3.75})
    logger.close()
    # finish() can return before wandb's service process has written the whole file (a run that stops flushes it at
    # exit); this process lives on, so wait for the service as exit would
    wandb.teardown()
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = read_wandb_history(path)
    assert history[5]["loss"] == 4.25 and history[5]["moe/layer0/load_max_over_mean"] == 1.5
    assert history[10]["loss"] == 3.75
