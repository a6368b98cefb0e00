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
(( SLURM_NODEID == 0 )) && megarl_net_env
# job.sh passes the time-limit warning on as USR1 to every process of this step. torchrun would die
# of it (it handles torch's TORCHELASTIC_SIGNALS_TO_HANDLE, by default TERM, INT, HUP, QUIT), and
# its ranks with it. Ignored here, it stays ignored in torchrun and whatever it starts, except
# megarl's ranks, which handle it: they save at the end of their step, then exit 143.
trap '' USR1
exec "$@"
