#!/usr/bin/env bash
# One node: torchrun starts trainer.n_gpus_per_node ranks of megarl.train.
#
#   launch/torchrun.sh configs/quickstart.yaml [section.key=value ...]
#   NPROC_PER_NODE=8 launch/torchrun.sh my.yaml      (sets trainer.n_gpus_per_node)
#
# The run directory is trainer.default_local_dir; this script's log is <run dir>/logs/torchrun-*.log.
# Running it again with the same config resumes from the latest checkpoint (trainer.resume_mode=auto).
# When a rank fails, torchrun stops the others and prints which rank failed and why.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

[[ $# -ge 1 && $1 != -* ]] || megarl_die "usage: launch/torchrun.sh CONFIG [section.key=value ...]"
config=$1
shift
layout=(trainer.nnodes=1)
[[ -n ${NPROC_PER_NODE:-} ]] && layout+=("trainer.n_gpus_per_node=$NPROC_PER_NODE")
megarl_resolve --nnodes 1 --by "launch/torchrun.sh (one node)" --config "$config" "${layout[@]}" "$@"

mkdir -p "$MEGARL_LOG_DIR"
log="$MEGARL_LOG_DIR/torchrun-$(date +%Y%m%d-%H%M%S)-$$.log"
echo "megarl: $MEGARL_NPROC_PER_NODE ranks of $MEGARL_ENTRY on $(hostname); run dir $MEGARL_RUN_DIR; log $log" | tee -a "$log"
threads=$(( $(nproc) / MEGARL_NPROC_PER_NODE ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}

# torchrun's static rendezvous on a loopback port: its store holds JSON and bytes, where the c10d
# rendezvous (--standalone) unpickles whatever a local user writes to its store (docs/security.md).
port=${MASTER_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

set +e
# supervise: torchrun and everything below it end when this script ends, even by kill -9 (parent-death
# signal), and no helper process outlives the run (megarl/parallel/supervise.py).
"$PYTHON" -m megarl.parallel.supervise -- "$PYTHON" -m torch.distributed.run --rdzv-backend=static --nnodes=1 --node-rank=0 \
    --master-addr=127.0.0.1 --master-port="$port" --nproc-per-node="$MEGARL_NPROC_PER_NODE" --max-restarts=0 --shutdown-timeout="${MEGARL_SHUTDOWN_TIMEOUT_S:-15}" \
    -m "$MEGARL_ENTRY" --config "$config" "${layout[@]}" "$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "megarl: torchrun exited $rc; log $log" | tee -a "$log"
exit "$rc"
