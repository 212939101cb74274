"""Configs: ModelConfig + named FLAVORS, the training sections, TOML loading and `--section.key=value`
overrides. Every check that can fail on user input lives here and says what to change."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dsv3 import failures
from dsv3.failures import UserError  # the error every check here raises, defined beside the policy for it


def run_main(main: Callable[[], object]) -> None:
    """Run an entry point under dsv3.failures' policy: every failure a user can cause or a machine can suffer is one
    line on stderr and a documented exit code (a UserError: 2), a traceback only for a bug."""
    failures.run(main)


def option(default: Any, help: str) -> Any:
    """A config field and its one-line meaning, which `--help` prints; a list or dict default is copied per config."""
    if isinstance(default, (list, dict)):
        return field(default_factory=default.copy, metadata={"help": help})
    return field(default=default, metadata={"help": help})


PRECISIONS = ("bf16", "fp8", "mxfp8", "mxfp8-emulated")  # train.precision (dsv3.lowp.quant)
EXPERT_PRECISIONS = ("bf16", "low", "fp8-blockwise")  # train.expert_precision
FP8_RECIPES = ("rowwise", "tensorwise")  # train.fp8_recipe


@dataclass
class ModelConfig:
    """DeepSeek-V3 hyper-parameters, named as in DeepSeek's `ModelArgs`."""

    vocab_size: int = option(102400, "tokenizer vocabulary (embedding and output-head rows)")
    dim: int = option(2048, "hidden size d")
    inter_dim: int = option(10944, "dense SwiGLU hidden size")
    moe_inter_dim: int = option(1408, "per-expert SwiGLU hidden size")
    n_layers: int = option(27, "transformer blocks")
    n_dense_layers: int = option(1, "the first layers use a dense MLP instead of MoE")
    n_heads: int = option(16, "attention heads")
    # MoE
    n_routed_experts: int = option(64, "routed experts per MoE layer")
    n_shared_experts: int = option(2, "experts every token passes through")
    n_activated_experts: int = option(6, "top-k")
    n_expert_groups: int = option(1, "expert groups for group-limited routing")
    n_limited_groups: int = option(1, "groups a token may route to")
    score_func: str = option("softmax", "softmax | sigmoid")
    route_scale: float = option(1.0, "factor on the gate weights of the routed experts")
    route_norm: bool = option(False, "renormalise the top-k gate weights to sum to 1 (before route_scale)")
    # MLA
    q_lora_rank: int = option(0, "query compression rank d_c'; 0: plain wq")
    kv_lora_rank: int = option(512, "key-value compression rank d_c")
    qk_nope_head_dim: int = option(128, "per-head query/key dim without RoPE d_h")
    qk_rope_head_dim: int = option(64, "per-head query/key dim with RoPE d_h^R")
    v_head_dim: int = option(128, "per-head value dim")
    # RoPE / YaRN (YaRN is on only when rope_factor > 1)
    max_seq_len: int = option(4096, "longest sequence the RoPE tables cover")
    original_seq_len: int = option(4096, "context trained with plain RoPE; YaRN stretches it to max_seq_len")
    rope_theta: float = option(10000.0, "RoPE base")
    rope_factor: float = option(1.0, "YaRN scale factor s; 1: plain RoPE, no YaRN")
    beta_fast: int = option(32, "YaRN: rotations below which frequencies are interpolated")
    beta_slow: int = option(1, "YaRN: rotations above which frequencies are kept")
    mscale: float = option(1.0, "YaRN attention-temperature coefficient")
    n_mtp_layers: int = option(0, "multi-token prediction depth D")
    norm_eps: float = option(1e-6, "RMSNorm epsilon")
    init_std: float = option(0.006, "standard deviation of the initial weights")

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
        for name in ("norm_eps", "init_std", "rope_theta", "route_scale"):
            if not 0 < getattr(self, name) < math.inf:  # `not` also catches nan
                problems.append(f"model.{name} must be > 0 and finite, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            problems.append(f"model.qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        problems += self._rope_problems()
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
            raise UserError("invalid model config: " + "; ".join(problems))

    def _rope_problems(self) -> list[str]:
        """YaRN only where rope_factor asks for it, and then only past original_seq_len: there DeepSeek's code
        (YaRN when max_seq_len > original_seq_len) and transformers' (YaRN whenever rope_scaling is set) agree."""
        length, original, factor = self.max_seq_len, self.original_seq_len, self.rope_factor
        if not factor >= 1:
            return [f"model.rope_factor must be >= 1 (1: plain RoPE), got {factor}"]
        if factor == 1 and length > original:
            return [f"model.max_seq_len ({length}) exceeds model.original_seq_len ({original}) with plain RoPE "
                    "(rope_factor 1): to train at that length raise model.original_seq_len with it; to stretch a "
                    "model trained at original_seq_len, set model.rope_factor > 1 (YaRN)"]
        if factor > 1 and length <= original:
            return [f"model.rope_factor ({factor}) turns YaRN on, which stretches RoPE past model.original_seq_len "
                    f"({original}), but model.max_seq_len ({length}) does not go past it: set model.rope_factor=1 "
                    "for plain RoPE (dsv3 configs written before YaRN followed rope_factor kept its old default, 40, "
                    "there)"]
        if length > original * factor:
            return [f"model.max_seq_len ({length}) exceeds the {original * factor:g} positions YaRN covers "
                    f"(model.original_seq_len × model.rope_factor = {original} × {factor}): raise model.rope_factor"]
        return []

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


FLAVORS: dict[str, ModelConfig] = {
    # Tiny, every dim a multiple of 32 so every precision path runs; configs/debug.toml trains in minutes on a CPU.
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


def load_config_json(path: str | Path) -> ModelConfig:
    """The ModelConfig a dsv3 config.json holds (an export's, convert_hf.py --to-dsv3's). Raises ValueError."""
    d = json.loads(Path(path).read_text())
    unknown = sorted(set(d) - {f.name for f in fields(ModelConfig)})
    if unknown:
        hint = " (an HF config? convert with scripts/convert_hf.py --to-dsv3)" if "hidden_size" in d else ""
        raise ValueError(f"{path}: unknown ModelConfig key(s) {', '.join(unknown)}{hint}")
    return ModelConfig(**d)


def hf_checkpoint_error(path: str | Path, then: str = "pass --checkpoint.init_from=OUT_DIR") -> UserError:
    return UserError(f"{path} is a Hugging Face checkpoint: convert it first with python scripts/convert_hf.py "
                     f"--to-dsv3 {path} OUT_DIR, then {then}")


def saved_model_config(weights_dir: str | Path,
                       then: str = "pass --checkpoint.init_from=OUT_DIR") -> ModelConfig | None:
    """The model a weights directory's config.json describes (checkpoint.init_from's, generate.py's); None where it
    has none. `then`: what to do with the conversion of a Hugging Face directory."""
    path = Path(weights_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path} is not JSON ({e}); export or convert it again") from None
    if "model_type" in d:  # HF's config.json; ours holds ModelConfig fields only
        raise hf_checkpoint_error(weights_dir, then)
    try:
        return load_config_json(path)
    except ValueError as e:
        raise UserError(str(e)) from None


@dataclass
class TrainConfig:
    steps: int = option(1000, "optimizer steps")
    global_batch: int = option(32, "sequences per optimizer step, all ranks together")
    micro_batch: int = option(8, "sequences per rank per forward/backward")
    seq_len: int = option(256, "tokens per training sequence")
    lr: float = option(3e-4, "peak learning rate, > 0")
    min_lr_ratio: float = option(0.1, "cosine decays to lr * min_lr_ratio, in [0, 1]")
    warmup_steps: int = option(100, "linear warmup from 0 to lr")
    decay_start: float = option(0.8, "fraction of steps after which the cosine decay begins (paper §4.2)")
    batch_ramp_steps: int = option(0, "0: no ramp; else global batch grows linearly from batch_ramp_start")
    batch_ramp_start: int = option(0, "global batch at step 0 of the ramp")
    weight_decay: float = option(0.1, "AdamW weight decay on matrices")
    beta1: float = option(0.9, "AdamW β1, in [0, 1)")
    beta2: float = option(0.95, "AdamW β2, in [0, 1)")
    grad_clip: float = option(1.0, "clip the global gradient norm to this, > 0 (1e9: effectively off)")
    balance_alpha: float = option(1e-4, "sequence-wise balance loss weight α (0 disables)")
    bias_update_speed: float = option(1e-3, "aux-loss-free expert-bias step γ (0 disables)")
    bias_update_stop: float = option(1.0, "fraction of steps after which γ is 0 (paper §4.2: the last 500B tokens)")
    mtp_lambda: float = option(0.3, "MTP loss weight λ until mtp_lambda_switch")
    mtp_lambda_final: float = option(0.1, "MTP loss weight λ after mtp_lambda_switch (paper §4.2)")
    mtp_lambda_switch: float = option(0.7, "fraction of steps after which λ drops to mtp_lambda_final")
    precision: str = option("bf16", " | ".join(PRECISIONS))
    expert_precision: str = option("bf16", "bf16 | low (the `precision` path for the routed experts) | fp8-blockwise")
    optimizer_state_dtype: str = option("bf16", "bf16 | fp32: AdamW's moments (bf16: paper §3.3, docs/training.md)")
    fp8_recipe: str = option("rowwise", "rowwise | tensorwise (faster; held the loss with bf16 moments)")
    precision_skip: list[str] = option([], "dense linears whose name contains one stay bf16")
    fp8_min_features: int = option(1536, "fp8 converts a dense linear only if min(in, out) features reach this (≥ 0)")
    compile: bool = option(False, "torch.compile each block")
    activation_checkpoint: str = option("none", "none | full | selective")
    loss_spike_factor: float = option(3.0, "stop when the loss exceeds this × its running mean (0: off)")
    grad_norm_spike_factor: float = option(100.0, "the same for the grad norm (benign early spikes reach ~10×)")
    val_every: int = option(100, "validate every N steps and at the end; 0: never")
    val_batches: int = option(8, "global batches per validation")
    seed: int = option(0, "model init and data order")
    deterministic: bool = option(False, "bit-identical losses and weights for one seed, config and world size "
                                        "(GPUs: slower)")
    device: str = option("auto", "auto | cpu | cuda")


@dataclass
class DataConfig:
    path: str = option("data/stdlib", "directory of train/ and val/ token shards (scripts/prepare_data.py)")
    sources: list[str] = option([], "a mixture instead of path: DIR:WEIGHT each, e.g. data/web:0.7")

    def mixture(self) -> list[tuple[str, str, float]]:
        """(name, directory, share) of every source, shares summing to 1; `path` alone is a mixture of one.
        A source's name is its directory's last component, or the whole path where two would share one."""
        if not self.sources:
            return [(Path(self.path).name or self.path, self.path, 1.0)]
        pairs = []
        for item in self.sources:
            directory, _, weight = item.rpartition(":")
            try:
                share = float(weight)
            except ValueError:
                share = math.nan
            if not directory or not 0 < share < math.inf:
                raise UserError(f"data.sources entry {item!r} is not DIR:WEIGHT with a weight > 0, "
                                "e.g. --data.sources=data/web:0.7,data/code:0.3")
            pairs.append((directory.rstrip("/") or directory, share))
        directories = [d for d, _ in pairs]
        if len(set(directories)) < len(directories):
            raise UserError(f"data.sources names a directory twice ({directories}): give each source once, "
                            "with the sum of its weights")
        names = [Path(d).name for d in directories]
        total = sum(share for _, share in pairs)
        return [(name if names.count(name) == 1 else d, d, share / total)
                for name, (d, share) in zip(names, pairs)]


@dataclass
class ParallelConfig:
    ep: int = option(1, "expert-parallel degree; divides world size and n_routed_experts")
    ep_backend: str = option("all_to_all", "all_to_all | deepep")
    deepep_sms: int = option(24, "SMs DeepEP's kernels take (even) when ep_backend = deepep; the rest compute")
    accumulate_unsharded_grads: bool = option(False, "true: reduce-scatter gradients at the last micro-batch only "
                                                     "(less communication; a full fp32 gradient on every rank)")
    gpus: int = option(0, "the cluster this config is written for, as scripts/plan.py plans it (0: parallel.ep GPUs)")


@dataclass
class CheckpointConfig:
    dir: str = option("runs/debug", "run directory: metrics.jsonl, step-N/ checkpoints, export/")
    every: int = option(1000, "save every N steps and at the end; 0: never (benchmarks)")
    keep: int = option(3, "the newest N checkpoints; 0: all")
    resume: bool = option(False, "continue from the newest checkpoint in dir (also: --resume)")
    verify_checksums: bool = option(True, "on resume, checksum every file (sizes are always checked): off for "
                                          "huge runs")
    async_save: bool = option(False, "copy to host memory in the step, write in the background (docs/training.md)")
    export: bool = option(True, "safetensors + config.json at the end")
    # [model] overrides apply on top of the model its config.json describes, as long as no saved shape changes
    init_from: str = option("", "weights + model (their config.json) to start from: an export or convert_hf.py "
                                "--to-dsv3 output")


@dataclass
class LogConfig:
    every: int = option(10, "print and record metrics every N steps (and at step 1)")
    # Not every log step: at 671B a line holds 256 counts per MoE layer
    expert_load_every: int = option(100, "per-expert counts to expert_load.jsonl (+ a W&B heatmap) every N "
                                         "steps; 0: never")
    wandb: bool = option(False, "also log to Weights & Biases")
    project: str = option("dsv3", "W&B project")
    run_name: str = option("", "W&B run name; empty: W&B picks one")


@dataclass
class Config:
    flavor: str = option("debug", "model flavor: a name in FLAVORS")
    model: dict[str, Any] = option({}, "overrides of FLAVORS[flavor]")
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def model_config(self) -> ModelConfig:
        """The model this run trains: the flavor's, or with checkpoint.init_from the one its weights' config.json
        describes (as from_pretrained builds it), with the [model] overrides on top."""
        if self.flavor not in FLAVORS:
            raise UserError(f"unknown flavor {self.flavor!r}: choose one of {', '.join(FLAVORS)}")
        known = {f.name for f in fields(ModelConfig)}
        unknown = sorted(set(self.model) - known)
        if unknown:
            raise UserError(f"unknown model key(s) {unknown}: {_known_keys('model', unknown[0], known)}")
        base = FLAVORS[self.flavor]
        if self.checkpoint.init_from:
            base = self.init_model or base
        return dataclasses.replace(base, **self.model)

    @functools.cached_property
    def init_model(self) -> ModelConfig | None:
        """checkpoint.init_from's model, read once: the model a run built must not change if the file does."""
        return saved_model_config(self.checkpoint.init_from)

    def continue_model(self, recorded: ModelConfig) -> None:
        """A resumed run that started from checkpoint.init_from trains the model its checkpoint recorded (the
        [model] overrides on top, for `resume_changes` to judge): the init_from directory is not read again."""
        self.init_model = recorded


_SECTIONS = ("train", "data", "parallel", "checkpoint", "log")
_CHOICES = {
    ("train", "precision"): PRECISIONS,
    ("train", "expert_precision"): EXPERT_PRECISIONS,
    ("train", "fp8_recipe"): FP8_RECIPES,
    ("train", "optimizer_state_dtype"): ("bf16", "fp32"),
    ("train", "activation_checkpoint"): ("none", "full", "selective"),
    ("train", "device"): ("auto", "cpu", "cuda"),
    ("parallel", "ep_backend"): ("all_to_all", "deepep"),
}


def _known_keys(section: str, key: str, known: set[str]) -> str:
    """The keys a mistyped `key` may have meant: the closest, else all of them."""
    close = difflib.get_close_matches(key, known, n=3)
    if close:
        return "did you mean " + " or ".join(f"{section}.{name}" for name in close) + "?"
    return f"{section} has {', '.join(sorted(known))}"


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


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
        raise UserError(f"{section}.{key} must be true or false, got {value!r}")
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(current, list) and isinstance(value, str) and text is not None:
        value = [item.strip() for item in value.split(",")]  # --data.sources=a:0.7,b:0.3
    if type(value) is not type(current):
        example = f""" (in TOML syntax: --{section}.{key}='["a", "b"]')""" if isinstance(current, list) else ""
        raise UserError(f"{section}.{key} must be {_a(type(current).__name__)}{example}, got {value!r}")
    if isinstance(value, list) and not all(isinstance(item, str) and item for item in value):
        raise UserError(f"{section}.{key} must be a list of non-empty strings, got {value!r}")
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
            raise UserError(f"unknown top-level key {key!r}: only `flavor` sits outside a [section]")
        cfg.flavor = _typed(section, key, value, cfg.flavor, text) if text is not None else value
        return
    if section not in _SECTIONS:
        raise UserError(f"unknown config section {section!r} (key {key!r}): sections are "
                        f"flavor, model, {', '.join(_SECTIONS)}")
    target = getattr(cfg, section)
    types = {f.name: f.type for f in fields(target)}
    if key not in types:
        raise UserError(f"unknown key {section}.{key}: {_known_keys(section, key, set(types))}")
    value = _typed(section, key, value, getattr(target, key), text)
    choices = _CHOICES.get((section, key))
    if choices and value not in choices:
        raise UserError(f"{section}.{key} must be one of {', '.join(choices)}, got {value!r}")
    setattr(target, key, value)


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults ← TOML file ← `--section.key=value` overrides; validated before anything is built."""
    cfg = Config()
    if path is not None:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except FileNotFoundError:
            raise UserError(f"config file {path} not found: pass an existing TOML file to --config, "
                            "e.g. configs/debug.toml") from None
        except tomllib.TOMLDecodeError as e:  # its message ends "(at line L, column C)"
            raise UserError(f"{path} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise UserError(f"{path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}): TOML "
                            "files are UTF-8, save it as UTF-8") from None
        for section, body in doc.items():
            if not isinstance(body, dict):  # top-level keys: only `flavor`
                _set(cfg, "", section, body)
                continue
            for key, value in body.items():
                _set(cfg, section, key, value)
    for arg in overrides:
        if not arg.startswith("--") or "=" not in arg:
            raise UserError(f"bad override {arg!r}: write --section.key=value, e.g. --train.lr=3e-4")
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
                               ("train.val_batches", t.val_batches, 1), ("train.seed", t.seed, 0),
                               ("train.batch_ramp_steps", t.batch_ramp_steps, 0),
                               ("train.batch_ramp_start", t.batch_ramp_start, 0),
                               ("train.weight_decay", t.weight_decay, 0), ("train.balance_alpha", t.balance_alpha, 0),
                               ("train.bias_update_speed", t.bias_update_speed, 0),
                               ("train.fp8_min_features", t.fp8_min_features, 0),
                               ("train.mtp_lambda", t.mtp_lambda, 0), ("train.mtp_lambda_final", t.mtp_lambda_final, 0),
                               ("log.every", cfg.log.every, 1), ("log.expert_load_every", cfg.log.expert_load_every, 0),
                               ("checkpoint.every", cfg.checkpoint.every, 0),
                               ("checkpoint.keep", cfg.checkpoint.keep, 0)):
        if not least <= value < math.inf:  # `not` also catches nan
            raise UserError(f"{name} must be >= {least} and finite, got {value}")
    for name, value in (("train.min_lr_ratio", t.min_lr_ratio), ("train.decay_start", t.decay_start),
                        ("train.mtp_lambda_switch", t.mtp_lambda_switch),
                        ("train.bias_update_stop", t.bias_update_stop)):
        if not 0 <= value <= 1:
            raise UserError(f"{name} is a fraction and must be in [0, 1], got {value}")
    for name, value in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0 <= value < 1:
            raise UserError(f"{name} must be in [0, 1), got {value}")
    if not 0 < t.lr < math.inf:
        raise UserError(f"train.lr must be > 0, got {t.lr}")
    if not 0 < t.grad_clip < math.inf:  # 0 would zero every gradient, a negative one flip their sign
        raise UserError(f"train.grad_clip must be > 0, got {t.grad_clip}: it is the largest global gradient norm "
                        "kept; for no clipping set a large value, e.g. 1e9")
    if t.seq_len > mc.max_seq_len:
        past = (f"; past model.original_seq_len ({mc.original_seq_len}), raise that with it to train with plain RoPE, "
                "or set model.rope_factor > 1 to stretch it with YaRN" if t.seq_len > mc.original_seq_len else "")
        raise UserError(f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({mc.max_seq_len}): raise "
                        f"model.max_seq_len{past}")
    if t.global_batch % t.micro_batch:
        raise UserError(f"train.global_batch ({t.global_batch}) must be a multiple of train.micro_batch "
                        f"({t.micro_batch})")
    if t.batch_ramp_steps and not 0 < t.batch_ramp_start <= t.global_batch:
        raise UserError("train.batch_ramp_start must be in (0, train.global_batch] when batch_ramp_steps > 0")
    for name in ("loss_spike_factor", "grad_norm_spike_factor"):
        if not (getattr(t, name) == 0 or getattr(t, name) > 1):  # nan, which would turn the guard off, too
            raise UserError(f"train.{name} must be 0 (off) or > 1, got {getattr(t, name)}")
    if t.seq_len <= mc.n_mtp_layers:  # MTP depth k predicts token i + k + 1: no position would be left
        raise UserError(f"train.seq_len ({t.seq_len}) must exceed model.n_mtp_layers ({mc.n_mtp_layers})")
    if cfg.data.sources and cfg.data.path != DataConfig.path:
        raise UserError(f"data.path ({cfg.data.path}) and data.sources are both set: a single dataset is "
                        f"data.path, a mixture is data.sources (e.g. --data.sources={cfg.data.path}:1,other:1)")
    cfg.data.mixture()  # its entries parse
    if cfg.parallel.ep < 1:
        raise UserError(f"parallel.ep must be >= 1, got {cfg.parallel.ep}")
    if t.deterministic and cfg.parallel.ep_backend == "deepep":  # dsv3.determinism says why
        raise UserError("train.deterministic=true is not verified with parallel.ep_backend=deepep (its kernels were "
                        "never run twice bit for bit here): use --parallel.ep_backend=all_to_all")


# Resuming with another value of these would reinterpret saved state: AdamW's moments, the data positions.
_RESUME_FIXED = ("train.optimizer_state_dtype", "train.seq_len")


def resume_record(cfg: Config) -> dict[str, Any]:
    """What a checkpoint records of its run's config (JSON), for `resume_changes` to compare a resumed run with."""
    record = {section: dataclasses.asdict(getattr(cfg, section)) for section in ("train", "parallel", "checkpoint",
                                                                                   "log")}
    for key in ("resume", "dir"):  # how this run was started, not what it trains
        del record["checkpoint"][key]
    record["model"] = dataclasses.asdict(cfg.model_config())
    record["sources"] = {name: [path, share] for name, path, share in cfg.data.mixture()}
    return record


def resume_changes(saved: dict[str, Any], cfg: Config) -> list[str]:
    """The run saved in a checkpoint (`resume_record`) against this one, before anything is built: a difference that
    would drop, reshape or reinterpret saved state (a model field but init_std, the data sources, _RESUME_FIXED) is a
    UserError naming the key, the saved value and the fix; the safe ones come back, one line each."""
    now = resume_record(cfg)

    def refuse(key: str, was: Any, fix: str) -> UserError:
        return UserError(f"--resume: the checkpoint was saved with {key}={was}, this run has {_flat(now, key)}: "
                         f"{fix}, or start a new run in another --checkpoint.dir")

    # init_std is moot: the weights are loaded
    differing = {key: was for key, was in saved["model"].items() if key != "init_std" and now["model"].get(key) != was}
    if differing:
        flags = " ".join(f"--model.{key}={json.dumps(was).strip(chr(34))}" for key, was in differing.items())
        if saved["checkpoint"].get("init_from") and not cfg.checkpoint.init_from:  # its model came from the weights
            flags = f"--checkpoint.init_from={saved['checkpoint']['init_from']}"
        key, was = next(iter(differing.items()))
        raise refuse(f"model.{key}", was, f"resume with {flags}")
    for key in _RESUME_FIXED:
        if _flat(saved, key) != _flat(now, key):
            raise refuse(key, _flat(saved, key), f"resume with --{key}={_flat(saved, key)}")
    saved_paths, paths = ({name: path for name, (path, _) in record["sources"].items()} for record in (saved, now))
    if saved_paths != paths:
        raise UserError(f"--resume: the checkpoint read the data sources {saved_paths}, this run has {paths}: resume "
                        "with the same data.path or data.sources (their weights may change), or start a new run in "
                        "another --checkpoint.dir")
    changes = []
    weights = [f"{name} {share:.3g} → {now['sources'][name][1]:.3g}" for name, (_, share) in saved["sources"].items()
               if not math.isclose(share, now["sources"][name][1])]
    if weights:
        changes.append("mixture weights changed: " + ", ".join(weights))
    for section in ("train", "parallel", "checkpoint", "log"):
        for key, was in saved[section].items():
            value = now[section].get(key)
            if value != was and f"{section}.{key}" != "train.steps":
                changes.append(f"{section}.{key} changed: {was} → {value}")
    if saved["train"]["steps"] != cfg.train.steps:
        changes.append(f"train.steps {saved['train']['steps']} → {cfg.train.steps}: lr schedule recomputed"
                       + (", export will be replaced" if cfg.checkpoint.export else ""))
    return changes


def _flat(record: dict[str, Any], key: str) -> Any:
    section, name = key.split(".")
    return record[section][name]


def field_help(cls: type) -> dict[str, str]:
    """A config dataclass's one-line meaning of each field (`option`'s help)."""
    return {f.name: f.metadata["help"] for f in fields(cls) if "help" in f.metadata}


def help_text() -> str:
    """`train.py --help`: usage, then every config key with its default and meaning, by section."""
    lines = ["usage: python train.py [--config FILE.toml] [--section.key=value ...] [--resume]",
             "       torchrun --nproc_per_node=N train.py ... (the same arguments)",
             "",
             "Defaults ← the TOML file ← --section.key=value overrides (TOML syntax: --train.lr=3e-4,",
             "--train.precision_skip='[\"wo\"]'); --resume is --checkpoint.resume=true.",
             "",
             f"flavor = {json.dumps(Config.flavor)}  # {field_help(Config)['flavor']} ({', '.join(FLAVORS)})",
             "",
             "[model]  # single-field overrides of the flavor; defaults shown are the 16B flavor's"]
    sections = [("model", ModelConfig())] + [(name, getattr(Config(), name)) for name in _SECTIONS]
    for section, defaults in sections:
        if section != "model":
            lines += ["", f"[{section}]"]
        meanings = field_help(type(defaults))
        for f in fields(defaults):
            lines.append(f"  {f.name} = {json.dumps(getattr(defaults, f.name))}  # {meanings[f.name]}")
    return "\n".join(lines)
