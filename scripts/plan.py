"""Plan a run before renting the GPUs: `python scripts/plan.py --config C [--section.key=value ...]
[--gpus N] [--gpu h100|h200|b200] [--json]`.

Prints per-GPU memory (itemised) and whether it fits, then step time (itemised) and tokens/s per GPU, with the
rates and overlap assumptions behind them (dsv3/plan.py). Without --gpus it plans for the config's
`parallel.gpus` (or `parallel.ep` GPUs when that is 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv3.config import UserError, load_config, run_main  # noqa: E402
from dsv3.plan import FIT_FRACTION, GPUS, Plan, fit_advice, plan  # noqa: E402


def format_plan(p: Plan, advice: str = "") -> str:
    """The plan as a table; `advice`: what to change when it does not fit (dsv3.plan.fit_advice)."""
    width = max(map(len, [*p.memory, *p.time]))
    lines = [f"memory per GPU ({p.gpus} × {p.gpu}) at its peak, {p.peak_at}:"]
    lines += [f"  {name:<{width}}  {gib:7.2f} GiB" for name, gib in p.memory.items()]
    verdict = "fits" if p.fits else f"does NOT fit: {advice}"
    lines.append(f"  {'total':<{width}}  {p.memory_gib_per_gpu:7.2f} GiB of {p.capacity_gib:.1f} (limit "
                 f"{FIT_FRACTION:.0%}): {verdict}")
    lines.append(f"time per optimizer step ({p.tokens_per_step_per_gpu} tokens per GPU):")
    lines += [f"  {name:<{width}}  {1e3 * s:9.1f} ms" for name, s in p.time.items()]
    lines.append(f"  {'total':<{width}}  {1e3 * p.step_s:9.1f} ms → {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")
    lines.append("assumptions:")
    lines += [f"  {a}" for a in p.assumptions]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a TOML config (default: the built-in defaults)")
    parser.add_argument("--gpus", type=int, help="GPU count (default: parallel.gpus, else parallel.ep)")
    parser.add_argument("--gpu", default="h100", help=f"GPU kind: {' | '.join(GPUS)} (default h100)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except (OSError, ValueError) as e:
        raise UserError(str(e)) from e
    gpus = args.gpus or cfg.parallel.gpus or cfg.parallel.ep
    if gpus < 1:
        raise UserError(f"--gpus must be a positive GPU count, got {gpus}")
    planned = plan(cfg, gpus, args.gpu.lower())
    advice = "" if planned.fits else fit_advice(cfg, gpus, args.gpu.lower())
    print(json.dumps(planned.as_dict(), indent=1) if args.json else format_plan(planned, advice))


if __name__ == "__main__":
    run_main(main)
