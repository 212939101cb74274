import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `dsv3`, `train` and `scripts` import from a plain checkout


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A few KB of English, code and non-Latin text: enough merges for a few hundred ids.
TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog; the dog sleeps on, and the fox runs into the forest.\n",
    "def train(model, batch, lr=3e-4):\n    loss = model(batch).mean()\n    loss.backward()\n    return loss.item()\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += x[i] * y[i];\n}\n",
    "数据并行与专家并行 データ並列 — naïve café, Ωμέγα ✓ 🚀 2025-01-20 12:34:56\n",
    "    if tokens_per_expert[e] > capacity:\n        dropped += 1\n\n\n",
] * 8


@pytest.fixture(scope="session")
def deepseek_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory laid out like DeepSeek-V3's tokenizer, built here (no download): tokenizer.json (byte-level
    BPE behind DeepSeek's split regexes, BOS / EOS / pad at ids 0 / 1 / 2, chat tokens at the top, and the BOS
    post-processor transformers writes for add_bos_token) and tokenizer_config.json (AddedToken dicts,
    add_bos_token true, LlamaTokenizerFast, legacy). 384 ids."""
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence([])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), "isolated"),
        pre_tokenizers.Split(Regex("[一-龥\u3040-ゟ゠-ヿ]+"), "isolated"),
        pre_tokenizers.Split(Regex(r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"""
                                   r"""|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"""
                                   r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TOKENIZER_CORPUS, trainers.BpeTrainer(
        vocab_size=381, special_tokens=[bos, eos, "<｜▁pad▁｜>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    ))
    tokenizer.add_special_tokens(["<｜fim▁hole｜>", "<｜User｜>", "<｜Assistant｜>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, 0)]
    )
    directory = tmp_path_factory.mktemp("deepseek_tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))

    def added(content: str) -> dict:
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
                "single_word": False}

    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": added(bos), "eos_token": added(eos),
              "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": 16384,
              "pad_token": added(eos), "sp_model_kwargs": {}, "unk_token": None,
              "tokenizer_class": "LlamaTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    return directory


@pytest.fixture(autouse=True)
def signal_handlers():
    """train.main catches SIGTERM and SIGINT during its loop and gives them back when the loop ends; a test that
    raises out of the loop would leave them caught, and Ctrl-C would no longer stop pytest."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="session")
def data() -> Path:
    """The bundled corpus (`python scripts/prepare_data.py`), written here if a checkout lacks it."""
    corpus = ROOT / "data" / "stdlib"
    if not (corpus / "val" / "index.json").is_file():
        from scripts.prepare_data import prepare
        prepare(None, str(ROOT / "data" / "tokenizer.model"), str(corpus), workers=os.cpu_count(),
                progress=False)
    return corpus


def free_port() -> int:
    """A free TCP port for a spawned process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_vars(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment variables torchrun gives rank `rank` of `world` processes on one host."""
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def torchrun_env(rank: int, world: int, port: int) -> None:
    """Make this process rank `rank` of `world`, as torchrun would."""
    os.environ.update(torchrun_vars(rank, world, port))


def leave_process_group() -> None:
    """The end of a spawned test worker, once its results are written: every rank leaves the process group together,
    then the process exits at once. Objects that outlive destroy_process_group (device meshes, FSDP state) keep gloo's
    threads to the interpreter's finalization, which rarely aborted there ("terminate called without an active
    exception", SIGABRT), failing a test whose work had passed."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def load_export(export_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export (or any safetensors directory), by name, from all its files."""
    tensors = {}
    for file in sorted(export_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """A run's metrics.jsonl by step; a later line for the same step (a resumed run's) wins."""
    by_step: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row.pop("step"), {}).update(row)
    return by_step


def on_full_disk(disk: Path, size_kib: int, code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -c code` (cwd: the checkout) with a tmpfs of `size_kib` KiB mounted at `disk`, in a mount namespace
    of its own: a real full disk, ENOSPC from the kernel. Skips where the machine allows no such mount."""
    disk.mkdir(parents=True, exist_ok=True)
    mount = f"mount -t tmpfs -o size={size_kib}k tmpfs {shlex.quote(str(disk))}"
    for unshare in (["unshare", "-m"], ["unshare", "-rm"]):
        probe = subprocess.run([*unshare, "sh", "-c", mount], capture_output=True)
        if probe.returncode == 0:
            break
    else:
        pytest.skip(f"no private tmpfs on this machine: {probe.stderr.decode().strip()}")
    command = f"{mount} && exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    return subprocess.run([*unshare, "sh", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
