"""Plan a run before renting the GPUs: `python scripts/plan.py --config C [--section.key=value ...]
[--gpus N] [--gpu h100|h200|b200] [--search [--top K]] [--json]`.

Prints the layout it plans (ep, micro-batch, AC mode, moment dtype, as the overrides that select them), per-GPU
memory at its peak (what is alive then, by line; with --tensors, every tensor alive then and its lifetime) and
whether it fits, with the fix train.py would name when it does not; then step time (itemised), tokens/s per GPU and
the time `train.steps` take, with the rates and overlap assumptions behind them (dsv3/plan.py). With --search, every
layout that fits instead, the fastest planned first. Without --gpus it plans for the config's `parallel.gpus` (or
`parallel.ep` GPUs when that is 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv3.config import Config, UserError, load_config, run_main  # noqa: E402
from dsv3.plan import FIT_FRACTION, GIB, GPUS, Plan, advice, bottleneck, layout_flags, plan, search, train_hours  # noqa: E402


def format_layout(cfg: Config, p: Plan) -> str:
    """What the plan planned, in the config's own terms."""
    t = cfg.train
    micro_batches = p.tokens_per_step_per_gpu // (t.micro_batch * t.seq_len)
    return (f"layout on {p.gpus} × {p.gpu}: {layout_flags(cfg)}\n"
            f"  per GPU per step: {micro_batches} micro-batch{'es' if micro_batches > 1 else ''} of "
            f"train.micro_batch={t.micro_batch} sequences × {t.seq_len} tokens (train.global_batch={t.global_batch} "
            f"over {p.gpus} GPUs); parallel.ep_backend={cfg.parallel.ep_backend}")


def format_training_time(cfg: Config, p: Plan) -> str:
    hours = train_hours(cfg, p)
    return (f"train.steps={cfg.train.steps}: {_duration(hours)} on {p.gpus} GPUs, {hours * p.gpus:,.0f} GPU-hours "
            "at this rate")


def _duration(hours: float) -> str:
    if hours < 1:
        return f"{60 * hours:.0f} min"
    return f"{hours:,.1f} h" if hours < 48 else f"{hours / 24:,.1f} days"


def format_plan(cfg: Config, p: Plan, fix: str | None = None, tensors: bool = False) -> str:
    """The plan as text; `fix`: what to set when it does not fit (dsv3.plan.advice)."""
    width = max(map(len, [*p.memory, *p.time]))
    peak = p.peak_phase
    lines = [format_layout(cfg, p),
             f"memory per GPU ({p.gpus} × {p.gpu}) at its peak, {p.phases[peak]}: what is alive then"]
    lines += [f"  {name:<{width}}  {gib:7.2f} GiB" for name, gib in p.memory.items()]
    lines.append(f"  {'total':<{width}}  {p.memory_gib_per_gpu:7.2f} GiB of {p.capacity_gib:.1f}: "
                 f"{'fits' if p.fits else 'does NOT fit'} (limit {FIT_FRACTION:.0%})")
    if fix:
        lines.append(f"  to fit, {fix}")
    if tensors:
        lines.append("tensors alive at the peak (GiB, alive from → until):")
        lines += [f"  {x.bytes / GIB:8.3f}  {x.name}  ({p.phases[x.first]} → {p.phases[x.last]})"
                  for x in p.alive(peak)]
    lines.append(f"time per optimizer step ({p.tokens_per_step_per_gpu} tokens per GPU):")
    lines += [f"  {name:<{width}}  {1e3 * s:9.1f} ms" for name, s in p.time.items()]
    lines.append(f"  {'total':<{width}}  {1e3 * p.step_s:9.1f} ms → {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")
    lines.append(format_training_time(cfg, p))
    lines.append("assumptions:")
    lines += [f"  {a}" for a in p.assumptions]
    return "\n".join(lines)


def format_search(cfg: Config, p: Plan, found: list[tuple[Config, Plan]], top: int) -> str:
    """The `top` fastest layouts that fit, with this config's own rank, memory, bottleneck and training time."""
    mine = layout_flags(cfg)
    rank = next((i for i, (layout, _) in enumerate(found, 1) if layout_flags(layout) == mine), None)
    lines = [format_layout(cfg, p),
             f"  planned: {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {p.memory_gib_per_gpu:.1f} GiB per GPU of "
             f"{p.capacity_gib:.1f}: " + (f"rank {rank} of the {len(found)} layouts that fit" if rank else
                                          "does NOT fit"),
             f"the fastest layouts on {p.gpus} × {p.gpu} (every other setting as configured), "
             f"for train.steps={cfg.train.steps}:",
             f"  {'#':>2}  {'tokens/s/GPU':>12}  {'vs this':>7}  {'GiB/GPU':>7}  {'time':>11}  {'GPU-hours':>9}  "
             f"bottleneck (share of the step)"]
    for i, (layout, q) in enumerate(found[:top], 1):
        hours, speedup = train_hours(layout, q), q.tokens_per_s_per_gpu / p.tokens_per_s_per_gpu
        lines.append(f"  {i:>2}  {q.tokens_per_s_per_gpu:>12,.0f}  {speedup:>6.2f}×  {q.memory_gib_per_gpu:>7.1f}  "
                     f"{_duration(hours):>11}  {hours * q.gpus:>9,.0f}  {bottleneck(q)}")
        lines.append(f"      {layout_flags(layout)}")
    if not found:
        lines.append("  none fits: use more GPUs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a TOML config (default: the built-in defaults)")
    parser.add_argument("--gpus", type=int, help="GPU count (default: parallel.gpus, else parallel.ep)")
    parser.add_argument("--gpu", default="h100", help=f"GPU kind: {' | '.join(GPUS)} (default h100)")
    parser.add_argument("--tensors", action="store_true", help="list every tensor alive at the peak")
    parser.add_argument("--search", action="store_true",
                        help="rank every layout (ep, micro-batch, AC mode, moment dtype) that fits by tokens/s")
    parser.add_argument("--top", type=int, default=5, help="layouts --search prints (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except (OSError, ValueError) as e:
        raise UserError(str(e)) from e
    gpus = args.gpus or cfg.parallel.gpus or cfg.parallel.ep
    if gpus < 1:
        raise UserError(f"--gpus must be a positive GPU count, got {gpus}")
    kind = args.gpu.lower()
    planned = plan(cfg, gpus, kind)
    found = search(cfg, gpus, kind) if args.search else None
    if args.json:
        record = {**planned.as_dict(), "layout": layout_flags(cfg), "train_hours": train_hours(cfg, planned),
                  "fix": None if planned.fits else advice(cfg, gpus, kind)}
        if found is not None:
            record["search"] = [{"layout": layout_flags(layout), "tokens_per_s_per_gpu": q.tokens_per_s_per_gpu,
                                 "memory_gib_per_gpu": q.memory_gib_per_gpu, "bottleneck": bottleneck(q),
                                 "train_hours": train_hours(layout, q)} for layout, q in found]
        print(json.dumps(record, indent=1))
    elif found is not None:
        print(format_search(cfg, planned, found, args.top))
    else:
        print(format_plan(cfg, planned, None if planned.fits else advice(cfg, gpus, kind), args.tensors))


if __name__ == "__main__":
    run_main(main)
