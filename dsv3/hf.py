"""HF DeepSeek-V3 ↔ dsv3: config and state-dict conversion, both directions, one tensor at a time.

HF layout (DeepSeek's released checkpoints, transformers' DeepseekV3/V2): decoder layers
`model.layers.N.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}`; routed experts either
per expert `mlp.experts.J.{gate,up,down}_proj.weight` (on disk) or transformers-5 fused
`mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I]; MTP module k is HF layer
`n_layers + k`, which also repeats the shared embedding and head (dropped on import, written on export).
Ours: `Transformer.state_dict()`, experts stacked as `ffn.experts.w13` [E, 2I, dim] (gate rows, then up)
and `ffn.experts.w2` [E, dim, I] — the fused HF layout, so only the per-expert layout needs (un)stacking.
DeepSeek's FP8 release (float8_e4m3fn linear weights, fp32 scales per 128×128 block in `weight_scale_inv`) is
dequantized to bf16 one weight at a time on import, as DeepSeek's own fp8_cast_bf16.py does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from dsv3.config import ModelConfig, UserError
from dsv3.model import Transformer


@contextlib.contextmanager
def open_safetensors(path: str | Path) -> Iterator[Any]:
    """safe_open(path, "pt"); a damaged file (a header length past the file, offsets out of range, bad JSON) is a
    UserError naming it instead of a SafetensorError traceback."""
    try:
        with safe_open(path, "pt") as f:
            yield f
    except SafetensorError as e:
        raise UserError(f"{path} is not a readable safetensors file ({e}): it is damaged or truncated; restore it, "
                        "or write it again (export or convert)") from None

# ours → HF, outside the blocks
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
# ours inside a Block → HF inside a decoder layer
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.expert_bias": "mlp.gate.e_score_correction_bias",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.experts.w13": "mlp.experts.gate_up_proj",
    "ffn.experts.w2": "mlp.experts.down_proj",
}
# ours inside MTP module k (outside its block) → HF inside layer n_layers + k
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}
# HF repeats the shared embedding and output head in every MTP layer
_MTP_COPIES = {"embed.weight": "embed_tokens.weight", "head.weight": "shared_head.head.weight"}
_TOP_FROM_HF = {hf: ours for ours, hf in _TOP.items()}
_BLOCK_FROM_HF = {hf: ours for ours, hf in _BLOCK.items()}
_MTP_FROM_HF = {hf: ours for ours, hf in _MTP.items()}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_PER_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# ModelConfig's YaRN parameters, which HF's config holds only while YaRN is on; rope_factor is not among them:
# HF's rope_scaling says whether YaRN is on, and without it RoPE is plain (rope_factor 1)
_YARN_FIELDS = ("original_seq_len", "beta_fast", "beta_slow", "mscale")


# ---------------------------------------------------------------------------------------------- config

def config_from_hf(d: dict) -> ModelConfig:
    """An HF DeepseekV3 (or V2) config.json dict → ModelConfig. Raises ValueError for what dsv3 cannot run."""
    _check_supported(d)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                           "num_hidden_layers", "num_attention_heads", "n_routed_experts", "num_experts_per_tok",
                           "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                           "max_position_embeddings") if d.get(k) is None]
    if missing:
        raise ValueError(f"HF config lacks {', '.join(missing)}")
    rope, rope_type = _rope(d)
    max_seq_len = d["max_position_embeddings"]
    # transformers' V3 config has no scoring_func: its router is sigmoid only; V2 is softmax only.
    v2 = d.get("model_type") == "deepseek_v2"
    default_score = "softmax" if v2 else "sigmoid"
    # V2's greedy router (its default) is a plain top-k over all experts, whatever n_group says
    grouped = not (v2 and d.get("topk_method", "greedy") == "greedy")
    cfg = dict(
        vocab_size=d["vocab_size"], dim=d["hidden_size"], inter_dim=d["intermediate_size"],
        moe_inter_dim=d["moe_intermediate_size"], n_layers=d["num_hidden_layers"],
        n_dense_layers=d.get("first_k_dense_replace") or 0, n_heads=d["num_attention_heads"],
        n_routed_experts=d["n_routed_experts"], n_shared_experts=d.get("n_shared_experts") or 0,
        n_activated_experts=d["num_experts_per_tok"], n_expert_groups=grouped and d.get("n_group") or 1,
        n_limited_groups=grouped and d.get("topk_group") or 1, score_func=d.get("scoring_func", default_score),
        route_scale=d.get("routed_scaling_factor", 1.0), route_norm=bool(d.get("norm_topk_prob", False)),
        q_lora_rank=d.get("q_lora_rank") or 0, kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
        max_seq_len=max_seq_len, original_seq_len=max_seq_len,  # YaRN off unless rope scaling says otherwise
        rope_theta=d.get("rope_theta") or rope.get("rope_theta") or 10000.0,
        n_mtp_layers=d.get("num_nextn_predict_layers") or 0, norm_eps=d.get("rms_norm_eps", 1e-6),
    )
    kept = d.get("dsv3") or {}  # what config_to_hf kept beside HF's fields
    if rope_type == "yarn":
        cfg.update(_yarn_from_hf(rope, max_seq_len))
    else:  # YaRN's parameters ride along unused, as long as they keep it off as HF does (no edited max length)
        cfg.update({k: kept[k] for k in _YARN_FIELDS if k in kept})
        cfg["original_seq_len"] = max(cfg["original_seq_len"], max_seq_len)
    if "init_std" in kept:
        cfg["init_std"] = kept["init_std"]
    return ModelConfig(**cfg)


def _yarn_from_hf(rope: dict, max_seq_len: int) -> dict:
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"YaRN rope_scaling {rope} lacks original_max_position_embeddings, the length it stretches")
    factor = rope.get("factor") or max_seq_len / original
    if max_seq_len <= original:
        raise ValueError(f"YaRN with max_position_embeddings {max_seq_len} <= original_max_position_embeddings "
                         f"{original}: transformers applies it there, DeepSeek's code does not, dsv3 refuses it")
    # transformers also scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim); dsv3 (like
    # DeepSeek's own code) scales only the softmax, so the two must cancel, as in DeepSeek's configs.
    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    cos_scale = rope.get("attention_factor") or (_yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
                                                 if m and m_all else _yarn_mscale(factor, 1.0))
    if abs(cos_scale - 1.0) > 1e-12:
        raise ValueError(f"YaRN rope_scaling {rope} scales cos/sin by {cos_scale}; dsv3 supports only "
                         "mscale == mscale_all_dim (as DeepSeek's configs have)")
    return dict(original_seq_len=original, rope_factor=factor, beta_fast=rope.get("beta_fast", 32),
                beta_slow=rope.get("beta_slow", 1), mscale=m_all or 0.0)  # no mscale_all_dim: softmax unscaled


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _rope(d: dict) -> tuple[dict, str]:
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}  # on-disk name, transformers-5 name
    return rope, rope.get("rope_type", rope.get("type", "default"))


def _check_supported(d: dict) -> None:
    problems = []
    rope_type = _rope(d)[1]
    if rope_type not in ("default", "yarn"):
        problems.append(f"rope type {rope_type!r} (dsv3 has plain RoPE and YaRN)")
    if d.get("moe_layer_freq", 1) != 1:
        problems.append("moe_layer_freq != 1 (dsv3 makes every layer after the dense ones MoE)")
    if d.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {d['hidden_act']!r} (dsv3 experts are SwiGLU)")
    if d.get("attention_bias"):
        problems.append("attention_bias (dsv3 projections have no bias)")
    if d.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings (dsv3 has an untied head)")
    if d.get("rope_interleave") is False:
        problems.append("rope_interleave false (dsv3 rotates interleaved pairs, as DeepSeek's weights expect)")
    if d.get("topk_method") == "group_limited_greedy" and (d.get("n_group") or 1) > 1:
        problems.append("topk_method group_limited_greedy (V2 ranks groups by their max score; dsv3 by the sum "
                        "of the top 2)")
    if problems:
        raise ValueError("HF config not supported by dsv3: " + "; ".join(problems))


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig → an HF config.json dict. Sigmoid routing exports as deepseek_v3; softmax as deepseek_v2,
    the transformers model with a softmax router (it has no expert bias and ignores route_norm: an export
    checks `check_hf_represents` first)."""
    v3 = cfg.score_func == "sigmoid"
    d: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.inter_dim,
        "moe_intermediate_size": cfg.moe_inter_dim, "num_hidden_layers": cfg.n_layers,
        "first_k_dense_replace": cfg.n_dense_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts, "num_experts_per_tok": cfg.n_activated_experts,
        "n_group": cfg.n_expert_groups, "topk_group": cfg.n_limited_groups, "scoring_func": cfg.score_func,
        "topk_method": "noaux_tc" if v3 else "greedy" if cfg.n_expert_groups == 1 else "group_limited_greedy",
        "routed_scaling_factor": cfg.route_scale, "norm_topk_prob": cfg.route_norm,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
        "num_nextn_predict_layers": cfg.n_mtp_layers, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False,
    }
    # The ModelConfig fields HF has no place for, so that --to-hf then --to-dsv3 gives back the same config
    # (transformers keeps unknown keys): the init std (HF's initializer_range is its own default, not ours),
    # and YaRN's parameters while it is off, which matter again once a run sets rope_factor.
    d["dsv3"] = {"init_std": cfg.init_std}
    if cfg.rope_factor > 1:
        d["rope_scaling"] = {"type": "yarn", "factor": cfg.rope_factor,
                             "original_max_position_embeddings": cfg.original_seq_len,
                             "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
                             "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale,
                             # cos/sin unscaled, as here, even where mscale 0 would have transformers scale them
                             "attention_factor": 1.0}
    else:
        d["dsv3"].update({k: getattr(cfg, k) for k in _YARN_FIELDS})
    return d


def save_config(cfg: ModelConfig, path: str | Path) -> None:
    """Our config.json: the ModelConfig fields, as every dsv3 export writes it."""
    Path(path).write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")


# ------------------------------------------------------------------------------------------ state dict

def model_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Our state-dict keys and shapes for cfg, read off a model on the meta device (no memory)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


class Target(NamedTuple):
    key: str  # our key; "" for an HF copy of the shared embedding or head, which is dropped
    expert: int | None = None  # per-expert HF tensor: its row in our expert stack
    part: int = 0  # which half of that expert's w13 rows: 0 gate (or w2), 1 up


def _hf_target(name: str, cfg: ModelConfig) -> Target | None:
    """Where one HF tensor goes in our state dict; None if it has no place in a model of this config."""
    if name in _TOP_FROM_HF:
        return Target(_TOP_FROM_HF[name])
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    layer, rest = int(m[1]), m[2]
    if layer < cfg.n_layers:
        prefix = f"layers.{layer}."
    elif layer < cfg.n_layers + cfg.n_mtp_layers:
        k = layer - cfg.n_layers
        if rest in _MTP_COPIES.values():
            return Target("")
        if rest in _MTP_FROM_HF:
            return Target(f"mtp.{k}.{_MTP_FROM_HF[rest]}")
        prefix = f"mtp.{k}.block."
    else:
        return None
    if rest in _BLOCK_FROM_HF:
        return Target(prefix + _BLOCK_FROM_HF[rest])
    e = _PER_EXPERT.fullmatch(rest)
    if e is None or int(e[1]) >= cfg.n_routed_experts:
        return None
    stack = "ffn.experts.w2" if e[2] == "down" else "ffn.experts.w13"
    return Target(prefix + stack, int(e[1]), int(e[2] == "up"))


class FromHF:
    """An HF state dict to ours one tensor at a time: `add(name, tensor)` returns the dsv3 tensors it completes
    (none for MTP's copies of embedding and head, none until an expert stack's last arrives); `finish()` raises
    one ValueError listing unknown and missing keys, and returns what may be left out (docs/hf.md#the-converter)."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.shapes = model_shapes(cfg)
        self.unknown: list[str] = []
        self.filled: dict[str, set[tuple[int | None, int]]] = defaultdict(set)  # our key → (expert, part) seen
        self.stacks: dict[str, torch.Tensor] = {}  # expert stacks still being filled

    def claim(self, name: str, shape: Sequence[int]) -> Target | None:
        """Records HF tensor `name` of `shape` as present and returns its target (None: unknown)."""
        target = _hf_target(name, self.cfg)
        if target is None or (target.key and target.key not in self.shapes):
            self.unknown.append(name)
            return None
        if target.key:
            expected = tuple(self.shapes[target.key])
            if target.expert is not None:  # one expert's slice of the stack
                expected = (expected[1] // 2, expected[2]) if target.key.endswith("w13") else expected[1:]
            if tuple(shape) != expected:
                raise ValueError(f"{name} has shape {tuple(shape)}; the config needs {expected} (for {target.key})")
            self.filled[target.key].add((target.expert, target.part))
        return target

    def add(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        target = self.claim(name, tensor.shape)
        if target is None or not target.key:
            return {}
        if target.expert is None:
            # the expert bias is training state the router adds in fp32; keep it fp32 whatever the checkpoint
            return {target.key: tensor.float() if target.key.endswith("expert_bias") else tensor}
        stack = self.stacks.get(target.key)
        if stack is None:
            stack = self.stacks[target.key] = tensor.new_empty(self.shapes[target.key])
        rows = tensor.size(0)
        stack[target.expert, target.part * rows:(target.part + 1) * rows] = tensor
        return {target.key: self.stacks.pop(target.key)} if self._complete(target.key) else {}

    def _complete(self, key: str) -> bool:
        seen = self.filled[key]
        parts = self.cfg.n_routed_experts * (2 if key.endswith("experts.w13") else 1)
        return (None, 0) in seen or len(seen) == parts

    def finish(self) -> dict[str, torch.Tensor]:
        """Checks that everything arrived; returns the zero expert biases of a softmax (DeepSeek-V2 style)
        checkpoint, which has no e_score_correction_bias: its routing is ours with b = 0."""
        missing, zero_biases = [], {}
        for key in self.shapes:
            if self._complete(key):
                continue
            if key.endswith("expert_bias") and self.cfg.score_func == "softmax":
                zero_biases[key] = torch.zeros(self.shapes[key])
                continue
            seen = len(self.filled[key])
            missing.append(f"{key} (only {seen} per-expert tensors)" if seen else key)
        if self.unknown or missing:
            raise _mismatch("HF state dict", self.unknown, missing)
        return zero_biases


def check_hf_keys(shapes: Mapping[str, Sequence[int]], cfg: ModelConfig) -> None:
    """Raises the ValueError `FromHF` would, from names and shapes alone (e.g. read off safetensors headers)."""
    importer = FromHF(cfg)
    for name, shape in shapes.items():
        importer.claim(name, shape)
    importer.finish()


def check_dsv3_keys(shapes: Mapping[str, Sequence[int]], cfg: ModelConfig) -> None:
    """Raises one ValueError if our state dict's names or shapes don't match cfg."""
    expected = model_shapes(cfg)
    unknown = [k for k in shapes if k not in expected]
    missing = [k for k in expected if k not in shapes]
    if unknown or missing:
        raise _mismatch("dsv3 state dict", unknown, missing)
    for k, shape in shapes.items():
        if tuple(shape) != tuple(expected[k]):
            raise ValueError(f"{k} has shape {tuple(shape)}; the config needs {tuple(expected[k])}")


def _listing(names: list[str]) -> str:
    more = f", ... ({len(names) - 20} more)" if len(names) > 20 else ""
    return ", ".join(names[:20]) + more


def _mismatch(what: str, unknown: list[str], missing: list[str]) -> ValueError:
    parts = [f"{len(unknown)} unknown: {_listing(unknown)}"] if unknown else []
    parts += [f"{len(missing)} missing: {_listing(missing)}"] if missing else []
    hint = ""
    if any(n.endswith(SCALE_SUFFIX) for n in unknown):
        hint = " (FP8 weights with block scales: dequantize them with dequantize_fp8, as convert_hf.py --to-dsv3 does)"
    elif missing and all(k.startswith("mtp.") for k in missing):
        hint = " (no MTP layers in the checkpoint, as transformers saves it: use n_mtp_layers=0)"
    return ValueError(f"{what} does not match the model config: " + "; ".join(parts) + hint)


def tensor_to_hf(key: str, tensor: torch.Tensor, cfg: ModelConfig,
                 fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """One of our tensors → its HF tensor(s): per-expert slices unless fused_experts, plus the MTP layers'
    copies of the embedding and head. Keys must be valid for cfg (see `check_dsv3_keys`)."""
    # Extra tensors are cloned: safetensors refuses to save tensors that share storage.
    if key in _MTP_COPIES:
        copies = {f"model.layers.{cfg.n_layers + k}.{_MTP_COPIES[key]}": tensor.clone()
                  for k in range(cfg.n_mtp_layers)}
        return {_TOP[key]: tensor, **copies}
    if key in _TOP:
        return {_TOP[key]: tensor}
    scope, i, rest = key.split(".", 2)
    if scope == "layers":
        hf = f"model.layers.{i}.{_BLOCK[rest]}"
    elif rest.startswith("block."):
        hf = f"model.layers.{cfg.n_layers + int(i)}.{_BLOCK[rest.removeprefix('block.')]}"
    else:
        return {f"model.layers.{cfg.n_layers + int(i)}.{_MTP[rest]}": tensor}
    if fused_experts or not rest.endswith(("experts.w13", "experts.w2")):
        return {hf: tensor}
    experts = hf.rpartition(".")[0]  # model.layers.N.mlp.experts
    if rest.endswith("w13"):
        gate, up = tensor.chunk(2, dim=1)  # [E, I, dim] each
        return {f"{experts}.{j}.{proj}.weight": w[j].clone()
                for j in range(cfg.n_routed_experts) for proj, w in (("gate_proj", gate), ("up_proj", up))}
    return {f"{experts}.{j}.down_proj.weight": tensor[j].clone() for j in range(cfg.n_routed_experts)}


def state_dict_from_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF state dict (either expert layout) → ours, ready for `Transformer.load_state_dict(strict=True)`."""
    importer = FromHF(cfg)
    out = {}
    for name, tensor in sd.items():
        out.update(importer.add(name, tensor))
    out.update(importer.finish())
    return out


def check_hf_represents(cfg: ModelConfig, expert_biases: Iterable[torch.Tensor], allow_lossy: bool = False) -> None:
    """Refuse (or, allow_lossy, warn about) an export whose HF model would compute something else: a softmax
    router exports as deepseek_v2, which has no expert bias and never renormalises the top-k weights."""
    if cfg.score_func != "softmax":
        return
    lost = []
    if any(bool(b.any()) for b in expert_biases):
        lost.append("a non-zero expert bias (the trained routing)")
    if cfg.route_norm:
        lost.append("route_norm (deepseek_v2 ignores norm_topk_prob)")
    if not lost:
        return
    message = (f"HF's deepseek_v2, the transformers model for a softmax router, cannot represent {' and '.join(lost)}: "
               "its logits would differ from this model's")
    if not allow_lossy:
        raise UserError(f"{message}. Pass --allow-lossy to export anyway, or train with "
                        "--train.bias_update_speed=0 --model.route_norm=false (or a sigmoid router).")
    warnings.warn(f"{message}; exporting anyway (--allow-lossy).", stacklevel=2)


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig, fused_experts: bool = False,
                     allow_lossy: bool = False) -> dict[str, torch.Tensor]:
    """Our state dict → HF names: per-expert experts as on disk, or transformers-5 fused with fused_experts.
    A model HF cannot represent is refused unless allow_lossy (see `check_hf_represents`)."""
    check_dsv3_keys({k: v.shape for k, v in sd.items()}, cfg)
    check_hf_represents(cfg, [t for k, t in sd.items() if k.endswith("expert_bias")], allow_lossy)
    out = {}
    for key, tensor in sd.items():
        out.update(tensor_to_hf(key, tensor, cfg, fused_experts))
    return out


# ---------------------------------------------------------------------------------------- FP8 release

# DeepSeek's FP8 release: each quantized `X.weight` (float8_e4m3fn) has its block scales in `X.weight_scale_inv`
SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(hf_config: dict) -> tuple[int, int] | None:
    """The [rows, cols] weight block of config.json's quantization_config (DeepSeek's FP8 release: [128, 128]);
    None if it has none. Raises ValueError for a quantization other than DeepSeek's block-scaled e4m3."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    block = q.get("weight_block_size")
    if (q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not isinstance(block, list)
            or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config {json.dumps(q)} not supported: dsv3 dequantizes DeepSeek's FP8 "
                         'release only (quant_method "fp8", fmt "e4m3", weight_block_size [rows, cols])')
    return block[0], block[1]


def _scale_shape(weight_shape: Sequence[int], block: tuple[int, int]) -> tuple[int, ...]:
    return tuple(math.ceil(n / b) for n, b in zip(weight_shape, block))  # edge blocks are partial


def fp8_scales(dtypes: Mapping[str, str], shapes: Mapping[str, Sequence[int]],
               block: tuple[int, int] | None) -> dict[str, str]:
    """Each FP8 weight's scale (weight name → scale name), from the safetensors headers' dtypes and shapes, before
    anything is read; one ValueError lists what does not pair up (no quantization_config, another FP8 format, a
    missing weight_scale_inv or one not of ceil(shape / block) blocks, a scale without an FP8 weight)."""
    fp8 = {name for name, dtype in dtypes.items() if dtype.startswith("F8_")}
    if fp8 and block is None:
        raise ValueError(f"{len(fp8)} FP8 tensors ({_listing(sorted(fp8))}) but config.json has no "
                         "quantization_config")
    problems: dict[str, list[str]] = defaultdict(list)
    for name in dtypes:
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) not in fp8:
            problems["weight_scale_inv without an FP8 weight"].append(name)
    scales = {}
    for name in sorted(fp8):
        scale = name + SCALE_SUFFIX
        if dtypes[name] != "F8_E4M3":
            problems["FP8 weights not in e4m3"].append(f"{name} ({dtypes[name]})")
        elif scale not in dtypes:
            problems["FP8 weights without their weight_scale_inv"].append(name)
        elif len(shapes[name]) != 2 or tuple(shapes[scale]) != _scale_shape(shapes[name], block):
            problems[f"scales that are not ceil(weight shape / {list(block)})"].append(
                f"{scale} {list(shapes[scale])} for {list(shapes[name])}")
        else:
            scales[name] = scale
    if problems:
        raise ValueError("FP8 checkpoint: " + "; ".join(f"{len(names)} {what}: {_listing(names)}"
                                                        for what, names in problems.items()))
    return scales


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-scaled FP8 weight [out, in] → bf16 as DeepSeek's fp8_cast_bf16.py computes it: in fp32,
    w[i, j] = fp8[i, j] · scale_inv[i // block_rows, j // block_cols], rounded once to bf16."""
    if weight.dim() != 2 or scale_inv.shape != _scale_shape(weight.shape, block):
        raise ValueError(f"scale_inv {list(scale_inv.shape)} does not hold the {list(block)} blocks of a weight "
                         f"{list(weight.shape)}")
    i = torch.arange(weight.size(0))[:, None]
    j = torch.arange(weight.size(1))[None, :]
    return (weight.float() * scale_inv.float()[i // block[0], j // block[1]]).to(torch.bfloat16)
