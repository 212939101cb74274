import threading
import time

import pytest
import torch

from dsv3 import checkpoint, host_memory

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_pinning_from_a_thread_lets_the_training_thread_run():
    """torch's cudaHostRegister binding holds Python's lock while the pages lock (~0.5 s a GB): the training thread
    stops. The driver called through ctypes lets it run."""
    host = torch.ones(2 << 30, dtype=torch.uint8)  # 2 GiB, its pages touched
    torch.cuda.init()
    pinned = threading.Event()
    took = []

    def pin() -> None:
        torch.cuda.set_device(0)
        since = time.perf_counter()
        host_memory.pin(host.untyped_storage())
        took.append(time.perf_counter() - since)
        pinned.set()

    thread = threading.Thread(target=pin)
    longest_gap, last = 0.0, time.perf_counter()
    thread.start()
    while not pinned.is_set():  # a loop of Python: it runs only while it holds the lock
        now = time.perf_counter()
        longest_gap, last = max(longest_gap, now - last), now
    thread.join()
    assert host.is_pinned()
    assert took[0] > 0.2, "too little memory to tell a held lock from a released one"
    assert longest_gap < took[0] / 4


def test_a_background_save_on_cuda_stages_into_pinned_buffers_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_staging", None)  # a stager of its own, made once CUDA is initialized
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, device="cuda")  # 4 MB of weight: pinned
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    optimizer.step()
    checkpoint.prepare_background_save(model, optimizer)
    with torch.no_grad():
        model.weight.add_(1.0)
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    checkpoint.save(tmp_path, 1, model, optimizer, {"step": 1}, keep=2, background=True)
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step, while the write runs
    checkpoint.wait_for_save()
    assert checkpoint._staging.pinned, "no host buffer was pinned"
    checkpoint.load_model(tmp_path / "step-1", model)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in saved.items())
