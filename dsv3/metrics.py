"""Training metrics: the startup banner and run summary, expert-load stats, memory, and the logger that writes them
(metrics.jsonl, one console line per log step, W&B when enabled). FLOP counting is dsv3/flops.py.

Metric keys the console line knows (others go to jsonl/W&B only): `loss`, `mtp_loss`, `balance_loss`, `lr`,
`grad_norm`, `tokens_per_s` (all ranks together), `mfu` (a fraction, printed as %), `memory/peak_allocated_gib`.
"""

from __future__ import annotations

import datetime
import json
import netrc
import os
import re
import shlex
import sys
import time
from types import ModuleType
from urllib.parse import urlparse

import torch

from dsv3.config import Config, ModelConfig, UserError
from dsv3.flops import parameter_counts
from dsv3.safeopen import append_line, open_no_follow


def startup_banner(cfg: Config, world: int, device: torch.device, memory_plan: str | None, data: str) -> str:
    """The run at a glance, printed before the model is built: what trains, how it is laid out, where it
    reads and writes. `memory_plan`: the planner's one-line per-GPU estimate (dsv3.plan), on GPUs; `data`: the
    sources' line (dsv3.data.describe_mixture)."""
    mc, t, p = cfg.model_config(), cfg.train, cfg.parallel
    total, activated = parameter_counts(mc)
    micro_batches = t.global_batch // (t.micro_batch * world)
    precision = "fp32" if device.type == "cpu" and t.precision == "bf16" else t.precision  # bf16: the GPU path
    if t.expert_precision == "low":
        precision += ", routed experts too"
    elif t.expert_precision == "fp8-blockwise":
        precision += ", routed experts fp8 (1×128 / 128×128 blocks, DeepGEMM)"

    def count(n: int) -> str:
        return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"

    lines = [f"model   {cfg.checkpoint.init_from or cfg.flavor}: {count(total)} parameters, {count(activated)} "
             f"activated per token; {mc.n_layers} layers ({mc.n_dense_layers} dense), {mc.n_routed_experts} routed "
             f"experts top-{mc.n_activated_experts}, MTP depth {mc.n_mtp_layers}",
             *_vocabulary_note(mc, total),
             f"batch   {t.global_batch} sequences × {t.seq_len} tokens = {t.global_batch * t.seq_len:,} tokens/step, "
             f"{t.steps} steps; {micro_batches} × {t.micro_batch} sequences per rank and step",
             f"layout  world {world} on {device.type}, ep {p.ep} ({p.ep_backend}); precision {precision}; "
             f"activation checkpointing {t.activation_checkpoint}; compile {'on' if t.compile else 'off'}"]
    if memory_plan is not None:
        lines.append(f"memory  {memory_plan}")
    lines.append(f"data    {data}")
    lines.append(f"run dir {cfg.checkpoint.dir}")
    return "\n".join(lines)


def _vocabulary_note(mc: ModelConfig, total: int) -> list[str]:
    """A line when the embedding and head outweigh the layers (a large tokenizer on a small model): a step then
    costs mostly the head, which a newcomer on a CPU would otherwise learn minutes into the run."""
    embedding = 2 * mc.vocab_size * mc.dim  # the embedding and the output head
    if embedding <= 0.75 * total:
        return []
    return [f"vocab   {mc.vocab_size:,} tokens: the embedding and output head are {embedding / total:.0%} of the "
            "parameters and most of each step; for a faster run, tokenize with a smaller vocabulary "
            "(scripts/train_tokenizer.py --vocab-size 4096, then scripts/prepare_data.py --tokenizer)"]


def run_summary(run_dir: str, last_checkpoint: str | None, export_dir: str | None, resume: str, steps: int) -> str:
    """The run's last lines: where its results are, and the commands for what comes next, each as it can be pasted
    (a trailing comment says what it does). `resume`: the command continuing this run (dsv3.stop.resume_command)."""
    lines = [f"results in {run_dir}:", f"  metrics     {os.path.join(run_dir, 'metrics.jsonl')} (expert_load.jsonl "
                                       "beside it)"]
    if last_checkpoint:
        lines.append(f"  checkpoint  {last_checkpoint}")
    if export_dir:
        lines.append(f"  export      {export_dir} (config.json, *.safetensors, the tokenizer)")
    lines += ["next:", f"  python scripts/plot.py {shlex.quote(run_dir)}  # plots into "
                       f"{os.path.join(run_dir, 'plots')}/"]
    if export_dir:
        lines += [f"  python scripts/generate.py {shlex.quote(export_dir)} --prompt 'The'  # sample text",
                  f"  python scripts/convert_hf.py --to-hf {shlex.quote(export_dir)} "
                  f"{shlex.quote(os.path.join(run_dir, f'hf-step-{steps}'))}  # for transformers"]
    elif last_checkpoint:
        lines.append(f"  python scripts/generate.py {shlex.quote(last_checkpoint)} --prompt 'The'  # sample text")
    if last_checkpoint:
        train_on = re.sub(r" --train\.steps=\S+", "", resume)  # the run's own step count gives way to the new one
        lines.append(f"  {train_on} --train.steps={2 * steps}  # train on")
    return "\n".join(lines)


def expert_load_stats(tokens_per_expert: torch.Tensor,
                      expert_biases: list[torch.Tensor] | torch.Tensor) -> dict[str, float]:
    """Load balance and expert-bias stats per MoE layer: tokens_per_expert [L, E] in `Transformer.routers()` order
    (MTP blocks last; layer{i} names row i), expert_biases one [E] per row or [L, E]. max/mean load is 1.0 when
    perfectly balanced, `moe/load_max_over_mean` the worst layer's; bias_std is the population std."""
    if tokens_per_expert.numel() == 0:  # no MoE layers
        return {}
    load = tokens_per_expert.detach().float().cpu()  # [L, E]
    bias = expert_biases if isinstance(expert_biases, torch.Tensor) else torch.stack(list(expert_biases))
    bias = bias.detach().float().cpu()  # [L, E]
    ratio = (load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)).tolist()
    rows = zip(ratio, bias.min(dim=1).values.tolist(), bias.max(dim=1).values.tolist(),
               bias.std(dim=1, correction=0).tolist())
    stats = {}
    for i, (r, b_min, b_max, b_std) in enumerate(rows):
        stats[f"moe/layer{i}/load_max_over_mean"] = r
        stats[f"moe/layer{i}/bias_min"] = b_min
        stats[f"moe/layer{i}/bias_max"] = b_max
        stats[f"moe/layer{i}/bias_std"] = b_std
    stats["moe/load_max_over_mean"] = max(ratio)
    return stats


def memory_stats() -> dict[str, float]:
    """Peak allocated CUDA memory of this process since start (GiB); {} without CUDA."""
    if not torch.cuda.is_available():
        return {}
    return {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}


def import_wandb() -> ModuleType:
    """The wandb module, for log.wandb=true: imported only then (requirements.txt installs it; a trimmed install
    may not)."""
    try:
        import wandb
    except ImportError:
        raise UserError("log.wandb=true needs the wandb package: pip install wandb, or drop --log.wandb=true") from None
    return wandb


def _wandb_mode() -> str | None:
    """'offline' when the user chose no WANDB_MODE and no API key is configured (env, or ~/.netrc for the server);
    else None, leaving the mode to wandb. Without this, wandb would stop to ask for a login."""
    if "WANDB_MODE" in os.environ or os.environ.get("WANDB_API_KEY"):
        return None
    try:
        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname  # or a self-hosted one
        if netrc.netrc().authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


def _console_line(step: int, m: dict[str, float], total_steps: int | None, eta_s: float | None) -> str:
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    losses = [f"{label} {m[key]:{fmt}}" for key, label, fmt in
              (("loss", "loss", ".3f"), ("mtp_loss", "mtp", ".3f"), ("balance_loss", "bal", ".3g"),
               ("val_loss", "val", ".3f")) if key in m]
    if losses:
        parts.append(" ".join(losses))
    if "lr" in m:
        parts.append(f"lr {m['lr']:.1e}")
    if "grad_norm" in m:
        parts.append(f"gnorm {m['grad_norm']:.2f}")
    if "tokens_per_s" in m:
        tps = m["tokens_per_s"]
        text = f"{tps / 1e6:.2f}M" if tps >= 1e6 else f"{tps / 1e3:.1f}k" if tps >= 1e3 else f"{tps:.0f}"
        parts.append(f"{text} tok/s")
    if "mfu" in m:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    if "memory/peak_allocated_gib" in m:
        parts.append(f"mem {m['memory/peak_allocated_gib']:.1f} GiB")
    if eta_s is not None:
        parts.append(f"eta {datetime.timedelta(seconds=round(eta_s))}")
    return " | ".join(parts)


def _rewind(path: str, start_step: int) -> float:
    """Drop the rows of a jsonl log after `start_step` (atomically), and rows that are no JSON row of a step (one
    warning: a log must not stop a resume); returns the last kept row's elapsed_s."""
    if not os.path.exists(path):
        return 0.0
    with open_no_follow(path, errors="replace") as f:
        lines = [line for line in f if line.strip()]
    if lines and not lines[-1].endswith("\n"):  # a row cut short by a kill mid-write: none of it is kept
        lines.pop()
    kept, bad = [], 0
    for line in lines:
        try:
            step = json.loads(line)["step"]
        except (ValueError, TypeError, KeyError):
            bad += 1
            continue
        if step <= start_step:
            kept.append(line)
    if bad:
        print(f"warning: {path}: skipped {bad} unreadable line(s)", file=sys.stderr, flush=True)
    with open_no_follow(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    return json.loads(kept[-1]).get("elapsed_s", 0.0) if kept else 0.0


class MetricsLogger:
    """Appends one JSON line per `log` to run_dir/metrics.jsonl, first rewound to `start_step` (a resumed run redoes
    those rows), prints a console line and logs to W&B when use_wandb; enabled=False (non-zero ranks): a no-op. Rows
    carry `time` and `elapsed_s` (across resumes); the ETA: the step rate since the first `log` (at it, since start)."""

    def __init__(self, run_dir: str, config: dict, enabled: bool = True, use_wandb: bool = False,
                 project: str = "dsv3", run_name: str = "", total_steps: int | None = None, start_step: int = 0):
        self.enabled = enabled
        self.total_steps = total_steps
        self._first: tuple[int, float] | None = None  # (step, time) of the first log call
        self._wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        self._elapsed_before = _rewind(path, start_step)
        self._jsonl = open_no_follow(path, "a")
        expert_path = os.path.join(run_dir, "expert_load.jsonl")
        _rewind(expert_path, start_step)
        self._expert_jsonl = open_no_follow(expert_path, "a")
        if use_wandb:
            wandb = import_wandb()
            mode = _wandb_mode()
            if mode == "offline":
                print(f"W&B: no API key configured (WANDB_API_KEY or ~/.netrc), logging offline under "
                      f"{run_dir}/wandb; upload later with `wandb sync`", flush=True)
            self._wandb = wandb.init(project=project, name=run_name or None, config=config, dir=run_dir, mode=mode)
        self._started, self._start_step = time.perf_counter(), start_step  # after W&B's start: no step's time

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        since = self._first or (self._start_step, self._started)  # the first line: its own steps, warm-up included
        self._first = self._first or (step, now)
        eta_s = None
        if self.total_steps and step > since[0]:
            eta_s = max(self.total_steps - step, 0) * (now - since[1]) / (step - since[0])
        values = {key: float(value) for key, value in metrics.items()}
        stamps = {"time": round(time.time(), 3), "elapsed_s": round(self._elapsed_before + now - self._started, 3)}
        append_line(self._jsonl, json.dumps({"step": step, **values, **stamps}) + "\n")  # readable while it runs
        print(_console_line(step, values, self.total_steps, eta_s), flush=True)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def log_expert_load(self, step: int, tokens_per_expert: torch.Tensor) -> None:
        """Per-expert token counts [L, E] of one step (rows as in `expert_load_stats`) as one line of
        expert_load.jsonl, the input of scripts/plot.py's heatmaps; the heatmap as an image to W&B."""
        if not self.enabled or tokens_per_expert.numel() == 0:
            return
        counts = tokens_per_expert.detach().long().cpu().tolist()
        append_line(self._expert_jsonl, json.dumps({"step": step, "tokens_per_expert": counts}) + "\n")
        if self._wandb is not None:
            from matplotlib import pyplot as plt

            from dsv3.plots import expert_load_figure
            figure = expert_load_figure([(step, counts)])
            self._wandb.log({"moe/expert_load": import_wandb().Image(figure)}, step=step)
            plt.close(figure)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._expert_jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
        self.enabled = False
