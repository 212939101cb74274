"""What a checkpoint costs the training, blocking and in the background, in one run:
`python scripts/bench_save.py --config configs/16b_4layer.toml [--saves 2] [--write-limit 300] [--dir DIR]
[--section.key=value ...]`.

Trains on random tokens: `--warmup` steps, then `--quiet-steps` timed ones (their median is the step's time), then
steps while a thread allocates the background save's host buffers (as train.py does after its first step), then a
blocking save, then `--saves` background saves (checkpoint.async_save), each followed by training steps until its
write is published, as a run goes on training. A blocking save stalls the training for its whole time; a background
one for its call (the copy to host memory), what the steps during its write took beyond the quiet median, and its
publication on the training thread (rotation); the allocation for what its steps took beyond the median. At most
two checkpoints are on disk at a time; all are removed at the end. Prints a line per save on stderr, then one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from dsv3 import checkpoint, parallel  # noqa: E402
from dsv3.config import load_config, run_main  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    parser.add_argument("--quiet-steps", type=int, default=10, help="timed steps with no save: the step's median")
    parser.add_argument("--saves", type=int, default=2, help="background saves, one after the other")
    parser.add_argument("--write-limit", type=float, default=300.0,
                        help="seconds of training per background write; a write still going then is waited for, "
                             "and that wait counted in its stall")
    parser.add_argument("--dir", default="runs/bench_save", help="where the checkpoints are written, then removed")
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides)
    mcfg, t = cfg.model_config(), cfg.train
    rank, world, device = parallel.init_distributed(t.device)
    train.check_setup(cfg, world, device)
    model, copies = train.build_model(cfg, world, device)
    optimizer = train.build_optimizer(model, t, device, copies)
    generator = torch.Generator().manual_seed(rank)
    run_dir = Path(args.dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    step_no = 0

    def step() -> float:
        nonlocal step_no
        step_no += 1
        batch = torch.randint(0, mcfg.vocab_size, (t.global_batch // world, t.seq_len + 1), generator=generator)
        start = time.perf_counter()
        values, _ = train.train_step(model, optimizer, parallel.to_device(batch, device), t, step_no)
        values.tolist()  # the host waits for the step, as train.py's log steps do
        return time.perf_counter() - start

    def say(line: str) -> None:
        if rank == 0:
            print(line, file=sys.stderr, flush=True)

    def timed(action: Callable[[], object]) -> float:
        start = time.perf_counter()
        action()
        return time.perf_counter() - start

    def still_writing(since: float) -> bool:
        """Every rank alike: go on training while any rank's write goes on, within the limit."""
        writing = torch.tensor([float(checkpoint._in_flight.thread.is_alive()
                                      and time.perf_counter() - since < args.write_limit)], device=device)
        if dist.is_initialized():
            dist.all_reduce(writing, op=dist.ReduceOp.MAX)
        return bool(writing.item())

    for _ in range(args.warmup):
        step()
    median = statistics.median(step() for _ in range(args.quiet_steps))
    say(f"quiet step {median:.4f} s")
    prepare_s = timed(lambda: checkpoint.prepare_background_save(model, optimizer))  # as train.py after its step 1
    preparing = []
    while checkpoint._staging.preparing.is_alive():
        preparing.append(step())
    prepare_s += sum(preparing) - len(preparing) * median
    say(f"host buffers allocated over {len(preparing)} steps, costing them {prepare_s:.3f} s")
    blocking = run_dir / "blocking" / f"step-{step_no}"
    blocking_s = timed(lambda: checkpoint.save(blocking.parent, step_no, model, optimizer, {"step": step_no}, keep=1))
    checkpoint_gb = sum(f.stat().st_size for f in blocking.rglob("*") if f.is_file()) / 1e9
    say(f"blocking save {blocking_s:.1f} s ({checkpoint_gb:.1f} GB)")
    saves = []
    for k in range(args.saves):
        call_s = timed(lambda: checkpoint.save(run_dir / "background", step_no, model, optimizer, {"step": step_no},
                                               keep=1, background=True))
        since, during = time.perf_counter(), []
        while still_writing(since):
            during.append(step())
        write_s = time.perf_counter() - since  # to within a step
        publish_s = timed(checkpoint.wait_for_save)  # what a limited write left, the rotation of the older one
        excess_s = sum(during) - len(during) * median
        saves.append({"call_s": round(call_s, 3), "write_s": round(write_s, 1), "steps": len(during),
                      "steps_excess_s": round(excess_s, 3), "publish_s": round(publish_s, 3),
                      "stall_s": round(call_s + excess_s + publish_s, 3)})
        say(f"background save {k + 1}: {saves[-1]}")
        if k == 0:
            checkpoint.barrier()
            if rank == 0:
                shutil.rmtree(blocking.parent, ignore_errors=True)
    checkpoint.barrier()
    if rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        first, steady = prepare_s + saves[0]["stall_s"], saves[-1]["stall_s"]  # the first pays the allocation
        print(json.dumps({"config": args.config, "checkpoint_gb": round(checkpoint_gb, 2), "step_s": round(median, 4),
                          "blocking_stall_s": round(blocking_s, 3), "prepare_stall_s": round(prepare_s, 3),
                          "prepare_steps": len(preparing), "background": saves,
                          "first_over_blocking": round(first / blocking_s, 3),
                          "steady_over_blocking": round(steady / blocking_s, 3)}), flush=True)


if __name__ == "__main__":
    run_main(main)
