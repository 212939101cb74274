"""The step time a checkpoint costs, blocking and in the background, in one run:
`python scripts/bench_save.py --config configs/16b_4layer.toml [--steps 12] [--dir runs/bench_save]
[--section.key=value ...]`.

Trains on random tokens; after `--warmup` steps, step `--steps` // 3 is followed by a blocking save and step
2 × `--steps` // 3 by a background one (checkpoint.async_save). The stall is what the save adds to training: for the
blocking save its own time; for the background one the time of its call (the copy to host memory) plus what every
step adds over the median step until its write is published. Prints one JSON object; the checkpoints are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from dsv3 import checkpoint, parallel  # noqa: E402
from dsv3.config import load_config, run_main  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=12, help="timed steps (the saves after a third and two thirds)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dir", default="runs/bench_save", help="where the two checkpoints are written, then removed")
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides)
    mcfg, t = cfg.model_config(), cfg.train
    rank, world, device = parallel.init_distributed(t.device)
    train.check_setup(cfg, world, device)
    model, copies = train.build_model(cfg, world, device)
    optimizer = train.build_optimizer(model, t, device, copies)
    generator = torch.Generator().manual_seed(rank)
    run_dir = Path(args.dir)

    def step(i: int) -> float:
        batch = torch.randint(0, mcfg.vocab_size, (t.global_batch // world, t.seq_len + 1), generator=generator)
        start = time.perf_counter()
        values, _ = train.train_step(model, optimizer, parallel.to_device(batch, device), t, i)
        values.tolist()  # the host waits for the step, as train.py's log steps do
        return time.perf_counter() - start

    def save(i: int, background: bool) -> float:
        start = time.perf_counter()
        checkpoint.save(run_dir / ("background" if background else "blocking"), i, model, optimizer, {"step": i},
                        keep=1, background=background)
        return time.perf_counter() - start

    for i in range(1, args.warmup + 1):
        step(i)
    blocking_at, background_at = args.steps // 3, 2 * args.steps // 3
    times, blocking_s, background_call_s, writing = [], 0.0, 0.0, []
    for i in range(args.warmup + 1, args.warmup + args.steps + 1):
        times.append(step(i))
        if checkpoint._in_flight is not None:
            writing.append(len(times) - 1)  # this step ran while the background write went on
            if not checkpoint._in_flight.thread.is_alive():
                checkpoint.wait_for_save()
        if i == args.warmup + blocking_at:
            blocking_s = save(i, background=False)
            shutil.rmtree(run_dir / "blocking", ignore_errors=True)  # the disk holds one 16B checkpoint at a time
        elif i == args.warmup + background_at:
            background_call_s = save(i, background=True)
    waited = time.perf_counter()
    checkpoint.wait_for_save()
    waited = time.perf_counter() - waited
    quiet = [s for k, s in enumerate(times) if k not in writing]
    median = statistics.median(quiet)
    background_s = background_call_s + sum(max(0.0, times[k] - median) for k in writing) + waited
    bytes_saved = sum(f.stat().st_size for f in (run_dir / "background").rglob("*") if f.is_file())
    shutil.rmtree(run_dir, ignore_errors=True)
    if rank == 0:
        print(json.dumps({"config": args.config, "checkpoint_gb": round(bytes_saved / 1e9, 2),
                          "step_s": round(median, 4), "blocking_stall_s": round(blocking_s, 3),
                          "background_stall_s": round(background_s, 3),
                          "background_call_s": round(background_call_s, 3),
                          "steps_during_write": len(writing), "waited_at_end_s": round(waited, 3),
                          "background_over_blocking": round(background_s / blocking_s, 3)}), flush=True)


if __name__ == "__main__":
    run_main(main)
