#!/usr/bin/env bash
# A one-node Slurm on this machine, from Debian's packages, to try launch/slurm/*.sbatch without a
# cluster (tests/test_launch_slurm.py runs it). Needs root; a test setup, not a production one:
# linuxproc process tracking, no cgroups. Every message is authenticated by a munged of its own
# (auth/munge, cred/munge) with a fresh key, in a private directory; the daemons are addressed on
# 127.0.0.1 (docs/security.md: what they listen on).
#
#   launch/slurm/local_cluster.sh install   # apt-get install slurmctld slurmd slurm-client munge (if missing)
#   launch/slurm/local_cluster.sh start     # munged + both daemons; prints what to export:
#   export MEGARL_SLURM_DIR=<dir> SLURM_CONF=<dir>/slurm.conf   # then sbatch / srun / squeue use it
#   launch/slurm/local_cluster.sh status    # status and stop need MEGARL_SLURM_DIR
#   launch/slurm/local_cluster.sh stop      # cancel its jobs, stop only the daemons started here
#
#   MEGARL_SLURM_DIR   config, state, logs, pid files and munge's key and socket: an existing
#                      directory of this user's with mode 0700, or one to create; default: a new
#                      `mktemp -d` directory (never a fixed /tmp name another user could plant)
#   MEGARL_SLURM_PORT  slurmctld's port; slurmd takes the next one (default 16817, not Slurm's 6817)
#   MEGARL_SLURM_CPUS  CPUs the node offers (default: nproc)
#   MEGARL_SLURM_NODE  the node's name (default: hostname -s, or localhost where that does not resolve)
set -euo pipefail

dir=${MEGARL_SLURM_DIR:-}
port=${MEGARL_SLURM_PORT:-16817}
packages=(slurmctld slurmd slurm-client munge)

die() { echo "local_cluster: $*" >&2; exit 1; }
say() { echo "local_cluster: $*"; }
kill_tree() {  # children first, so none is re-parented out of reach
    local child
    for child in $(pgrep -P "$1" || true); do kill_tree "$child"; done
    kill -9 "$1" 2>/dev/null || true
}
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# The state directory: private to this user (0700), so no one else can plant a config, a key or a
# socket in it. A name given in MEGARL_SLURM_DIR that exists must already be ours and 0700.
private_dir() {
    if [[ -z $dir ]]; then
        dir=$(mktemp -d "${TMPDIR:-/tmp}/megarl-slurm.XXXXXXXX") || die "mktemp -d failed"
    elif [[ ! -e $dir ]]; then
        (umask 077 && mkdir -p "$dir") || die "cannot create $dir"
    fi
    [[ -d $dir && ! -L $dir ]] || die "$dir is not a directory"
    local owner mode
    read -r owner mode < <(stat -c '%u %a' "$dir")
    [[ $owner == "$(id -u)" && $mode == 700 ]] ||
        die "$dir must be owned by uid $(id -u) with mode 700 (it is uid $owner, mode $mode); use a new directory"
}
need_dir() {
    [[ -n $dir ]] || die "set MEGARL_SLURM_DIR to the directory that start printed"
    conf=$dir/slurm.conf
}

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
        command -v munged >/dev/null; then
        say "Slurm is installed ($(slurmd -V))"
        return
    fi
    [[ $(id -u) == 0 ]] || die "installing needs root: sudo $0 install"
    command -v apt-get >/dev/null || die "no apt-get here; install Slurm (slurmctld, slurmd, client) yourself"
    export DEBIAN_FRONTEND=noninteractive
    # The packages' maintainer scripts would start the daemons from /etc; ours start from our own
    # config, so deny service starts during the install (the Debian policy-rc.d convention).
    local policy=/usr/sbin/policy-rc.d made=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made=1
    fi
    local rc=0
    apt-get install -y -q --no-install-recommends "${packages[@]}" ||
        { apt-get update -q && apt-get install -y -q --no-install-recommends "${packages[@]}"; } || rc=$?
    (( made )) && rm -f "$policy"
    (( rc == 0 )) || die "apt-get install ${packages[*]} failed (exit $rc)"
    say "installed $(slurmd -V)"
}

write_conf() {
    local node=$1 cpus=$2 mem_mb=$3
    (umask 077 && mkdir -p "$dir/state" "$dir/spool")
    cat >"$conf" <<EOF
# Written by launch/slurm/local_cluster.sh: a one-node test cluster.
ClusterName=megarl-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
# Listen on the node's address (127.0.0.1 below), not on every interface.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SwitchType=switch/none
MpiDefault=none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
# Accept CPUs= above what slurmd detects (MEGARL_SLURM_CPUS on a small machine).
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=300
# Launch scripts derive ports from job ids: a random start keeps two test clusters on one
# machine from picking the same ones.
FirstJobId=$(( RANDOM * 30 + 1 ))
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

# munged with a fresh key, its socket inside the private directory (so only this user reaches
# it; --force accepts that the socket's directory is not world-searchable, which munged warns about).
start_munge() {
    local m=$dir/munge
    alive "$m/munged.pid" && return
    (umask 077 && mkdir -p "$m")
    if [[ ! -s $m/munge.key ]]; then
        (umask 077 && mungekey --create --keyfile="$m/munge.key" 2>/dev/null) ||
            (umask 077 && head -c 1024 /dev/urandom >"$m/munge.key") || die "cannot write a munge key in $m"
    fi
    chmod 0400 "$m/munge.key"
    munged --force --socket="$m/munge.socket" --key-file="$m/munge.key" --pid-file="$m/munged.pid" \
        --log-file="$m/munged.log" --seed-file="$m/munged.seed" || die "munged did not start; see $m/munged.log"
}

start() {
    [[ $(id -u) == 0 ]] || die "starting needs root (slurmd starts job steps as their users)"
    command -v slurmctld >/dev/null && command -v munged >/dev/null || die "Slurm or munge is not installed: $0 install"
    private_dir
    conf=$dir/slurm.conf
    if alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid"; then
        say "already running"
        echo "export MEGARL_SLURM_DIR=$dir SLURM_CONF=$conf"
        return
    fi
    start_munge
    local node cpus mem_mb
    node=${MEGARL_SLURM_NODE:-$(hostname -s)}
    # Jobs reach their first node by name (MASTER_ADDR); fall back to a name that always resolves.
    getent hosts "$node" >/dev/null || node=localhost
    cpus=${MEGARL_SLURM_CPUS:-$(nproc)}
    mem_mb=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
    write_conf "$node" "$cpus" "$mem_mb"
    slurmctld -f "$conf" || die "slurmctld did not start; see $dir/slurmctld.log"
    slurmd -f "$conf" -N "$node" || die "slurmd did not start; see $dir/slurmd.log"
    local state=""
    for _ in $(seq 1 60); do
        state=$(SLURM_CONF=$conf sinfo -h -N -n "$node" -o %T 2>/dev/null || true)
        [[ $state == idle* ]] && break
        sleep 0.5
    done
    if [[ $state != idle* ]]; then
        tail -n 5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
        stop >&2
        die "node $node did not come up (state '${state:-unknown}'); logs in $dir"
    fi
    say "node $node idle, $cpus CPUs, ports $port/$((port + 1)), munge socket $dir/munge/munge.socket"
    echo "export MEGARL_SLURM_DIR=$dir SLURM_CONF=$conf"
}

stop() {
    need_dir
    if [[ -f $conf ]] && alive "$dir/slurmctld.pid"; then
        local jobs
        jobs=$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086
            SLURM_CONF=$conf scancel $jobs 2>/dev/null || true
            for _ in $(seq 1 40); do
                [[ -z $(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null) ]] && break
                sleep 0.5
            done
        fi
    fi
    local name pid
    for name in slurmd slurmctld; do
        alive "$dir/$name.pid" || continue
        pid=$(cat "$dir/$name.pid")
        kill "$pid"
        for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        say "stopped $name ($pid)"
    done
    # Job steps outlive slurmd (when their jobs could not be cancelled): end the slurmstepd
    # processes of this cluster, known by their working directory or their open slurmd.log here,
    # together with the job processes under them.
    local cwd
    for pid in $(pgrep -x slurmstepd || true); do
        cwd=$(readlink "/proc/$pid/cwd" 2>/dev/null || true)
        if [[ $cwd == "$dir" || $cwd == "$dir"/* ]] || ls -l "/proc/$pid/fd" 2>/dev/null | grep -qF -- "$dir/slurmd.log"; then
            kill_tree "$pid" && say "stopped slurmstepd ($pid) and its job processes"
        fi
    done
    rm -f "$dir/slurmctld.pid" "$dir/slurmd.pid"
    if alive "$dir/munge/munged.pid"; then    # last: slurmd needs it to report its jobs' ends
        pid=$(cat "$dir/munge/munged.pid")
        kill "$pid"
        for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        say "stopped munged ($pid)"
    fi
    rm -f "$dir/munge/munged.pid"
}

status() {
    need_dir
    local name
    if alive "$dir/munge/munged.pid"; then say "munged running ($(cat "$dir/munge/munged.pid"))"; else say "munged not running"; fi
    for name in slurmctld slurmd; do
        if alive "$dir/$name.pid"; then say "$name running ($(cat "$dir/$name.pid"))"; else say "$name not running"; fi
    done
    if alive "$dir/slurmctld.pid"; then
        SLURM_CONF=$conf sinfo
        SLURM_CONF=$conf squeue
    fi
}

case ${1:-} in
    install | start | stop | status) "$1" ;;
    *) die "usage: $0 {install|start|stop|status}" ;;
esac
