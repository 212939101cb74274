"""train.deterministic: one seed, config and world size give bit-identical losses and weights, on GPUs too.

The seed already fixes the initial weights, the data order and the stochastic rounding of bf16 moments; what varies
between two GPU runs is the order in which kernels sum. `make_deterministic` fixes it, before CUDA, cuBLAS or NCCL
start (train.py calls it first):
- torch's deterministic algorithms: an op with a deterministic implementation uses it (scatter_add_, index_add,
  index_put with accumulate, ...), one without raises instead of varying silently; inductor's deterministic mode
  with it: no kernel chosen by timing, since a faster-measured config sums in another order;
- cuBLAS with a fixed workspace (CUBLAS_WORKSPACE_CONFIG), without which it may split a GEMM's reduction
  differently from run to run; cuDNN's deterministic algorithms, none picked by benchmarking;
- NCCL on one algorithm and protocol (NCCL_ALGO=Ring, NCCL_PROTO=Simple): its reductions then sum in one order,
  whatever its tuner would pick. Values the user set are kept.
DeepEP is refused with it (dsv3.config): its intranode combine reads a token's rows from their ranks in rank order
into an fp32 sum, a fixed order by reading, but no run here has compared two of its runs bit for bit.
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
