#!/usr/bin/env bash
# One device call: bench variants of the 16B cut config; logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTORCH_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
PY
i=0
for variant in "$@"; do
  i=$((i+1))
  echo "=== $variant" | tee -a "$OUT/bench.txt"
  timeout 300 python scripts/bench.py --config configs/16b_4layer.toml $variant 2>&1 | tee "$OUT/bench_$i.log" | tail -32 | tee -a "$OUT/bench.txt"
done
