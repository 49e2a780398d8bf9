#!/usr/bin/env bash
# Launch scripts/train.py (Lightning + megatron-core GPT + DCR callback) on this host.
#   NPROC   processes (= TP x PP x DP), default 4
#   TP, PP  tensor / pipeline parallel sizes, default 2 / 2
#   STEPS   optimizer steps, default 10
#   STORE   DCR store URL, default file://<run dir>/dcr-store
# Extra arguments are Hydra overrides, e.g.  ./scripts/launch_torchrun.sh dcr.verify=true model.num_layers=8
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-4}; TP=${TP:-2}; PP=${PP:-2}; STEPS=${STEPS:-10}
PY=${PYTHON:-.venv/bin/python}
args=(parallel.tensor_model_parallel_size="$TP" parallel.pipeline_model_parallel_size="$PP" trainer.max_steps="$STEPS")
[ -n "${STORE:-}" ] && args+=(dcr.store="$STORE")
exec "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" --master-addr 127.0.0.1 \
    --master-port "${MASTER_PORT:-29500}" scripts/train.py "${args[@]}" "$@"
