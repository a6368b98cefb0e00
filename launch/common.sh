# Sourced by launch/torchrun.sh and launch/slurm/job.sh; not run on its own.
#
#   MEGARL_ENTRY   module every rank runs (default megarl.train)
#   PYTHON         interpreter (default python3 on PATH)

MEGARL_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MEGARL_ENTRY=${MEGARL_ENTRY:-megarl.train}
PYTHON=${PYTHON:-python3}
# A checkout works without `pip install -e .`; an installed megarl is found either way.
export PYTHONPATH="$MEGARL_REPO${PYTHONPATH:+:$PYTHONPATH}"
# The command that runs megarl's Python for megarl_resolve: here, or through srun inside the
# user's container (launch/slurm/job.sh), where the batch node's own Python may be missing.
megarl_python=("$PYTHON")

megarl_die() { echo "megarl: $*" >&2; exit 2; }

# megarl_resolve [--nnodes N] [--nproc-per-node P] [--by TEXT] --config CONFIG [overrides...]
# Validates the config exactly as megarl-train does (one-line error, exit 2, before any rank
# starts) and sets MEGARL_RUN_DIR, MEGARL_LOG_DIR, MEGARL_NNODES, MEGARL_NPROC_PER_NODE,
# MEGARL_COLLECTIVE_TIMEOUT_S, MEGARL_SHUTDOWN_WAIT_S (and whatever else vars.py is asked for).
megarl_resolve() {
    local vars key value
    vars=$(mktemp) || exit 2
    # Values come back on stdout as NUL-separated pairs, never through `eval`: whatever the config's
    # modules print (a user's reward file, say) goes to stderr and cannot become shell code.
    if ! "${megarl_python[@]}" -m megarl.launcher.vars --env-file - "$@" >"$vars"; then
        rm -f "$vars"
        exit 2
    fi
    while IFS= read -r -d '' key && IFS= read -r -d '' value; do
        [[ $key =~ ^MEGARL_[A-Z_]+$ ]] || { rm -f "$vars"; megarl_die "unexpected name from megarl.launcher.vars: $key"; }
        printf -v "$key" '%s' "$value"
    done <"$vars"
    rm -f "$vars"
}

# megarl_node_net MASTER_ADDR NODE_RANK (multi-node only)
# Exports GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME as the interface that routes to the first node,
# unless the user set them, and sets MEGARL_LOCAL_ADDR to this node's address on it (torchrun's
# --local-addr). Left to itself gloo binds whatever the hostname resolves to: loopback on a
# machine with Debian's `127.0.1.1 <hostname>` line, which no other node can reach.
megarl_node_net() {
    MEGARL_LOCAL_ADDR=""
    [[ -n ${GLOO_SOCKET_IFNAME:-} ]] && return
    local net
    net=$("$PYTHON" -m megarl.launcher.nodenet --master-addr "$1" --node-rank "$2") || exit 2
    export GLOO_SOCKET_IFNAME=${net%% *}
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$GLOO_SOCKET_IFNAME}
    MEGARL_LOCAL_ADDR=${net#* }
}

# megarl_net_env: one line with the variables that steer NCCL, UCX, gloo and the devices, as this
# process will hand them to its ranks (docs/launch.md, "NCCL"). A name that looks like it holds a
# credential is printed without its value.
megarl_net_env() {
    local name value shown=()
    while IFS= read -r name; do
        value=${!name}
        [[ $name =~ (KEY|TOKEN|SECRET|PASSW|CRED|AUTH) ]] && value="<set, not shown>"
        shown+=("$name=$value")
    done < <(compgen -e | grep -E '^(NCCL_|UCX_|TORCH_NCCL_|NVSHMEM_|GLOO_SOCKET_IFNAME$|CUDA_VISIBLE_DEVICES$|CUDA_DEVICE_MAX_CONNECTIONS$|CUDA_LAUNCH_BLOCKING$|CUDA_MODULE_LOADING$)' | sort)
    echo "megarl: network environment on $(hostname): ${shown[*]:-none of NCCL_*, UCX_*, GLOO_SOCKET_IFNAME, CUDA_* set}"
}
