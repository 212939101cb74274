"""The run directory's safety: one run at a time holds it (an OS lock, `lock_run_dir`), and a run does not start
where it cannot write the checkpoints it keeps and its export (`check_room`)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import IO

import torch.distributed as dist

from dsv3.checkpoint import checkpoints
from dsv3.checkpoint import rank as this_rank
from dsv3.config import CheckpointConfig, UserError
from dsv3.lockfile import take_lock
from dsv3.safeopen import open_no_follow

_held_locks: dict[Path, IO] = {}


def lock_run_dir(run_dir: str | Path, create: bool = True) -> None:
    """Hold an OS lock on `run_dir/lock` (rank 0; the OS drops it when the process dies) for this run's life:
    a second run on the same directory is refused with the holder's pid and host, on every rank. create=False
    (resuming) leaves a missing directory missing, for `resume_from` to report."""
    run_dir = Path(run_dir).resolve()
    problem = None
    if this_rank() == 0 and (create or run_dir.is_dir()):
        stale = _held_locks.pop(run_dir, None)  # an earlier run in this process that ended by an exception
        if stale is not None:
            stale.close()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = open_no_follow(run_dir / "lock", "a+")
        except UserError as e:
            problem = str(e)
        except OSError as e:
            problem = f"checkpoint.dir={run_dir} cannot be written ({e.strerror}): choose a writable --checkpoint.dir"
        else:
            holder = take_lock(lock)
            if holder is not None:
                problem = (f"checkpoint.dir={run_dir} is in use by another run (pid {holder[0]} on host "
                           f"{holder[1]}): wait for it to end, or give this run its own --checkpoint.dir")
            else:
                _held_locks[run_dir] = lock
    if dist.is_initialized():  # every rank stops, or none: a lone rank 0 exit would hang the others
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem:
        raise UserError(problem)


def unlock_run_dir(run_dir: str | Path) -> None:
    lock = _held_locks.pop(Path(run_dir).resolve(), None)
    if lock is not None:
        lock.close()


def estimated_bytes(n_params: int, optimizer_state_dtype: str) -> int:
    """One checkpoint's size: fp32 weights and AdamW's two moments per parameter."""
    return n_params * (4 + 2 * (2 if optimizer_state_dtype == "bf16" else 4))


def _size(n: float) -> str:
    """Bytes in the largest binary unit that leaves at least 1 (0.04 GiB printed as 0.0 GiB read as none)."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def check_room(run_dir: str | Path, n_params: int, optimizer_state_dtype: str, ckpt: CheckpointConfig) -> None:
    """Refuse to start where the run cannot write what it will hold at its fullest: checkpoint.keep checkpoints and
    the one being written before rotation deletes the oldest (fewer to come when a resumed run holds some already),
    then the export (fp32 weights). keep=0 keeps all: one more at least."""
    held = len(checkpoints(run_dir))
    coming = max(1, ckpt.keep + 1 - held) if ckpt.every and ckpt.keep else 1 if ckpt.every else 0
    check_free_space(run_dir, estimated_bytes(n_params, optimizer_state_dtype), coming, 4 * n_params * ckpt.export)


def check_free_space(run_dir: str | Path, checkpoint_bytes: int, n_checkpoints: int = 1, export_bytes: int = 0) -> None:
    """Refuse to start, on every rank, when `run_dir` is not writable from some rank or cannot hold
    `n_checkpoints` more checkpoints and the export."""
    run_dir = Path(run_dir)
    problem = None
    # ranks on several hosts of a shared filesystem may share a pid (containers): the name must be theirs alone
    probe = run_dir / f".write-test-{socket.gethostname()}-{this_rank()}-{os.getpid()}"
    try:
        with open_no_follow(probe, "xb") as f:
            f.write(b"x")
        probe.unlink()
    except OSError as e:
        problem = f"checkpoint.dir={run_dir} is not writable ({e.strerror}): choose another --checkpoint.dir"
    else:
        free, needed = shutil.disk_usage(run_dir).free, n_checkpoints * checkpoint_bytes + export_bytes
        parts = ([f"{'one checkpoint' if n_checkpoints == 1 else f'{n_checkpoints} checkpoints'} "
                  f"({_size(checkpoint_bytes)} each, checkpoint.keep and the one being written)"
                  if n_checkpoints > 1 else "one checkpoint"] if n_checkpoints else [])
        parts += [f"the export ({_size(export_bytes)})"] if export_bytes else []
        if free < needed:
            problem = (f"checkpoint.dir={run_dir} has {_size(free)} free but {' and '.join(parts)} "
                       f"{'need' if len(parts) > 1 or n_checkpoints > 1 else 'needs'} about {_size(needed)}: "
                       "free space, lower --checkpoint.keep, or choose another --checkpoint.dir")
    if dist.is_initialized():  # a rank that stopped alone would leave the others in their first collective
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((f"{found} (rank {rank})" for rank, found in enumerate(problems) if found), None)
    if problem:
        raise UserError(problem)
