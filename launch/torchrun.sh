#!/usr/bin/env bash
# torchrun starts trainer.n_gpus_per_node ranks of megarl.train on this node; with NNODES > 1, run
# it on every node with the same config, MASTER_ADDR and MASTER_PORT and each node's NODE_RANK.
#
#   launch/torchrun.sh configs/quickstart.yaml [section.key=value ...]
#   NPROC_PER_NODE=8 launch/torchrun.sh my.yaml      (sets trainer.n_gpus_per_node)
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh my.yaml     (on node0)
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 launch/torchrun.sh my.yaml     (on node1)
#
# NNODES (1), NODE_RANK (0), MASTER_ADDR (the first node: a name or address every node reaches),
# MASTER_PORT (one node: a free port; several: 29500) are torchrun's usual variables.
# The run directory is trainer.default_local_dir; this script's log is <run dir>/logs/torchrun-*.log.
# Running it again with the same config resumes from the latest checkpoint (trainer.resume_mode=auto).
# When a rank fails, torchrun stops the others and prints which rank failed and why.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

[[ $# -ge 1 && $1 != -* ]] || megarl_die "usage: launch/torchrun.sh CONFIG [section.key=value ...]"
config=$1
shift
nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
[[ $nnodes =~ ^[1-9][0-9]*$ ]] || megarl_die "NNODES=$nnodes: give the number of nodes (1, 2, ...)"
[[ $node_rank =~ ^[0-9]+$ ]] && (( node_rank < nnodes )) ||
    megarl_die "NODE_RANK=$node_rank: give this node's rank, 0 to $(( nnodes - 1 )) (NNODES=$nnodes)"
layout=("trainer.nnodes=$nnodes")
check=()
[[ -n ${NPROC_PER_NODE:-} ]] && layout+=("trainer.n_gpus_per_node=$NPROC_PER_NODE")
if (( nnodes == 1 )); then
    by="launch/torchrun.sh (NNODES=1)"
else
    [[ -n ${MASTER_ADDR:-} ]] || megarl_die "NNODES=$nnodes needs MASTER_ADDR: the first node's name or address, the same on every node"
    by="launch/torchrun.sh (NNODES=$nnodes)"
    # The inputs (data, model, reward) are checked once, by the first node; the others check only
    # what is theirs: config, devices, their run directory.
    (( node_rank == 0 )) || check=(--node-only)
fi
megarl_resolve --nnodes "$nnodes" "${check[@]}" --by "$by" --config "$config" "${layout[@]}" "$@"
export MEGARL_PREFLIGHT_DONE=1     # megarl.train's ranks skip what was just checked

mkdir -p "$MEGARL_LOG_DIR"
log="$MEGARL_LOG_DIR/torchrun-$(date +%Y%m%d-%H%M%S)-$$.log"
threads=$(( $(nproc) / MEGARL_NPROC_PER_NODE ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}

# torchrun's static rendezvous: its store holds JSON and bytes, where the c10d rendezvous
# (--standalone) unpickles whatever anyone who reaches its port writes to its store (docs/security.md).
if (( nnodes == 1 )); then
    master=127.0.0.1
    port=${MASTER_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
    net=()
else
    master=$MASTER_ADDR
    port=${MASTER_PORT:-29500}
    megarl_node_net "$master" "$node_rank"
    # The address torchrun's agent would otherwise take from socket.getfqdn(), which need not
    # resolve on the other nodes.
    net=(${MEGARL_LOCAL_ADDR:+--local-addr="$MEGARL_LOCAL_ADDR"})
fi
echo "megarl: $MEGARL_NPROC_PER_NODE ranks of $MEGARL_ENTRY on $(hostname) (node $node_rank of $nnodes," \
     "rendezvous $master:$port${GLOO_SOCKET_IFNAME:+, gloo on $GLOO_SOCKET_IFNAME}); run dir $MEGARL_RUN_DIR; log $log" | tee -a "$log"
(( node_rank == 0 )) && megarl_net_env | tee -a "$log"

set +e
# supervise: torchrun and everything below it end when this script ends, even by kill -9 (parent-death
# signal), and no helper process outlives the run (megarl/parallel/supervise.py).
"$PYTHON" -m megarl.parallel.supervise -- "$PYTHON" -m torch.distributed.run --rdzv-backend=static --nnodes="$nnodes" \
    --node-rank="$node_rank" --master-addr="$master" --master-port="$port" "${net[@]}" \
    --rdzv-conf="timeout=$MEGARL_COLLECTIVE_TIMEOUT_S" --nproc-per-node="$MEGARL_NPROC_PER_NODE" --max-restarts=0 \
    --shutdown-timeout="${MEGARL_SHUTDOWN_TIMEOUT_S:-15}" \
    -m "$MEGARL_ENTRY" --config "$config" "${layout[@]}" "$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "megarl: torchrun exited $rc on node $node_rank ($(hostname)); log $log" | tee -a "$log"
exit "$rc"
