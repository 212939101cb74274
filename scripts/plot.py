"""Plot training runs: loss, lr, grad norm, tokens/s and expert load, as PNGs.

    python scripts/plot.py runs/debug                    # writes runs/debug/plots/*.png
    python scripts/plot.py runs/a runs/b --out cmp/      # a and b overlaid, legend = directory names

Reads RUN/metrics.jsonl and RUN/expert_load.jsonl (per-expert counts, every log.expert_load_every steps).
Curves overlay all runs; expert load is one figure per run (expert_load.png, or expert_load_NAME.png with
several runs): per-expert load at the step where the worst layer was most imbalanced and at the last step,
and each layer's max/mean load over training.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file without installing dsv3
from dsv3.config import UserError, run_main  # noqa: E402

# (file, title, metric keys drawn on it, log y axis)
CURVES = [
    ("loss.png", "loss", ["loss", "val_loss", "mtp_loss"], False),
    ("lr.png", "learning rate", ["lr"], False),
    ("grad_norm.png", "gradient norm (before clipping)", ["grad_norm"], True),
    ("tokens_per_s.png", "tokens / s (all ranks together)", ["tokens_per_s"], False),
]


def read_jsonl(path: Path) -> dict[int, dict]:
    """Rows by step; a later line for the same step (a resumed run's) wins."""
    by_step: dict[int, dict] = {}
    lines = path.read_text().splitlines()
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if line_no == len(lines):
                continue  # a run killed mid-write leaves a partial last line
            raise UserError(f"{path}:{line_no}: not valid JSON; is this a dsv3 metrics file?") from None
        by_step.setdefault(row.pop("step"), {}).update(row)
    return dict(sorted(by_step.items()))


def series(metrics: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    steps = [step for step, row in metrics.items() if key in row]
    return steps, [metrics[step][key] for step in steps]


def max_over_mean_by_layer(metrics: dict[int, dict]) -> tuple[list[int], list[list[float]]] | None:
    """(steps, [layer][step]) of `moe/layer{i}/load_max_over_mean`, or None without MoE layers."""
    steps = [step for step, row in metrics.items() if "moe/layer0/load_max_over_mean" in row]
    if not steps:
        return None
    n_layers = sum(1 for key in metrics[steps[0]] if key.endswith("/load_max_over_mean") and "/layer" in key)
    return steps, [[metrics[s][f"moe/layer{i}/load_max_over_mean"] for s in steps] for i in range(n_layers)]


def plot_runs(runs: list[str], out: str | None = None) -> list[Path]:
    """Write the PNGs for `runs` into `out` (default: the first run's plots/); returns the files written."""
    from matplotlib import pyplot as plt

    from dsv3.plots import curves_figure, expert_load_figure

    dirs = [Path(run) for run in runs]
    for run_dir in dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise UserError(f"{run_dir} has no metrics.jsonl; pass a run directory (a run's checkpoint.dir).")
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):  # runs/a/debug and runs/b/debug: the whole paths tell them apart
        names = [str(d) for d in dirs]
    metrics = {name: read_jsonl(d / "metrics.jsonl") for name, d in zip(names, dirs)}
    out_dir = Path(out) if out else dirs[0] / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(figure, file_name: str) -> None:
        path = out_dir / file_name
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)

    for file_name, title, keys, log_y in CURVES:
        drawn = {key: {name: series(m, key) for name, m in metrics.items() if series(m, key)[0]} for key in keys}
        drawn = {key: by_run for key, by_run in drawn.items() if by_run}
        if drawn:
            save(curves_figure(title, drawn, log_y), file_name)
    for name, run_dir in zip(names, dirs):
        counts_file = run_dir / "expert_load.jsonl"
        counts = read_jsonl(counts_file) if counts_file.is_file() else {}
        snapshots = {step: row["tokens_per_expert"] for step, row in counts.items()}
        if snapshots:
            worst = max(snapshots, key=lambda s: max(max(r) * len(r) / max(sum(r), 1) for r in snapshots[s]))
            last = max(snapshots)
            snapshots = {s: snapshots[s] for s in sorted({worst, last})}
        history = max_over_mean_by_layer(metrics[name])
        if snapshots or history:
            file_name = "expert_load.png" if len(dirs) == 1 else f"expert_load_{name.replace('/', '_')}.png"
            save(expert_load_figure(list(snapshots.items()), history), file_name)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories (checkpoint.dir), overlaid in this order")
    parser.add_argument("--out", default=None, help="where the PNGs go; default: FIRST_RUN/plots")
    args = parser.parse_args(argv)
    for path in plot_runs(args.runs, args.out):
        print(path)


if __name__ == "__main__":
    run_main(main)
