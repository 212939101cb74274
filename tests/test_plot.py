from pathlib import Path

import pytest
import torch

from dsv3.config import UserError
from dsv3.metrics import MetricsLogger
from scripts.plot import plot_runs, read_jsonl

PNG = b"\x89PNG\r\n\x1a\n"


def synthetic_run(run_dir: Path, collapse_until: int) -> None:
    """A run whose 2 MoE layers of 4 experts send every token to one expert until `collapse_until`, then
    balance: logged through MetricsLogger as train.py does."""
    logger = MetricsLogger(str(run_dir), {}, total_steps=40)
    for step in range(5, 45, 5):
        collapsed = step <= collapse_until
        load = [[400, 0, 0, 0], [0, 400, 0, 0]] if collapsed else [[100] * 4, [90, 110, 100, 100]]
        tokens_per_expert = torch.tensor(load)  # [MoE layers, E]
        logger.log(step, {"loss": 8 - step / 10, "mtp_loss": 8.1 - step / 10, "lr": 1e-3, "grad_norm": 1 / step,
                          "tokens_per_s": 1000.0, "moe/layer0/load_max_over_mean": 4.0 if collapsed else 1.0,
                          "moe/layer1/load_max_over_mean": 4.0 if collapsed else 1.1})
        if step % 10 == 0:
            logger.log(step, {"val_loss": 8.2 - step / 10})
        logger.log_expert_load(step, tokens_per_expert)
    logger.close()


def test_expert_counts_are_logged_as_integers_beside_the_metrics(tmp_path):
    synthetic_run(tmp_path, collapse_until=10)
    rows = read_jsonl(tmp_path / "expert_load.jsonl")
    assert sorted(rows) == list(range(5, 45, 5))
    assert rows[5]["tokens_per_expert"] == [[400, 0, 0, 0], [0, 400, 0, 0]]
    assert all("tokens_per_expert" not in row for row in read_jsonl(tmp_path / "metrics.jsonl").values())


def test_plot_writes_every_png_and_overlays_runs(tmp_path):
    synthetic_run(tmp_path / "a", collapse_until=10)
    synthetic_run(tmp_path / "b", collapse_until=25)
    written = plot_runs([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "cmp"))
    assert sorted(p.name for p in written) == ["expert_load_a.png", "expert_load_b.png", "grad_norm.png",
                                               "loss.png", "lr.png", "tokens_per_s.png"]
    for path in written:
        assert path.read_bytes().startswith(PNG) and path.stat().st_size > 10_000, path
    single = plot_runs([str(tmp_path / "a")])
    assert {p.parent for p in single} == {tmp_path / "a" / "plots"} and "expert_load.png" in {p.name for p in single}


def test_a_run_killed_mid_write_still_plots_and_a_missing_run_is_a_clear_error(tmp_path):
    synthetic_run(tmp_path / "a", collapse_until=10)
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write('{"step": 45, "loss": 3.')  # the partial last line of a killed run
    assert max(read_jsonl(tmp_path / "a" / "metrics.jsonl")) == 40
    assert plot_runs([str(tmp_path / "a")])
    with pytest.raises(UserError, match="no metrics.jsonl"):
        plot_runs([str(tmp_path / "nowhere")])


def test_the_expert_load_history_labels_round_steps_that_do_not_overlap():
    from dsv3.plots import expert_load_figure

    steps = list(range(100, 30001, 100))  # 300 log steps
    figure = expert_load_figure([], (steps, [[1.5] * len(steps)] * 4))
    figure.canvas.draw()
    labels = figure.axes[0].get_xticklabels()
    assert [label.get_text() for label in labels] == ["100", "5000", "10000", "15000", "20000", "25000", "30000"]
    boxes = [label.get_window_extent() for label in labels]
    assert all(left.x1 < right.x0 for left, right in zip(boxes, boxes[1:]))



def test_each_run_has_its_colour_and_each_metric_its_line_style_named_in_the_legend():
    from dsv3.plots import curves_figure

    loss = {"a": ([1, 2], [3.0, 2.0]), "b": ([1, 2], [3.5, 2.5])}
    val = {"a": ([2], [2.2]), "b": ([2], [2.7])}
    ax = curves_figure("loss", {"loss": loss, "val_loss": val}).axes[0]
    lines = {line.get_label(): (line.get_color(), line.get_linestyle()) for line in ax.get_lines()}
    assert list(lines) == ["a: loss", "b: loss", "a: val_loss", "b: val_loss"]
    assert [text.get_text() for text in ax.get_legend().get_texts()] == list(lines)
    assert lines["a: loss"][0] == lines["a: val_loss"][0] != lines["b: loss"][0] == lines["b: val_loss"][0]
    assert lines["a: loss"][1] == lines["b: loss"][1] != lines["a: val_loss"][1] == lines["b: val_loss"][1]
    one_run = curves_figure("loss", {"loss": {"a": loss["a"]}, "val_loss": {"a": val["a"]}}).axes[0]
    assert len({line.get_color() for line in one_run.get_lines()}) == 2
