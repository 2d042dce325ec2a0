#!/usr/bin/env bash
# A one-node Slurm on this machine, for CI and for trying launch/megarl.sbatch locally.
#
#   launch/ci/slurm_localhost.sh up       install slurm-wlm + munge if missing (apt), write a
#                                         private slurm.conf, start munged, slurmctld, slurmd,
#                                         and wait until the node is idle
#   launch/ci/slurm_localhost.sh down     stop the daemons this script started (munged too,
#                                         if `up` started it)
#   launch/ci/slurm_localhost.sh env      print `export SLURM_CONF=...` for sbatch/squeue/scontrol
#
# Needs root (it starts daemons and may apt-get install). The configuration lives in
# MEGARL_SLURM_DIR (default /var/lib/megarl-slurm), not in /etc/slurm, so a machine's own
# Slurm is never overwritten; clients find it through SLURM_CONF. The node is this host
# (`hostname -s`) with its real CPU count and memory. Jobs' processes are tracked with
# proctrack/cgroup where cgroup v1's freezer is mounted (Slurm then kills every process a
# job left behind, Ray's included), else proctrack/linuxproc.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/slurm_common.sh"

DIR=${MEGARL_SLURM_DIR:-/var/lib/megarl-slurm}
CONF=$DIR/slurm.conf
NODE=$(hostname -s)
CTLD_PORT=${MEGARL_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${MEGARL_SLURMD_PORT:-6818}
export SLURM_CONF=$CONF

die() { echo "slurm_localhost: $*" >&2; exit 1; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
    command -v apt-get >/dev/null || die "slurm-wlm/munge are missing and apt-get is not available"
    export DEBIAN_FRONTEND=noninteractive
    # Try the cached package lists first (fast); refresh them only if that fails.
    apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; } \
        || die "apt-get install slurm-wlm munge failed"
}

write_config() {
    mkdir -p "$DIR/spool/ctld" "$DIR/spool/d" "$DIR/log" "$DIR/run"
    local cpus mem_mib proctrack
    cpus=$(nproc --all)
    # RealMemory a little under MemTotal: slurmd drains a node reporting less than configured.
    mem_mib=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.95)}' /proc/meminfo)
    proctrack=$(cgroup_proctrack "$DIR" slurm_localhost.sh)
    cat > "$CONF" <<SLURM
# Written by launch/ci/slurm_localhost.sh: a one-node cluster on $NODE.
ClusterName=megarl-ci
SlurmctldHost=$NODE
SlurmUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
$(scheduling_settings "$DIR" "$proctrack")
NodeName=$NODE CPUs=$cpus RealMemory=$mem_mib State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
SLURM
}

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    [[ -s /etc/munge/munge.key ]] || { mungekey --create >/dev/null 2>&1 || create-munge-key -f; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    runuser -u munge -- munged
    touch "$DIR/run/munged.ours"  # started here: `down` stops it
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.2
    done
    die "munged did not start"
}

running() { [[ -s "$DIR/run/$1.pid" ]] && kill -0 "$(cat "$DIR/run/$1.pid")" 2>/dev/null; }

node_state() { sinfo -h -n "$NODE" -o %t 2>/dev/null | head -1; }

up() {
    [[ $EUID -eq 0 ]] || die "must run as root (it installs packages and starts daemons)"
    install_packages
    write_config
    start_munge
    running slurmctld || slurmctld -f "$CONF"
    running slurmd || slurmd -f "$CONF"
    local state=""
    for _ in $(seq 120); do
        state=$(node_state)
        case $state in
            idle|mix|alloc) echo "slurm_localhost: node $NODE is $state (SLURM_CONF=$CONF)"; return ;;
            down*|drain*) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    die "node $NODE not idle after 60 s (state '${state}'); see $DIR/log/"
}

stop_daemon() {
    local name=$1 pid
    running "$name" || return 0
    pid=$(cat "$DIR/run/$name.pid")
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
}

down() {
    stop_daemon slurmd
    stop_daemon slurmctld
    # munged only if `up` started it: a machine's own munged serves other users of munge.
    if [[ -f $DIR/run/munged.ours && -s /run/munge/munged.pid ]]; then
        kill -TERM "$(cat /run/munge/munged.pid)" 2>/dev/null || true
        rm -f "$DIR/run/munged.ours"
    fi
    echo "slurm_localhost: stopped"
}

case ${1:-} in
    up) up ;;
    down) down ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
