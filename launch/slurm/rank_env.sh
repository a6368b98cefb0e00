#!/usr/bin/env bash
# One srun task per rank: give the task torch's standard variables from Slurm's, then run it.
#
#   srun launch/slurm/rank_env.sh python -m megarl.train --config my.yaml
#
# MASTER_ADDR / MASTER_PORT come from launch/slurm/job.sh (the first node of the allocation).
set -euo pipefail
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
export GROUP_RANK=$SLURM_NODEID NODE_RANK=$SLURM_NODEID
# SLURM_STEP_TASKS_PER_NODE reads "4" or "4(x2)"; srun places tasks evenly here (checked by job.sh).
export LOCAL_WORLD_SIZE=${SLURM_STEP_TASKS_PER_NODE%%(*}
export MASTER_ADDR=${MASTER_ADDR:?set by launch/slurm/job.sh} MASTER_PORT=${MASTER_PORT:?set by launch/slurm/job.sh}
export MEGARL_SLURM_TASK_PER_RANK=1   # megarl.train: ranks are started, do not start more
exec "$@"
