set -uo pipefail
export PYTHONUNBUFFERED=1 PYTORCH_ALLOC_CONF=expandable_segments:True
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peer/whl/*.whl && export PYTHONPATH=/tmp/site
mkdir -p .peer/torchtitan/tests/assets/c4_test
python3 - <<'PY'
import json, pathlib, sysconfig
root = pathlib.Path(sysconfig.get_paths()["stdlib"]); n = 0
with open(".peer/torchtitan/tests/assets/c4_test/data.json", "w") as f:
    for p in sorted(root.rglob("*.py")):
        try: t = p.read_text()
        except Exception: continue
        f.write(json.dumps({"text": t}) + "\n"); n += len(t)
        if n > 12e6: break
PY
echo "== torchtitan default"
(cd .peer/torchtitan && timeout 100 torchrun --nproc_per_node=1 ../torchtitan_peer.py 4 --job.config_file torchtitan/models/deepseek_v3/train_configs/deepseek_v3_16b.toml --model.flavor 16B_cut --model.hf_assets_path tests/assets/tokenizer --training.dataset c4_test --training.steps 25 --parallelism.expert_parallel_degree 1 --metrics.log_freq 5 --training.local_batch_size 4 --training.seq_len 4096 > $OUT/tdef.log 2>&1); sed 's/\x1b\[[0-9;]*m//g' $OUT/tdef.log | grep "tps" | tail -4
echo "== dsv3 default (fp32 moments)"
timeout 70 python scripts/bench.py --config configs/16b_4layer.toml --steps 8 --warmup 3 --profile-steps 0 > $OUT/d.log 2>&1; grep -A1 "tokens/s/GPU" $OUT/d.log
