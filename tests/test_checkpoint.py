"""Resharded resume on real gloo process groups: a checkpoint written by 4 ranks (FSDP2 + expert
parallelism over 2) resumes at world 2 and world 1 and continues the 4-rank run loss for loss; RNG streams
come back at the same world size."""

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import train
from dsv3 import checkpoint
from conftest import free_port, torchrun_env, read_metrics

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "stdlib"
STEPS, SAVED_AT = 6, 3
# 2 layers (dense + MoE) + MTP; 8 sequences of 32 tokens per step: 1 micro-batch of 2 per rank at world 4,
# 2 at world 2, 4 at world 1. Warmup (1-2) → constant (3) → cosine (4-6): the resumed half decays.
ARGS = ["--config", str(ROOT / "configs" / "debug.toml"), f"--data.path={DATA}", "--model.n_layers=2",
        "--train.seq_len=32", "--train.global_batch=8", "--train.micro_batch=2", f"--train.steps={STEPS}",
        "--train.warmup_steps=2", "--train.decay_start=0.5", "--train.val_every=0", "--log.every=1",
        f"--checkpoint.every={SAVED_AT}", "--checkpoint.export=false"]

def _rank_main(rank: int, world: int, port: int, argv: list[str]) -> None:
    """One rank of `torchrun --nproc_per_node=world train.py argv`."""
    torchrun_env(rank, world, port)
    train.main(argv)


def launch(world: int, argv: list[str]) -> None:
    if world == 1:  # plainly, in this process: the single-device path, no process group
        assert "WORLD_SIZE" not in os.environ
        train.main(argv)
    else:
        mp.spawn(_rank_main, args=(world, free_port(), argv), nprocs=world)


@pytest.fixture(scope="module")
def world4(data, tmp_path_factory) -> Path:
    """The uninterrupted reference: world 4, ep 2, checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("world4")
    launch(4, [*ARGS, "--parallel.ep=2", f"--checkpoint.dir={run_dir}"])
    assert [p.name for p in checkpoint.checkpoints(run_dir)] == [f"step-{SAVED_AT}", f"step-{STEPS}"]
    return run_dir


@pytest.mark.parametrize("world,ep", [(2, 2), (2, 1), (1, 1)], ids=["world2-ep2", "world2-ep1", "world1"])
def test_world4_checkpoint_resumes_at_another_world_size(world4, tmp_path, world, ep):
    shutil.copytree(world4 / f"step-{SAVED_AT}", tmp_path / f"step-{SAVED_AT}")
    launch(world, [*ARGS, f"--parallel.ep={ep}", f"--checkpoint.dir={tmp_path}", "--resume"])

    reference, resumed = read_metrics(world4), read_metrics(tmp_path)
    assert sorted(resumed) == list(range(SAVED_AT + 1, STEPS + 1))
    for step in resumed:
        assert resumed[step]["lr"] == reference[step]["lr"]
        assert resumed[step]["global_batch"] == reference[step]["global_batch"]
        # sharded reductions sum in another order: equal up to float32 rounding (measured: losses ≤ 1e-7
        # apart; the grad norm, a root of sums with cancellation, ≤ 1e-5 relative by step 6)
        for key in ("loss", "mtp_loss", "balance_loss"):
            assert resumed[step][key] == pytest.approx(reference[step][key], rel=1e-5, abs=1e-5), (step, key)
        assert resumed[step]["grad_norm"] == pytest.approx(reference[step]["grad_norm"], rel=1e-4), step
        # the expert biases came back too (they move by ±γ per step, from the same counts)
        for key in (k for k in reference[step] if k.startswith("moe/")):
            assert resumed[step][key] == pytest.approx(reference[step][key], rel=1e-5, abs=1e-6), (step, key)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == [f"step-{SAVED_AT}", f"step-{STEPS}"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])])
def test_resume_restores_the_rng_stream_at_the_same_world_size(tmp_path, device):
    model = torch.nn.Linear(4, 4, device=device)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.manual_seed(3)  # seeds the CUDA generator too
    torch.rand(7, device=device)
    saved = checkpoint.save(tmp_path, 1, model, optimizer, {"step": 1}, keep=1)
    expected = torch.rand(5, device=device)

    torch.manual_seed(4)  # a restarted process seeds afresh, then resumes
    checkpoint.load(saved, model, optimizer, {"step": 0})
    assert torch.equal(torch.rand(5, device=device), expected)

    shutil.copy(saved / "rng-0.pt", saved / "rng-1.pt")  # as if written by 2 ranks: a resharded resume
    torch.manual_seed(4)
    fresh = torch.rand(5, device=device)
    torch.manual_seed(4)
    checkpoint.load(saved, model, optimizer, {"step": 0})
    assert torch.equal(torch.rand(5, device=device), fresh)  # the fresh stream is kept
