"""The model as safetensors, out and in: the final export (HF-style files with dsv3 names and full tensors,
written by every rank) and `checkpoint.init_from`, checked before anything is built (`check_init_from`) and
loaded into the possibly sharded model (`load_weights`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

# what HuggingFaceStorageWriter(enable_consolidation=True) runs, on rank 0 alone; torchtitan imports it the same way
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from dsv3.checkpoint import barrier, dcp_call, rank, wait_for_save
from dsv3.config import FLAVORS, Config, ModelConfig, UserError, hf_checkpoint_error, saved_model_config
from dsv3.hf import model_shapes, open_safetensors, save_config
from dsv3.safeopen import refuse_link
from dsv3.tokenizer import Tokenizer


def check_init_from(cfg: Config) -> str:
    """Refuse, before anything is built, a checkpoint.init_from without dsv3 weights (no safetensors, or HF's) or a
    [model] override that reshapes a saved tensor. Returns the banner's line: where weights and model come from,
    and each field that differs from the flavor and the overrides (which reshape nothing: RoPE, routing)."""
    path = cfg.checkpoint.init_from
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise UserError(f"checkpoint.init_from={path} holds no *.safetensors: point it at an export, or convert an "
                        f"HF model with python scripts/convert_hf.py --to-dsv3 HF_DIR OUT_DIR")
    with open_safetensors(files[0]) as f:
        if any(name.startswith("model.") for name in f.keys()):  # HF's tensor names
            raise hf_checkpoint_error(path)
    saved, model = saved_model_config(path), cfg.model_config()
    if saved is None:  # load_weights still checks every key
        return f"init    weights from {path} (no config.json: the model is flavor {cfg.flavor}'s and the overrides)"
    if model_shapes(model) != model_shapes(saved):
        reshaping = [key for key, value in cfg.model.items() if _reshapes(saved, key, value)] or list(cfg.model)
        raise UserError(f"checkpoint.init_from={path} holds a model of other shapes than "
                        + " ".join(f"--model.{key}={json.dumps(cfg.model[key])}" for key in reshaping)
                        + f" makes: drop {'it' if len(reshaping) == 1 else 'them'}, the model comes from "
                        f"{path}/config.json")

    def changes(old: ModelConfig, new: ModelConfig) -> str:
        return ", ".join(f"{f.name} {getattr(old, f.name)} -> {getattr(new, f.name)}" for f in dataclasses.fields(new)
                         if getattr(old, f.name) != getattr(new, f.name) and f.name != "init_std")  # moot: loaded

    line = f"init    weights and model from {path} (config.json)"
    if unlike_flavor := changes(FLAVORS[cfg.flavor], saved):
        line += f"; unlike flavor {cfg.flavor}: {unlike_flavor}"
    if overridden := changes(saved, model):
        line += f"; overridden by [model]: {overridden}"
    return line


def _reshapes(saved: ModelConfig, key: str, value: Any) -> bool:
    """Whether the override key = value alone changes a saved tensor's shape (or makes no valid model)."""
    try:
        return model_shapes(dataclasses.replace(saved, **{key: value})) != model_shapes(saved)
    except UserError:
        return True


def load_weights(path: str | Path, model: nn.Module) -> None:
    """Initialise the (possibly sharded) model from a dsv3 safetensors directory; each rank reads only
    the slices it holds, so a 671B import never passes through one process."""
    state = get_model_state_dict(model)
    on_disk = set()
    for file in Path(path).glob("*.safetensors"):
        with open_safetensors(file) as f:
            on_disk |= set(f.keys())
    missing, unexpected = sorted(state.keys() - on_disk), sorted(on_disk - state.keys())
    if missing or unexpected:
        raise UserError(f"checkpoint.init_from={path} does not fit this model: missing {missing[:10]} "
                        f"({len(missing)}), unexpected {unexpected[:10]} ({len(unexpected)}); check the flavor "
                        f"and [model] overrides against its config.json")
    with dcp_call():
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
    set_model_state_dict(model, state)


def export(out_dir: str | Path, model: nn.Module, cfg: ModelConfig, tokenizer: Tokenizer | None = None) -> None:
    """The model as HF-style safetensors (dsv3 names, full tensors, a file per block and one for the rest), with
    `config.json` and the tokenizer, atomically: into `out_dir.tmp/`, renamed when complete. No rank holds the whole
    model (docs/training.md#the-run-directory-checkpoints-and-resuming)."""
    wait_for_save()  # a checkpoint still writing in the background comes first: the disk holds both
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    for path in (tmp, out_dir):  # the export would go to a link's target
        refuse_link(path)
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    state = get_model_state_dict(model)
    file_of = _file_per_block(state)
    writer = dcp.HuggingFaceStorageWriter(str(tmp / "sharded"), fqn_to_index_mapping=file_of, save_distributed=True)
    try:
        with dcp_call():
            dcp.save(state, storage_writer=writer)
        if dist.is_initialized():
            consolidate_safetensors_files_on_every_rank(str(tmp / "sharded"), str(tmp), file_of)
        else:
            consolidate_safetensors_files(str(tmp / "sharded"), str(tmp), file_of)
    except Exception as e:
        if rank() == 0:  # on a full disk its bytes are in the way of the resumed run that writes it again
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno is not None and not e.filename:  # DCP's writer names no file
            e = OSError(e.errno, e.strerror, str(tmp)).with_traceback(e.__traceback__)
        e.add_note(f"the half-written {tmp.name} was removed; the export is written again by --resume")
        raise e
    barrier()
    if rank() == 0:
        shutil.rmtree(tmp / "sharded")
        save_config(cfg, tmp / "config.json")
        if tokenizer is not None:
            tokenizer.save(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    barrier()


def _file_per_block(state: dict[str, Any]) -> dict[str, int]:
    """Output file (1..N) of each tensor: one per transformer block and MTP module, one for the embedding, final
    norm and head. Files are what ranks share out when assembling an export."""
    def block(name: str) -> tuple[str, int]:
        parts = name.split(".")
        return (parts[0], int(parts[1])) if parts[0] in ("layers", "mtp") else ("", 0)

    index = {key: i for i, key in enumerate(sorted({block(name) for name in state}), start=1)}
    return {name: index[block(name)] for name in state}
