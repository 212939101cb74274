"""Convert between HF DeepSeek-V3 checkpoints and dsv3 safetensors checkpoints, tensor by tensor.

    python scripts/convert_hf.py --to-dsv3 HF_DIR OUT_DIR
    python scripts/convert_hf.py --to-hf DSV3_DIR OUT_DIR [--fused-experts] [--allow-lossy] [--no-mtp]

HF_DIR: an HF config.json + *.safetensors shards: bf16/fp32, or DeepSeek's FP8 release as published
(float8_e4m3fn weights + `weight_scale_inv` block scales, config.json's quantization_config), which is
dequantized to bf16 weight by weight, each scale read from whichever shard holds it.
DSV3_DIR: our config.json (ModelConfig fields) + *.safetensors shards with `Transformer.state_dict()` names.
Both directions write shards of at most --max-shard-gb plus model.safetensors.index.json, and hold at most
one output shard and the routed-expert stacks still being collected, never the whole model. The tokenizer
files beside the source's config.json (tokenizer.json, tokenizer_config.json, ...) are copied along, so that
transformers loads model and tokenizer from one directory. Bad input stops before anything is written. OUT_DIR
must be new or empty: the conversion is written into OUT_DIR.tmp beside it and renamed to OUT_DIR when complete,
so a conversion killed midway leaves no OUT_DIR (a rerun removes the stale OUT_DIR.tmp).
--to-hf --no-mtp leaves the MTP modules out: transformers' DeepseekV3 has no MTP layers (it never predicts more
than the next token), and lists their tensors as UNEXPECTED keys when it loads a checkpoint that has them.
--to-hf refuses a softmax-routed model with a trained expert bias or route_norm (HF's deepseek_v2 has neither)
unless --allow-lossy. Files are written with the umask's mode (0644 under the usual 022), like config.json.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file without installing dsv3
from dsv3.config import UserError, load_config_json, run_main  # noqa: E402
from dsv3.hf import (  # noqa: E402
    FromHF,
    check_dsv3_keys,
    check_hf_keys,
    check_hf_represents,
    config_from_hf,
    config_to_hf,
    dequantize_fp8,
    fp8_block_size,
    fp8_scales,
    open_safetensors,
    save_config,
    tensor_to_hf,
)

INDEX = "model.safetensors.index.json"
# what transformers' AutoTokenizer (and generate's defaults) read from a checkpoint directory
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "generation_config.json")


def find_shards(src: Path) -> list[Path]:
    """The shards the index names, else every *.safetensors in src."""
    if (src / INDEX).exists():
        try:
            names = sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{src / INDEX} is not a safetensors index ({type(e).__name__}: {e}): it is damaged; "
                            "restore it, or remove it to convert every *.safetensors in the directory") from None
        if outside := [n for n in names if not isinstance(n, str) or Path(n).is_absolute() or ".." in Path(n).parts]:
            raise UserError(f"{src / INDEX} names shards outside {src}: {outside[:3]}; a checkpoint reads only "
                            "its own files")
        if missing := [n for n in names if not (src / n).is_file()]:
            raise UserError(f"{src / INDEX} names shards that are not in {src}: {', '.join(missing)}; "
                            f"download them or fix the index.")
        return [src / n for n in names]
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise UserError(f"no *.safetensors shards in {src}; point at a checkpoint directory.")
    return shards


def source_config(src: Path, hf: bool) -> dict:
    """src's config.json, once src is known to be a directory in the format this direction reads (Hugging Face's
    where `hf`, else dsv3's): checked before any shard is opened."""
    if not src.is_dir():
        raise UserError(f"{src} {'is not a directory' if src.exists() else 'does not exist'}; pass a checkpoint "
                        "directory (config.json + *.safetensors)")
    if (src / ".metadata").is_file():  # DCP's: a train.py checkpoint, step-N/
        raise UserError(f"{src} is a training checkpoint, which convert_hf.py does not read: convert its run's "
                        f"export, {src.parent / 'export'} (train.py writes it when the run ends)")
    path = src / "config.json"
    if not path.is_file():
        raise UserError(f"{path} not found: a checkpoint directory needs its config.json beside the shards.")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path} is not JSON ({e}): restore it from where the checkpoint came from") from None
    if hf and "model_type" not in config:  # ours holds ModelConfig fields only
        raise UserError(f"{src} is in dsv3's format already (its config.json has no model_type): train from it "
                        f"with --checkpoint.init_from={src}, or convert it for transformers with --to-hf")
    if not hf and "model_type" in config:
        raise UserError(f"{src} is a Hugging Face checkpoint (model_type {config['model_type']}): convert it to "
                        f"dsv3's format with --to-dsv3 {src} OUT_DIR")
    return config


@contextmanager
def describing(src: Path) -> Iterator[None]:
    """A mismatch between the shards' names or shapes and config.json, said of src's config.json."""
    try:
        yield
    except ValueError as e:
        raise UserError(f"{src / 'config.json'} does not describe the shards beside it: {e}") from None


class Header(NamedTuple):
    shard: Path
    dtype: str  # safetensors' name: "BF16", "F32", "F8_E4M3", ...
    shape: list[int]


def read_headers(shards: list[Path]) -> dict[str, Header]:
    """Every tensor's shard, dtype and shape from the safetensors headers, without reading any tensor."""
    headers = {}
    for shard in shards:
        with open_safetensors(shard) as f:
            for name in f.keys():
                if name in headers:  # which copy is meant is unknown: one of the shards is stale or misplaced
                    raise UserError(f"{name} is in two shards, {headers[name].shard} and {shard}; "
                                    f"remove the one that does not belong to this checkpoint.")
                header = f.get_slice(name)
                headers[name] = Header(shard, header.get_dtype(), header.get_shape())
    return headers


def expert_biases(shards: list[Path]) -> Iterator[torch.Tensor]:
    for shard in shards:
        with open_safetensors(shard) as f:
            yield from (f.get_tensor(name) for name in f.keys() if name.endswith("expert_bias"))


def read_tensors(shards: list[Path], total: int, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    with tqdm(total=total, unit="tensor", desc="converting") as progress:
        for shard in shards:
            with open_safetensors(shard) as f:
                for name in f.keys():
                    if name not in skip:
                        yield name, f.get_tensor(name)
                        progress.update()


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], scales: dict[str, str], headers: dict[str, Header],
                block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """The FP8 weights among `tensors` in bf16 (`scales`: weight → its scale's name). A scale is read from its
    own shard as its weight passes, since DeepSeek's release may keep the two in different shards."""
    for name, tensor in tensors:
        if name in scales:
            with open_safetensors(headers[scales[name]].shard) as f:
                tensor = dequantize_fp8(tensor, f.get_tensor(scales[name]), block)
        yield name, tensor


class ShardWriter:
    """Buffers tensors up to max_bytes per shard; `close()` names the shards -of-N and writes the index."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffer_bytes = 0
        self.shard_of: dict[str, int] = {}  # tensor name → shard number
        self.n_shards = 0
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffer_bytes + size > self.max_bytes:
            self._flush()
        self.buffer[name] = tensor.contiguous()
        self.buffer_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        self.n_shards += 1
        path = self.out / f"part-{self.n_shards:05d}.tmp"
        save_file(self.buffer, path, metadata={"format": "pt"})
        path.chmod(0o666 & ~current_umask())  # save_file creates 0600 files; config.json and the index are not
        self.shard_of.update(dict.fromkeys(self.buffer, self.n_shards))
        self.buffer, self.buffer_bytes = {}, 0

    def close(self) -> None:
        if self.buffer:
            self._flush()
        # the final names carry the shard count, known only now
        names = {i: f"model-{i:05d}-of-{self.n_shards:05d}.safetensors" for i in range(1, self.n_shards + 1)}
        for i, name in names.items():
            (self.out / f"part-{i:05d}.tmp").rename(self.out / name)
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {k: names[i] for k, i in sorted(self.shard_of.items())}}
        (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def current_umask() -> int:
    umask = os.umask(0)  # reading it means setting it; set it straight back
    os.umask(umask)
    return umask


def check_output(out: Path) -> None:
    """`out` must be new or empty: the finished conversion is renamed onto it, which merging into a directory that
    holds files would not be (and could overwrite them)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty directory; pick a new or empty output directory.")


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A directory beside `out` to convert into, renamed to `out` once everything is written: a conversion killed
    midway leaves no `out` that looks complete (all shards, config.json half-written), as dsv3.export does."""
    out = Path(os.path.realpath(out))  # "." has no name to append to; a link's target is where the rename lands
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed run's leftovers
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, out)  # atomic; replaces an empty `out` too (POSIX rename)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_tokenizer(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)  # a new file with the umask's mode, like the shards


def to_dsv3(src: Path, out: Path, max_bytes: int) -> None:
    hf_config = source_config(src, hf=True)
    cfg, block = config_from_hf(hf_config), fp8_block_size(hf_config)
    shards = find_shards(src)
    headers = read_headers(shards)
    scales = fp8_scales({n: h.dtype for n, h in headers.items()}, {n: h.shape for n, h in headers.items()}, block)
    scale_names = set(scales.values())
    shapes = {n: h.shape for n, h in headers.items() if n not in scale_names}
    if cfg.n_mtp_layers and not any(n.startswith(f"model.layers.{cfg.n_layers}.") for n in shapes):
        print(f"{src} has no MTP layers (transformers does not save them): converting with n_mtp_layers=0")
        cfg = dataclasses.replace(cfg, n_mtp_layers=0)
    with describing(src):
        check_hf_keys(shapes, cfg)  # fail before writing anything
    check_output(out)
    with staged(out) as tmp:
        importer, writer = FromHF(cfg), ShardWriter(tmp, max_bytes)
        for name, tensor in dequantized(read_tensors(shards, len(shapes), skip=scale_names), scales, headers, block):
            for key, converted in importer.add(name, tensor).items():
                writer.add(key, converted)
        for key, converted in importer.finish().items():
            writer.add(key, converted)
        writer.close()
        save_config(cfg, tmp / "config.json")
        copy_tokenizer(src, tmp)


def to_hf(src: Path, out: Path, max_bytes: int, fused_experts: bool, allow_lossy: bool = False,
          no_mtp: bool = False) -> None:
    source_config(src, hf=False)
    cfg = load_config_json(src / "config.json")
    shards = find_shards(src)
    shapes = {n: h.shape for n, h in read_headers(shards).items()}
    with describing(src):
        check_dsv3_keys(shapes, cfg)
    check_hf_represents(cfg, expert_biases(shards), allow_lossy)
    check_output(out)
    left_out = {key for key in shapes if key.startswith("mtp.")} if no_mtp else set()
    if no_mtp:  # transformers never runs MTP layers: without them it loads every tensor it is given
        cfg = dataclasses.replace(cfg, n_mtp_layers=0)
    with staged(out) as tmp:
        writer = ShardWriter(tmp, max_bytes)
        for key, tensor in read_tensors(shards, len(shapes) - len(left_out), skip=left_out):
            for name, converted in tensor_to_hf(key, tensor, cfg, fused_experts).items():
                writer.add(name, converted)
        writer.close()
        (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
        copy_tokenizer(src, tmp)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to-dsv3", nargs=2, metavar=("HF_DIR", "OUT_DIR"), type=Path)
    direction.add_argument("--to-hf", nargs=2, metavar=("DSV3_DIR", "OUT_DIR"), type=Path)
    parser.add_argument("--fused-experts", action="store_true",
                        help="--to-hf: transformers-5 fused experts instead of per-expert tensors as on disk")
    parser.add_argument("--allow-lossy", action="store_true",
                        help="--to-hf: export a model HF cannot represent exactly (softmax router with a trained "
                             "expert bias or route_norm), with a warning")
    parser.add_argument("--no-mtp", action="store_true",
                        help="--to-hf: leave the MTP modules out (transformers ignores them, and lists their tensors "
                             "as UNEXPECTED when it loads them)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0)
    args = parser.parse_args(argv)
    if (args.fused_experts or args.no_mtp) and not args.to_hf:
        parser.error("--fused-experts and --no-mtp choose what --to-hf writes")
    max_bytes = int(args.max_shard_gb * 1e9)
    try:
        if args.to_dsv3:
            to_dsv3(*args.to_dsv3, max_bytes)
        else:
            to_hf(*args.to_hf, max_bytes, args.fused_experts, args.allow_lossy, args.no_mtp)
    except ValueError as e:  # config or key mismatch, explained by dsv3.hf
        raise UserError(str(e)) from None


if __name__ == "__main__":
    run_main(main)
