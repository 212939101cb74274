"""train.deterministic: two fresh runs of one seed, config and world size give the same losses and weights bit for
bit on GPUs (the GPU tests); on CPU, that the flag reaches the run and what it cannot promise is refused."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, load_export, read_metrics

import train
from dsv3.config import UserError, load_config
from dsv3.determinism import DETERMINISTIC_ENV

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "debug.toml")
DATA = ROOT / "data" / "stdlib"
TINY = ["--model.n_layers=2", "--train.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2",
        "--train.val_every=0", "--checkpoint.export=false", "--train.steps=1"]


@pytest.fixture
def process_wide_modes(monkeypatch):
    """make_deterministic sets the process's modes for good (train.py runs one training per process): give them back."""
    for name in DETERMINISTIC_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    from torch._inductor import config as inductor
    inductor.deterministic = False


def test_the_flag_trains_under_torchs_deterministic_mode_and_sets_cublas_and_nccl(data, tmp_path, monkeypatch,
                                                                                 process_wide_modes):
    modes = []
    real_step = train.train_step

    def recording_step(*args, **kwargs):
        modes.append(torch.are_deterministic_algorithms_enabled())
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", recording_step)
    common = ["--config", CONFIG, f"--data.path={DATA}", *TINY]
    train.main([*common, f"--checkpoint.dir={tmp_path / 'default'}"])
    assert modes == [False] and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    train.main([*common, f"--checkpoint.dir={tmp_path / 'deterministic'}", "--train.deterministic=true"])
    assert modes == [False, True]
    assert {name: os.environ.get(name) for name in DETERMINISTIC_ENV} == DETERMINISTIC_ENV
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def test_deepep_is_refused_in_one_line_at_start_up():
    with pytest.raises(UserError, match=r"^train.deterministic=true is not verified with parallel.ep_backend=deepep.*"
                                        r"use --parallel.ep_backend=all_to_all$"):
        load_config(CONFIG, ["--train.deterministic=true", "--parallel.ep_backend=deepep"])
    assert load_config(CONFIG, ["--train.deterministic=true"]).train.deterministic


def fresh_gpu_run(run_dir: Path, world: int) -> None:
    """The debug model for 30 steps (validation at 15 and 30) in a process of its own, one per GPU at world > 1; at
    world 4 with expert parallelism over all four (all_to_all), as the many-GPU configs run."""
    launcher = [] if world == 1 else ["-m", "torch.distributed.run", f"--master_port={free_port()}",
                                      f"--nproc_per_node={world}"]
    args = ["--config", CONFIG, f"--data.path={DATA}", f"--checkpoint.dir={run_dir}", "--train.deterministic=true",
            "--train.steps=30", "--train.val_every=15", "--log.every=1", "--checkpoint.every=0",
            f"--train.micro_batch={min(8, 16 // world)}", f"--parallel.ep={4 if world == 4 else 1}"]
    done = subprocess.run([sys.executable, *launcher, str(ROOT / "train.py"), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4], ids=["1-gpu", "2-gpus", "4-gpus"])
def test_two_fresh_gpu_runs_repeat_every_loss_and_weight_bit_for_bit(data, tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    for name in ("first", "second"):
        fresh_gpu_run(tmp_path / name, world)
    runs = [read_metrics(tmp_path / name) for name in ("first", "second")]
    values = ("loss", "mtp_loss", "balance_loss", "grad_norm", "val_loss")
    logged = [{step: {k: row[k] for k in values if k in row} for step, row in rows.items()} for rows in runs]
    assert sorted(logged[0]) == list(range(1, 31)) and "val_loss" in logged[0][30]
    assert logged[0] == logged[1]  # floats from JSON: equal means bit-equal
    weights = [load_export(tmp_path / name / "export") for name in ("first", "second")]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name
