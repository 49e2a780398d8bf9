#!/usr/bin/env bash
# Issue 8's device check, from the repo root of a fresh GPU machine:
#   bash scripts/device_check.sh [--sizes-mib 256,1024] [--rates 0.01,0.03,0.05] [--reps 10]
# Builds the CPU and CUDA kernels, checks the CUDA kernels against the CPU reference (every
# dtype, odd sizes, 0% and 100% change, empty tensors, realistic BF16 deltas, refusals, the
# sender's side stream), times delta and apply against a device-to-device copy of the same
# bytes, writes $OUT/cuda.json (else benchmarks/results/cuda.json) and prints a table last.
# Needs only python3 with a CUDA torch (pip-installed if torch is missing) and nvcc; about a
# minute on an H200. The logic is in nemo_dcr_callback/bench/cuda.py; this stays thin.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)

echo "== $($PY --version 2>&1) ($(command -v "$PY"))"
# No GPU, no work: checked before anything is installed (a CUDA torch is several GB).
if ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  echo "device_check: no NVIDIA GPU here (nvidia-smi -L lists none); nothing to check" >&2
  exit 2
fi
if ! $PY -c 'import torch' 2>/dev/null; then
  echo "== torch is missing: pip install torch"
  $PY -m pip install -q torch || { echo "device_check: pip install torch failed" >&2; exit 2; }
fi
cuda=$($PY -c 'import torch; print(torch.cuda.is_available())')
echo "== torch $($PY -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)'); GPU visible: $cuda"
if [ "$cuda" != "True" ]; then
  echo "device_check: torch sees no CUDA device; nothing to check" >&2
  exit 2
fi

echo "== build: CPU kernels (cuda_ext/build.py into nemo_dcr_callback/_lib; the torch reference if this fails)"
$PY cuda_ext/build.py || echo "   (no compiled CPU kernels: the pure-torch reference is used)"

echo "== build: CUDA kernels ($(command -v nvcc || echo 'nvcc not on PATH'))"
t0=$(date +%s)
$PY cuda_ext/build.py --cuda --no-cpu || { echo "device_check: nvcc build failed" >&2; exit 2; }
echo "   built in $(( $(date +%s) - t0 )) s"
$PY -c 'from nemo_dcr_callback.tools import doctor; print(doctor.render(doctor.report()))'

echo "== check and time (nemo_dcr_callback.bench.cuda $*)"
$PY -m nemo_dcr_callback.bench.cuda "$@"
rc=$?
echo "== device_check: exit $rc after $(( $(date +%s) - start )) s"
exit $rc
