#!/usr/bin/env bash
# Build DeepGEMM for --train.expert_precision=fp8-blockwise (Hopper), at the commit dsv3 is tested with, as an
# in-place torch extension with a private C++ runtime (docs/precision.md): built plainly against torch 2.11's
# wheel, DeepGEMM's JIT host code crashed in libstdc++'s locale (std::regex, then integer stream output) before it
# compiled a kernel; linked with its own static libstdc++, hidden and bound locally, it runs.
#
#   scripts/install_deepgemm.sh               # clones DeepGEMM (CUTLASS and fmt included) into third_party/DeepGEMM
#   scripts/install_deepgemm.sh --src DIR     # an existing checkout with its submodules (e.g. for an offline machine)
#
# Needs nvcc ($CUDA_HOME, or the one on PATH) here and on every training node: DeepGEMM compiles its kernels on
# first use (a few seconds per GEMM shape, cached in ~/.deep_gemm). Builds with the `python` on PATH (or $PYTHON),
# runs one FP8 grouped GEMM against bf16 when this machine has a Hopper GPU, and prints the PYTHONPATH line to use.
set -euo pipefail

COMMIT=54e22612409371d6364144b69086735beb54e98b
REPO_URL=https://github.com/deepseek-ai/DeepGEMM
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
src="$ROOT/third_party/DeepGEMM"

while [[ $# -gt 0 ]]; do
  case $1 in
    --src) src=${2:?--src needs a directory}; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
src=$(realpath -m "$src")

if [[ ! -d $src ]]; then
  echo "cloning $REPO_URL into $src"
  git clone --recursive "$REPO_URL" "$src"
fi
if [[ -d $src/.git || -f $src/.git ]]; then
  if ! git -C "$src" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
    echo "error: $src has no commit $COMMIT; run 'git -C $src fetch origin' (or bring a fresh clone)." >&2
    exit 2
  fi
  git -C "$src" checkout --detach "$COMMIT"
  git -C "$src" submodule update --init --recursive
else
  echo "note: $src is not a git checkout; building it as DeepGEMM $COMMIT"
fi
for dir in third-party/cutlass/include/cute third-party/fmt/include; do
  if [[ ! -d $src/$dir ]]; then
    echo "error: $src/$dir is missing: DeepGEMM's submodules (CUTLASS, fmt) are not checked out." >&2
    exit 2
  fi
done
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
if [[ ! -x $cuda_home/bin/nvcc ]]; then
  echo "error: no nvcc at $cuda_home/bin: set CUDA_HOME to the CUDA toolkit torch was built for." >&2
  exit 2
fi

echo "building DeepGEMM's extension in $src/deep_gemm (CUDA_HOME=$cuda_home)"
ln -sfn "$src/third-party/cutlass/include/cutlass" "$src/deep_gemm/include/cutlass"
ln -sfn "$src/third-party/cutlass/include/cute" "$src/deep_gemm/include/cute"
(cd "$src" && "$PYTHON" - "$cuda_home" <<'EOF'
import os
import sys

import torch
from torch.utils.cpp_extension import load

cuda_home = sys.argv[1]
load(name="_C", sources=["csrc/python_api.cpp"], build_directory=os.path.abspath("deep_gemm"),
     extra_include_paths=[f"{cuda_home}/include", f"{cuda_home}/include/cccl", "deep_gemm/include",
                          "third-party/cutlass/include", "third-party/fmt/include"],
     # DeepGEMM's own flags, and no STB_GNU_UNIQUE symbols: those would bind to the process's libstdc++ anyway
     extra_cflags=["-std=c++17", "-O3", "-Wno-psabi", "-Wno-deprecated-declarations", "-fno-gnu-unique"],
     # a private libstdc++: linked in, its symbols hidden, every reference bound inside the extension
     extra_ldflags=[f"-L{cuda_home}/lib64", "-lcudart", "-lnvrtc", "-static-libstdc++", "-static-libgcc",
                    "-Wl,--exclude-libs,ALL", "-Wl,-Bsymbolic"],
     with_cuda=True)
EOF
)

export PYTHONPATH="$src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_HOME=$cuda_home
if "$PYTHON" -c "import torch, sys; sys.exit(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9))"
then
  echo "checking one FP8 grouped GEMM against bf16 on this GPU (DeepGEMM compiles its kernels first)"
  "$PYTHON" - <<'EOF'
import torch

from dsv3.lowp.quant import fp8_blockwise_grouped_mm

torch.manual_seed(0)
x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
w = (torch.randn(2, 384, 256, device="cuda") * 0.05).bfloat16().transpose(-2, -1)
offsets = torch.tensor([128, 512], device="cuda", dtype=torch.int32)
ours, bf16 = fp8_blockwise_grouped_mm(x, w, offsets).float(), torch._grouped_mm(x, w, offs=offsets).float()
error = ((ours - bf16).norm() / bf16.norm()).item()
print(f"  relative difference from bf16: {error:.4f}")
assert error < 0.06, "DeepGEMM's result is off: do not train with it"
EOF
else
  echo "no Hopper GPU here: skipped the check; run this script's check on a GPU node"
fi
echo
echo "DeepGEMM is built. Put it on the path of every training process (and keep nvcc at CUDA_HOME):"
echo "  export PYTHONPATH=\"$src\"\${PYTHONPATH:+:\$PYTHONPATH} CUDA_HOME=\"$cuda_home\""
