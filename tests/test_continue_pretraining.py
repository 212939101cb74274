"""The path of a user who continues pretraining DeepSeek's weights on their own corpus, end to end on CPU, with the
commands README's "Continue pretraining DeepSeek's weights" shows: a tiny random HF DeepSeek-V3 saved by
transformers beside a DeepSeek-layout tokenizer → convert_hf.py --to-dsv3 → prepare_data.py with that tokenizer on
two sources (a .jsonl.gz and .txt files) → train.py --checkpoint.init_from on the mixture, no --model.* flag → its
export → convert_hf.py --to-hf → transformers loads model and tokenizer from that one directory, with dsv3's logits."""

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, load_export, read_metrics
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

from dsv3.config import ModelConfig
from dsv3.model import Transformer
from dsv3.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # five scripts in subprocesses, one of them training

WEB = [f"The river {i} runs past {i * 7} old mills; the town keeps its bridges and its {i % 5} bells." * 3
       for i in range(48)]
CODE = [f"def f{i}(x):\n    return [x * k for k in range({i})]  # {i} items\n" * 4 for i in range(40)]


def cli(script: str, *args: str) -> str:
    """A command as README shows it, run from the repository root; its stdout."""
    done = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_deepseek_weights_and_tokenizer_to_a_trained_model_transformers_loads(deepseek_tokenizer_dir, tmp_path):
    # "DeepSeek's release": config + safetensors written by transformers, and the tokenizer files beside them
    tokenizer = Tokenizer(deepseek_tokenizer_dir)
    hf_config = DeepseekV3Config(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=128, num_nextn_predict_layers=0,
        initializer_range=0.1)
    torch.manual_seed(0)
    release = tmp_path / "DeepSeek-V3"
    DeepseekV3ForCausalLM(hf_config).save_pretrained(release)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(deepseek_tokenizer_dir / name, release / name)

    # two sources of the user's own corpus, in formats they come in
    (tmp_path / "corpus" / "web").mkdir(parents=True)
    with gzip.open(tmp_path / "corpus" / "web" / "part-000.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in WEB)
    (tmp_path / "corpus" / "code").mkdir()
    for i, doc in enumerate(CODE):
        (tmp_path / "corpus" / "code" / f"f{i}.txt").write_text(doc)

    ckpt, web, code, run = (str(tmp_path / name) for name in ("ckpt", "web", "code", "run"))
    cli("scripts/convert_hf.py", "--to-dsv3", str(release), ckpt)
    cli("scripts/prepare_data.py", "--input", str(tmp_path / "corpus" / "web"), "--tokenizer", ckpt, "--out", web,
        "--val-fraction", "0.1", "--workers", "2")
    cli("scripts/prepare_data.py", "--input", str(tmp_path / "corpus" / "code"), "--tokenizer", ckpt, "--out", code,
        "--val-fraction", "0.1", "--workers", "2")
    out = cli("train.py", "--config", "configs/debug.toml", f"--checkpoint.init_from={ckpt}",
              f"--data.sources={web}:0.7,{code}:0.3", f"--checkpoint.dir={run}",
              "--train.steps=3", "--train.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2",
              "--train.val_every=3", "--train.val_batches=1", "--log.every=1")
    hf_out = tmp_path / "hf_out"
    cli("scripts/convert_hf.py", "--to-hf", f"{run}/export", str(hf_out))

    # the documents were tokenized with DeepSeek's tokenizer: BOS, the ids transformers gives, EOS
    first = json.loads((Path(web) / "train" / "index.json").read_text())
    assert first["tokenizer_fingerprint"] == tokenizer.fingerprint and first["add_bos"]
    stream = np.fromfile(Path(web) / "train" / first["shards"][0]["file"], dtype=first["dtype"])
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_out)
    expected_first_doc = hf_tokenizer(WEB[0])["input_ids"] + [tokenizer.eos_id]
    assert stream[:len(expected_first_doc)].tolist() == expected_first_doc

    # it trained the imported model (no --model.* flag: its shape came from the weights' config.json) on both
    # sources, and says so
    assert out.startswith(f"model   {ckpt}: ")
    init_line = f"\ninit    weights and model from {ckpt} (config.json); unlike flavor debug: vocab_size 4096 -> 384, "
    assert init_line in out
    assert "data    web 70% (" in out and "; code 30% (" in out
    metrics = read_metrics(Path(run))
    assert metrics[3]["tokens_seen/web"] > metrics[3]["tokens_seen/code"] > 0
    assert {"val_loss/web", "val_loss/code"} <= metrics[3].keys()

    # the export carries the tokenizer; transformers loads model and tokenizer from the converted directory
    assert Tokenizer(f"{run}/export").fingerprint == tokenizer.fingerprint
    hf_model = AutoModelForCausalLM.from_pretrained(hf_out, attn_implementation="eager").float().eval()
    ours = Transformer(ModelConfig(**json.loads(Path(f"{run}/export/config.json").read_text()))).eval()
    ours.load_state_dict(load_export(Path(run) / "export"), strict=True)
    tokens = torch.tensor([hf_tokenizer("The river 3 runs past the mills; def f(x): return x")["input_ids"]])
    with torch.no_grad():
        ours_logits, hf_logits = ours(tokens), hf_model(tokens).logits
    assert (ours_logits - hf_logits).abs().max() <= 1e-5 * hf_logits.abs().max()
    # and training changed the weights it started from
    imported = load_export(Path(ckpt))
    assert any(not torch.equal(imported[k].float(), v.float()) for k, v in load_export(Path(run) / "export").items())
