"""checkpoint.async_save: the step copies the state to host memory, a thread writes it, publishes it by the same
rename and never overlaps the next save; losses and checkpoints are those of the blocking save, and a kill -9 during
the background write leaves the previous checkpoint as the one --resume takes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.utils._pytree as pytree
from conftest import free_port, leave_process_group, read_metrics, torchrun_env

import train
from dsv3 import checkpoint

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--config", str(ROOT / "configs" / "debug.toml"), f"--data.path={ROOT / 'data' / 'stdlib'}", "--log.every=1",
        "--model.n_layers=2", "--train.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2",
        "--train.val_every=0", "--checkpoint.export=false", "--train.steps=6", "--checkpoint.every=2",
        "--checkpoint.keep=2"]


def _crcs(path: Path) -> dict[str, int]:
    """The checksums of the tensors and RNG streams (.metadata and train.json name the run's own directory)."""
    files = json.loads((path / checkpoint.MANIFEST).read_text())["files"]
    return {name: entry["crc32"] for name, entry in files.items() if name.endswith((".distcp", ".pt"))}


@pytest.mark.slow
def test_async_saves_give_the_losses_of_no_saves_and_the_blocking_saves_checkpoints(data, tmp_path):
    unsaved = read_metrics_of(tmp_path / "unsaved", "--checkpoint.every=0")
    blocking = read_metrics_of(tmp_path / "blocking")
    background = read_metrics_of(tmp_path / "background", "--checkpoint.async_save=true")
    losses = [row["loss"] for row in unsaved.values()]
    assert len(losses) == 6 and [row["loss"] for row in background.values()] == losses
    assert [row["loss"] for row in blocking.values()] == losses
    for step in (4, 6):
        assert _crcs(tmp_path / "background" / f"step-{step}") == _crcs(tmp_path / "blocking" / f"step-{step}")
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "background")] == ["step-4", "step-6"]
    resumed = {}
    for name in ("blocking", "background"):
        train.main([*ARGS, f"--checkpoint.dir={tmp_path / name}", "--train.steps=8", "--resume",
                    "--checkpoint.async_save=true"])
        resumed[name] = [read_metrics(tmp_path / name)[step]["loss"] for step in (7, 8)]
    assert resumed["background"] == resumed["blocking"]


def read_metrics_of(run_dir: Path, *overrides: str) -> dict[int, dict]:
    train.main([*ARGS, f"--checkpoint.dir={run_dir}", *overrides])
    return read_metrics(run_dir)


def _save_linear(run_dir: Path, step: int, background: bool) -> Path:
    torch.manual_seed(step)
    model = torch.nn.Linear(64, 64)
    return checkpoint.save(run_dir, step, model, torch.optim.AdamW(model.parameters()), {"step": step}, keep=2,
                           background=background)


def test_a_background_save_waits_for_the_one_before_and_is_confirmed_once_published(tmp_path):
    _save_linear(tmp_path, 1, background=True)
    checkpoint.confirm(tmp_path, 1, keep=2)  # its next step was healthy while it was still being written
    _save_linear(tmp_path, 2, background=True)  # waits for step-1 first: never two in flight
    assert checkpoint.verify(tmp_path / "step-1") is None and checkpoint.is_confirmed(tmp_path / "step-1")
    checkpoint.wait_for_save()
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-1", "step-2"]
    assert checkpoint.verify(tmp_path / "step-2") is None and not checkpoint.is_confirmed(tmp_path / "step-2")


def test_a_background_save_holds_the_weights_of_its_step_not_those_the_next_step_writes(tmp_path):
    """The copy to host memory is complete when save returns: the optimizer step after it may change the weights."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    checkpoint.save(tmp_path, 1, model, torch.optim.AdamW(model.parameters()), {"step": 1}, keep=2, background=True)
    with torch.no_grad():
        for param in model.parameters():  # in place, as the next optimizer step does
            param.add_(1.0)
    checkpoint.wait_for_save()
    checkpoint.load_model(tmp_path / "step-1", model)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in saved.items())


def test_background_saves_copy_into_the_host_buffers_of_the_first(tmp_path, monkeypatch):
    """A run saves many times: the host buffers (a copy of the rank's whole state) are allocated once."""
    staged, stage = [], checkpoint._HostCopy.stage

    def recording(self, state_dict):
        staged.append(stage(self, state_dict))  # kept: freed buffers could be allocated again at the same address
        return staged[-1]

    monkeypatch.setattr(checkpoint._HostCopy, "stage", recording)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model, optimizer, {"step": step}, keep=2, background=True)
    checkpoint.wait_for_save()
    buffers = [sorted(t.data_ptr() for t in state["model"].values()) for state in staged]
    assert buffers[0] == buffers[1] == buffers[2]


def test_host_buffers_allocated_ahead_take_the_first_save_and_its_weights(tmp_path, monkeypatch):
    """train.py allocates the host buffers in a thread after its first step: the first save copies into them, and
    holds the weights of its own step, not those of the allocation's step."""
    staged, stage = [], checkpoint.StateDictStager.stage

    def recording(self, state_dict, **kwargs):
        staged.append(stage(self, state_dict, **kwargs))
        return staged[-1]

    monkeypatch.setattr(checkpoint.StateDictStager, "stage", recording)
    monkeypatch.setattr(checkpoint, "_staging", None)  # buffers of this model's only
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()  # the optimizer's state exists
    checkpoint.prepare_background_save(model, optimizer)
    with torch.no_grad():
        model.weight.add_(1.0)  # a step while the thread allocates
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    checkpoint._staging.preparing.join()
    allocated = {buffer.data_ptr() for buffer in checkpoint._staging.copier._cached_storage_mapping.values()}
    checkpoint.save(tmp_path, 2, model, optimizer, {"step": 2}, keep=2, background=True)
    checkpoint.wait_for_save()
    assert len(staged) == 1, "the allocation ahead copies nothing"
    first = {t.data_ptr() for t in pytree.tree_leaves(staged[0]) if isinstance(t, torch.Tensor)}
    assert first == allocated
    checkpoint.load_model(tmp_path / "step-2", model)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in saved.items())


def test_a_failed_allocation_ahead_fails_the_first_save(tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes")

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    monkeypatch.setattr(torch, "zeros", out_of_memory)
    checkpoint.prepare_background_save(model, optimizer)
    checkpoint._staging.preparing.join()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        checkpoint.save(tmp_path, 1, model, optimizer, {"step": 1}, keep=2, background=True)
    assert not (tmp_path / "step-1.tmp").exists()


def test_the_background_write_never_waits_for_the_device(tmp_path, monkeypatch):
    """The staged tensors are host memory: DCP's default loader would copy them again and, from the writer thread,
    sync the training's stream every 10 MB (on a CPU build, any use of CUDA fails)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _save_linear(tmp_path, 1, background=True)
    checkpoint.wait_for_save()
    assert checkpoint.verify(tmp_path / "step-1") is None


_SLOW_SAVE = """
import sys, time
from pathlib import Path
sys.path.insert(0, "."); sys.path.insert(0, "tests")
import train
from torch.distributed.checkpoint import FileSystemWriter
real_write = FileSystemWriter.write_data
def slow_write(self, plan, planner):
    if str(self.path).endswith("step-4.tmp"):  # the background write of step 4, the training goes on
        Path(sys.argv[1]).write_text("writing")
        time.sleep(600)
    return real_write(self, plan, planner)
FileSystemWriter.write_data = slow_write
train.main(sys.argv[2:])
"""


@pytest.mark.slow
def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint_for_resume(data, tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "writing"
    args = [*ARGS, f"--checkpoint.dir={run_dir}", "--checkpoint.async_save=true"]
    process = subprocess.Popen([sys.executable, "-c", _SLOW_SAVE, str(marker), *args], cwd=ROOT)
    deadline = time.monotonic() + 300
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), "the background write of step 4 never started"
    time.sleep(1)  # the training thread has gone on to step 5 meanwhile
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert (run_dir / "step-4.tmp").is_dir() and checkpoint.resume_from(run_dir) == run_dir / "step-2"
    train.main([*args, "--resume"])
    assert [p.name for p in checkpoint.checkpoints(run_dir)] == ["step-4", "step-6"]
    assert sorted(read_metrics(run_dir)) == list(range(1, 7))


def _rank_main(rank: int, world: int, port: int, argv: list[str]) -> None:
    torchrun_env(rank, world, port)
    train.main(argv)
    leave_process_group()


@pytest.mark.slow
def test_two_ranks_save_in_the_background_as_they_do_blocking(data, tmp_path):
    """FSDP's sharded state staged by DCP on every rank; the write's collectives on a gloo group of their own."""
    for name, overrides in (("blocking", []), ("background", ["--checkpoint.async_save=true"])):
        argv = [*ARGS, f"--checkpoint.dir={tmp_path / name}", *overrides]
        mp.spawn(_rank_main, args=(2, free_port(), argv), nprocs=2)
    losses = {name: [row["loss"] for row in read_metrics(tmp_path / name).values()]
              for name in ("blocking", "background")}
    assert losses["background"] == losses["blocking"]
    for step in (4, 6):
        saved = tmp_path / "background" / f"step-{step}"
        assert checkpoint.verify(saved) is None and _crcs(saved) == _crcs(tmp_path / "blocking" / f"step-{step}")


@pytest.mark.slow
def test_the_save_benchmark_trains_through_each_write_and_reports_every_stall(data, tmp_path):
    """scripts/bench_save.py, the measurement of docs/training.md#checkpoints-that-do-not-stop-training, on CPU."""
    ended = subprocess.run([sys.executable, "scripts/bench_save.py", "--config", "configs/debug.toml",
                            "--model.n_layers=2", "--train.seq_len=32", "--train.global_batch=4",
                            "--train.micro_batch=2", "--warmup", "1", "--quiet-steps", "2", "--saves", "2",
                            "--dir", str(tmp_path / "bs")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ended.returncode == 0, ended.stderr
    report = json.loads(ended.stdout.splitlines()[-1])
    assert report["blocking_stall_s"] > 0 and report["checkpoint_gb"] > 0 and len(report["background"]) == 2
    for save in report["background"]:
        assert save["call_s"] > 0 and save["write_s"] > 0 and save["steps"] >= 0
        assert save["stall_s"] == pytest.approx(save["call_s"] + save["steps_excess_s"] + save["publish_s"], abs=2e-3)
    assert not (tmp_path / "bs").exists()


@pytest.mark.gpu
def test_a_background_save_on_cuda_holds_its_steps_weights(tmp_path, monkeypatch):
    """On CUDA the host buffers are allocated ahead, with no copy from the device; the save still holds the weights
    of its step, not those of the allocation's step or of the step after it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(checkpoint, "_staging", None)  # buffers of this model's only
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    optimizer.step()
    checkpoint.prepare_background_save(model, optimizer)
    with torch.no_grad():
        model.weight.add_(1.0)
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    checkpoint.save(tmp_path, 1, model, optimizer, {"step": 1}, keep=2, background=True)
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step, while the write runs
    checkpoint.wait_for_save()
    checkpoint.load_model(tmp_path / "step-1", model)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in saved.items())
