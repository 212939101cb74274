"""scripts/generate.py samples from a run's export or checkpoint with dsv3's model and the run's tokenizer: greedy, it
continues a prompt as transformers' greedy generate does on the same export converted to HF; convert_hf.py --no-mtp
leaves out the MTP tensors that transformers would list as UNEXPECTED."""

import io
import json
import shutil

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM

from dsv3 import checkpoint, export
from dsv3.config import FLAVORS, UserError, load_config
from dsv3.model import Transformer
from dsv3.tokenizer import Tokenizer
from scripts import convert_hf
from scripts.generate import generate, main


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The debug model with every tensor random (distinct logits, no near-ties for argmax), exported as train.py
    exports it, with the bundled tokenizer."""
    model = Transformer(FLAVORS["debug"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            scale = 1.0 if name.endswith("expert_bias") else 0.2 if "norm" in name else 0.1
            t.add_(scale * torch.randn(t.shape, generator=g))
    out = tmp_path_factory.mktemp("run") / "export"
    export.export(out, model, model.cfg, Tokenizer(ROOT / "data" / "tokenizer.model"))
    return out


def test_greedy_continues_a_prompt_as_transformers_greedy_generate_does(exported, tmp_path):
    hf_dir = tmp_path / "hf"
    convert_hf.main(["--to-hf", str(exported), str(hf_dir), "--no-mtp"])
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    ours = Transformer(FLAVORS["debug"]).eval()
    export.load_weights(exported, ours)
    prompt = Tokenizer(exported).encode("def main(argv):\n    return")
    new = generate(ours, prompt, max_tokens=24)
    hf_ids = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0].tolist()
    assert len(new) == 24 and len(set(new)) > 3  # a real continuation, not one token repeated
    assert hf_ids == prompt + new


def test_without_no_mtp_transformers_lists_the_mtp_tensors_as_unexpected_and_ignores_them(exported, tmp_path):
    convert_hf.main(["--to-hf", str(exported), str(tmp_path / "with")])
    convert_hf.main(["--to-hf", str(exported), str(tmp_path / "without"), "--no-mtp"])
    n_layers = FLAVORS["debug"].n_layers  # MTP module k is HF layer n_layers + k
    _, with_mtp = AutoModelForCausalLM.from_pretrained(tmp_path / "with", output_loading_info=True)
    hf_model, without_mtp = AutoModelForCausalLM.from_pretrained(tmp_path / "without", output_loading_info=True)
    assert with_mtp["unexpected_keys"] and all(key.startswith(f"model.layers.{n_layers}.")
                                               for key in with_mtp["unexpected_keys"])
    assert not without_mtp["unexpected_keys"] and not without_mtp["missing_keys"]
    assert hf_model.config.num_nextn_predict_layers == 0


def test_the_script_samples_from_an_export_reproducibly_per_seed(exported, capsys):
    def sample(*args: str) -> str:
        main([str(exported), "--prompt", "import os", "--max-tokens", "12", "--device", "cpu", *args])
        return capsys.readouterr().out

    greedy = sample("--temperature", "0")
    assert greedy.startswith("import os") and len(greedy) > len("import os\n")
    assert sample("--seed", "1") == sample("--seed", "1")
    assert len({sample("--seed", str(seed), "--top-k", "0", "--temperature", "2") for seed in range(4)}) > 1


def _checkpoint(run_dir, train_state: dict | None):
    """A complete checkpoint of a small model; train_state None: one from before checkpoints recorded it."""
    model = torch.nn.Linear(8, 8)
    saved = checkpoint.save(run_dir, 5, model, torch.optim.AdamW(model.parameters()), train_state or {}, keep=0)
    if train_state is None:
        (saved / checkpoint.TRAIN_STATE).unlink()
        manifest = json.loads((saved / checkpoint.MANIFEST).read_text())
        del manifest["files"][checkpoint.TRAIN_STATE]
        (saved / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return saved


def test_a_checkpoint_that_records_no_config_is_refused_naming_what_to_pass(tmp_path):
    saved = _checkpoint(tmp_path, None)
    with pytest.raises(UserError, match=r"records no model config: pass the run's own --config FILE.toml"):
        main([str(saved), "--device", "cpu"])


def test_a_config_for_another_model_is_refused_before_any_model_is_built(tmp_path, monkeypatch):
    """A checkpoint of the debug model sampled with the 16B's --config: one line naming what differs, not a model
    built for a minute and then DCP's size-mismatch traceback."""
    from dataclasses import asdict

    import scripts.generate as generate_script
    saved = _checkpoint(tmp_path, {"step": 5, "config": {"model": asdict(FLAVORS["debug"])}})
    monkeypatch.setattr(generate_script, "Transformer", lambda *a: pytest.fail("built a model"))
    with pytest.raises(UserError, match=r"^--config configs/16b_4layer.toml describes another model than .*: "
                                        r"model\.vocab_size .*leave out --config"):
        main([str(saved), "--config", "configs/16b_4layer.toml", "--device", "cpu"])


def test_a_hugging_face_directory_is_refused_naming_the_conversion_before_building(exported, tmp_path,
                                                                                     monkeypatch):
    """A run's convert_hf.py output handed to generate.py: the line says to convert back, in generate.py's words (it
    named checkpoint.init_from, a train.py key)."""
    import scripts.generate as generate_script
    convert_hf.main(["--to-hf", str(exported), str(tmp_path / "hf")])
    monkeypatch.setattr(generate_script, "Transformer", lambda *a: pytest.fail("built a model"))
    with pytest.raises(UserError, match=rf"^{tmp_path / 'hf'} is a Hugging Face checkpoint: convert it first with "
                                        rf"python scripts/convert_hf.py --to-dsv3 {tmp_path / 'hf'} OUT_DIR, then "
                                        r"sample from OUT_DIR$"):
        main([str(tmp_path / "hf"), "--device", "cpu"])


def test_a_checkpoint_is_verified_before_its_train_json_is_read(tmp_path):
    saved = _checkpoint(tmp_path, {"step": 5, "config": {}})
    train_json = saved / checkpoint.TRAIN_STATE
    train_json.write_text(train_json.read_text()[:7])  # truncated: once a JSONDecodeError traceback
    with pytest.raises(UserError, match=rf"^{saved} cannot be loaded: {train_json} has \d+ bytes, the manifest says"):
        main([str(saved), "--device", "cpu"])


def test_a_pickle_in_a_checkpoint_tensor_is_one_line_not_torchs_unpickling_advice(tmp_path):
    saved = _checkpoint(tmp_path, {"step": 5, "config": {}})
    payload = io.BytesIO()
    torch.save(_RunsCode(), payload)
    (saved / "rng-0.pt").write_bytes(payload.getvalue())
    files = {p.name: {"size": p.stat().st_size} for p in saved.iterdir()
             if p.name not in (checkpoint.MANIFEST, checkpoint.UNCONFIRMED)}
    (saved / checkpoint.MANIFEST).write_text(json.dumps({"files": files}))  # resealed, as its writer could
    with pytest.raises(UserError, match=rf"^{saved} cannot be loaded: {saved / 'rng-0.pt'} is not plain data"):
        main([str(saved), "--device", "cpu"])


class _RunsCode:
    def __reduce__(self):
        return print, ("this ran",)


@pytest.mark.parametrize("damage", ["huge-header-length", "offsets-out-of-range", "bad-json"])
def test_a_damaged_safetensors_header_is_one_line_naming_the_file(exported, tmp_path, damage):
    """In generate.py, checkpoint.init_from and convert_hf.py alike: once a SafetensorError traceback."""
    broken = tmp_path / "export"
    shutil.copytree(exported, broken)
    file = sorted(broken.glob("*.safetensors"))[0]
    data = bytearray(file.read_bytes())
    length = int.from_bytes(data[:8], "little")
    if damage == "huge-header-length":
        data[:8] = (1 << 62).to_bytes(8, "little")
    elif damage == "offsets-out-of-range":
        header = json.loads(data[8:8 + length])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"] = [0, 1 << 40]
        text = json.dumps(header).encode()
        data = bytearray(len(text).to_bytes(8, "little") + text + data[8 + length:])
    else:
        data[8:8 + length] = b"{" + b"x" * (length - 1)
    file.write_bytes(bytes(data))
    message = rf"^{file} is not a readable safetensors file \(.*\): it is damaged or truncated"
    with pytest.raises(UserError, match=message):
        main([str(broken), "--device", "cpu"])
    with pytest.raises(UserError, match=message):
        export.check_init_from(load_config(None, [f"--checkpoint.init_from={broken}"]))
    with pytest.raises(UserError, match=message):
        convert_hf.main(["--to-hf", str(broken), str(tmp_path / "hf")])
