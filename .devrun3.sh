set -uo pipefail
export PYTHONUNBUFFERED=1 PYTORCH_ALLOC_CONF=expandable_segments:True
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
python scripts/prepare_data.py > /dev/null 2>&1
p() { timeout 130 python train.py --config configs/16b_4layer.toml --train.steps=300 --train.val_every=100 --log.every=100 --checkpoint.every=0 --checkpoint.export=false --checkpoint.dir=/tmp/p$1 $2 > $OUT/p$1.log 2>&1; grep -E "^step (100|200|300)/|val" $OUT/p$1.log | cut -c1-150 | tail -6; }
echo "== 300 steps, fp32 moments"; p 1 "--train.optimizer_state_dtype=fp32"
echo "== 300 steps, bf16 moments"; p 2 "--train.optimizer_state_dtype=bf16"
b() { timeout 75 python scripts/bench.py --config configs/16b_4layer.toml --steps 10 --warmup 4 --profile-steps 0 $2 > $OUT/b$1.log 2>&1; grep -A1 "tokens/s/GPU" $OUT/b$1.log; }
echo "== 16B bench fp8 tensorwise"; b 1 "--train.optimizer_state_dtype=bf16 --train.precision=fp8 --train.fp8_recipe=tensorwise"
echo "== 16B bench bf16"; b 2 "--train.optimizer_state_dtype=bf16"
