"""Training checkpoints with torch.distributed.checkpoint (sharded, reshardable: save at world 4, resume
at 2 or 1) and the final safetensors export. A checkpoint is written to `step-N.tmp/` and renamed to
`step-N/` only when complete, so a crash mid-save never touches the last good one."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from dsv3.config import ModelConfig, UserError
from dsv3.hf import save_config

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (unfinished `*.tmp` ones are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


@contextlib.contextmanager
def _quiet_without_group() -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process, even when told so (no_dist=True):
    here that is the intent, so the warning is noise. With a group, nothing is filtered."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any], keep: int) -> Path:
    """Model (expert biases included: they are buffers), optimizer, `train_state` (step, data-loader
    position, ...) and every rank's RNG state as `run_dir/step-{step}`; keeps the newest `keep`."""
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"step-{step}", run_dir / f"step-{step}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
             "train": train_state}
    with _quiet_without_group():
        dcp.save(state, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-{_rank()}.pt")  # per rank: DCP keeps one copy of a plain tensor
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint into the (possibly differently sharded) model and optimizer; returns the saved
    train_state (`train_state` gives its keys and types)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
             "train": train_state}
    with _quiet_without_group():
        dcp.load(state, checkpoint_id=str(path))
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
    resume keeps the freshly seeded ones (one rank's stream has no counterpart at another world size).
    Nothing draws from them after the model's init today: this keeps resume exact once something does."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if {p.name for p in path.glob("rng-*.pt")} != {f"rng-{r}.pt" for r in range(world)}:
        return
    state = torch.load(path / f"rng-{_rank()}.pt")
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on CPU (gathered on every rank; only rank 0 keeps real tensors)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # An expert stack sharded over ep and then efsdp can only be gathered by two all-gathers in turn, which
    # DTensor logs as a warning on every rank; for a one-off gather that is expected, not news.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        return get_model_state_dict(model, options=options)
    finally:
        redistribute_log.setLevel(level)


def export(out_dir: str | Path, model: nn.Module, cfg: ModelConfig) -> None:
    """Write `model.safetensors` (dsv3 names) + `config.json` (ModelConfig fields), atomically."""
    state = full_state_dict(model)
    if _rank() == 0:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in state.items()}
        save_file(tensors, out_dir / "model.safetensors.tmp")
        os.replace(out_dir / "model.safetensors.tmp", out_dir / "model.safetensors")
        save_config(cfg, out_dir / "config.json.tmp")
        os.replace(out_dir / "config.json.tmp", out_dir / "config.json")
    _barrier()
