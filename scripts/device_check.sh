#!/usr/bin/env bash
# The GPU checks, from the repo root of a fresh GPU machine (issues 8 and 51):
#   bash scripts/device_check.sh [--sizes-mib 256,1024] [--rates 0.01,0.03,0.05] [--reps 10]
#   bash scripts/device_check.sh --e2e [--tune]      # the whole device run of issue 51
#   bash scripts/device_check.sh --e2e --dry-run     # its CPU path, here (make device-dry-run)
# Default: builds the CPU and CUDA kernels, runs the GPU pytest cases (GPU_TESTS below; the
# suite skips them without a device: only here do they run), checks the CUDA kernels against the CPU reference
# (every dtype, odd sizes, 0% and 100% change, empty tensors, realistic BF16 deltas, refusals,
# the sender's side stream), times delta and apply against a device-to-device copy of the same
# bytes, writes $OUT/cuda.json (else benchmarks/results/cuda.json), prints a table last.
# --e2e: first installs the wheelhouse .whl/ (make wheelhouse: what the run needs beyond the
# device image, installed offline), then `nemo-dcr bench e2e`, then the kernel check at one size.
# e2e: the training recipe on the GPU with and without the callback and a transformers
# receiver on the same GPU, every version checked against the dense export ($OUT/e2e.json).
# --tune: then scripts/cuda_tune.sh's variants ($OUT/cuda_tune.json). --dry-run: no GPU asked
# for; the tiny model on the CPU, the CUDA library only compiled (nvcc, if here).
# Needs python3 with torch (a CUDA torch on a GPU) and nvcc. The logic is in
# nemo_dcr_callback/bench/{cuda,e2e}.py; this stays thin.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)
e2e=0 tune=0 dry=0 rest=()
for a in "$@"; do
  case "$a" in
    --e2e) e2e=1 ;;
    --tune) tune=1 ;;
    --dry-run) dry=1 ;;
    *) rest+=("$a") ;;
  esac
done
results=${OUT:-benchmarks/results}
[ $dry = 1 ] && results=${OUT:-$(mktemp -d)}  # (a dry run's figures are not the device's)

echo "== $($PY --version 2>&1) ($(command -v "$PY"))"
# No GPU, no work: checked before anything is installed (a CUDA torch is several GB).
if [ $dry = 0 ] && ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  echo "device_check: no NVIDIA GPU here (nvidia-smi -L lists none); nothing to check" >&2
  exit 2
fi

if [ $e2e = 1 ]; then
  # The device machine reaches no registry: the wheels travel with the tree (make wheelhouse).
  whl=${DCR_WHEELHOUSE:-.whl}
  if ls "$whl"/*.whl >/dev/null 2>&1; then
    site=${DCR_SITE:-/tmp/nemo-dcr-site}
    echo "== wheelhouse: $(ls "$whl"/*.whl | wc -l) wheels, $(du -sh "$whl" | cut -f1), offline into $site"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$whl"/*.whl \
      || { echo "device_check: the offline install of $whl/ failed" >&2; exit 2; }
    export PYTHONPATH="$PYTHONPATH:$site"
  fi
  missing=$($PY - <<'EOF'
import importlib.util
need = ["torch", "megatron.core", "transformers", "lightning", "hydra", "omegaconf", "safetensors", "zstandard",
        "xxhash", "numpy", "yaml"]
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # (a dotted name whose parent is missing)
        return False
print(" ".join(n for n in need if not found(n)))
EOF
)
  if [ -n "$missing" ]; then
    echo "device_check: missing Python packages: $missing (run make wheelhouse where pip reaches PyPI)" >&2
    exit 2
  fi
fi

if ! $PY -c 'import torch' 2>/dev/null; then
  echo "== torch is missing: pip install torch"
  $PY -m pip install -q torch || { echo "device_check: pip install torch failed" >&2; exit 2; }
fi
cuda=$($PY -c 'import torch; print(torch.cuda.is_available())')
echo "== torch $($PY -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)'); GPU visible: $cuda"
if [ "$cuda" != "True" ] && [ $dry = 0 ]; then
  echo "device_check: torch sees no CUDA device; nothing to check" >&2
  exit 2
fi

echo "== build: CPU kernels (cuda_ext/build.py into nemo_dcr_callback/_lib; the torch reference if this fails)"
$PY cuda_ext/build.py -q || echo "   (no compiled CPU kernels: the pure-torch reference is used)"

echo "== build: CUDA kernels ($(command -v nvcc || echo 'nvcc not on PATH'))"
t0=$(date +%s)
if [ $dry = 1 ] && ! command -v nvcc >/dev/null; then
  echo "   (dry run without nvcc: not built)"
elif ! $PY cuda_ext/build.py -q --cuda --no-cpu; then
  echo "device_check: nvcc build failed" >&2
  exit 2
fi
echo "   built in $(( $(date +%s) - t0 )) s"
$PY -c 'from nemo_dcr_callback.tools import doctor; print(doctor.render(doctor.report()))'

rc=0
# The GPU cases of the test suite first: CI has no device and skips them, so they run only
# here. Their report goes to $results/gpu_pytest.txt (bounded: a hang must not eat the lease).
GPU_TESTS=(tests/core/test_cuda_ext.py tests/receiver/test_receive_device.py
           "tests/receiver/test_context_chunks.py::test_a_receiver_on_a_gpu_decodes_from_exponent_bytes")
if [ $dry = 0 ] && [ "${DCR_NO_PYTEST:-0}" != 1 ]; then
  if $PY -c 'import pytest' 2>/dev/null; then
    echo "== GPU test cases: pytest ${GPU_TESTS[*]}"
    timeout "${DCR_PYTEST_TIMEOUT_S:-300}" $PY -m pytest -q -p no:cacheprovider -m "not slow" "${GPU_TESTS[@]}" \
      2>&1 | tee "$results/gpu_pytest.txt" | tail -15
    s=${PIPESTATUS[0]}; [ "$s" != 0 ] && rc=$s
  else
    echo "device_check: pytest is missing (make wheelhouse brings it): the GPU test cases did not run" >&2
    rc=2
  fi
fi
# --e2e: the end-to-end run first (the kernels alone have run on an H200 before; a lease that
# runs out should cut the check short, not the run never made)
if [ $e2e = 1 ]; then
  model=1b
  [ $dry = 1 ] && model=tiny
  echo "== end to end: nemo-dcr bench e2e --model $model"
  $PY -m nemo_dcr_callback.cli bench e2e --model $model --steps 10 --timeout 240 --json "$results/e2e.json" || rc=$?
fi
if [ $dry = 0 ]; then
  echo "== check and time (nemo_dcr_callback.bench.cuda ${rest[*]:-})"
  if [ $e2e = 1 ] && [ ${#rest[@]} = 0 ]; then
    rest=(--sizes-mib 1024 --rates 0.01,0.03 --reps 5)  # (the e2e run's share of the budget)
  fi
  $PY -m nemo_dcr_callback.bench.cuda "${rest[@]}" || { s=$?; [ $rc = 0 ] && rc=$s; }
fi
if [ $tune = 1 ] && [ $dry = 0 ]; then
  echo "== tuning variants: scripts/cuda_tune.sh"
  tune_args=""
  [ $e2e = 1 ] && tune_args="--rates 0.01,0.03 --reps 5"  # (the e2e run's share of the budget)
  SIZES_MIB=1024 CUDA_TUNE_BENCH_ARGS="$tune_args" bash scripts/cuda_tune.sh || { s=$?; [ $rc = 0 ] && rc=$s; }
fi
echo "== device_check: exit $rc after $(( $(date +%s) - start )) s"
exit $rc
