#!/usr/bin/env bash
# One srun task per node running torchrun: its node rank for the static rendezvous, then run it.
#
#   srun --ntasks-per-node=1 launch/slurm/node_env.sh python -m torch.distributed.run --rdzv-backend=static ...
#
# torchrun reads --node-rank from PET_NODE_RANK when the flag is absent; srun's command line is the
# same on every node, so the rank comes from the task's own SLURM_NODEID.
set -euo pipefail
export PET_NODE_RANK=${SLURM_NODEID:?run by srun inside a Slurm job}
exec "$@"
