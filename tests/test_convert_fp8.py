"""scripts/convert_hf.py --to-dsv3 on DeepSeek's FP8 release format: float8_e4m3fn linear weights with fp32
scales per 128×128 block (`weight_scale_inv`), made here from a tiny random transformers DeepseekV3 whose dims are
not multiples of 128 (partial edge blocks) and above 128 (several blocks per tensor)."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import load_export
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import scripts.convert_hf as convert_hf
from dsv3.config import UserError, load_config_json
from dsv3.hf import state_dict_from_hf, state_dict_to_hf
from dsv3.model import Transformer

# q_a_proj [144, 160], q_b_proj [160, 144], kv_a_proj_with_mqa [152, 160], kv_b_proj [272, 136], o_proj [160, 144],
# dense MLP [200, 160] / [160, 200], experts [136, 160] / [160, 136]
DIMS = dict(vocab_size=64, hidden_size=160, intermediate_size=200, moe_intermediate_size=136, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=144, kv_lora_rank=136,
            qk_nope_head_dim=64, qk_rope_head_dim=16, v_head_dim=72, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, max_position_embeddings=64, num_nextn_predict_layers=0)
QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def is_quantized(name: str) -> bool:
    """DeepSeek quantizes the linears of attention, dense MLP, shared and routed experts; not the embedding, head,
    norms or router gate."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def per_element(scale: torch.Tensor, shape: torch.Size, block: list[int]) -> torch.Tensor:
    """Block scales [ceil(rows/br), ceil(cols/bc)] spread over the elements of a [rows, cols] weight."""
    return scale.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8: per block, scale_inv = amax / 448 and the weight / scale_inv in e4m3."""
    (rows, cols), (br, bc) = w.shape, block
    padded = torch.zeros(math.ceil(rows / br) * br, math.ceil(cols / bc) * bc)
    padded[:rows, :cols] = w
    blocks = padded.view(padded.size(0) // br, br, padded.size(1) // bc, bc)
    scale_inv = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX  # [ceil(rows/br), ceil(cols/bc)]
    return (w / per_element(scale_inv, w.shape, block)).to(torch.float8_e4m3fn), scale_inv


def dequantized(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """DeepSeek's fp8_cast_bf16.py: weight.float() * scale_inv[i // 128, j // 128], cast to bf16."""
    return (q.float() * per_element(scale_inv, q.shape, block)).to(torch.bfloat16)


def write_release(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Two shards and an index, as DeepSeek publishes; each scale in the other shard than its weight."""
    path.mkdir()
    weights = sorted(n for n in tensors if not n.endswith("_scale_inv"))
    shard_of = {n: i % 2 for i, n in enumerate(weights)}
    shard_of |= {n: 1 - shard_of[n.removesuffix("_scale_inv")] for n in tensors if n.endswith("_scale_inv")}
    files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    for i, file in enumerate(files):
        save_file({n: t for n, t in tensors.items() if shard_of[n] == i}, path / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: files[i] for n, i in shard_of.items()}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))


def randomize(model: torch.nn.Module) -> None:
    """Random weights whose magnitude varies by row and column over 100×, so that block scales differ."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.dim() == 2:
                magnitude = torch.rand(t.size(0), 1, generator=g) * torch.rand(1, t.size(1), generator=g)
                t.copy_(torch.randn(t.shape, generator=g) * (0.01 + magnitude))
            else:  # norms and the router's expert bias
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))


class Release:
    def __init__(self, root: Path, block: list[int]):
        hf_model = DeepseekV3ForCausalLM(DeepseekV3Config(**DIMS))
        randomize(hf_model)
        hf_model.save_pretrained(root / "saved")
        self.original = load_file(root / "saved" / "model.safetensors")  # fp32
        self.block = block
        self.tensors = {}  # DeepSeek's release: FP8 + scales, the rest bf16 but the expert bias fp32
        for name, w in self.original.items():
            if is_quantized(name):
                self.tensors[name], self.tensors[f"{name}_scale_inv"] = quantize(w, block)
            else:
                self.tensors[name] = w if name.endswith("e_score_correction_bias") else w.to(torch.bfloat16)
        self.config = json.loads((root / "saved" / "config.json").read_text())
        self.config["quantization_config"] = QUANTIZATION | {"weight_block_size": block}
        self.path = root / "release"
        write_release(self.path, self.tensors, self.config)

    def deepseek_bf16(self) -> dict[str, torch.Tensor]:
        """What DeepSeek's fp8_cast_bf16.py makes of the release."""
        return {n: dequantized(t, self.tensors[f"{n}_scale_inv"], self.block) if is_quantized(n) else t
                for n, t in self.tensors.items() if not n.endswith("_scale_inv")}


@pytest.fixture(scope="module", params=[[128, 128], [64, 96]], ids=["128x128", "64x96"])
def release(request, tmp_path_factory) -> Release:
    return Release(tmp_path_factory.mktemp("fp8"), request.param)


def test_release_quantizes_what_deepseek_quantizes_with_partial_blocks(release):
    """The test's own input: 28 FP8 weights, each scale in the other shard, tensors past and between blocks."""
    quantized = [n for n in release.tensors if release.tensors[n].dtype == torch.float8_e4m3fn]
    assert len(quantized) == 2 * 5 + 3 + 3 * (4 + 1)  # attention ×2 layers, dense MLP, shared + 4 routed experts
    index = json.loads((release.path / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(index[n] != index[f"{n}_scale_inv"] for n in quantized)
    shapes = {tuple(release.tensors[n].shape) for n in quantized}
    assert (272, 136) in shapes and all(rows % release.block[0] or cols % release.block[1] for rows, cols in shapes)


def test_fp8_release_converts_to_deepseeks_bf16_dequantization_exactly(release, tmp_path):
    convert_hf.main(["--to-dsv3", str(release.path), str(tmp_path / "dsv3")])
    cfg = load_config_json(tmp_path / "dsv3" / "config.json")
    converted = load_export(tmp_path / "dsv3")
    assert not [k for k in converted if "scale" in k]
    Transformer(cfg).load_state_dict(converted, strict=True)
    # every FP8 weight is DeepSeek's formula to the bit; every other tensor is passed through in its dtype
    expected = state_dict_from_hf(release.deepseek_bf16(), cfg)
    assert converted.keys() == expected.keys()
    for k in expected:
        assert converted[k].dtype == expected[k].dtype and torch.equal(converted[k], expected[k]), k
    # and is the original weight up to e4m3's rounding (2^-4 relative; subnormals 2^-10 of the block's scale)
    # and bf16's (2^-8 relative), loosely
    as_hf = state_dict_to_hf(converted, cfg)
    for name, w in release.original.items():
        if is_quantized(name):
            scale = per_element(release.tensors[f"{name}_scale_inv"], w.shape, release.block)
            error = (as_hf[name].float() - w).abs()
            assert (error <= 0.07 * w.abs() + 2**-9 * scale).all(), name
            assert error.max() > 0, name  # really quantized


def test_one_step_equals_deepseeks_two_steps(release, tmp_path):
    """fp8_cast_bf16.py, then --to-dsv3 (its output keeps config.json's quantization_config) gives the same files."""
    write_release(tmp_path / "bf16", release.deepseek_bf16(), release.config)
    convert_hf.main(["--to-dsv3", str(tmp_path / "bf16"), str(tmp_path / "two_steps")])
    convert_hf.main(["--to-dsv3", str(release.path), str(tmp_path / "one_step")])
    one_step, two_steps = load_export(tmp_path / "one_step"), load_export(tmp_path / "two_steps")
    assert one_step.keys() == two_steps.keys() and all(torch.equal(one_step[k], two_steps[k]) for k in one_step)


def bad(release: Release, tensors: dict | None = None, **quantization) -> tuple[dict, dict]:
    config = release.config | {"quantization_config": release.config["quantization_config"] | quantization}
    return release.tensors | (tensors or {}), config


EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"
KV_B = "model.layers.1.self_attn.kv_b_proj.weight"
GATE = "model.layers.1.mlp.gate.weight"
BAD_INPUTS = {
    "scale missing": (lambda r: ({n: t for n, t in r.tensors.items() if n != f"{EXPERT}_scale_inv"}, r.config),
                      rf"1 FP8 weights without their weight_scale_inv: {EXPERT}$"),
    "scale shape": (lambda r: bad(r, {f"{KV_B}_scale_inv": torch.ones(2, 2)}),
                    rf"scales that are not ceil\(weight shape / \[\d+, \d+\]\): {KV_B}_scale_inv \[2, 2\] for "
                    r"\[272, 136\]"),
    "e5m2 weight": (lambda r: bad(r, {EXPERT: r.tensors[EXPERT].float().to(torch.float8_e5m2)}),
                    rf"1 FP8 weights not in e4m3: {EXPERT} \(F8_E5M2\)"),
    "scale of a bf16 weight": (lambda r: bad(r, {f"{GATE}_scale_inv": torch.ones(1, 2)}),
                               rf"1 weight_scale_inv without an FP8 weight: {GATE}_scale_inv"),
    "no quantization_config": (lambda r: (r.tensors, {k: v for k, v in r.config.items() if k != "quantization_config"}),
                               r"28 FP8 tensors \(.*\) but config.json has no quantization_config"),
    "fmt e5m2": (lambda r: bad(r, fmt="e5m2"), r'quantization_config .*"fmt": "e5m2".* not supported'),
    "quant_method": (lambda r: bad(r, quant_method="compressed-tensors"), "quantization_config .* not supported"),
    "block size": (lambda r: bad(r, weight_block_size=[128]), "quantization_config .* not supported"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_fp8_input_is_one_line_before_any_output(release, tmp_path, case):
    make, message = BAD_INPUTS[case]
    write_release(tmp_path / "src", *make(release))
    for out, existing in ((tmp_path / "new", None), (tmp_path / "old", "an earlier conversion's notes\n")):
        if existing:
            out.mkdir()
            (out / "notes.txt").write_text(existing)
        with pytest.raises(UserError, match=message) as e:
            convert_hf.main(["--to-dsv3", str(tmp_path / "src"), str(out)])
        assert "\n" not in str(e.value)
        if existing:
            assert [f.name for f in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == existing
        else:
            assert not out.exists()


def killed(*args) -> None:
    raise KeyboardInterrupt("killed")  # as the process dies after the shards, index and config.json are written


def test_conversion_killed_midway_leaves_no_output_and_a_rerun_succeeds(release, tmp_path, monkeypatch):
    out, staging = tmp_path / "dsv3", tmp_path / "dsv3.tmp"
    with monkeypatch.context() as m:
        m.setattr(convert_hf, "copy_tokenizer", killed)
        with pytest.raises(KeyboardInterrupt):
            convert_hf.main(["--to-dsv3", str(release.path), str(out)])
    assert not out.exists() and not staging.exists()
    # a SIGKILL leaves the staging directory behind, which the rerun replaces; the user may have made OUT_DIR
    staging.mkdir()
    save_file({"stale": torch.ones(1)}, staging / "model-00001-of-00001.safetensors")
    out.mkdir()
    convert_hf.main(["--to-dsv3", str(release.path), str(out)])
    Transformer(load_config_json(out / "config.json")).load_state_dict(load_export(out), strict=True)
    assert not staging.exists()
    with pytest.raises(UserError, match="already exists and is not an empty directory"):
        convert_hf.main(["--to-dsv3", str(release.path), str(out)])

    with monkeypatch.context() as m:
        m.setattr(convert_hf, "copy_tokenizer", killed)
        with pytest.raises(KeyboardInterrupt):
            convert_hf.main(["--to-hf", str(out), str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_an_output_directory_that_is_a_link_receives_the_conversion_at_its_target(release, tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "ckpt").mkdir()
    (tmp_path / "ckpt").symlink_to(tmp_path / "disk" / "ckpt")
    convert_hf.main(["--to-dsv3", str(release.path), str(tmp_path / "ckpt")])
    assert (tmp_path / "ckpt").is_symlink() and (tmp_path / "disk" / "ckpt" / "config.json").is_file()


def test_index_naming_a_missing_shard_is_one_line_before_any_output(release, tmp_path):
    write_release(tmp_path / "src", release.tensors, release.config)
    (tmp_path / "src" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match=r"model\.safetensors\.index\.json names shards that are not in .*src: "
                                        r"model-00002-of-00002\.safetensors;"):
        convert_hf.main(["--to-dsv3", str(tmp_path / "src"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_tensor_in_two_shards_is_one_line_before_any_output(release, tmp_path):
    """Without an index every *.safetensors is a shard: a stray copy of a tensor would silently win or lose."""
    write_release(tmp_path / "src", release.tensors, release.config)
    (tmp_path / "src" / "model.safetensors.index.json").unlink()
    save_file({GATE: torch.zeros_like(release.tensors[GATE])}, tmp_path / "src" / "model-extra.safetensors")
    with pytest.raises(UserError, match=rf"{GATE} is in two shards, .*model-0000\d-of-00002\.safetensors and "
                                        r".*model-extra\.safetensors;"):
        convert_hf.main(["--to-dsv3", str(tmp_path / "src"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
