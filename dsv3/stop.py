"""Stopping like a cluster job. Slurm and Kubernetes send SIGTERM some time before SIGKILL (torchrun passes it on to
its workers); Ctrl-C sends SIGINT. Neither kills a run mid-step: from `StopSignal()` on, they ask it to stop at the
next step boundary, where train.py saves a checkpoint and exits with 128 + the signal's number (143, 130), the code
a scheduler reads as "stopped by a signal" and may requeue.

A signal can reach the ranks during different steps, so after every step the ranks agree, with one all-reduce of a
flag on the CPU (gloo: a CUDA collective would make the host wait for the step's kernels). Later signals change
nothing: under Slurm and torchrun every worker may get the same SIGTERM twice (from Slurm and from torchrun), and a
second Ctrl-C must not cut the save short.
"""

from __future__ import annotations

import os
import shlex
import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Catches SIGTERM and SIGINT until `restore()`; `agreed()` says, on every rank alike, whether to stop now."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._group = None
        if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # a collective of every rank: all construct one
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def agreed(self) -> signal.Signals | None:
        """The signal to stop on, or None; the same on every rank (SIGTERM if ranks received different ones)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([self.received or 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return signal.Signals(flag.item()) if flag.item() else None

    def restore(self) -> None:
        """Give the signals back their previous handlers (for SIGINT, Python's KeyboardInterrupt)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: its own arguments with --resume, under the launcher it ran under."""
    args = shlex.join([arg for arg in argv if arg not in ("--resume", "--checkpoint.resume=true")] + ["--resume"])
    if "WORLD_SIZE" not in os.environ:
        return f"python train.py {args}"
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if world == per_node:
        return f"torchrun --nproc_per_node={per_node} train.py {args}"
    return f"your launch command (torchrun on {world // per_node} nodes) for train.py {args}"
