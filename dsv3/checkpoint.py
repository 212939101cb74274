"""Training checkpoints with torch.distributed.checkpoint (sharded, reshardable: save at world 4, resume
at 2 or 1) and the final safetensors export, written by every rank. A checkpoint is written to `step-N.tmp/` and
renamed to `step-N/` only when complete, so a crash mid-save never touches the last good one.

The run directory is guarded too: one run at a time holds it (`lock_run_dir`), every checkpoint carries a
manifest of its files' sizes and checksums that resume verifies (`resume_from` falls back to an older one when a
file is damaged), and a checkpoint stays *unconfirmed* until the step after it trained healthily (`confirm`):
the weights an exploding update produced show only in the next step's loss, so `discard_after` moves the
unconfirmed ones aside when the run diverges and rotation never deletes the newest confirmed one."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
# what HuggingFaceStorageWriter(enable_consolidation=True) runs, on rank 0 alone; torchtitan imports it the same way
from torch.distributed.checkpoint._consolidate_hf_safetensors import (consolidate_safetensors_files,
                                                                       consolidate_safetensors_files_on_every_rank)
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from dsv3.config import ModelConfig, UserError
from dsv3.hf import load_config_json, model_shapes, save_config
from dsv3.tokenizer import Tokenizer

_STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"  # {"files": {name: {"size": bytes, "crc32": int}}}, written last inside step-N.tmp
UNCONFIRMED = "unconfirmed"  # marker: the step after this checkpoint has not been seen healthy yet
_CHUNK = 16 << 20
_held_locks: dict[Path, IO] = {}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _move_aside(path: Path, suffix: str) -> None:
    """Rename checkpoint `path` to `path{suffix}` (replacing an older one of that name), out of `checkpoints()`."""
    aside = path.with_name(path.name + suffix)
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _on_rank_0(what: str, action: Callable[[], None]) -> None:
    """Run the filesystem step `action` on rank 0 alone; if it fails, every rank raises the same error. With a bare
    barrier after it, the other ranks waited there for a rank that had left, until the collective's timeout."""
    failure = None
    if _rank() == 0:
        try:
            action()
        except Exception as e:
            failure = e
    report = [None if failure is None else f"{what} failed on rank 0: {type(failure).__name__}: {failure}"]
    if dist.is_initialized():
        dist.broadcast_object_list(report, src=0)
    if report[0] is not None:
        raise RuntimeError(report[0]) from failure


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (unfinished `*.tmp` ones are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int:
    """The step of checkpoint `path` (`step-N`)."""
    return int(path.name.split("-")[1])


@contextlib.contextmanager
def _quiet_without_group() -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process, even when told so (no_dist=True):
    here that is the intent, so the warning is noise. With a group, nothing is filtered."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any], keep: int, checksums: bool = True) -> Path:
    """Model (expert biases included: they are buffers), optimizer, `train_state` (step, data-loader
    position, ...) and every rank's RNG state as `run_dir/step-{step}`, with its manifest, unconfirmed;
    keeps the newest `keep` (and the newest confirmed one)."""
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"step-{step}", run_dir / f"step-{step}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
             "train": train_state}
    try:
        with _quiet_without_group():
            dcp.save(state, checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / f"rng-{_rank()}.pt")  # per rank: DCP keeps one copy of a plain tensor
        _barrier()
        manifest = _describe(tmp, checksums)  # every rank hashes a share of the files

        def publish() -> None:
            _write_json(tmp / MANIFEST, {"files": manifest})
            (tmp / UNCONFIRMED).touch()
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _rotate(run_dir, keep)

        _on_rank_0(f"renaming checkpoint {tmp} to {final}", publish)
    except Exception as e:
        # DCP and torch.save may wrap the OS error in their own (torch.save: "enforce fail at inline_container")
        disk_full = getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e)
        if disk_full or shutil.disk_usage(run_dir).free < _CHUNK:
            previous = [p.name for p in checkpoints(run_dir) if p != final]
            raise OSError(errno.ENOSPC, f"No space left on device while writing checkpoint {tmp}: free space "
                          f"there, then --resume (the last complete checkpoint, "
                          f"{previous[-1] if previous else 'none'}, is untouched)") from e
        raise
    return final


def confirm(run_dir: str | Path, step: int, keep: int) -> None:
    """Mark step-{step} healthy (the step after it trained with a sane loss) and rotate."""

    def mark_and_rotate() -> None:
        (Path(run_dir) / f"step-{step}" / UNCONFIRMED).unlink(missing_ok=True)
        _rotate(Path(run_dir), keep)

    _on_rank_0(f"confirming checkpoint step-{step} in {run_dir}", mark_and_rotate)


def is_confirmed(path: Path) -> bool:
    return not (path / UNCONFIRMED).exists()


def discard_after(run_dir: str | Path, step: int) -> Path | None:
    """After a divergence: move every checkpoint newer than `step` aside (as `step-N.diverged`, kept for
    inspection) so that `--resume` loads weights from before it; returns the newest one left."""
    run_dir = Path(run_dir)

    def move_newer_aside() -> None:
        for path in checkpoints(run_dir):
            if step_of(path) > step:
                _move_aside(path, ".diverged")

    _on_rank_0(f"moving the checkpoints after step {step} in {run_dir} aside", move_newer_aside)
    kept = checkpoints(run_dir)
    return kept[-1] if kept else None


def _rotate(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, never the newest confirmed one."""
    found = checkpoints(run_dir)
    confirmed = [p for p in found if is_confirmed(p)]
    for old in found[:-keep] if keep > 0 else []:
        if not confirmed or old != confirmed[-1]:
            shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, value: Any) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(value, indent=1))
    os.replace(path.with_suffix(".tmp"), path)


def _file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _describe(directory: Path, checksums: bool) -> dict[str, dict[str, int]]:
    """{name: {size, crc32}} of every file in `directory` (except the manifest and the marker); the files are
    hashed in shares, one per rank, and gathered on every rank."""
    names = sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                   if p.is_file() and p.name not in (MANIFEST, UNCONFIRMED))
    mine = {}
    for name in names[_rank()::_world()]:
        mine[name] = {"size": (directory / name).stat().st_size}
        if checksums:
            mine[name]["crc32"] = _file_crc32(directory / name)
    return {name: entry for share in _gather(mine) for name, entry in share.items()}


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def verify(path: Path, checksums: bool = True) -> str | None:
    """What is wrong with checkpoint `path` (a missing, truncated or altered file), or None when its files match
    its manifest: sizes always, crc32 too when `checksums`. Every rank checks a share of the files."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{path / MANIFEST} is missing or unreadable ({e})"
    names = sorted(manifest)
    problems = []
    for name in names[_rank()::_world()]:
        file, expected = path / name, manifest[name]
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != expected["size"]:
            problems.append(f"{file} has {file.stat().st_size} bytes, the manifest says {expected['size']}")
        elif checksums and "crc32" in expected and _file_crc32(file) != expected["crc32"]:
            problems.append(f"{file} does not match its checksum (its bytes were altered)")
    problems = sorted(p for share in _gather(problems) for p in share)
    return "; ".join(problems) or None


def resume_from(run_dir: str | Path, checksums: bool = True) -> Path:
    """The newest checkpoint in `run_dir` whose files match its manifest. A damaged one is renamed to
    `step-N.corrupt` with a warning and the next older one is tried; none at all is a UserError that says what
    the directory holds (a mistyped checkpoint.dir must not quietly start a new run)."""
    run_dir = Path(run_dir)
    found = checkpoints(run_dir)
    if not found:
        if not run_dir.is_dir():
            holds = "does not exist"
        else:
            names = sorted(p.name for p in run_dir.iterdir() if p.name != "lock")
            holds = f"holds {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}" if names else "is empty"
        raise UserError(f"--resume: checkpoint.dir={run_dir} {holds}, no complete checkpoint (step-N/) to resume "
                        f"from: check the path, or drop --resume to start a new run")
    for path in reversed(found):
        problem = verify(path, checksums)
        if problem is None:
            return path
        if _rank() == 0:
            print(f"warning: checkpoint {path} is damaged: {problem}; moved aside as {path.name}.corrupt, "
                  f"trying the previous one", file=sys.stderr, flush=True)
        _on_rank_0(f"moving {path} aside", lambda: _move_aside(path, ".corrupt"))
    raise UserError(f"--resume: no checkpoint in checkpoint.dir={run_dir} is intact (each one is now *.corrupt): "
                    f"restore one from a backup, or drop --resume to start a new run")


def lock_run_dir(run_dir: str | Path, create: bool = True) -> None:
    """Hold an OS lock on `run_dir/lock` (rank 0; the OS drops it when the process dies) for this run's life:
    a second run on the same directory is refused with the holder's pid and host, on every rank. create=False
    (resuming) leaves a missing directory missing, for `resume_from` to report."""
    run_dir = Path(run_dir).resolve()
    problem = None
    if _rank() == 0 and (create or run_dir.is_dir()):
        stale = _held_locks.pop(run_dir, None)  # an earlier run in this process that ended by an exception
        if stale is not None:
            stale.close()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = open(run_dir / "lock", "a+")
        except OSError as e:
            problem = f"checkpoint.dir={run_dir} cannot be written ({e.strerror}): choose a writable --checkpoint.dir"
        else:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().split() or ["?", "?"]
                lock.close()
                problem = (f"checkpoint.dir={run_dir} is in use by another run (pid {holder[0]} on host "
                           f"{holder[-1]}): wait for it to end, or give this run its own --checkpoint.dir")
            else:
                lock.truncate(0)
                lock.write(f"{os.getpid()} {socket.gethostname()}\n")
                lock.flush()
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


def check_free_space(run_dir: str | Path, checkpoint_bytes: int) -> None:
    """Refuse to start when `run_dir` is not writable or cannot hold one more checkpoint."""
    run_dir = Path(run_dir)
    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise UserError(f"checkpoint.dir={run_dir} is not writable ({e.strerror}): choose another "
                        f"--checkpoint.dir") from e
    free = shutil.disk_usage(run_dir).free
    if free < checkpoint_bytes:
        raise UserError(f"checkpoint.dir={run_dir} has {free / 2**30:.1f} GiB free but one checkpoint needs about "
                        f"{checkpoint_bytes / 2**30:.1f} GiB: free space, or choose another --checkpoint.dir")


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint into the (possibly differently sharded) model and optimizer; returns the saved
    train_state (`train_state` gives its keys and types)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
             "train": train_state}
    try:
        with _quiet_without_group():
            dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # under a process group DCP re-raises a rank's error wrapped in its own
        missing = re.search(r"Missing key in checkpoint state_dict: (\S+?)\.?$", str(e), re.MULTILINE)
        if missing is None:
            raise
        raise UserError(f"{path} holds no {missing.group(1)}: resume with the model, optimizer and "
                        "data.sources the run was saved with") from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    _restore_rng(Path(path))
    return state["train"]


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(path: Path) -> None:
    """This rank's RNG streams as saved, when the world size is the one they were saved at; a resharded
    resume keeps the freshly seeded ones (one rank's stream has no counterpart at another world size)."""
    if {p.name for p in path.glob("rng-*.pt")} != {f"rng-{r}.pt" for r in range(_world())}:
        return
    state = torch.load(path / f"rng-{_rank()}.pt")
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def check_init_from(path: str | Path, cfg: ModelConfig) -> None:
    """Refuse, before anything is built, a checkpoint.init_from that holds no dsv3 weights (no safetensors at all,
    or a Hugging Face checkpoint: its config.json names a model_type, its tensors are named model.layers.*), or
    weights of other shapes than this model's, naming the [model] overrides that would fit them (from the
    config.json an export or convert_hf.py --to-dsv3 writes)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise UserError(f"checkpoint.init_from={path} holds no *.safetensors: point it at an export, or convert an "
                        f"HF model with python scripts/convert_hf.py --to-dsv3 HF_DIR OUT_DIR")
    config_json = Path(path) / "config.json"
    hf_config = config_json.is_file() and "model_type" in json.loads(config_json.read_text())
    with safe_open(files[0], "pt") as f:
        hf_names = any(name.startswith("model.") for name in f.keys())
    if hf_config or hf_names:
        raise UserError(f"checkpoint.init_from={path} is a Hugging Face checkpoint: convert it first with "
                        f"python scripts/convert_hf.py --to-dsv3 {path} OUT_DIR, then pass "
                        f"--checkpoint.init_from=OUT_DIR")
    if not config_json.is_file():
        return  # load_weights still checks every key
    try:
        saved = load_config_json(config_json)
    except ValueError as e:
        raise UserError(f"checkpoint.init_from: {e}") from None
    if model_shapes(saved) != model_shapes(cfg):
        fix = " ".join(f"--model.{f.name}={json.dumps(getattr(saved, f.name))}" for f in dataclasses.fields(cfg)
                       if getattr(saved, f.name) != getattr(cfg, f.name))
        raise UserError(f"checkpoint.init_from={path} holds a model of other shapes than this config's: "
                        f"match its config.json, e.g. {fix}")


def load_weights(path: str | Path, model: nn.Module) -> None:
    """Initialise the (possibly sharded) model from a dsv3 safetensors directory; each rank reads only
    the slices it holds, so a 671B import never passes through one process."""
    state = get_model_state_dict(model)
    on_disk = set()
    for file in Path(path).glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            on_disk |= set(f.keys())
    missing, unexpected = sorted(state.keys() - on_disk), sorted(on_disk - state.keys())
    if missing or unexpected:
        raise UserError(f"checkpoint.init_from={path} does not fit this model: missing {missing[:10]} "
                        f"({len(missing)}), unexpected {unexpected[:10]} ({len(unexpected)}); check the flavor "
                        f"and [model] overrides against its config.json")
    with _quiet_without_group():
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
    set_model_state_dict(model, state)


def export(out_dir: str | Path, model: nn.Module, cfg: ModelConfig, tokenizer: Tokenizer | None = None) -> None:
    """Write the model as HF-style safetensors with dsv3 names and full tensors (`model-0000i-of-0000N.safetensors`,
    one file per block and one for the rest, + `model.safetensors.index.json`), `config.json` (ModelConfig
    fields) and the tokenizer it was trained with, atomically: into `out_dir.tmp/`, renamed when complete.

    No process ever holds the whole model (a 671B one is 2.7 TB in fp32): every rank writes its own shards, then
    every rank assembles its share of the files from them, one tensor at a time."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state = get_model_state_dict(model)
    file_of = _file_per_block(state)
    writer = dcp.HuggingFaceStorageWriter(str(tmp / "sharded"), fqn_to_index_mapping=file_of, save_distributed=True)
    with _quiet_without_group():
        dcp.save(state, storage_writer=writer)
    if dist.is_initialized():
        consolidate_safetensors_files_on_every_rank(str(tmp / "sharded"), str(tmp), file_of)
    else:
        consolidate_safetensors_files(str(tmp / "sharded"), str(tmp), file_of)
    _barrier()
    if _rank() == 0:
        shutil.rmtree(tmp / "sharded")
        save_config(cfg, tmp / "config.json")
        if tokenizer is not None:
            tokenizer.save(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    _barrier()


def _file_per_block(state: dict[str, Any]) -> dict[str, int]:
    """Output file (1..N) of each tensor: one per transformer block and MTP module, one for the embedding, final
    norm and head. Files are what ranks share out when assembling an export."""
    def block(name: str) -> tuple[str, int]:
        parts = name.split(".")
        return (parts[0], int(parts[1])) if parts[0] in ("layers", "mtp") else ("", 0)

    index = {key: i for i, key in enumerate(sorted({block(name) for name in state}), start=1)}
    return {name: index[block(name)] for name in state}
