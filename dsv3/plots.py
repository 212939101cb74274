"""Figures of a run's metrics: curves over steps (several runs overlaid) and the expert-load heatmaps that show
routing collapse and recovery. Needs matplotlib (optional: only scripts/plot.py and W&B logging import this).

Expert load is shown as max/mean tokens per expert: 1.0 is perfect balance, E means one expert takes every
token of its layer.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files only, no display: works on a headless node
from matplotlib import pyplot as plt  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

Series = dict[str, tuple[list[int], list[float]]]  # run name -> (steps, values)


LINE_STYLES = ["-", "--", ":", "-."]  # one per metric key on an axis: loss solid, val_loss dashed, ...


def curves_figure(title: str, series_by_key: dict[str, Series], log_y: bool = False) -> Figure:
    """One axis, a line per (run, metric key): e.g. train and val loss of two runs. Each run has its colour, each
    key its line style, and the legend names both. log_y: a log axis when the values span more than 20x (grad
    norm spikes)."""
    figure, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    runs = list(dict.fromkeys(run for by_run in series_by_key.values() for run in by_run))
    for k, (key, by_run) in enumerate(series_by_key.items()):
        for run, (steps, values) in by_run.items():
            label = key if len(runs) == 1 else run if len(series_by_key) == 1 else f"{run}: {key}"
            # one run: a colour per key as well, so a legend-less print still tells them apart
            colour = f"C{(k if len(runs) == 1 else runs.index(run)) % 10}"
            ax.plot(steps, values, label=label, color=colour, linestyle=LINE_STYLES[k % len(LINE_STYLES)],
                    marker="o" if len(steps) < 30 else None, markersize=3)
    ax.set(title=title, xlabel="step")
    values = [v for by_run in series_by_key.values() for _, vs in by_run.values() for v in vs if v > 0]
    if log_y and values and max(values) > 20 * min(values):  # over a narrow range a log axis only loses labels
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return figure


def _load_map(ax, image, title: str, xlabel: str, x_ticks: list | None, n_experts: int):
    # Log scale symmetric about balance (1, white): starved experts blue down to idle (1/E), overloaded red up
    # to total collapse (E, one expert takes every token); 2x over and 2x under are equally strong colours.
    norm = LogNorm(vmin=1 / max(n_experts, 2), vmax=max(n_experts, 2))
    shown = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm)
    ax.set(title=title, xlabel=xlabel, ylabel="MoE layer")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # layer and expert numbers, at any count
    if x_ticks is None:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:  # one column per logged step: label the columns nearest to a few round steps, which fit side by side
        wanted = MaxNLocator(nbins=6, integer=True).tick_values(x_ticks[0], x_ticks[-1])
        columns = sorted({min(range(len(x_ticks)), key=lambda i: abs(x_ticks[i] - step)) for step in wanted})
        ax.set_xticks(columns, [str(x_ticks[i]) for i in columns])
    return shown


def expert_load_figure(snapshots: list[tuple[int, list[list[int]]]],
                       max_over_mean: tuple[list[int], list[list[float]]] | None = None) -> Figure:
    """Heatmaps of expert load: load / mean of every expert (layers × experts) for each (step, tokens_per_expert
    [L, E]) snapshot as logged by MetricsLogger.log_expert_load, and, given max_over_mean = (steps,
    [layer][step] ratios), each layer's busiest expert over training (layers × steps): collapse and recovery."""
    n_experts = len(snapshots[0][1][0]) if snapshots else 0
    if not snapshots:  # E unknown: the scale ends at the worst ratio seen
        n_experts = max(2, math.ceil(max(max(row) for row in max_over_mean[1])))
    panels = len(snapshots) + bool(max_over_mean)
    n_layers = len(snapshots[0][1]) if snapshots else len(max_over_mean[1])
    figure, axes = plt.subplots(1, panels, figsize=(5.5 * panels + 1, min(1.6 + 0.45 * n_layers, 9)),
                                layout="constrained", squeeze=False)
    for ax, (step, tokens_per_expert) in zip(axes[0], snapshots):
        relative = [[max(count * len(row) / max(sum(row), 1), 1 / n_experts) for count in row]  # idle: scale end
                    for row in tokens_per_expert]
        shown = _load_map(ax, relative, f"load / mean per expert, step {step}", "expert", None, n_experts)
    if max_over_mean:
        steps, ratios = max_over_mean
        shown = _load_map(axes[0][-1], ratios, "max / mean load per layer", "step", steps, n_experts)
    bar = figure.colorbar(shown, ax=axes[0].tolist(), label="load / mean (1 = balanced)")
    powers = range(-math.ceil(math.log2(n_experts)), math.ceil(math.log2(n_experts)) + 1)
    bar.set_ticks([2.0**p for p in powers], labels=[f"1/{2**-p}" if p < 0 else str(2**p) for p in powers])
    bar.minorticks_off()
    return figure
