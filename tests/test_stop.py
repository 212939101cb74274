"""SIGTERM and SIGINT become a stop request that every rank agrees on; the command that resumes the run.
train.py's use of them, end to end (save, exit code, resume), is in test_train.py."""

import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port, leave_process_group, torchrun_env

from dsv3.stop import StopSignal, resume_command


def test_the_first_signal_is_kept_and_later_ones_change_nothing():
    # Python's own Ctrl-C handler, as in a terminal (a shell's background job starts with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stop = StopSignal()
    assert stop.agreed() is None
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: no KeyboardInterrupt while the stop is armed
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.agreed() == signal.SIGINT
    stop.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def _rank(rank: int, world: int, port: int, signalled_at: int, out: Path) -> None:
    torchrun_env(rank, world, port)
    dist.init_process_group("gloo")
    stopped_at = []
    for group in ("default", "gloo beside nccl"):
        if group == "gloo beside nccl":  # as under NCCL: the flag travels over a gloo group of its own
            dist.get_backend = lambda *args: "nccl"
        stop = StopSignal()
        for step in range(1, 10):
            if rank == 1 and step == signalled_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if stop.agreed():
                break
        stop.restore()
        stopped_at.append(str(step))
    (out / f"rank-{rank}").write_text(" ".join(stopped_at))
    leave_process_group()


@pytest.mark.slow
def test_a_signal_that_reaches_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    mp.spawn(_rank, args=(2, free_port(), 4, tmp_path), nprocs=2)
    assert [(tmp_path / f"rank-{rank}").read_text() for rank in range(2)] == ["4 4", "4 4"]


@pytest.mark.parametrize("env,command", [
    ({}, "python train.py --config configs/debug.toml '--train.precision_skip=[\"attn\"]' --resume"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     "torchrun --nproc_per_node=4 train.py --config configs/debug.toml '--train.precision_skip=[\"attn\"]' --resume"),
], ids=["python", "torchrun"])
def test_the_resume_command_is_this_runs_own_with_resume(monkeypatch, env, command):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert resume_command(["--config", "configs/debug.toml", '--train.precision_skip=["attn"]']) == command
    assert resume_command(["--config", "configs/debug.toml", '--train.precision_skip=["attn"]', "--resume"]) == command
