"""Training checkpoints with torch.distributed.checkpoint (sharded, reshardable: save at world 4, resume
at 2 or 1). A checkpoint is written to `step-N.tmp/` and renamed to `step-N/` only when complete, so a crash
mid-save never touches the last good one.

Every checkpoint carries a manifest of its files' sizes and checksums that resume verifies (`resume_from` falls
back to an older one when a file is damaged), and a checkpoint stays *unconfirmed* until the step after it trained
healthily (`confirm`): the weights an exploding update produced show only in the next step's loss, so
`discard_after` moves the unconfirmed ones aside when the run diverges and rotation never deletes the newest
confirmed one.

A checkpoint is data, not code: loading one runs nothing from it. DCP reads its .metadata with pickle.load and its
non-tensor entries with torch.load(weights_only=False); here the .metadata goes through an unpickler that knows only
the classes DCP's metadata is made of, and the entries through weights_only=True. Our own train state (step, data
positions, divergence guard, the run's config) is JSON."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import re
import shutil
import sys
import threading
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils._pytree as pytree
from torch import (
    _weights_only_unpickler,  # what torch.load(weights_only=True) unpickles with
    nn,
)
from torch.distributed.checkpoint._state_dict_stager import StateDictStager  # what DCP's DefaultStager copies with
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from dsv3.config import ModelConfig, UserError
from dsv3.safeopen import refuse_link

_STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"  # {"files": {name: {"size": bytes, "crc32": int}}}, written last inside step-N.tmp
UNCONFIRMED = "unconfirmed"  # marker: the step after this checkpoint has not been seen healthy yet
TRAIN_STATE = "train.json"  # the train_state `save` was given, written by rank 0
_CHUNK = 16 << 20


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _move_aside(path: Path, suffix: str) -> None:
    """Rename checkpoint `path` to `path{suffix}` (replacing an older one of that name), out of `checkpoints()`."""
    aside = path.with_name(path.name + suffix)
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)


def barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _on_rank_0(what: str, action: Callable[[], None], group: Any = None) -> None:
    """Run the filesystem step `action` on rank 0 alone; if it fails, every rank raises the same error. With a bare
    barrier after it, the other ranks waited there for a rank that had left, until the collective's timeout."""
    failure = None
    if rank() == 0:
        try:
            action()
        except Exception as e:
            failure = e
    report = [None if failure is None else f"{what} failed on rank 0: {type(failure).__name__}: {failure}"]
    if dist.is_initialized():
        dist.broadcast_object_list(report, src=0, group=group)
    if report[0] is not None:
        raise RuntimeError(report[0]) from failure


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (unfinished `*.tmp` ones are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()]  # a link is none of ours
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int:
    """The step of checkpoint `path` (`step-N`)."""
    return int(path.name.split("-")[1])


@contextlib.contextmanager
def dcp_call() -> Iterator[None]:
    """Around a dcp.save or dcp.load: the first failed rank's own error is raised (a full disk stays an OSError), not
    DCP's CheckpointException, a BaseException that `except Exception` misses; without a process group, DCP's
    warning that it assumes one process is filtered, since that is the intent."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            yield
        except CheckpointException as e:
            error, _ = e.failures[min(e.failures)]  # (exception, its stack summary)
            raise error from None


def save(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any], keep: int, checksums: bool = True, background: bool = False) -> Path:
    """Model (expert biases included), optimizer, `train_state` (JSON, the same on every rank) and each rank's RNG
    state as `run_dir/step-{step}`, with its manifest, unconfirmed; keeps the newest `keep` and the newest confirmed.
    `background`: the rest after the host copy in a thread (docs/training.md#checkpoints-that-do-not-stop-training)."""
    wait_for_save()  # never two in flight
    _wait_for_removals()  # the room an earlier rotation frees
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"step-{step}", run_dir / f"step-{step}.tmp"
    for path in (tmp, final):  # the save would go to a link's target
        refuse_link(path)
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if not background:
        with _removed_when_failed(run_dir, tmp):
            with dcp_call():
                dcp.save(state, checkpoint_id=str(tmp))
            _finish(run_dir, tmp, final, train_state, _rng_state(), keep, checksums, group=None)
            _rotate_on_rank_0(run_dir, keep)
        return final
    global _in_flight
    group = _background_group()
    if not dist.is_initialized():  # DCP's own thread warns as dcp_call filters it (warning filters are global)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    # the staged tensors are in host memory already: DCP's default loader would, from the writer thread, wait for the
    # device's default stream (the training's) every 10 MB
    writer = dcp.FileSystemWriter(str(tmp), per_thread_copy_ahead=0)
    with _removed_when_failed(run_dir, tmp):
        with dcp_call():  # stages the device-to-host copy now, then writes in DCP's thread
            written = dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=_stager())
    rng = {name: value.clone() for name, value in _rng_state().items()}  # this step's streams, not the next ones'

    def write_and_publish() -> None:
        with _removed_when_failed(run_dir, tmp):
            with dcp_call():
                written.result()
            _finish(run_dir, tmp, final, train_state, rng, keep, checksums, group)

    _in_flight = _Save(step, run_dir, keep, write_and_publish)
    return final


class _Save:
    """A save writing in the background: its thread, and what the main thread owes it once it is done."""

    def __init__(self, step: int, run_dir: Path, keep: int, work: Callable[[], None]):
        self.step, self.run_dir, self.keep = step, run_dir, keep
        self.confirmed, self.error = False, None
        self.thread = threading.Thread(target=self._run, args=(work,), name=f"dsv3-save-{step}", daemon=True)
        self.thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # raised again on the main thread, by wait_for_save
            self.error = e


_in_flight: _Save | None = None
_group: Any = None  # gloo group of every rank for the background save's collectives, apart from training's
_staging: _HostCopy | None = None  # its host buffers kept from one save to the next


def _background_group() -> Any:
    global _group
    if dist.is_initialized() and _group is None:
        _group = dist.new_group(backend="gloo")
    return _group


class _HostCopy(AsyncStager):
    """The background save's copy to host memory, complete when `stage` returns (the next optimizer step may change
    the weights): one copy per storage into host buffers that `prepare` (or the first save) allocates and every later
    save reuses. # torch 2.11: its DefaultStager drops them after every save. Pageable, not pinned: page-locking them
    stalled the training for longer than pinned copies would save over many saves (docs/log.md)."""

    _synchronize_after_execute = False  # nothing left to wait for once `stage` returned

    def __init__(self) -> None:
        self.copier = StateDictStager(pin_memory=False, share_memory=False)
        self.preparing: threading.Thread | None = None
        self.prepare_error: BaseException | None = None

    def prepare(self, state_dict: dict[str, Any]) -> None:
        """Allocate the host buffers in a thread, while training goes on, each touched once so that the first save
        does not wait for the kernel to map its pages. No copy from the device: one in a thread stalled the step
        beside it for as long as it ran (docs/log.md)."""

        def allocate() -> None:
            try:
                buffers = self.copier._cached_storage_mapping  # device storage → its host buffer, as `stage` keeps them
                for value in pytree.tree_leaves(state_dict):
                    if isinstance(value, torch.Tensor):
                        storage = (value.to_local() if isinstance(value, DTensor) else value).untyped_storage()
                        if storage not in buffers:
                            buffers[storage] = torch.zeros(storage.nbytes(), dtype=torch.uint8).untyped_storage()
            except BaseException as e:  # raised again by the first save
                self.prepare_error = e

        self.preparing = threading.Thread(target=allocate, name="dsv3-host-buffers", daemon=True)
        self.preparing.start()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.preparing is not None:
            self.preparing.join()
            self.preparing, error, self.prepare_error = None, self.prepare_error, None
            if error is not None:
                raise error
        return self.copier.stage(state_dict)  # a copy to pageable memory returns once it has arrived


def _stager() -> _HostCopy:
    global _staging
    if _staging is None:
        _staging = _HostCopy()
    return _staging


def prepare_background_save(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Start allocating the background save's host buffers, so that the first save only copies; call it once the
    optimizer holds its state (after a step)."""
    _stager().prepare({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)})


def wait_for_save() -> None:
    """Block until the background save, if any, is published (and rotated); its failure is raised here."""
    global _in_flight
    pending, _in_flight = _in_flight, None
    if pending is None:
        return
    pending.thread.join()
    if pending.error is not None:
        raise pending.error
    if pending.confirmed:
        confirm(pending.run_dir, pending.step, pending.keep)
    else:
        _rotate_on_rank_0(pending.run_dir, pending.keep)


@contextlib.contextmanager
def _removed_when_failed(run_dir: Path, tmp: Path) -> Iterator[None]:
    """A failed save removes its step-N.tmp; a full disk is raised as ENOSPC naming it."""
    try:
        yield
    except Exception as e:
        # judged before the half save is removed: its bytes are what filled the disk. torch.save's writer reports a
        # full disk as "unexpected pos N vs M" (no errno), DCP's rank-0 report as text
        disk_full = (getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e)
                     or shutil.disk_usage(run_dir).free < _CHUNK)
        if rank() == 0:  # on a full disk, a half-written step-N.tmp would keep the resumed run from starting
            shutil.rmtree(tmp, ignore_errors=True)
        if disk_full:
            full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            full.add_note(f"the half-written {tmp.name} was removed")
            raise full from e
        raise


def _finish(run_dir: Path, tmp: Path, final: Path, train_state: dict[str, Any], rng: dict[str, torch.Tensor],
            keep: int, checksums: bool, group: Any) -> None:
    """After DCP's files: the train state, this rank's RNG streams, the manifest, then the rename to step-N."""
    if rank() == 0:
        _write_json(tmp / TRAIN_STATE, train_state)
    with open(tmp / f"rng-{rank()}.pt", "wb") as f:  # per rank: DCP keeps one copy of a plain tensor
        torch.save(rng, f)
        _sync(f)
    barrier(group)
    manifest = _describe(tmp, checksums, group)  # every rank hashes a share of the files

    def publish() -> None:
        _write_json(tmp / MANIFEST, {"files": manifest})
        (tmp / UNCONFIRMED).touch()
        _sync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _sync_dir(run_dir)  # on disk before _rotate deletes an older one: a node crash must not take both

    _on_rank_0(f"renaming checkpoint {tmp} to {final}", publish, group)


def _rotate_on_rank_0(run_dir: Path, keep: int) -> None:
    """Rotation on the main thread only: a background save's thread renames, it never deletes."""
    _on_rank_0(f"rotating the checkpoints in {run_dir}", lambda: _rotate(run_dir, keep))


def confirm(run_dir: str | Path, step: int, keep: int) -> None:
    """Mark step-{step} healthy (the step after it trained with a sane loss) and rotate; a step still being saved in
    the background is marked once it is published (`wait_for_save`)."""
    if _in_flight is not None and _in_flight.step == step:
        _in_flight.confirmed = True
        return

    def mark_and_rotate() -> None:
        (Path(run_dir) / f"step-{step}" / UNCONFIRMED).unlink(missing_ok=True)
        _sync_dir(Path(run_dir) / f"step-{step}")
        _rotate(Path(run_dir), keep)

    _on_rank_0(f"confirming checkpoint step-{step} in {run_dir}", mark_and_rotate)


def is_confirmed(path: Path) -> bool:
    return not (path / UNCONFIRMED).exists()


def discard_after(run_dir: str | Path, step: int) -> Path | None:
    """After a divergence: move every checkpoint newer than `step` aside (as `step-N.diverged`, kept for
    inspection) so that `--resume` loads weights from before it; returns the newest one left."""
    wait_for_save()
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
    _wait_for_removals()  # no two threads deleting the same `*.removed`
    found = checkpoints(run_dir)
    confirmed = [p for p in found if is_confirmed(p)]
    doomed = [p for p in found[:-keep] if not confirmed or p != confirmed[-1]] if keep > 0 else []
    for old in doomed:  # renamed at once: no resume takes it
        removed = old.with_name(old.name + _REMOVED)
        shutil.rmtree(removed, ignore_errors=True)  # a killed process's, of the same step
        os.replace(old, removed)
    # deleting a large checkpoint takes seconds: a thread does it (the process waits for it at exit; one that was
    # killed leaves `*.removed`, deleted here next time)
    removals = [p for p in run_dir.iterdir() if p.name.endswith(_REMOVED) and not p.is_symlink()]
    if removals:
        _removing.append(threading.Thread(target=_remove_all, args=(removals,), name="dsv3-rotate"))
        _removing[-1].start()


_REMOVED = ".removed"
_removing: list[threading.Thread] = []  # rotations deleting old checkpoints


def _wait_for_removals() -> None:
    while _removing:
        _removing.pop().join()


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _write_json(path: Path, value: Any) -> None:
    with open(path.with_suffix(".tmp"), "w") as f:
        f.write(json.dumps(value, indent=1))
        _sync(f)
    os.replace(path.with_suffix(".tmp"), path)


def _sync(f: IO) -> None:
    """`f`'s bytes on disk, not just in the page cache (DCP syncs its own files, not ours)."""
    f.flush()
    os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    """The directory's entries (new names, renames, removals) on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _describe(directory: Path, checksums: bool, group: Any = None) -> dict[str, dict[str, int]]:
    """{name: {size, crc32}} of every file in `directory` (except the manifest and the marker); the files are
    hashed in shares, one per rank, and gathered on every rank."""
    names = sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                   if p.is_file() and p.name not in (MANIFEST, UNCONFIRMED))
    mine = {}
    for name in names[rank()::world()]:
        mine[name] = {"size": (directory / name).stat().st_size}
        if checksums:
            mine[name]["crc32"] = _file_crc32(directory / name)
    return {name: entry for share in _gather(mine, group) for name, entry in share.items()}


def _gather(value: Any, group: Any = None) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def verify(path: Path, checksums: bool = True) -> str | None:
    """What is wrong with checkpoint `path` (a missing, truncated or altered file, a pickle that would run code), or
    None when its files match its manifest (sizes always, crc32 too when `checksums`; every rank checks a share of
    the files) and hold data only."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{path / MANIFEST} is missing or unreadable ({e})"
    names = sorted(manifest)
    problems = []
    for name in names[rank()::world()]:
        file, expected = path / name, manifest[name]
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != expected["size"]:
            problems.append(f"{file} has {file.stat().st_size} bytes, the manifest says {expected['size']}")
        elif checksums and "crc32" in expected and _file_crc32(file) != expected["crc32"]:
            problems.append(f"{file} does not match its checksum (its bytes were altered)")
    if rank() == 0 and not problems and (code := _code_in(path)):  # the manifest can be rewritten with the files
        problems.append(code)
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
        if rank() == 0:
            print(f"warning: checkpoint {path} is damaged: {problem}; moved aside as {path.name}.corrupt, "
                  f"trying the previous one", file=sys.stderr, flush=True)
        _on_rank_0(f"moving {path} aside", lambda: _move_aside(path, ".corrupt"))
    raise UserError(f"--resume: no checkpoint in checkpoint.dir={run_dir} is intact (each one is now *.corrupt): "
                    f"restore one from a backup, or drop --resume to start a new run")


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint into the (possibly differently sharded) model and optimizer, and this rank's RNG state."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    try:
        _load_data_only(state, path)
    except RuntimeError as e:
        missing = re.search(r"Missing key in checkpoint state_dict: (\S+?)\.?$", str(e), re.MULTILINE)
        if missing is None:
            raise
        raise UserError(f"{path} holds no {missing.group(1)}: resume with the model and optimizer the run was "
                        "saved with") from None
    hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    for group, kept in zip(optimizer.param_groups, hyperparameters, strict=True):
        group.update(kept)  # this run's betas and weight decay, not the saved run's (its moments are the state)
    _restore_rng(Path(path))


def recorded_model(run_dir: str | Path) -> ModelConfig | None:
    """The model the newest checkpoint of `run_dir` recorded (its train.json), None without one."""
    for path in reversed(checkpoints(run_dir)):
        try:
            return ModelConfig(**read_train_state(path)["config"]["model"])
        except (UserError, OSError, ValueError, KeyError, TypeError):  # damaged or older: resume_from judges it
            continue
    return None


def read_train_state(path: str | Path) -> dict[str, Any]:
    """The train_state checkpoint `path` was saved with: a few bytes of JSON, read before the model is built."""
    try:
        return json.loads((Path(path) / TRAIN_STATE).read_text())
    except FileNotFoundError:
        raise UserError(f"{path} has no {TRAIN_STATE}: it was written by an older dsv3, which kept the train state "
                        "inside DCP's pickled entries; finish that run with the dsv3 version that wrote it") from None


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler for DCP's .metadata that resolves only what that metadata is made of: DCP's metadata
    classes, torch.Size, dtypes and layouts, paths. Anything else (os.system, ...) is an UnpicklingError."""

    _ALLOWED = {("torch", "Size"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                ("torch.serialization", "_get_layout"), ("torch._utils", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        if module == "torch.distributed.checkpoint.metadata":
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:  # its own classes, not what it imports
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is no part of DCP's metadata")


class _DataOnlyReader(dcp.FileSystemReader):
    """DCP's file reader, its .metadata unpickled by _MetadataUnpickler instead of pickle.load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, its non-tensor entries (optimizer hyper-parameters) first read with weights_only=True:
    bytes that load that way hold plain values only, so DCP's own torch.load of them runs nothing."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def _code_in(path: Path) -> str | None:
    """What in checkpoint `path` would run code or fail to unpickle when loaded (a planted pickle), or None. Each
    entry's pickle is read alone: a tensor's through torch's weights-only unpickler with its storage left on the
    meta device, so a check never reads the tensor bytes."""
    try:
        metadata = _DataOnlyReader(str(path)).read_metadata()
    except Exception as e:  # a damaged pickle fails in many ways
        return f"{path / '.metadata'} is not plain DCP metadata ({type(e).__name__}: {e})"
    for index, where in metadata.storage_data.items():
        try:
            with open(path / where.relative_path, "rb") as f:
                if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                    f.seek(where.offset)
                    torch.load(io.BytesIO(f.read(where.length)), weights_only=True)
                else:
                    _unpickle_tensor_entry(_Window(f, where.offset, where.length))
        except pickle.UnpicklingError:
            return f"{path / where.relative_path} entry {index.fqn} is not plain data (loading it would run code)"
        except Exception as e:  # a damaged record: zipfile, pickle and torch fail in many ways
            return f"{path / where.relative_path} entry {index.fqn} is damaged ({type(e).__name__}: {e})"
    for rng in sorted(path.glob("rng-*.pt")):
        try:
            torch.load(rng, weights_only=True)
        except Exception as e:
            return f"{rng} is not plain data ({type(e).__name__})"
    return None


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of the open file `f`, as a seekable file of their own."""

    def __init__(self, f: IO[bytes], start: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + offset
        return self.pos

    def readinto(self, buffer: Any) -> int:
        wanted = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        n = self.f.readinto(memoryview(buffer)[:wanted])
        self.pos += n
        return n


def _unpickle_tensor_entry(entry: IO[bytes]) -> None:
    """Unpickle a torch.save'd tensor's data.pkl as torch.load(weights_only=True) would (UnpicklingError for any
    other global), its storages on the meta device: no tensor bytes are read."""
    with zipfile.ZipFile(entry) as archive:
        pickled = next(name for name in archive.namelist() if name.endswith("/data.pkl"))
        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(archive.read(pickled)))

    def meta_storage(saved_id: tuple) -> torch.storage.TypedStorage:
        _, storage_type, _, _, numel = saved_id
        dtype = storage_type.dtype if hasattr(storage_type, "dtype") else storage_type(0).dtype
        untyped = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    unpickler.persistent_load = meta_storage
    unpickler.load()


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(path: Path) -> None:
    """This rank's RNG streams as saved, when the world size is the one they were saved at; a resharded
    resume keeps the freshly seeded ones (one rank's stream has no counterpart at another world size)."""
    if {p.name for p in path.glob("rng-*.pt")} != {f"rng-{r}.pt" for r in range(world())}:
        return
    with _refused_pickle(path):
        state = torch.load(path / f"rng-{rank()}.pt", weights_only=True)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_model(path: str | Path, model: nn.Module) -> None:
    """The model's weights alone from checkpoint `path` (for sampling): no optimizer moments or train state read."""
    state = {"model": get_model_state_dict(model)}
    _load_data_only(state, path)
    set_model_state_dict(model, state["model"])


def _load_data_only(state: dict[str, Any], path: str | Path) -> None:
    """dcp.load of `state` from checkpoint `path`, running nothing it holds (_DataOnlyReader, _DataOnlyPlanner)."""
    with _refused_pickle(path), dcp_call():
        dcp.load(state, storage_reader=_DataOnlyReader(str(path)), planner=_DataOnlyPlanner())


@contextlib.contextmanager
def _refused_pickle(path: str | Path) -> Iterator[None]:
    """A pickle weights_only refuses is damage, not a prompt to load it with weights_only=False (torch's advice)."""
    try:
        yield
    except (pickle.UnpicklingError, AssertionError) as e:  # DCP reports its metadata reader's error as the latter
        if isinstance(e, AssertionError) and "no part of DCP's metadata" not in str(e):
            raise
        named = re.search(r"GLOBAL (\S+)|(\S+) is no part of DCP's metadata", str(e))
        what = f"it names {named.group(1) or named.group(2)}" if named else type(e).__name__
        raise UserError(f"checkpoint {path} holds a pickle that is not plain data ({what}): it is damaged or "
                        "was tampered with; resume from the one before it (--resume does, after checking)") from None
