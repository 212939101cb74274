"""Configs: ModelConfig + named FLAVORS, the training sections, TOML loading and `--section.key=value`
overrides. Every check that can fail on user input lives here and says what to change."""

from __future__ import annotations

import dataclasses
import os
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any


class UserError(ValueError):
    """Bad input the user can fix (config, data, tokenizer, paths, hardware, a plan that cannot fit): train.py and
    the scripts report it as one line on stderr with exit code 2, no traceback. The message names the fix."""


def run_main(main: Callable[[], object]) -> None:
    """Run an entry point: a UserError is one line on stderr (rank 0 only under torchrun) and exit code 2."""
    try:
        main()
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


@dataclass
class ModelConfig:
    """DeepSeek-V3 hyper-parameters, named as in DeepSeek's `ModelArgs`."""

    vocab_size: int = 102400
    dim: int = 2048
    inter_dim: int = 10944  # dense SwiGLU hidden size
    moe_inter_dim: int = 1408  # per-expert SwiGLU hidden size
    n_layers: int = 27
    n_dense_layers: int = 1  # the first layers use a dense MLP instead of MoE
    n_heads: int = 16
    # MoE
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    n_activated_experts: int = 6  # top-k
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    score_func: str = "softmax"  # "softmax" | "sigmoid"
    route_scale: float = 1.0
    route_norm: bool = False  # renormalise the top-k gate weights to sum to 1 (before route_scale)
    # MLA
    q_lora_rank: int = 0  # 0: plain wq
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE / YaRN (YaRN is on only when max_seq_len > original_seq_len)
    max_seq_len: int = 4096
    original_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0
    # multi-token prediction depth D
    n_mtp_layers: int = 0
    norm_eps: float = 1e-6
    init_std: float = 0.006

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads",
                     "n_routed_experts", "n_activated_experts", "n_expert_groups", "n_limited_groups",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "max_seq_len", "original_seq_len"):
            if getattr(self, name) <= 0:
                problems.append(f"model.{name} must be positive, got {getattr(self, name)}")
        for name in ("n_dense_layers", "n_shared_experts", "q_lora_rank", "n_mtp_layers"):
            if getattr(self, name) < 0:
                problems.append(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            problems.append(f"model.qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.n_dense_layers > self.n_layers:
            problems.append(f"model.n_dense_layers ({self.n_dense_layers}) exceeds model.n_layers ({self.n_layers})")
        if self.score_func not in ("softmax", "sigmoid"):
            problems.append(f"model.score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if self.n_expert_groups > 0 and self.n_routed_experts % self.n_expert_groups:
            problems.append(f"model.n_routed_experts ({self.n_routed_experts}) is not divisible by "
                            f"model.n_expert_groups ({self.n_expert_groups})")
        elif self.n_limited_groups > self.n_expert_groups:
            problems.append(f"model.n_limited_groups ({self.n_limited_groups}) exceeds "
                            f"model.n_expert_groups ({self.n_expert_groups})")
        elif self.n_expert_groups > 0:
            reachable = self.n_limited_groups * self.n_routed_experts // self.n_expert_groups
            if self.n_activated_experts > reachable:
                problems.append(f"model.n_activated_experts ({self.n_activated_experts}) is larger than the "
                                f"{reachable} experts in the {self.n_limited_groups} limited groups")
        if problems:
            raise ValueError("invalid model config:\n  " + "\n  ".join(problems))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


FLAVORS: dict[str, ModelConfig] = {
    # Tiny, every dim a multiple of 32 so every precision path runs; trains on a CPU in seconds.
    "debug": ModelConfig(
        vocab_size=4096, dim=128, inter_dim=320, moe_inter_dim=64, n_layers=3, n_dense_layers=1, n_heads=4,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=2, n_limited_groups=1,
        score_func="sigmoid", route_scale=2.5, route_norm=True, q_lora_rank=64, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, max_seq_len=256, n_mtp_layers=1,
    ),
    # DeepSeek-V2-Lite shaped 16B (torchtitan's "16B"), no MTP.
    "16B": ModelConfig(),
    "671B": ModelConfig(
        vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_dense_layers=3,
        n_heads=128, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8, n_expert_groups=8,
        n_limited_groups=4, score_func="sigmoid", route_scale=2.5, route_norm=True, q_lora_rank=1536,
        n_mtp_layers=1,
    ),
}


@dataclass
class TrainConfig:
    steps: int = 1000
    global_batch: int = 32  # sequences per optimizer step, all ranks together
    micro_batch: int = 8  # sequences per rank per forward/backward
    seq_len: int = 256
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    decay_start: float = 0.8  # fraction of steps after which the cosine decay begins (paper §4.2)
    batch_ramp_steps: int = 0  # 0: no ramp; else global batch grows linearly from batch_ramp_start
    batch_ramp_start: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    balance_alpha: float = 1e-4  # sequence-wise balance loss weight α (0 disables)
    bias_update_speed: float = 1e-3  # aux-loss-free expert-bias step γ (0 disables)
    mtp_lambda: float = 0.3  # MTP loss weight λ ...
    mtp_lambda_final: float = 0.1  # ... and its value after mtp_lambda_switch of the steps (paper §4.2)
    mtp_lambda_switch: float = 0.7
    precision: str = "bf16"  # bf16 | fp8 | mxfp8 | mxfp8-emulated
    expert_precision: str = "bf16"  # bf16 | low (the `precision` path for the routed experts)
    optimizer_state_dtype: str = "fp32"  # fp32 | bf16: AdamW's moments (the paper keeps them in bf16, §3.3)
    fp8_recipe: str = "rowwise"  # rowwise | tensorwise (tensorwise all-gathers fp8 under FSDP2)
    precision_skip: list[str] = field(default_factory=list)  # dense linears whose name contains one stay bf16
    compile: bool = False  # torch.compile each block
    activation_checkpoint: str = "none"  # none | full | selective
    loss_spike_factor: float = 3.0  # stop when the loss exceeds this × its running mean (0: off)
    grad_norm_spike_factor: float = 100.0  # the same for the grad norm (benign early spikes reach ~10×)
    val_every: int = 100
    val_batches: int = 8
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class DataConfig:
    path: str = "data/stdlib"


@dataclass
class ParallelConfig:
    ep: int = 1  # expert-parallel degree; divides world size and n_routed_experts
    ep_backend: str = "all_to_all"  # all_to_all | deepep
    deepep_sms: int = 24  # SMs DeepEP's kernels take (even) when ep_backend = "deepep"; the rest compute
    # true: skip FSDP's reduce-scatter on all but the last micro-batch (less communication, but every rank holds
    # a full unsharded fp32 gradient of every parameter until the step)
    accumulate_unsharded_grads: bool = False
    gpus: int = 0  # the cluster this config is written for, as scripts/plan.py plans it (0: parallel.ep GPUs)


@dataclass
class CheckpointConfig:
    dir: str = "runs/debug"
    every: int = 1000  # save every N steps and at the end; 0: never (benchmarks)
    keep: int = 3  # the newest N checkpoints; 0: all
    resume: bool = False
    verify_checksums: bool = True  # on resume, checksum every file (sizes are always checked); off for huge runs
    export: bool = True  # safetensors + config.json at the end
    init_from: str = ""  # start from these weights: a dsv3 safetensors dir (an export, or convert_hf.py --to-dsv3)


@dataclass
class LogConfig:
    every: int = 10
    # per-expert token counts [MoE layers, E] to expert_load.jsonl (and a heatmap to W&B) every N steps; 0: never.
    # Not every log step: at 671B a line is 59 × 256 counts (58 MoE layers + MTP), ~100 KB
    expert_load_every: int = 100
    wandb: bool = False
    project: str = "dsv3"
    run_name: str = ""


@dataclass
class Config:
    flavor: str = "debug"
    model: dict[str, Any] = field(default_factory=dict)  # overrides of FLAVORS[flavor]
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def model_config(self) -> ModelConfig:
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {self.flavor!r}: choose one of {', '.join(FLAVORS)}")
        known = {f.name for f in fields(ModelConfig)}
        unknown = sorted(set(self.model) - known)
        if unknown:
            raise ValueError(f"unknown model key(s) {unknown}: ModelConfig has {', '.join(sorted(known))}")
        return dataclasses.replace(FLAVORS[self.flavor], **self.model)


_SECTIONS = ("train", "data", "parallel", "checkpoint", "log")
_CHOICES = {
    ("train", "precision"): ("bf16", "fp8", "mxfp8", "mxfp8-emulated"),
    ("train", "expert_precision"): ("bf16", "low"),
    ("train", "fp8_recipe"): ("rowwise", "tensorwise"),
    ("train", "optimizer_state_dtype"): ("fp32", "bf16"),
    ("train", "activation_checkpoint"): ("none", "full", "selective"),
    ("train", "device"): ("auto", "cpu", "cuda"),
    ("parallel", "ep_backend"): ("all_to_all", "deepep"),
}


def _parse_value(text: str) -> Any:
    """A CLI value as TOML reads it (numbers, booleans, quoted strings), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _typed(section: str, key: str, value: Any, current: Any, text: str | None = None) -> Any:
    """`value` as the type of the field's `current` value: int → float is fine, anything else is an error.
    `text`: the command-line text `value` was parsed from, which a string field takes as written
    (--log.run_name=2024-06-01 is not a date)."""
    if isinstance(current, str) and text is not None and not isinstance(value, str):
        return text
    if isinstance(current, bool) and not isinstance(value, bool):
        raise ValueError(f"{section}.{key} must be true or false, got {value!r}")
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not type(current):
        example = f""" (in TOML syntax: --{section}.{key}='["a", "b"]')""" if isinstance(current, list) else ""
        raise ValueError(f"{section}.{key} must be a {type(current).__name__}{example}, got {value!r}")
    if isinstance(value, list) and not all(isinstance(item, str) and item for item in value):
        raise ValueError(f"{section}.{key} must be a list of non-empty strings, got {value!r}")
    return value


def _set(cfg: Config, section: str, key: str, value: Any, text: str | None = None) -> None:
    if section == "model":
        defaults = ModelConfig()
        if key in {f.name for f in fields(defaults)}:  # unknown keys are reported by model_config()
            value = _typed(section, key, value, getattr(defaults, key), text)
        cfg.model[key] = value
        return
    if section == "":
        if key != "flavor":
            raise ValueError(f"unknown top-level key {key!r}: only `flavor` sits outside a [section]")
        cfg.flavor = _typed(section, key, value, cfg.flavor, text) if text is not None else value
        return
    if section not in _SECTIONS:
        raise ValueError(f"unknown config section {section!r} (key {key!r}): sections are "
                         f"flavor, model, {', '.join(_SECTIONS)}")
    target = getattr(cfg, section)
    types = {f.name: f.type for f in fields(target)}
    if key not in types:
        raise ValueError(f"unknown key {section}.{key}: {section} has {', '.join(sorted(types))}")
    value = _typed(section, key, value, getattr(target, key), text)
    choices = _CHOICES.get((section, key))
    if choices and value not in choices:
        raise ValueError(f"{section}.{key} must be one of {', '.join(choices)}, got {value!r}")
    setattr(target, key, value)


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults ← TOML file ← `--section.key=value` overrides; validated before anything is built."""
    cfg = Config()
    if path is not None:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        for section, body in doc.items():
            if not isinstance(body, dict):  # top-level keys: only `flavor`
                _set(cfg, "", section, body)
                continue
            for key, value in body.items():
                _set(cfg, section, key, value)
    for arg in overrides:
        if not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"bad override {arg!r}: write --section.key=value, e.g. --train.lr=3e-4")
        dotted, text = arg[2:].split("=", 1)
        section, _, key = dotted.rpartition(".")
        _set(cfg, section, key, _parse_value(text), text)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    mc = cfg.model_config()
    t = cfg.train
    for name, value, least in (("train.steps", t.steps, 1), ("train.global_batch", t.global_batch, 1),
                               ("train.micro_batch", t.micro_batch, 1), ("train.seq_len", t.seq_len, 1),
                               ("train.warmup_steps", t.warmup_steps, 0), ("train.val_every", t.val_every, 0),
                               ("train.val_batches", t.val_batches, 1), ("log.every", cfg.log.every, 1),
                               ("checkpoint.every", cfg.checkpoint.every, 0),
                               ("checkpoint.keep", cfg.checkpoint.keep, 0)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if t.seq_len > mc.max_seq_len:
        raise ValueError(f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({mc.max_seq_len})")
    if t.global_batch % t.micro_batch:
        raise ValueError(f"train.global_batch ({t.global_batch}) must be a multiple of train.micro_batch "
                         f"({t.micro_batch})")
    if t.batch_ramp_steps and not 0 < t.batch_ramp_start <= t.global_batch:
        raise ValueError("train.batch_ramp_start must be in (0, train.global_batch] when batch_ramp_steps > 0")
    for name in ("loss_spike_factor", "grad_norm_spike_factor"):
        if getattr(t, name) and getattr(t, name) <= 1:
            raise ValueError(f"train.{name} must be 0 (off) or > 1, got {getattr(t, name)}")
    if cfg.parallel.ep < 1:
        raise ValueError(f"parallel.ep must be >= 1, got {cfg.parallel.ep}")
