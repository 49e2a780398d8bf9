#!/usr/bin/env bash
# Tries tuning variants of the CUDA kernels on this GPU. Each variant is a set of -DDCR_* knobs
# (documented at the top of cuda_ext/cuda/dcr_cuda.cu), built into a folder of its own by
# `cuda_ext/build.py --cuda --defines`, loaded through NEMO_DCR_CUDA_LIB, checked against the CPU
# reference and timed by bench/cuda.py; a table of the variants comes last, and
# $OUT/cuda_tune.json (else benchmarks/results/cuda_tune.json).
#   bash scripts/cuda_tune.sh                      # the variants below (CUDA_TUNE_SET: which)
#   bash scripts/cuda_tune.sh "" "-DDCR_BLOCK=128"  # these ("" is the defaults)
# Needs what scripts/device_check.sh needs; about 20 s per variant on an H200.
# CUDA_TUNE_BENCH_ARGS: more arguments for bench.cuda (device_check.sh --e2e makes it shorter).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SIZES=${SIZES_MIB:-1024}
# The default set: the kernel as shipped, then the variants issue 51 asks to measure that no
# device run has measured yet (docs/CUDA.md, "Variants prepared, not yet measured"): tiles
# staged through shared memory by cp.async, rereading changed vectors from L2 (with the registers
# it frees turned into resident blocks, then alone), fewer vectors per tile, 8-byte vectors, and
# the two-phase count + prefix + write pass; the likeliest first, so a run cut short keeps them. CUDA_TUNE_SET=measured runs
# the earlier sweep (docs/CUDA.md, "What was tried"); CUDA_TUNE_SET=all both.
DEFAULT_VARIANTS=("" "-DDCR_STAGES=3 -DDCR_BLOCK=256" "-DDCR_STAGES=4 -DDCR_BLOCK=256 -DDCR_VECS=2"
                  "-DDCR_STAGES=3 -DDCR_BLOCK=128" "-DDCR_REREAD=1 -DDCR_MIN_BLOCKS=3"
                  "-DDCR_REREAD=1 -DDCR_BLOCK=256 -DDCR_MIN_BLOCKS=6" "-DDCR_REREAD=1 -DDCR_VECS=2 -DDCR_MIN_BLOCKS=4"
                  "-DDCR_REREAD=1" "-DDCR_VECS=2" "-DDCR_VEC_BYTES=8" "-DDCR_TWO_PHASE=1" "-DDCR_TWO_PHASE=1 -DDCR_REREAD=1")
MEASURED_VARIANTS=("-DDCR_TILE_ORDER=1 -DDCR_FAST_MASK=0" "-DDCR_TILE_ORDER=1" "-DDCR_FAST_MASK=0"
                   "-DDCR_BLOCK=128" "-DDCR_BLOCK=256" "-DDCR_STREAM_BASE=1" "-DDCR_SLEEP_NS=0" "-DDCR_PERSIST=1"
                   "-DDCR_PERSIST=1 -DDCR_BLOCK=128" "-DDCR_PERSIST=1 -DDCR_BLOCK=512" "-DDCR_PERSIST=1 -DDCR_STREAM_BASE=1")
if [ $# -gt 0 ]; then
  variants=("$@")
else
  case ${CUDA_TUNE_SET:-default} in
    default) variants=("${DEFAULT_VARIANTS[@]}") ;;
    measured) variants=("" "${MEASURED_VARIANTS[@]}") ;;
    all) variants=("${DEFAULT_VARIANTS[@]}" "${MEASURED_VARIANTS[@]}") ;;
    *) echo "cuda_tune: CUDA_TUNE_SET is default, measured or all, not ${CUDA_TUNE_SET}" >&2; exit 2 ;;
  esac
fi
# The CPU kernels (the reference's compiled path), once for every variant.
[ -f nemo_dcr_callback/_lib/libdcr_cpu.so ] || $PY cuda_ext/build.py -q \
  || echo "cuda_tune: no compiled CPU kernels: the pure-torch reference is used" >&2
tmp=$(mktemp -d)
jsons=()
for i in "${!variants[@]}"; do
  v=${variants[$i]}
  t0=$(date +%s)
  if ! $PY cuda_ext/build.py -q --cuda --no-cpu --defines "$v" --out "$tmp/$i" >"$tmp/$i.log" 2>&1; then
    echo "== variant $i (${v:-defaults}): build failed"; tail -15 "$tmp/$i.log"; continue
  fi
  # shellcheck disable=SC2086  # (CUDA_TUNE_BENCH_ARGS: words for bench.cuda, e.g. "--rates 0.01,0.03 --reps 5")
  NEMO_DCR_CUDA_LIB="$tmp/$i/libdcr_cuda.so" $PY -m nemo_dcr_callback.bench.cuda --sizes-mib "$SIZES" \
    ${CUDA_TUNE_BENCH_ARGS:-} --json "$tmp/$i.json" >>"$tmp/$i.log" 2>&1
  rc=$?
  echo "== variant $i (${v:-defaults}): exit $rc in $(( $(date +%s) - t0 )) s: $(tail -1 "$tmp/$i.log")"
  if [ $rc -ne 0 ]; then tail -15 "$tmp/$i.log"; fi
  [ -f "$tmp/$i.json" ] && jsons+=("$tmp/$i.json")
  # the summary so far, after every variant: a run cut off by its time limit keeps what it measured
  [ ${#jsons[@]} -gt 0 ] && $PY -m nemo_dcr_callback.bench.cuda --summarize "${jsons[@]}" >/dev/null 2>&1
done
[ ${#jsons[@]} -gt 0 ] || { echo "cuda_tune: no variant produced results" >&2; exit 1; }
$PY -m nemo_dcr_callback.bench.cuda --summarize "${jsons[@]}"
