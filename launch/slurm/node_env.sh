#!/usr/bin/env bash
# One srun task per node running torchrun: its node rank for the static rendezvous, the interface
# its ranks use, their threads, then run it.
#
#   srun --ntasks-per-node=1 launch/slurm/node_env.sh python -m torch.distributed.run --rdzv-backend=static ...
#
# torchrun reads --node-rank from PET_NODE_RANK (and --local-addr from PET_LOCAL_ADDR) when the flag
# is absent; srun's command line is the same on every node, so these come from the task's own node.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/common.sh"
export PET_NODE_RANK=${SLURM_NODEID:?run by srun inside a Slurm job}
if (( ${SLURM_NNODES:-1} > 1 )); then
    megarl_node_net "${MASTER_ADDR:?set by launch/slurm/job.sh}" "$SLURM_NODEID"
    [[ -n $MEGARL_LOCAL_ADDR ]] && export PET_LOCAL_ADDR=$MEGARL_LOCAL_ADDR
fi
# This node's CPUs over its ranks: nodes of one job need not be alike.
threads=$(( ${SLURM_CPUS_ON_NODE:-$(nproc)} / ${MEGARL_NPROC_PER_NODE:-1} ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
exec "$@"
