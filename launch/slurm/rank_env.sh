#!/usr/bin/env bash
# One srun task per rank: give the task torch's standard variables from Slurm's, then run it.
#
#   srun launch/slurm/rank_env.sh python -m megarl.train --config my.yaml
#
# MASTER_ADDR / MASTER_PORT come from launch/slurm/job.sh (the first node of the allocation).
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/common.sh"
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
export GROUP_RANK=$SLURM_NODEID NODE_RANK=$SLURM_NODEID
# SLURM_STEP_TASKS_PER_NODE reads "4" or "4(x2)"; srun places tasks evenly here (checked by job.sh).
export LOCAL_WORLD_SIZE=${SLURM_STEP_TASKS_PER_NODE%%(*}
export MASTER_ADDR=${MASTER_ADDR:?set by launch/slurm/job.sh} MASTER_PORT=${MASTER_PORT:?set by launch/slurm/job.sh}
(( ${SLURM_NNODES:-1} > 1 )) && megarl_node_net "$MASTER_ADDR" "$SLURM_NODEID"   # the interface gloo binds
# The task's own CPUs (--cpus-per-task, set by job.sh), not the batch node's count.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export MEGARL_SLURM_TASK_PER_RANK=1   # megarl.train: ranks are started, do not start more
(( RANK == 0 )) && megarl_net_env
exec "$@"
