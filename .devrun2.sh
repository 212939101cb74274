set -uo pipefail
export PYTHONUNBUFFERED=1 PYTORCH_ALLOC_CONF=expandable_segments:True
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== gpu tests (quant)"; timeout 150 python -m pytest -q -m gpu tests/test_quant.py > $OUT/gpu_quant.log 2>&1; tail -2 $OUT/gpu_quant.log
B="--config configs/671b_3layer.toml --steps 8 --warmup 4"
b() { timeout 110 python scripts/bench.py $B ${2:-} > $OUT/w$1.log 2>&1; grep -A12 "tokens/s/GPU" $OUT/w$1.log | grep -v "^ *$" | head -13; }
echo "== bf16, bf16 moments"; b 1 --train.optimizer_state_dtype=bf16
echo "== fp8 rowwise"; b 2 "--train.optimizer_state_dtype=bf16 --train.precision=fp8 --train.fp8_recipe=rowwise"
echo "== fp8 rowwise_with_gw_hp"; b 3 "--train.optimizer_state_dtype=bf16 --train.precision=fp8 --train.fp8_recipe=rowwise_with_gw_hp"
echo "== fp8 tensorwise"; b 4 "--train.optimizer_state_dtype=bf16 --train.precision=fp8 --train.fp8_recipe=tensorwise"
echo "== fp8 blockwise"; b 5 "--train.optimizer_state_dtype=bf16 --train.precision=fp8 --train.fp8_recipe=blockwise"
echo "== bf16, fp32 moments"; b 6
