# Sourced by launch/torchrun.sh and launch/slurm/job.sh; not run on its own.
#
#   MEGARL_ENTRY   module every rank runs (default megarl.train)
#   PYTHON         interpreter (default python3 on PATH)

MEGARL_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MEGARL_ENTRY=${MEGARL_ENTRY:-megarl.train}
PYTHON=${PYTHON:-python3}
# A checkout works without `pip install -e .`; an installed megarl is found either way.
export PYTHONPATH="$MEGARL_REPO${PYTHONPATH:+:$PYTHONPATH}"

megarl_die() { echo "megarl: $*" >&2; exit 2; }

# megarl_resolve [--nnodes N] [--nproc-per-node P] [--by TEXT] --config CONFIG [overrides...]
# Validates the config exactly as megarl-train does (one-line error, exit 2, before any rank
# starts) and sets MEGARL_RUN_DIR, MEGARL_LOG_DIR, MEGARL_NNODES, MEGARL_NPROC_PER_NODE,
# MEGARL_COLLECTIVE_TIMEOUT_S, MEGARL_SHUTDOWN_WAIT_S.
megarl_resolve() {
    local out
    out=$("$PYTHON" -m megarl.launch_vars "$@") || exit 2
    eval "$out"
}
