"""Sample text from a trained model: dsv3's own model, the tokenizer that travelled with the run.

    python scripts/generate.py runs/debug/export --prompt "def main(" [--max-tokens 100] [--temperature 0.8]
        [--top-k 50] [--seed 0] [--device auto]
    python scripts/generate.py runs/debug/step-200 --prompt ...

An export (train.py's, or convert_hf.py --to-dsv3's) holds config.json, the weights and the tokenizer. A checkpoint
records its run's model and data (train.json), whose tokenizer is used; one written before it did needs the run's own
--config and overrides. The prompt is encoded as the data was (BOS first where the tokenizer adds one); generation
stops at EOS or after --max-tokens. --temperature 0 is greedy. On CUDA the weights compute in bf16, as in training;
on CPU in fp32.

No KV cache: every new token re-runs the whole forward over the context (at most model.max_seq_len tokens, the
newest kept). dsv3.model's MLA is the training form, which expands the latent into per-head keys and values; a
cache would want the absorbed form, a second attention path in the model. For a sampling script the quadratic
cost is fine.
"""

import argparse
import sys
from dataclasses import fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file without installing dsv3
from dsv3 import checkpoint, export  # noqa: E402
from dsv3.config import ModelConfig, UserError, load_config, run_main, saved_model_config  # noqa: E402
from dsv3.data import data_tokenizer  # noqa: E402
from dsv3.model import Transformer  # noqa: E402
from dsv3.tokenizer import Tokenizer, find_tokenizer  # noqa: E402


@torch.no_grad()
def generate(model: Transformer, ids: list[int], max_tokens: int, temperature: float = 0.0, top_k: int = 0,
             eos_id: int | None = None) -> list[int]:
    """The ids `model` continues `ids` with: greedy at temperature 0, else sampled from softmax(logits / temperature)
    over the top_k most likely (0: all), with torch's global RNG; stops after max_tokens or at eos_id (not returned)."""
    device = model.embed.weight.device
    tokens = torch.tensor([ids], device=device)
    new: list[int] = []
    for _ in range(max_tokens):
        logits = model(tokens[:, -model.cfg.max_seq_len:])[0, -1].float()  # [vocab]
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            next_id = int(torch.multinomial(logits.softmax(-1), 1))
        if next_id == eos_id:
            break
        new.append(next_id)
        tokens = torch.cat([tokens, tokens.new_tensor([[next_id]])], dim=1)
    return new


def load_model(path: Path, config: str | None, overrides: list[str],
               device: torch.device) -> tuple[Transformer, Tokenizer | None]:
    """The model of an export (config.json beside the weights) or of a checkpoint (the one its train.json records,
    or `config` and `overrides`: the run's), and the tokenizer that travelled with it: the export's, or the run's
    data's."""
    exported = (path / "config.json").is_file()
    if not exported and (path / ".metadata").is_file() and (problem := checkpoint.verify(path)):
        raise UserError(f"{path} cannot be loaded: {problem}")  # before its train.json is read
    if exported:
        cfg, tokenizer = saved_model_config(path, then="sample from OUT_DIR"), find_tokenizer(path)
    elif not (path / ".metadata").is_file():
        raise UserError(f"{path} is neither an export (config.json + safetensors) nor a checkpoint (step-N/): "
                        "pass runs/NAME/export or runs/NAME/step-N")
    elif (path / checkpoint.TRAIN_STATE).is_file() and config is None:  # the run's model and data, as it recorded them
        record = checkpoint.read_train_state(path)["config"]
        cfg = ModelConfig(**record["model"])
        tokenizer = data_tokenizer([(name, source, share) for name, (source, share) in record["sources"].items()])
    elif config is None:
        raise UserError(f"{path} is a checkpoint that records no model config: pass the run's own --config "
                        "FILE.toml and --model.* overrides, or sample from its export")
    else:
        run = load_config(config, overrides)
        cfg, tokenizer = run.model_config(), data_tokenizer(run.data.mixture())
        if (path / checkpoint.TRAIN_STATE).is_file():  # before a model is built: another model's weights do not load
            recorded = ModelConfig(**checkpoint.read_train_state(path)["config"]["model"])
            changed = [f"{f.name} {getattr(cfg, f.name)} (it holds {getattr(recorded, f.name)})"
                       for f in fields(ModelConfig) if getattr(cfg, f.name) != getattr(recorded, f.name)]
            if changed:
                raise UserError(f"--config {config} describes another model than {path} holds: model."
                                f"{', model.'.join(changed)}; leave out --config (the checkpoint records its model)")
    model = Transformer(cfg).eval()
    if exported:
        export.load_weights(path, model)
    else:
        checkpoint.load_model(path, model)
    model.to(device)
    if device.type == "cuda":  # bf16 weights, as training computes on GPUs; RoPE tables and expert biases stay fp32
        for p in model.parameters():
            p.data = p.data.bfloat16()
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("weights", type=Path, help="an export directory, or a checkpoint step-N/")
    parser.add_argument("--config", default=None, help="an older checkpoint's run config (its --section.key=value too)")
    parser.add_argument("--prompt", default="", help="text to continue; empty: the start of a document")
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--tokenizer", default=None, help="a tokenizer file or directory instead of the run's")
    args, overrides = parser.parse_known_args(argv)
    if args.max_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        parser.error("--max-tokens must be >= 1, --temperature and --top-k >= 0")
    if overrides and args.config is None:
        parser.error(f"unrecognized arguments: {' '.join(overrides)} (config overrides go with --config)")
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.weights, args.config, overrides, device)
    if args.tokenizer:
        tokenizer = Tokenizer(args.tokenizer)
    if tokenizer is None:
        raise UserError(f"no tokenizer travelled with {args.weights} (no tokenizer.json or tokenizer.model in the "
                        "export, or in the data's tokenizer/): pass --tokenizer FILE")
    ids = ([tokenizer.bos_id] if tokenizer.add_bos else []) + tokenizer.encode(args.prompt)
    if not ids:  # an empty prompt: what follows a document's end
        ids = [tokenizer.eos_id]
    torch.manual_seed(args.seed)
    new = generate(model, ids, args.max_tokens, args.temperature, args.top_k, tokenizer.eos_id)
    print(tokenizer.decode(ids + new))


if __name__ == "__main__":
    run_main(main)
