import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `dsv3`, `train` and `scripts` import from a plain checkout


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
        prepare(None, str(ROOT / "data" / "tokenizer.model"), str(corpus), num_threads=os.cpu_count(),
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
