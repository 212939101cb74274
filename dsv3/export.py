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
from safetensors import safe_open
from torch import nn
# what HuggingFaceStorageWriter(enable_consolidation=True) runs, on rank 0 alone; torchtitan imports it the same way
from torch.distributed.checkpoint._consolidate_hf_safetensors import (consolidate_safetensors_files,
                                                                       consolidate_safetensors_files_on_every_rank)
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from dsv3.checkpoint import _barrier, _dcp_call, _rank
from dsv3.config import ModelConfig, UserError
from dsv3.hf import load_config_json, model_shapes, save_config
from dsv3.tokenizer import Tokenizer


def check_init_from(path: str | Path, cfg: ModelConfig) -> str:
    """Refuse, before anything is built, a checkpoint.init_from that holds no dsv3 weights (no safetensors at all,
    or a Hugging Face checkpoint: its config.json names a model_type, its tensors are named model.layers.*), or
    weights of other shapes than this model's, naming the [model] overrides that would fit them (from the
    config.json an export or convert_hf.py --to-dsv3 writes). Returns a note listing the fields that differ from
    that config.json without changing a shape (RoPE, routing: the run uses its own), "" if none."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise UserError(f"checkpoint.init_from={path} holds no *.safetensors: point it at an export, or convert an "
                        f"HF model with python scripts/convert_hf.py --to-dsv3 HF_DIR OUT_DIR")
    config_json = Path(path) / "config.json"
    try:
        hf_config = config_json.is_file() and "model_type" in json.loads(config_json.read_text())
    except ValueError as e:
        raise UserError(f"checkpoint.init_from: {config_json} is not JSON ({e}); export or convert it again") from None
    with safe_open(files[0], "pt") as f:
        hf_names = any(name.startswith("model.") for name in f.keys())
    if hf_config or hf_names:
        raise UserError(f"checkpoint.init_from={path} is a Hugging Face checkpoint: convert it first with "
                        f"python scripts/convert_hf.py --to-dsv3 {path} OUT_DIR, then pass "
                        f"--checkpoint.init_from=OUT_DIR")
    if not config_json.is_file():
        return ""  # load_weights still checks every key
    try:
        saved = load_config_json(config_json)
    except ValueError as e:
        raise UserError(f"checkpoint.init_from: {e}") from None
    differ = [f.name for f in dataclasses.fields(cfg) if getattr(saved, f.name) != getattr(cfg, f.name)]
    if model_shapes(saved) != model_shapes(cfg):
        fix = " ".join(f"--model.{name}={json.dumps(getattr(saved, name))}" for name in differ)
        raise UserError(f"checkpoint.init_from={path} holds a model of other shapes than this config's: "
                        f"match its config.json, e.g. {fix}")
    differ = [name for name in differ if name != "init_std"]  # moot: the weights are loaded, not drawn
    if not differ:
        return ""
    return (f"checkpoint.init_from={path}: this run's model differs from its config.json in "
            + ", ".join(f"{name} {getattr(saved, name)} -> {getattr(cfg, name)}" for name in differ)
            + " (no shape changes; the run uses its own values)")


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
    with _dcp_call():
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
    with _dcp_call():
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
