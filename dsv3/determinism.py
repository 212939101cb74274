"""train.deterministic: one seed, config and world size give bit-identical losses and weights, on GPUs too.

The seed fixes the weights, the data order and the stochastic rounding; what varies between GPU runs is the order in
which kernels sum. `make_deterministic` fixes it before CUDA, cuBLAS or NCCL start: torch's (and inductor's)
deterministic algorithms, a fixed cuBLAS workspace, deterministic cuDNN, NCCL's Ring algorithm with the Simple protocol
(values the user set are kept). DeepEP is refused with it (dsv3.config): no run compared two of its runs bit for bit.
Costs and checks: docs/training.md#reproducibility.
"""

from __future__ import annotations

import os

import torch

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


def make_deterministic() -> None:
    """Process-wide, for the rest of the process: train.py is one run per process."""
    for name, value in DETERMINISTIC_ENV.items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    from torch._inductor import config as inductor  # torch.compile's settings: imported only by runs asking for this

    inductor.deterministic = True  # recent torch sets it with the line above too
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
