#!/usr/bin/env bash
# Build DeepEP for --parallel.ep_backend=deepep: intranode kernels only (no NVSHMEM), at the commit dsv3 is
# tested with, with the three local build fixes that commit needs (docs/deepep.md).
#
#   scripts/install_deepep.sh                  # clones DeepEP into third_party/DeepEP
#   scripts/install_deepep.sh --src DIR        # an existing checkout (e.g. brought along to an offline machine)
#   scripts/install_deepep.sh --patch-only     # check out and patch, do not build
#
# Builds in place (TORCH_CUDA_ARCH_LIST, default 9.0 = Hopper) with the `python` on PATH (or $PYTHON), runs
# DeepEP's intranode test when this machine has 2 or more GPUs, and prints the PYTHONPATH line to use.
# Safe to re-run: each fix is applied once and checked.
set -euo pipefail

COMMIT=567632dd59810d77b3cc05553df953cc0f779799
REPO_URL=https://github.com/deepseek-ai/DeepEP
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
src="$ROOT/third_party/DeepEP"
patch_only=0

while [[ $# -gt 0 ]]; do
  case $1 in
    --src) src=${2:?--src needs a directory}; shift 2 ;;
    --patch-only) patch_only=1; shift ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
src=$(realpath -m "$src")  # absolute: the build and the test below run inside it

if [[ ! -d $src ]]; then
  echo "cloning $REPO_URL into $src"
  git clone "$REPO_URL" "$src"
fi
if ! git -C "$src" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
  echo "error: $src has no commit $COMMIT; run 'git -C $src fetch origin' (or bring a fresh clone)." >&2
  exit 2
fi
if [[ $(git -C "$src" rev-parse HEAD) != "$COMMIT" ]]; then
  # our fixes on top of another commit are not carried over: git refuses rather than mixing them
  git -C "$src" checkout --detach "$COMMIT"
fi

echo "applying dsv3's intranode build fixes to $src"
"$PYTHON" - "$src" "$COMMIT" <<'EOF'
import re
import sys
from pathlib import Path

src = Path(sys.argv[1])
GUARD = "#ifndef DISABLE_NVSHMEM"


def patch(path: Path, done_marker: str, old: str, new: str, what: str) -> None:
    """Replace old by new once; already patched (done_marker present) is fine, old missing is an error."""
    text = path.read_text()
    if done_marker in text:
        print(f"  {what}: already applied")
        return
    if text.count(old) != 1:
        sys.exit(f"error: {path}: the code for '{what}' is not where expected; is {src} at commit {sys.argv[2]}?")
    path.write_text(text.replace(old, new))
    print(f"  {what}: applied")


setup = src / "setup.py"
# 1. NVSHMEM is used whenever the pip package nvidia-nvshmem is importable (recent CUDA torch wheels bring
#    it): DISABLE_NVSHMEM=1 switches it off.
patch(setup, "os.getenv('DISABLE_NVSHMEM'",
      "    if nvshmem_dir is None:\n        try:",
      "    if int(os.getenv('DISABLE_NVSHMEM', 0)):  # dsv3: intranode-only build\n"
      "        disable_nvshmem = True\n"
      "    elif nvshmem_dir is None:\n        try:",
      "setup.py: DISABLE_NVSHMEM=1 turns NVSHMEM off")
# 2. -rdc=true without NVSHMEM's device-link step leaves __cudaRegisterLinkedBinary_* undefined at import
#    (DeepEP issue #429); the intranode kernels need no relocatable device code.
patch(setup, "(['-rdc=true'] if not disable_nvshmem else [])",
      "nvcc_flags.extend(['-rdc=true', '--ptxas-options=--register-usage-level=10'])",
      "nvcc_flags.extend((['-rdc=true'] if not disable_nvshmem else []) + "
      "['--ptxas-options=--register-usage-level=10'])",
      "setup.py: no -rdc=true without NVSHMEM")
# 3. The low-latency mask-buffer calls sit outside the DISABLE_NVSHMEM guards of the rest of the file.
cpp = src / "csrc" / "deep_ep.cpp"
text = cpp.read_text()
for name in ("update_mask_buffer", "query_mask_buffer", "clean_mask_buffer"):
    call = re.search(rf"^( *)internode_ll::{name}\([^;]*;\n", text, flags=re.MULTILINE)
    if call is None:
        sys.exit(f"error: {cpp}: no call of internode_ll::{name}; is {src} at commit {sys.argv[2]}?")
    if text[: call.start()].endswith(GUARD + "\n"):
        print(f"  deep_ep.cpp: {name} guarded: already applied")
        continue
    indent = call.group(1)
    guarded = (f"{GUARD}\n{call.group(0)}#else\n"
               f'{indent}EP_HOST_ASSERT(false and "NVSHMEM is disabled during compilation");\n#endif\n')
    text = text[: call.start()] + guarded + text[call.end():]
    print(f"  deep_ep.cpp: {name} guarded: applied")
cpp.write_text(text)
EOF

if (( patch_only )); then
  echo "patched $src at $COMMIT (--patch-only: not built)"
  exit 0
fi

echo "building DeepEP in place (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0})"
(cd "$src" && DISABLE_NVSHMEM=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} "$PYTHON" setup.py build_ext --inplace)

# the GPUs this process may use (CUDA_VISIBLE_DEVICES respected; nvidia-smi would list the node's)
n_gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if (( n_gpus >= 2 )); then
  echo "running DeepEP's intranode test on 2 of $n_gpus GPUs"
  (cd "$src" && PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" tests/test_intranode.py --num-processes 2)
else
  echo "fewer than 2 GPUs here ($n_gpus): skipped DeepEP's tests/test_intranode.py; run it on a GPU node"
fi
echo
echo "DeepEP is built. Put it on the path of every training process:"
echo "  export PYTHONPATH=$src\${PYTHONPATH:+:\$PYTHONPATH}"
