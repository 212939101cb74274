"""Resharded resume on real gloo process groups: a checkpoint written by 4 ranks (FSDP2 + expert
parallelism over 2) resumes at world 2 and world 1 and continues the 4-rank run loss for loss; RNG streams
come back at the same world size. Then the run directory's safeguards: manifests, verification and fallback,
confirmation-aware rotation, a full disk, and the one-run-per-directory lock."""

import errno
import io
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port, leave_process_group, load_export, read_metrics, torchrun_env
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import train
from dsv3 import checkpoint, optim, rundir
from dsv3.config import FLAVORS, ModelConfig, TrainConfig, UserError
from dsv3.export import load_weights
from dsv3.model import Transformer

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
    leave_process_group()  # train.main has left the group; exit before finalization


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
@pytest.mark.slow
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
    checkpoint.load(saved, model, optimizer)
    assert torch.equal(torch.rand(5, device=device), expected)

    shutil.copy(saved / "rng-0.pt", saved / "rng-1.pt")  # as if written by 2 ranks: a resharded resume
    torch.manual_seed(4)
    fresh = torch.rand(5, device=device)
    torch.manual_seed(4)
    checkpoint.load(saved, model, optimizer)
    assert torch.equal(torch.rand(5, device=device), fresh)  # the fresh stream is kept


def test_resume_keeps_its_own_betas_and_weight_decay_and_the_saved_moments(tmp_path):
    """Lowering β2 or the weight decay after a loss spike, then resuming, must take effect."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95), weight_decay=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    saved = checkpoint.save(tmp_path, 1, model, optimizer, {"step": 1}, keep=1)
    moments = optimizer.state[model.weight]["exp_avg_sq"].clone()
    model.zero_grad(set_to_none=True)  # as a restarted process has none
    resumed = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.5), weight_decay=0.0)
    assert checkpoint.read_train_state(saved) == {"step": 1}
    checkpoint.load(saved, model, resumed)
    assert (resumed.param_groups[0]["betas"], resumed.param_groups[0]["weight_decay"]) == ((0.9, 0.5), 0.0)
    assert torch.equal(resumed.state[model.weight]["exp_avg_sq"], moments)


@pytest.mark.slow
def test_export_written_by_two_ranks_holds_the_full_model(tmp_path):
    """Each rank writes its shards and assembles its share of the files: full tensors, one file per block, equal
    to the last checkpoint; readable by plain safetensors and by export.load_weights; nothing left behind."""
    launch(2, [*ARGS, "--parallel.ep=2", "--train.steps=2", "--checkpoint.every=2", "--checkpoint.export=true",
               f"--checkpoint.dir={tmp_path}"])
    export = tmp_path / "export"
    assert not (tmp_path / "export.tmp").exists() and not (export / "sharded").exists()
    cfg = ModelConfig(**json.loads((export / "config.json").read_text()))
    files = sorted(p.name for p in export.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]  # rest, 2 layers, MTP
    weight_map = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == files
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in export.iterdir()} == {oct(0o666 & ~umask)}

    trained = Transformer(cfg)
    checkpoint.load(tmp_path / "step-2", trained,
                    train.build_optimizer(trained, TrainConfig(), torch.device("cpu")))
    exported = Transformer(cfg)
    exported.load_state_dict(load_export(export), strict=True)  # full shapes, every name
    imported = Transformer(cfg)
    load_weights(export, imported)
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(imported.state_dict()[name], value, rtol=0, atol=0, msg=name)
# --- the run directory: manifest and verification, confirmation and rotation, the lock ------------------------


def _save_linear(run_dir: Path, step: int, keep: int = 0, checksums: bool = True) -> Path:
    torch.manual_seed(step)
    model = torch.nn.Linear(64, 64)
    return checkpoint.save(run_dir, step, model, torch.optim.AdamW(model.parameters()), {"step": step}, keep,
                           checksums)


def test_a_checkpoint_is_on_disk_before_an_older_one_is_deleted(tmp_path, monkeypatch):
    """A node crash right after the rename must not leave the new checkpoint's files in the page cache only, with
    the older one already gone: our files, the step directory and the run directory are synced before pruning."""
    _save_linear(tmp_path, 1)
    checkpoint.confirm(tmp_path, 1, keep=1)
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                            real_fsync(fd)))
    # rotation takes the old checkpoint out by a rename, then deletes it
    monkeypatch.setattr(checkpoint.os, "replace", lambda src, dst: (events.append(f"rename {src}"),
                                                                     real_replace(src, dst)))
    _save_linear(tmp_path, 2)
    checkpoint.confirm(tmp_path, 2, keep=1)
    deleted = events.index(f"rename {tmp_path / 'step-1'}")
    synced = {Path(e).name for e in events[:deleted] if not e.startswith("rename")}
    assert {"manifest.tmp", "rng-0.pt", "step-2.tmp", tmp_path.name} <= synced, synced


def _largest_shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_every_checkpoint_carries_a_manifest_of_its_files(tmp_path):
    saved = _save_linear(tmp_path, 1)
    manifest = json.loads((saved / checkpoint.MANIFEST).read_text())["files"]
    on_disk = {p.name for p in saved.iterdir()} - {checkpoint.MANIFEST, checkpoint.UNCONFIRMED}
    assert set(manifest) == on_disk and ".metadata" in on_disk and "rng-0.pt" in on_disk
    for name, entry in manifest.items():
        assert entry["size"] == (saved / name).stat().st_size
        assert entry["crc32"] == zlib.crc32((saved / name).read_bytes())
    assert checkpoint.verify(saved) is None


def test_a_truncated_shard_is_named_and_resume_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    _save_linear(tmp_path, 1)
    shard = _largest_shard(_save_linear(tmp_path, 2))
    shard.write_bytes(shard.read_bytes()[:100])

    assert checkpoint.resume_from(tmp_path) == tmp_path / "step-1"
    warning = capsys.readouterr().err
    assert f"warning: checkpoint {tmp_path / 'step-2'} is damaged: {shard} has 100 bytes" in warning
    assert (tmp_path / "step-2.corrupt").is_dir()  # kept for inspection, no longer a checkpoint
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-1"]


def test_overwritten_bytes_are_caught_by_the_checksum_unless_it_is_switched_off(tmp_path):
    saved = _save_linear(tmp_path, 1)
    shard = _largest_shard(saved)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 3  # inside the weight's values, not the zip records around them
    data[middle:middle + 64] = bytes(64)  # other finite values (zeros), same size
    shard.write_bytes(bytes(data))
    assert checkpoint.verify(saved, checksums=False) is None  # sizes only: the cheap check for huge runs
    assert checkpoint.verify(saved) == f"{shard} does not match its checksum (its bytes were altered)"
    with pytest.raises(UserError, match=r"no checkpoint in checkpoint.dir=.* is intact"):
        checkpoint.resume_from(tmp_path)


class _Payload:
    """What an attacker plants in a checkpoint: unpickling it runs a shell command (here one that leaves a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _reseal(path: Path) -> None:
    """Rewrite the manifest to match the files, as whoever can write the checkpoint can."""
    files = {p.name: {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())} for p in path.iterdir()
             if p.name not in (checkpoint.MANIFEST, checkpoint.UNCONFIRMED)}
    (path / checkpoint.MANIFEST).write_text(json.dumps({"files": files}))


@pytest.mark.parametrize("planted_in", [".metadata", "distcp-entry", "distcp-tensor-entry", "rng"])
def test_a_checkpoint_carrying_code_is_refused_without_running_it_and_resume_falls_back(tmp_path, capsys,
                                                                                        planted_in):
    _save_linear(tmp_path, 1)
    saved, marker = _save_linear(tmp_path, 2), tmp_path / "payload-ran"
    metadata = pickle.loads((saved / ".metadata").read_bytes())
    if planted_in == ".metadata":
        metadata.planner_data = _Payload(marker)
    elif planted_in == "rng":
        torch.save(_Payload(marker), saved / "rng-0.pt")
    else:  # one non-tensor entry (an optimizer hyper-parameter) or one tensor replaced by a pickle that runs code
        tensor = planted_in == "distcp-tensor-entry"
        index = next(i for i in metadata.storage_data
                     if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata) != tensor)
        where = metadata.storage_data[index]
        payload = io.BytesIO()
        torch.save(_Payload(marker), payload)
        with open(saved / where.relative_path, "ab") as shard:
            offset = shard.tell()
            shard.write(payload.getvalue())
        metadata.storage_data[index] = replace(where, offset=offset, length=len(payload.getvalue()))
    (saved / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(saved)

    assert checkpoint.resume_from(tmp_path) == tmp_path / "step-1"
    warning = capsys.readouterr().err.splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: checkpoint {saved} is damaged: {saved}/")
    assert "not plain" in warning[0]
    model = torch.nn.Linear(64, 64)
    with pytest.raises(UserError, match=r"holds a pickle that is not plain data \(it names posix.system\): it is "
                                        r"damaged or was tampered with") as refused:  # loaded directly, refused too
        checkpoint.load(tmp_path / "step-2.corrupt", model, torch.optim.AdamW(model.parameters()))
    assert "weights_only" not in str(refused.value)  # torch's advice to unpickle it anyway
    assert not marker.exists()


@pytest.mark.parametrize("holds,message", [(None, "does not exist"), ([], "is empty"),
                                           (["metrics.jsonl", "step-2.tmp"], "holds metrics.jsonl, step-2.tmp")])
def test_resume_without_a_complete_checkpoint_names_the_directory_and_what_it_holds(tmp_path, holds, message):
    run_dir = tmp_path / "run"
    if holds is not None:
        run_dir.mkdir()
        for name in holds:
            (run_dir / name).mkdir()
    with pytest.raises(UserError, match=f"checkpoint.dir={run_dir} {message}, no complete checkpoint"):
        checkpoint.resume_from(run_dir)


def test_rotation_never_deletes_the_newest_confirmed_checkpoint(tmp_path):
    _save_linear(tmp_path, 1, keep=1)
    checkpoint.confirm(tmp_path, 1, keep=1)
    _save_linear(tmp_path, 2, keep=1)  # unconfirmed: step 3 has not been seen healthy
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-1", "step-2"]
    assert checkpoint.discard_after(tmp_path, 1) == tmp_path / "step-1"  # a divergence at step 3
    assert (tmp_path / "step-2.diverged").is_dir()
    _save_linear(tmp_path, 2, keep=1)
    checkpoint.confirm(tmp_path, 2, keep=1)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-2"]


def test_rotation_takes_old_checkpoints_out_at_once_and_deletes_them_in_a_thread(tmp_path, monkeypatch):
    """Deleting a 17 GB checkpoint took 5.9 s of the training thread on an H200's disk: rotation renames it (no resume
    takes it), a thread deletes it, and the next save waits for that room; what a killed process left is deleted."""
    (tmp_path / "step-0.removed").mkdir(parents=True)  # a killed process's half-deleted checkpoint
    deleting = threading.Event()
    remove_all = checkpoint._remove_all
    monkeypatch.setattr(checkpoint, "_remove_all", lambda paths: (deleting.wait(10), remove_all(paths)))
    _save_linear(tmp_path, 1, keep=1)
    _save_linear(tmp_path, 2, keep=1)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-2"]
    assert (tmp_path / "step-1.removed").is_dir()  # still being deleted
    deleting.set()
    _save_linear(tmp_path, 3, keep=1)  # waits for the deletion
    assert not (tmp_path / "step-1.removed").exists() and not (tmp_path / "step-0.removed").exists()
    assert checkpoint.resume_from(tmp_path).name == "step-3"


class _DiskFillsUp(FileSystemWriter):
    """A storage writer whose disk fills up as DCP writes the shards: DCP wraps the OS error in a CheckpointException,
    a BaseException that `except Exception` misses."""

    def write_data(self, plan, planner):
        super().write_data(plan, planner)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_during_a_save_names_the_path_removes_the_half_save_and_keeps_the_last_checkpoint(tmp_path,
                                                                                                    monkeypatch):
    _save_linear(tmp_path, 1)
    real_save = checkpoint.dcp.save
    monkeypatch.setattr(checkpoint.dcp, "save", lambda state, checkpoint_id: real_save(
        state, storage_writer=_DiskFillsUp(checkpoint_id)))
    with pytest.raises(OSError) as full:
        _save_linear(tmp_path, 2)
    assert (full.value.errno, full.value.filename) == (errno.ENOSPC, str(tmp_path / "step-2.tmp"))
    monkeypatch.undo()
    assert not (tmp_path / "step-2.tmp").exists()  # its space is free again for the resumed run
    assert checkpoint.resume_from(tmp_path) == tmp_path / "step-1"


def test_a_run_directory_without_room_for_one_checkpoint_is_refused(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="has .* free but one checkpoint needs about 1.05e\\+06 TiB"):
        rundir.check_free_space(tmp_path, 1 << 60)
    rundir.check_free_space(tmp_path, 1 << 10)
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, 50 << 20))
    with pytest.raises(UserError, match="has 50 MiB free but one checkpoint needs about 600 MiB: free space"):
        rundir.check_free_space(tmp_path, 600 << 20)  # under 0.1 GiB: once "0.0 GiB free but ... about 0.6 GiB"


def test_the_start_up_space_check_counts_the_kept_checkpoints_and_the_export(tmp_path, monkeypatch):
    """Rotation holds checkpoint.keep checkpoints and the one being written; the export comes after them. A run
    that passed a one-checkpoint check filled a 64 GiB disk at its end (two 17 GB checkpoints and the export)."""
    from dsv3.config import CheckpointConfig
    n_params = 10 << 20  # 120 MiB a checkpoint (fp32 moments), 40 MiB the export
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, 400 << 20))
    with pytest.raises(UserError, match=r"has 400 MiB free but 4 checkpoints \(120 MiB each, checkpoint.keep and "
                                        r"the one being written\) and the export \(40 MiB\) need about 520 MiB: "
                                        r"free space, lower --checkpoint.keep"):
        rundir.check_room(tmp_path, n_params, "fp32", CheckpointConfig(keep=3))
    rundir.check_room(tmp_path, n_params, "fp32", CheckpointConfig(keep=2, export=False))  # 360 MiB
    for step in (1, 2):  # a resumed run holds two already: one more to come
        _save_linear(tmp_path, step)
    rundir.check_room(tmp_path, n_params, "fp32", CheckpointConfig(keep=2))  # 120 + 40 MiB


def _check_space_where_rank_1_cannot_write(rank: int, world: int, port: int, run_dir: Path, results: Path) -> None:
    torchrun_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if rank == 1:  # as a host whose mount is read-only
        rundir.open_no_follow = lambda path, mode: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
    _record_outcome(results, rank, lambda: rundir.check_free_space(run_dir, 1 << 10), "fine")


def _record_outcome(results: Path, rank: int, action: Callable[[], None], success: str) -> None:
    """A spawned worker's end: `success`, or the UserError `action` raised, into results/rank-N; then it leaves."""
    try:
        action()
        outcome = success
    except UserError as e:
        outcome = str(e)
    (results / f"rank-{rank}").write_text(outcome)
    leave_process_group()


@pytest.mark.slow
def test_a_run_directory_one_rank_cannot_write_stops_every_rank(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    mp.spawn(_check_space_where_rank_1_cannot_write, args=(2, free_port(), tmp_path, results), nprocs=2)
    outcomes = {(results / f"rank-{rank}").read_text() for rank in range(2)}
    assert outcomes == {f"checkpoint.dir={tmp_path} is not writable (Permission denied): choose another "
                        "--checkpoint.dir (rank 1)"}


def _rename_fails_on_rank_0(rank: int, world: int, port: int, run_dir: Path, results: Path) -> None:
    torchrun_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    start = time.monotonic()
    try:
        _save_linear(run_dir, 1)
        outcome = "saved"
    except Exception as e:
        outcome = str(e)
    (results / f"rank-{rank}").write_text(json.dumps({"seconds": time.monotonic() - start, "error": outcome}))
    leave_process_group()


@pytest.mark.slow
def test_a_rename_that_fails_on_rank_0_ends_every_rank_with_its_error(tmp_path):
    """Only rank 0 renames step-N.tmp to step-N; when that failed, the other ranks waited at the barrier after it
    for a rank that had left, until the collective's timeout (NCCL's: 10 minutes)."""
    run_dir, results = tmp_path / "run", tmp_path / "results"
    run_dir.mkdir()
    results.mkdir()
    (run_dir / "step-1").write_text("a file where the checkpoint directory goes: the rename fails")
    mp.spawn(_rename_fails_on_rank_0, args=(2, free_port(), run_dir, results), nprocs=2)
    outcomes = [json.loads((results / f"rank-{rank}").read_text()) for rank in range(2)]
    assert outcomes[0]["error"] == outcomes[1]["error"]
    assert outcomes[0]["error"].startswith(f"renaming checkpoint {run_dir / 'step-1.tmp'} to {run_dir / 'step-1'} "
                                           "failed on rank 0: NotADirectoryError")
    assert all(outcome["seconds"] < 10 for outcome in outcomes)


_HOLD_LOCK = """
import sys, time
sys.path.insert(0, {root!r})
from dsv3 import optim, rundir
from dsv3.config import UserError
rundir.lock_run_dir({run_dir!r})
print("locked", flush=True)
time.sleep(120)
"""


def _lock_rank(rank: int, world: int, port: int, run_dir: Path, results: Path) -> None:
    torchrun_env(rank, world, port)
    dist.init_process_group("gloo")
    _record_outcome(results, rank, lambda: rundir.lock_run_dir(run_dir), "locked")


@pytest.mark.slow
def test_a_second_run_on_a_locked_directory_is_refused_on_every_rank_until_the_holder_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK.format(root=str(ROOT), run_dir=str(tmp_path))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        results = tmp_path / "results"
        results.mkdir()
        mp.spawn(_lock_rank, args=(2, free_port(), tmp_path, results), nprocs=2)
        refusal = f"is in use by another run (pid {holder.pid} on host {socket.gethostname()})"
        assert all(refusal in (results / f"rank-{r}").read_text() for r in range(2))
    finally:
        holder.kill()  # as kill -9: the OS releases its lock
        holder.wait()
    rundir.lock_run_dir(tmp_path)
    assert (tmp_path / "lock").read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    rundir.unlock_run_dir(tmp_path)


def _with_compute_copies(seed: int = 0) -> tuple[Transformer, optim.ComputeCopies, torch.optim.Optimizer,
                                                 TrainConfig]:
    torch.manual_seed(seed)
    model = Transformer(replace(FLAVORS["debug"], n_layers=2, max_seq_len=32))
    copies = optim.ComputeCopies(model, torch.bfloat16)
    t = TrainConfig(global_batch=2, micro_batch=2, seq_len=32, optimizer_state_dtype="bf16")
    return model, copies, train.build_optimizer(model, t, torch.device("cpu"), copies), t


@pytest.mark.slow
def test_a_run_with_compute_copies_checkpoints_fp32_weights_and_resumes_exactly(tmp_path):
    """The checkpoint holds the fp32 parameters, not their bf16 compute copies; after a load the copies are
    remade from the loaded weights (a stale copy would train on the fresh init)."""
    batches = torch.randint(0, 256, (4, 2, 33), generator=torch.Generator().manual_seed(3))
    model, _, optimizer, t = _with_compute_copies()
    for step in (1, 2):
        train.train_step(model, optimizer, batches[step - 1], t, step)
    saved = checkpoint.save(tmp_path, 2, model, optimizer, {"step": 2}, keep=1)
    expected = [train.train_step(model, optimizer, batches[step - 1], t, step)[0] for step in (3, 4)]

    fresh, fresh_copies, fresh_optimizer, _ = _with_compute_copies(seed=1)
    with fresh_copies.active():
        fresh(batches[0][:, :-1])  # its copies now hold its own init
    checkpoint.load(saved, fresh, fresh_optimizer)
    assert {v.dtype for v in fresh.state_dict().values() if v.is_floating_point()} == {torch.float32}
    got = [train.train_step(fresh, fresh_optimizer, batches[step - 1], t, step)[0] for step in (3, 4)]
    assert torch.equal(torch.stack(got), torch.stack(expected))


# --- links where the run keeps its own files ------------------------------------------------------------------


def test_a_lock_that_is_a_link_is_refused_and_its_target_left_as_it_was(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "lock").symlink_to(victim)
    with pytest.raises(UserError, match=rf"^{tmp_path / 'run' / 'lock'} is a symbolic link where dsv3 keeps"):
        rundir.lock_run_dir(tmp_path / "run")
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("name", ["metrics.jsonl", "metrics.jsonl.tmp", "expert_load.jsonl"])
def test_a_log_that_is_a_link_is_refused_and_its_target_left_as_it_was(tmp_path, name):
    from dsv3.metrics import MetricsLogger
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "run" / name).unlink(missing_ok=True)
    (tmp_path / "run" / name).symlink_to(victim)
    with pytest.raises(UserError, match=rf"^{tmp_path / 'run' / name} is a symbolic link"):
        MetricsLogger(str(tmp_path / "run"), {}, start_step=1)
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("name", ["step-5.tmp", "step-5"])
def test_a_checkpoint_directory_that_is_a_link_receives_nothing(tmp_path, name):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UserError, match=rf"^{tmp_path / 'run' / name} is a symbolic link"):
        _save_linear(tmp_path / "run", 5)
    assert list(elsewhere.iterdir()) == [] and checkpoint.checkpoints(tmp_path / "run") == []
