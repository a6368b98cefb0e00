#!/usr/bin/env bash
# The body of every launch/slurm/*.sbatch (they `exec` it): layout from the allocation, config
# check, ranks started by srun, requeue on the time-limit signal.
#
#   launch/slurm/job.sh CONFIG [section.key=value ...]      (inside an sbatch allocation)
#
# MEGARL_SLURM_MODE picks how ranks start (default: from the allocation):
#   torchrun  one srun task per node runs torchrun, which starts trainer.n_gpus_per_node ranks;
#             static rendezvous on the first node of the node list (--ntasks-per-node=1), node
#             rank from SLURM_NODEID (node_env.sh).
#   task      one srun task per rank (--ntasks-per-node=G); rank_env.sh maps SLURM_PROCID /
#             SLURM_NTASKS / SLURM_LOCALID to RANK / WORLD_SIZE / LOCAL_RANK.
# Logs: <trainer.default_local_dir>/logs/slurm-<job id>.log (and Slurm's own output file).
#
# Containers: every srun of the job (the config check, the ranks, the failure report) gets
#   MEGARL_SRUN_ARGS    srun options: pyxis/enroot's --container-image=IMAGE --container-mounts=A:A,...
#   MEGARL_SRUN_PREFIX  a command before each task's command: apptainer exec --nv IMAGE.sif
# both split as a shell splits words (quotes kept, nothing expanded). This batch shell runs no
# Python itself (Slurm's commands and coreutils only), so the host needs no Python environment.
#
# MEGARL_SIGNAL_MARGIN_S (600) is --signal's @seconds: printed at start beside the last save time.
# MEGARL_STOP_RESEND_S (30): how often USR1 goes to the ranks again until they have stopped.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/common.sh"

[[ $# -ge 1 && $1 != -* ]] || megarl_die "usage: sbatch launch/slurm/<script>.sbatch CONFIG [section.key=value ...]"
[[ -n ${SLURM_JOB_ID:-} ]] || megarl_die "launch/slurm/job.sh runs inside a Slurm job; submit an sbatch script"

# ARRAY VARIABLE: the variable's value split into ARRAY as the shell would split words (xargs:
# quotes and backslashes, no expansion, no eval). Unbalanced quotes stop the job with one line.
words() {
    local -n into=$1
    local split value=${!2:-}
    into=()
    [[ -n $value ]] || return 0
    split=$(mktemp) || exit 2
    xargs -r printf '%s\0' <<<"$value" >"$split" 2>/dev/null ||
        { rm -f "$split"; megarl_die "$2=$value: cannot split it into words (an unbalanced quote?)"; }
    mapfile -t -d '' into <"$split"
    rm -f "$split"
}
words srun_user MEGARL_SRUN_ARGS
words task_prefix MEGARL_SRUN_PREFIX
margin=${MEGARL_SIGNAL_MARGIN_S:-600}
[[ $margin =~ ^[0-9]+$ ]] || megarl_die "MEGARL_SIGNAL_MARGIN_S=$margin: give --signal's @seconds, e.g. 600"
resend_s=${MEGARL_STOP_RESEND_S:-30}
[[ $resend_s =~ ^[1-9][0-9]*$ ]] || megarl_die "MEGARL_STOP_RESEND_S=$resend_s: give whole seconds, e.g. 30"
# A time limit within the margin would signal at once: the ranks would save after their first step
# and the job requeue itself forever.
limit=$(scontrol show job -o "$SLURM_JOB_ID" | grep -o 'TimeLimit=[^ ]*' | cut -d= -f2-) || limit=""
if [[ $limit =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]]; then
    limit_s=$(( ((10#${BASH_REMATCH[2]:-0} * 24 + 10#${BASH_REMATCH[4]:-0}) * 60 + 10#${BASH_REMATCH[5]}) * 60 + 10#${BASH_REMATCH[6]} ))
    (( limit_s > margin + 60 )) || megarl_die "the time limit ($limit) is not above the ${margin} s stop signal" \
        "margin plus a minute: ask for more time (--time) or pass --signal=B:USR1@S with MEGARL_SIGNAL_MARGIN_S=S"
fi

config=$1
shift
nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
ntasks=${SLURM_NTASKS:-$nnodes}
mode=${MEGARL_SLURM_MODE:-auto}
if [[ $mode == auto ]]; then
    if (( ntasks > nnodes )); then mode=task; else mode=torchrun; fi
fi
alloc="this allocation ($nnodes node(s), $ntasks task(s))"
case $mode in
    task)
        (( ntasks % nnodes == 0 )) || megarl_die "$alloc: give every node the same number of tasks (--ntasks-per-node)"
        per_node=$(( ntasks / nnodes ))
        layout=("trainer.nnodes=$nnodes" "trainer.n_gpus_per_node=$per_node")
        check=(--nnodes "$nnodes" --nproc-per-node "$per_node") ;;
    torchrun)
        (( ntasks == nnodes )) || megarl_die "$alloc: MEGARL_SLURM_MODE=torchrun wants one task per node (--ntasks-per-node=1)"
        layout=("trainer.nnodes=$nnodes")
        # GPUs granted per node become ranks per node unless the config/overrides say otherwise.
        if (( ${SLURM_GPUS_ON_NODE:-0} > 0 )); then layout+=("trainer.n_gpus_per_node=$SLURM_GPUS_ON_NODE"); fi
        check=(--nnodes "$nnodes") ;;
    *) megarl_die "MEGARL_SLURM_MODE=$mode: use torchrun, task or auto" ;;
esac
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
first=$(head -n1 <<<"$nodes")
# CPUs of the smallest node ("2(x3),4" reads 2): one --cpus-per-task must fit on every node. Each
# node sets its ranks' OMP_NUM_THREADS from its own CPUs (node_env.sh, rank_env.sh), not this one's.
cpus_node=$(tr ',' '\n' <<<"${SLURM_JOB_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-$(nproc)}}" | sed 's/(.*//' | sort -n | head -n1)

# One task on the first node, in the container: the config check (and the free port it reports
# there) and the failure report. srun's own "task 0: Exited with exit code 2" after a config
# error's one line is dropped; the line says it all.
on_first_node() {
    local rc
    # stderr alone through the filter (stdout stays on fd 3), srun's exit status kept
    { srun --nodes=1 --ntasks=1 --nodelist="$first" --cpus-per-task="$cpus_node" \
          "${srun_user[@]}" "${task_prefix[@]}" "$@" 2>&1 1>&3 3>&- |
          grep -vE '^srun: error: [^ ]+: task 0: Exited with exit code [0-9]+$' >&2
      rc=${PIPESTATUS[0]}; } 3>&1
    return "$rc"
}
megarl_python=(on_first_node "$PYTHON")
megarl_resolve "${check[@]}" --free-port --signal-margin-s "$margin" --by "$alloc" --config "$config" \
    "${layout[@]}" "$@"

mkdir -p "$MEGARL_LOG_DIR"
log="$MEGARL_LOG_DIR/slurm-$SLURM_JOB_ID.log"
say() { echo "megarl: $*" | tee -a "$log"; }
# The rendezvous address is the first node's NodeAddr: a Slurm NodeName need not resolve as a
# host name (NodeName=cn1 NodeHostname=node1 NodeAddr=10.0.0.2), and then every rank would retry
# "gai error -3" until the join timeout.
if [[ -z ${MASTER_ADDR:-} ]]; then
    MASTER_ADDR=$(scontrol show node -o "$first" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2-) || true
    [[ -n $MASTER_ADDR ]] || megarl_die "cannot read the NodeAddr of $first (scontrol show node $first); set MASTER_ADDR to its address"
fi
export MASTER_ADDR
# A port the config check found free on the first node: a port derived from the job id alone
# collides for jobs whose ids differ by the range.
export MASTER_PORT=${MASTER_PORT:-$MEGARL_FREE_PORT}
# Ranks that skip the inputs checked above, and what node_env.sh / rank_env.sh need on each node.
export MEGARL_PREFLIGHT_DONE=1 MEGARL_NNODES MEGARL_NPROC_PER_NODE PYTHON
say "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $(tr '\n' ' ' <<<"$nodes")| $mode mode," \
     "$MEGARL_NNODES x $MEGARL_NPROC_PER_NODE ranks of $MEGARL_ENTRY | rendezvous $MASTER_ADDR:$MASTER_PORT |" \
     "run dir $MEGARL_RUN_DIR | log $log"

# --kill-on-bad-exit: a task that fails ends the step; --wait: a task still running this long
# after another one ended is stuck (every rank ends at the same final collective).
srun_args=(--kill-on-bad-exit=1 --wait="$MEGARL_SHUTDOWN_WAIT_S" --nodes="$nnodes" "${srun_user[@]}")
# CPUs per task are passed explicitly: newer Slurm no longer hands the job's --cpus-per-task to
# srun, and a torchrun task confined to one CPU would starve its ranks' data loading.
if [[ $mode == task ]]; then
    task_cpus=${SLURM_CPUS_PER_TASK:-$(( cpus_node / MEGARL_NPROC_PER_NODE ))}
    (( task_cpus > 0 )) || task_cpus=1
    cmd=(srun "${srun_args[@]}" --ntasks="$ntasks" --ntasks-per-node="$MEGARL_NPROC_PER_NODE" --cpus-per-task="$task_cpus"
         --label "${task_prefix[@]}" "$MEGARL_REPO/launch/slurm/rank_env.sh" "$PYTHON" -m "$MEGARL_ENTRY" --config "$config" "${layout[@]}" "$@")
else
    task_cpus=${SLURM_CPUS_PER_TASK:-$cpus_node}
    # The static rendezvous: the c10d one keeps pickled state in a store on MASTER_PORT that any
    # user who can reach the node may write, and unpickles it (docs/security.md). Static holds JSON.
    cmd=(srun "${srun_args[@]}" --ntasks="$nnodes" --ntasks-per-node=1 --cpus-per-task="$task_cpus" --label
         "${task_prefix[@]}" "$MEGARL_REPO/launch/slurm/node_env.sh" "$PYTHON" -m torch.distributed.run --nnodes="$nnodes"
         --nproc-per-node="$MEGARL_NPROC_PER_NODE" --rdzv-backend=static --master-addr="$MASTER_ADDR"
         --master-port="$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" --rdzv-conf="timeout=$MEGARL_COLLECTIVE_TIMEOUT_S"
         --max-restarts=0
         --shutdown-timeout="${MEGARL_SHUTDOWN_TIMEOUT_S:-15}"
         -m "$MEGARL_ENTRY" --config "$config" "${layout[@]}" "$@")
fi

# One line naming the rank that failed first, from the torchrun summaries in the log or srun's
# report of the first task that did not merely get terminated (megarl/launcher/failure.py says why
# torchrun's own "Root Cause" is not enough).
first_failure() {
    local names
    mapfile -t names <<<"$nodes"
    on_first_node "$PYTHON" -m megarl.launcher.failure "$log" "$mode" "${names[@]}" 2>/dev/null ||
        echo "not reported (see the lines above)"
}

# sbatch --signal=B:USR1@600 warns this shell 600 s before the time limit. It passes USR1 on to the
# ranks (scancel --signal reaches the job's steps, not this shell; torchrun ignores it, node_env.sh),
# which finish their step, save it and exit 143; then it requeues the job, which resumes from that
# save. Requeueing at once would SIGTERM the ranks and SIGKILL them KillWait (often 30 s) later.
# A rank still starting up ignores USR1 (torchrun's, or a container's, ignored disposition holds
# until megarl installs its handler), so the signal is sent again every MEGARL_STOP_RESEND_S
# (resend_s, above) seconds until the ranks' step ends; a rank that has it already takes no notice.
stopping=0
signalled=0
terminated=0
resender=""
on_usr1() {
    signalled=1
    (( stopping )) && return
    stopping=1
    say "job $SLURM_JOB_ID is near its time limit ($(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null || echo "?") left);" \
        "the ranks save the step they are in, then the job requeues"
    scancel --signal=USR1 "$SLURM_JOB_ID" || say "scancel --signal=USR1 $SLURM_JOB_ID failed: the ranks save nothing"
    { while sleep "$resend_s"; do scancel --signal=USR1 "$SLURM_JOB_ID" 2>/dev/null || :; done; } &
    resender=$!
}
trap on_usr1 USR1
# Slurm's requeue, scancel, preemption and the time limit send SIGTERM to this shell as well as to
# the ranks, SIGKILL KillWait seconds (GraceTime, for preemption) later. The ranks use that time to
# finish their step and save; this shell and the copy of their output (tee) wait for them, so the
# ranks' last line reaches the log.
on_term() {
    signalled=1
    terminated=1
}
trap on_term TERM

# In the background so the trap can run; the subshell ends only after tee has written the last
# line, so the log is complete when the failure is looked up in it. It ignores SIGTERM (srun sets
# its own handlers; the ranks are slurmstepd's children, not this shell's).
{ trap '' TERM; "${cmd[@]}" 2>&1 | tee -a "$log"; exit "${PIPESTATUS[0]}"; } &
step=$!
while :; do
    rc=0
    wait "$step" || rc=$?
    (( signalled )) || break
    signalled=0   # the trap interrupted `wait`; srun goes on (or has ended: wait again for its status)
done
[[ -z $resender ]] || kill "$resender" 2>/dev/null || :
if (( rc == 0 )); then
    say "job $SLURM_JOB_ID finished"
elif (( stopping && ! terminated )); then
    # Said first: the requeue ends this shell.
    say "job $SLURM_JOB_ID stopped for requeue (srun exit $rc); it resumes from the latest checkpoint"
    scontrol requeue "$SLURM_JOB_ID" || say "scontrol requeue $SLURM_JOB_ID failed: submit the same command again"
elif (( terminated )); then
    say "job $SLURM_JOB_ID stopped by SIGTERM (srun exit $rc); the same command resumes from the latest checkpoint"
else
    say "job $SLURM_JOB_ID failed: srun exit $rc; first failure: $(first_failure); log $log"
fi
exit "$rc"
