"""Pretrain DeepSeek-V3: `python train.py --config configs/debug.toml [--section.key=value ...] [--resume]`,
or the same under `torchrun --nproc_per_node=N`.

parse config → check inputs → build model → parallelize (EP, AC, FSDP2) → compile → train:
AdamW, warmup → constant → cosine (paper §4.2), optional batch-size ramp, gradient accumulation,
loss = CE + λ/D·Σ CE_mtp + α·L_bal, clip 1.0, then the aux-loss-free expert-bias update.
SIGTERM or Ctrl-C: the step in flight finishes and is saved, and the run exits 143 / 130 (dsv3/stop.py).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from dsv3 import checkpoint, dispatch, export, failures, optim, parallel, rundir
from dsv3.config import Config, TrainConfig, UserError, help_text, load_config, resume_changes, resume_record, run_main
from dsv3.data import (
    MixtureLoader,
    PackedLoader,
    check_first_batch,
    check_host_memory,
    check_sources,
    data_tokenizer,
    describe_mixture,
)
from dsv3.determinism import make_deterministic
from dsv3.flops import flops_per_token, mfu, parameter_counts, peak_flops
from dsv3.guard import DivergenceGuard
from dsv3.lowp import quant
from dsv3.metrics import MetricsLogger, expert_load_stats, import_wandb, memory_stats, run_summary, startup_banner
from dsv3.model import Transformer
from dsv3.moe import update_expert_bias
from dsv3.plan import check_fits
from dsv3.stop import StopSignal, resume_command
from dsv3.tokenizer import Tokenizer


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup → constant → cosine decay to lr·min_lr_ratio over the last (1 − decay_start) of steps."""
    if step <= t.warmup_steps:
        return t.lr * step / max(t.warmup_steps, 1)
    decay_from = max(int(t.decay_start * t.steps), t.warmup_steps)
    if step <= decay_from:
        return t.lr
    progress = (step - decay_from) / max(t.steps - decay_from, 1)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(step: int, t: TrainConfig, world: int) -> int:
    """Global batch in sequences: linear ramp from batch_ramp_start over batch_ramp_steps (paper §4.2),
    rounded down to whole micro-batches on every rank."""
    if not t.batch_ramp_steps or step >= t.batch_ramp_steps:
        return t.global_batch
    batch = t.batch_ramp_start + (t.global_batch - t.batch_ramp_start) * step // t.batch_ramp_steps
    unit = t.micro_batch * world
    return max(unit, batch // unit * unit)


def mtp_lambda_at(step: int, t: TrainConfig) -> float:
    return t.mtp_lambda if step <= t.mtp_lambda_switch * t.steps else t.mtp_lambda_final


def bias_update_speed_at(step: int, t: TrainConfig) -> float:
    return t.bias_update_speed if step <= t.bias_update_stop * t.steps else 0.0


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, batch: torch.Tensor, t: TrainConfig,
               step: int, accumulate_unsharded_grads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's `batch` [rows, S+1], in micro-batches. FSDP reduce-scatters every
    micro-batch's gradients into the shards, unless `accumulate_unsharded_grads` (parallel.accumulate_unsharded_grads)
    has it sum full unsharded gradients until the last one: fewer collectives, but a full fp32 gradient per rank.
    Returns ([main, mtp, balance, grad_norm] as one device tensor, global tokens_per_expert [L, E])."""
    micro_batches = batch.split(t.micro_batch)
    copies = optimizer.compute_copies if isinstance(optimizer, optim.AdamW) else None  # bf16 weights it writes
    mtp_weight = mtp_lambda_at(step, t) / max(len(model.mtp), 1)
    losses = torch.zeros(3, device=batch.device)
    tokens_per_expert = 0
    for i, micro in enumerate(micro_batches):
        if accumulate_unsharded_grads:
            parallel.set_gradient_sync(model, i == len(micro_batches) - 1)
        with copies.active(accumulate=len(micro_batches) > 1) if copies else contextlib.nullcontext():
            out = model(micro[:, :-1], micro[:, 1:])
            mtp_loss = torch.stack(out.mtp_losses).sum() if out.mtp_losses else torch.zeros_like(out.loss)
            total = out.loss + mtp_weight * mtp_loss + t.balance_alpha * out.balance_loss
            (total / len(micro_batches)).backward()
        losses += torch.stack([out.loss, mtp_loss / max(len(out.mtp_losses), 1), out.balance_loss]).detach()
        tokens_per_expert = tokens_per_expert + out.tokens_per_expert
    if isinstance(optimizer, optim.AdamW):  # clipping folded into the update: no pass of its own over the grads
        grad_norm = parallel.grad_norm(optimizer.grads())
        optimizer.step(grad_scale=parallel.clip_scale(grad_norm, t.grad_clip))
    else:
        grad_norm = parallel.clip_grad_norm_(list(model.parameters()), t.grad_clip)
        optimizer.step()
    if t.precision == "fp8" and t.fp8_recipe == "tensorwise" and isinstance(model, FSDPModule):
        # fp8 all-gather reuses scales computed now
        quant.precompute_fp8_scales(model)
    optimizer.zero_grad(set_to_none=True)
    # every rank must hold the same expert bias: sum the counts over the whole global batch first
    tokens_per_expert = parallel.all_reduce_sum(tokens_per_expert)
    update_expert_bias(model.routers(), tokens_per_expert, bias_update_speed_at(step, t))
    losses = parallel.all_reduce_sum(losses / len(micro_batches)) / checkpoint.world()
    return torch.cat([losses, grad_norm.reshape(1).float()]), tokens_per_expert


@torch.no_grad()
def evaluate(model: Transformer, cfg: Config, rank: int, world: int, device: torch.device,
             copies: optim.ComputeCopies | None = None) -> dict[str, float]:
    """Main-head loss over the first val_batches × global_batch sequences of each source's validation split, or as
    many whole batches as the split holds (at least one): the same sequences on every call and at every world
    size, so val losses of differently sharded runs compare. `val_loss` weighs the sources by their shares; with
    several sources each has its own `val_loss/NAME` too."""
    t = cfg.train
    model.eval()  # the main loss only: no MTP modules, no balance loss
    losses, mixture = {}, cfg.data.mixture()
    for name, path, _ in mixture:
        loader = PackedLoader(path, "val", t.seq_len, rank, world, shuffle=False)
        n_batches = min(t.val_batches, max(1, loader.num_sequences // t.global_batch))  # more would rescore the same
        total = torch.zeros((), device=device)
        for _ in range(n_batches):
            for micro in loader.next_batch(t.global_batch).to(device).split(t.micro_batch):
                with copies.active() if copies else contextlib.nullcontext():
                    total += model(micro[:, :-1], micro[:, 1:]).loss * micro.size(0)
        losses[name] = parallel.all_reduce_sum(total).item() / (n_batches * t.global_batch)
    model.train()
    result = {"val_loss": sum(share * losses[name] for name, _, share in mixture)}
    if len(losses) > 1:
        result.update({f"val_loss/{name}": loss for name, loss in losses.items()})
    return result


def build_optimizer(model: Transformer, t: TrainConfig, device: torch.device,
                    compute_copies: optim.ComputeCopies | None = None) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (norm scales are not decayed). dsv3.optim's, which takes the
    clipping factor into its step, for bf16 moments (paper §3.3) and for a model with compute copies; else
    torch's (fused on CUDA)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if t.optimizer_state_dtype == "bf16" or compute_copies is not None:
        state_dtype = torch.bfloat16 if t.optimizer_state_dtype == "bf16" else torch.float32
        return optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), state_dtype=state_dtype,
                           compute_copies=compute_copies)
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=device.type == "cuda")


def check_setup(cfg: Config, world: int, device: torch.device) -> None:
    """What this machine and world size must satisfy before a model is built: precision, EP, batch, compile, W&B."""
    t, p = cfg.train, cfg.parallel
    quant.check_precision(t.precision, t.expert_precision, device, t.micro_batch * t.seq_len, t.fp8_recipe)
    parallel.check_ep(p.ep, world, cfg.model_config().n_routed_experts)
    parallel.check_ep_backend(p.ep_backend, p.ep, device, p.deepep_sms)
    if t.global_batch % (t.micro_batch * world):
        raise UserError(f"train.global_batch ({t.global_batch}) must be a multiple of train.micro_batch × "
                        f"world size ({t.micro_batch} × {world})")
    parallel.check_compile(t.compile, device)
    if cfg.log.wandb:
        import_wandb()


def build_model(cfg: Config, world: int, device: torch.device) -> tuple[Transformer, optim.ComputeCopies | None]:
    """Build → low precision (dsv3.lowp.quant) → EP → activation checkpointing → compile → FSDP2, then materialise.
    On CUDA the model is built on the meta device so only this rank's shards are ever allocated. Its weights are
    fp32; on CUDA it computes in bf16: FSDP2's mixed precision, or at one rank (no FSDP) the compute copies returned
    beside it (dsv3.optim.ComputeCopies; also the routed experts' at ep == world)."""
    mcfg, t = cfg.model_config(), cfg.train
    torch.manual_seed(t.seed)
    with torch.device("meta" if device.type == "cuda" else device):
        model = Transformer(mcfg)
    quant.apply(model, t.precision, t.expert_precision, t.fp8_recipe, t.precision_skip, fsdp=world > 1,
                fp8_min_features=t.fp8_min_features)
    if world > 1:
        meshes = parallel.build_meshes(device.type, world, cfg.parallel.ep)
        if cfg.parallel.ep > 1:
            parallel.apply_expert_parallel(model, meshes, cfg.parallel.ep_backend, cfg.parallel.deepep_sms)
    parallel.apply_activation_checkpointing(model, t.activation_checkpoint)
    if t.compile:
        parallel.apply_compile(model, world)
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # plain fp32 on CPU
    unsharded = parallel.apply_fsdp(model, meshes, param_dtype, torch.float32, cfg.parallel.ep) if world > 1 else []
    copies = None
    if device.type == "cuda":
        model.to_empty(device=device)
        model.init_weights()
        if world == 1:
            copies = optim.ComputeCopies(model, torch.bfloat16, quant.own_compute_copy)
    if unsharded:  # the routed experts at ep == world, which FSDP leaves alone
        copies = optim.ComputeCopies(model, param_dtype, params=unsharded, grad_divisor=world)
    return model, copies


def configure(argv: list[str]) -> tuple[Config, bool]:
    """The config `argv` asks for (--config FILE, --resume, --section.key=value) and whether the run reads
    checkpoint.init_from's weights: not when it resumes, its checkpoint holds them (and init_from may be gone)."""
    config_path, overrides = None, []
    args = iter(argv)
    for arg in args:
        if arg == "--config":
            config_path = next(args, None)
            if config_path is None:
                raise UserError("--config needs a file: --config configs/debug.toml")
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        elif arg == "--resume":
            overrides.append("--checkpoint.resume=true")
        else:
            overrides.append(arg)
    cfg = load_config(config_path, overrides)
    recorded = checkpoint.recorded_model(cfg.checkpoint.dir) if cfg.checkpoint.resume else None
    if recorded is not None and cfg.checkpoint.init_from:
        cfg.continue_model(recorded)
    return cfg, bool(cfg.checkpoint.init_from) and recorded is None


def check_inputs(cfg: Config, world: int, device: torch.device,
                 reads_init_from: bool) -> tuple[str | None, Tokenizer | None]:
    """Every input checked before anything expensive is built; (the memory plan's line on GPUs, the tokenizer)."""
    check_setup(cfg, world, device)
    t, mcfg = cfg.train, cfg.model_config()
    if device.type == "cpu":  # a batch the host cannot hold is refused here, not by the OOM killer
        check_host_memory(t.global_batch, t.micro_batch, t.seq_len, world, mcfg.vocab_size, mcfg.dim, mcfg.n_layers)
    memory_plan = None
    if device.type == "cuda":  # a config that cannot fit stops here, before any weight is allocated
        memory_plan = check_fits(cfg, world, torch.cuda.get_device_name(device),
                                 torch.cuda.get_device_properties(device).total_memory)
    init_from = cfg.checkpoint.init_from if reads_init_from else ""
    check_sources(cfg.data.mixture(), cfg.model_config().vocab_size, init_from)
    tokenizer = data_tokenizer(cfg.data.mixture())  # for the export; a damaged one stops the run now, not at the end
    return memory_plan.summary() if memory_plan else None, tokenizer


class Run:
    """A training run around its model: the run directory (locked until `close`), the checkpoint it resumes from,
    the data loader, the logger, and the health of its steps: the guard (dsv3.guard) stops a spiking run, and a
    checkpoint is confirmed once the step after it is seen healthy."""

    def __init__(self, cfg: Config, rank: int, world: int, device: torch.device, reads_init_from: bool,
                 argv: list[str]):
        self.cfg, self.mcfg, self.rank, self.world, self.device = cfg, cfg.model_config(), rank, world, device
        t = cfg.train
        memory_plan, self.tokenizer = check_inputs(cfg, world, device, reads_init_from)
        init_from_line = export.check_init_from(cfg) if reads_init_from else ""
        self.run_dir, self.logger = Path(cfg.checkpoint.dir), None
        rundir.lock_run_dir(self.run_dir, create=not cfg.checkpoint.resume)  # one run per directory, until it ends
        failures.watch_run(self.run_dir, argv)  # a failure from here names the last checkpoint and what to run next
        saved = self._resume()
        if self.done:
            return
        n_params, _ = parameter_counts(self.mcfg)
        rundir.check_room(self.run_dir, n_params, t.optimizer_state_dtype, cfg.checkpoint)
        self.loader = MixtureLoader(cfg.data.mixture(), "train", t.seq_len, rank, world, seed=t.seed)
        if t.val_every:
            MixtureLoader(cfg.data.mixture(), "val", t.seq_len)  # fail now, not at the first validation
        self.guard = DivergenceGuard(t.loss_spike_factor, t.grad_norm_spike_factor)
        self.pending: list[tuple[int, torch.Tensor]] = []  # (step, [main, mtp, bal, gnorm] on device): no sync yet
        self.unconfirmed: list[int] = []  # saved checkpoints whose next step has not been seen healthy yet
        self.start_step = 0
        if saved:  # the train state before the model is built: another dataset stops here
            self.loader.load_state_dict(saved["data"])
            self.start_step = saved["step"]
            self.guard.load_state_dict(saved["guard"])  # a fresh guard would judge no spike in the first resumed steps
        check_first_batch(self.loader, batch_at(self.start_step + 1, t, world), self.mcfg.vocab_size)
        tokens = sum(batch_at(s, t, world) for s in range(1, t.steps + 1))
        self.say(startup_banner(cfg, world, device, memory_plan, describe_mixture(self.loader, tokens)))
        if init_from_line:
            self.say(init_from_line)

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def _resume(self) -> dict | None:
        """Find the checkpoint to resume from and read its train state; `done` when it ends the run already."""
        cfg, found = self.cfg, checkpoint.checkpoints(self.run_dir)
        if found and not cfg.checkpoint.resume:
            raise UserError(f"checkpoint.dir={self.run_dir} already holds checkpoints "
                            f"({', '.join(p.name for p in found)}): continue that run "
                            "with --resume, or give this one its own --checkpoint.dir")
        path = checkpoint.resume_from(self.run_dir, cfg.checkpoint.verify_checksums) if cfg.checkpoint.resume else None
        saved = checkpoint.read_train_state(path) if path else None
        for change in resume_changes(saved["config"], cfg) if saved else []:  # a change that breaks saved state stops
            self.say(f"resume: {change}")
        self.resume_path, self.done = path, False
        if path is None or checkpoint.step_of(path) < cfg.train.steps:
            return saved
        if cfg.checkpoint.export and not (self.run_dir / "export").is_dir():  # killed while it exported:
            self.say(f"{path} is the end of this run, but its export is missing: writing it")  # the export is all
        else:
            self.say(f"{path} is the end of this run (train.steps={cfg.train.steps}): nothing to train; raise "
                     f"--train.steps to continue it")
            self.done = True
        return saved

    def begin(self, model: Transformer, optimizer: torch.optim.Optimizer) -> None:
        """Load the weights the run resumes or starts from; open the logger and start the clock."""
        cfg = self.cfg
        if self.resume_path:
            checkpoint.load(self.resume_path, model, optimizer)  # the train state was read before the build
            if not checkpoint.is_confirmed(self.resume_path):  # the last run crashed right after saving it
                self.unconfirmed.append(self.start_step)
            self.say(f"resumed from {self.resume_path} at step {self.start_step}")
        elif cfg.checkpoint.init_from:
            export.load_weights(cfg.checkpoint.init_from, model)
        self.logger = MetricsLogger(str(self.run_dir), asdict(cfg), enabled=self.rank == 0, use_wandb=cfg.log.wandb,
                                    project=cfg.log.project, run_name=cfg.log.run_name, total_steps=cfg.train.steps,
                                    start_step=self.start_step)
        self.flops = flops_per_token(self.mcfg, cfg.train.seq_len)
        self.peak = peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        self.clock, self.tokens_since = time.perf_counter(), 0

    def stepped(self, step: int, values: torch.Tensor, tokens: int) -> None:
        """Step `step` trained `tokens`; its values ([main, mtp, bal, gnorm] on device) are judged at the next flush."""
        self.pending.append((step, values))
        self.tokens_since += tokens

    def flush(self) -> list[float] | None:
        """One host sync for all steps since the last: stop on the first non-finite or spiking loss or grad norm,
        confirm the checkpoints the healthy steps vouch for; the last step's values."""
        values = torch.stack([v for _, v in self.pending]).tolist() if self.pending else []
        for (step, _), row in zip(self.pending, values):
            problem = self.guard.check(step, dict(zip(("loss", "mtp_loss", "balance_loss", "grad_norm"), row)))
            if problem:  # the weights after step s-1 produced step s's values: only those up to s-2 are vouched for
                kept = checkpoint.discard_after(self.run_dir, step - 2)
                again = (f"the newest left is {kept}: --resume from it" if kept else
                         "no checkpoint from before it is left: start the run again without --resume")
                raise FloatingPointError(f"{problem}; newer checkpoints were moved aside (*.diverged), {again}, e.g. "
                                         "with a lower --train.lr")
            while self.unconfirmed and self.unconfirmed[0] < step:
                checkpoint.confirm(self.run_dir, self.unconfirmed.pop(0), self.cfg.checkpoint.keep)
        self.pending.clear()
        return values[-1] if values else None

    def log(self, step: int, lr: float, global_batch: int, tokens_per_expert: torch.Tensor,
            model: Transformer) -> None:
        """One host sync judges the steps since the last log; the last one's losses, throughput and expert load."""
        main_loss, mtp_loss, balance_loss, grad_norm = self.flush()
        elapsed, self.clock = time.perf_counter() - self.clock, time.perf_counter()
        tokens_per_s = self.tokens_since / elapsed
        self.tokens_since = 0
        metrics = {"loss": main_loss, "balance_loss": balance_loss, "grad_norm": grad_norm, "lr": lr,
                   "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / self.world,
                   "global_batch": global_batch}
        if self.mcfg.n_mtp_layers:
            metrics["mtp_loss"] = mtp_loss
        if self.peak:
            metrics["mfu"] = mfu(self.flops, tokens_per_s, self.world, self.peak)
        metrics.update({f"tokens_seen/{name}": n for name, n in self.loader.tokens_seen().items()})
        metrics.update(memory_stats())
        metrics.update(expert_load_stats(tokens_per_expert, [r.expert_bias for r in model.routers()]))
        self.logger.log(step, metrics)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Validation and saving inside are not training: their time stays out of tokens/s."""
        paused = time.perf_counter()
        yield
        self.clock += time.perf_counter() - paused

    def save(self, step: int, model: Transformer, optimizer: torch.optim.Optimizer) -> None:
        self.flush()  # never save over the last good checkpoint with a diverged model
        checkpoint.save(self.run_dir, step, model, optimizer,
                        {"step": step, "data": self.loader.state_dict(), "guard": self.guard.state_dict(),
                         "config": resume_record(self.cfg)},
                        self.cfg.checkpoint.keep, self.cfg.checkpoint.verify_checksums, self.cfg.checkpoint.async_save)
        self.unconfirmed.append(step)

    def finish(self, model: Transformer, argv: list[str], step: int, stopping: StopSignal | None) -> None:
        """The export and the summary at the end, or at a stop how to continue; then `close`."""
        cfg, t = self.cfg, self.cfg.train
        # The last checkpoint stays unconfirmed: no step has judged its weights, and confirming it would let pruning
        # delete the last one a step vouched for, which a continued run that diverges at once falls back to.
        if not stopping:
            if cfg.checkpoint.export:
                export.export(self.run_dir / "export", model, self.mcfg, self.tokenizer)
            last = [p for p in checkpoint.checkpoints(self.run_dir) if checkpoint.step_of(p) == t.steps]  # the end's
            self.say(run_summary(cfg.checkpoint.dir, str(last[-1]) if last else None,
                                 str(self.run_dir / "export") if cfg.checkpoint.export else None,
                                 resume_command(argv), t.steps))
        else:
            saved = (f"saved {self.run_dir / f'step-{step}'}; continue with: {resume_command(argv)}"
                     if cfg.checkpoint.every else "nothing saved (checkpoint.every=0)")
            self.say(f"stopped by {stopping.name} after step {step} of {t.steps}: {saved}")
        self.close()

    def close(self) -> None:
        if self.logger:
            self.logger.close()
        rundir.unlock_run_dir(self.run_dir)
        dispatch.close()  # DeepEP's buffer, if any: before the process group goes
        if dist.is_initialized():
            dist.barrier()  # no rank tears the group down while another still talks to it
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Train the run `argv` describes (the module docstring); a UserError names the fix (config.run_main)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return
    cfg, reads_init_from = configure(argv)
    t = cfg.train
    if t.deterministic:  # before CUDA, cuBLAS and NCCL start
        make_deterministic()
    rank, world, device = parallel.init_distributed(t.device)
    run = Run(cfg, rank, world, device, reads_init_from, argv)
    if run.done:
        run.close()
        return
    model, copies = build_model(cfg, world, device)
    optimizer = build_optimizer(model, t, device, copies)
    run.begin(model, optimizer)

    model.train()
    stop, stopping, step = StopSignal(), None, run.start_step  # SIGTERM, SIGINT: stop at a step's end, saved
    for step in range(run.start_step + 1, t.steps + 1):
        lr = lr_at(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        global_batch = batch_at(step, t, world)
        batch = parallel.to_device(run.loader.next_batch(global_batch), device)
        values, tokens_per_expert = train_step(model, optimizer, batch, t, step,
                                               cfg.parallel.accumulate_unsharded_grads)
        run.stepped(step, values, global_batch * t.seq_len)
        if step == run.start_step + 1 and cfg.checkpoint.every and cfg.checkpoint.async_save:
            checkpoint.prepare_background_save(model, optimizer)  # the host buffers, while the next steps run
        stopping = stop.agreed() if step < t.steps else None  # every rank alike: log this step, save it, leave

        if step % cfg.log.every == 0 or step in (t.steps, run.start_step + 1) or stopping:  # +1: first sign of life
            run.log(step, lr, global_batch, tokens_per_expert, model)
        if cfg.log.expert_load_every and (step % cfg.log.expert_load_every == 0 or step == t.steps):
            run.logger.log_expert_load(step, tokens_per_expert)
        with run.paused():
            if t.val_every and (step % t.val_every == 0 or step == t.steps):
                run.logger.log(step, evaluate(model, cfg, rank, world, device, copies))
            if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == t.steps or stopping):
                run.save(step, model, optimizer)
        if stopping:
            break
    stop.restore()
    checkpoint.wait_for_save()  # a background save is published before the run ends or exports
    run.finish(model, argv, step, stopping)
    if stopping:
        sys.exit(128 + stopping)  # 143 for SIGTERM, 130 for SIGINT: "ended by a signal", which schedulers requeue


if __name__ == "__main__":
    run_main(main)
