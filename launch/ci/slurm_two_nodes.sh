#!/usr/bin/env bash
# A two-node Slurm on this machine, each node a Linux network namespace: for testing the
# multi-node path of launch/megarl.sbatch (tests/test_launch_two_nodes.py).
#
#   launch/ci/slurm_two_nodes.sh up            clean up an earlier run's leftovers, then create
#                                              the two nodes, a private munged, slurmctld and
#                                              one slurmd per node; wait until both are idle
#   launch/ci/slurm_two_nodes.sh down          kill every process in either node and every
#                                              daemon `up` started, delete the namespaces (and
#                                              their link); safe to run at any time, repeatedly
#   launch/ci/slurm_two_nodes.sh env           print `export SLURM_CONF=...`
#   launch/ci/slurm_two_nodes.sh exec CMD...   run CMD on node 1 (sbatch, squeue, scontrol,
#                                              scancel: Slurm's clients reach slurmctld only
#                                              from inside the nodes)
#
# The nodes: network namespaces megarl-n1 and megarl-n2, joined by one veth pair (an
# interface `megarl0` in each) on a private /24 (MEGARL_SLURM2_NET, default 10.231.0: node k
# is 10.231.0.k); loopback up, no route anywhere else. Every process of a node runs in its
# network namespace plus a UTS namespace (hostname megarl-nK) and a mount namespace where
# /etc/hosts maps megarl-n1/megarl-n2 to their addresses, so a node's hostname resolves to its
# own address as on a real cluster (Ray and gloo find a node's address through it). `nsenter
# --net` is used rather than `ip netns exec`, which remounts /sys and so hides the cgroup
# hierarchy that Slurm tracks jobs with.
#
# slurmctld runs on node 1, so nothing listens outside the namespaces; slurmd on each node.
# They use their own directory (MEGARL_SLURM2_DIR, default /var/lib/megarl-slurm2), ports
# (6827/6828, not the one-node script's 6817/6818), job ids (from 170001, told apart from the
# one-node cluster's at a glance), cgroups (Slurm names them after the node: slurm_megarl-nK)
# and their own munged (a private socket and key), so this cluster and
# launch/ci/slurm_localhost.sh's can run at the same time and stop independently.
# Needs root.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/slurm_common.sh"

DIR=${MEGARL_SLURM2_DIR:-/var/lib/megarl-slurm2}
CONF=$DIR/slurm.conf
NET=${MEGARL_SLURM2_NET:-10.231.0}
NODES=(megarl-n1 megarl-n2)  # namespace, hostname and Slurm node name alike
IFACE=megarl0
CTLD_PORT=${MEGARL_SLURM2_CTLD_PORT:-6827}
SLURMD_PORT=${MEGARL_SLURM2_SLURMD_PORT:-6828}
FIRST_JOB_ID=170001
MUNGE_DIR=$DIR/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
export SLURM_CONF=$CONF

die() { echo "slurm_two_nodes: $*" >&2; exit 1; }
say() { echo "slurm_two_nodes: $*"; }

addr() { echo "$NET.${1#megarl-n}"; }  # megarl-n2 -> 10.231.0.2

# Runs a command on a node: its network namespace, its hostname, its /etc/hosts.
on_node() {
    local node=$1
    shift
    nsenter --net="/run/netns/$node" unshare --mount --uts --propagation slave \
        sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' \
        sh "$DIR/hosts" "$node" "$@"
}

munge_ok() { munge -S "$MUNGE_SOCKET" -n </dev/null 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }

check_tools() {
    [[ $EUID -eq 0 ]] || die "must run as root (it creates network namespaces and starts daemons)"
    local tool
    for tool in ip nsenter unshare slurmctld slurmd munged mungekey munge sinfo; do
        command -v "$tool" >/dev/null || die "$tool is not installed (apt-get install iproute2 util-linux slurm-wlm munge)"
    done
}

make_nodes() {
    local node
    for node in "${NODES[@]}"; do ip netns add "$node"; done
    # one veth pair straight between the two namespaces: nothing of it in the root namespace
    ip link add "$IFACE" netns "${NODES[0]}" type veth peer name "$IFACE" netns "${NODES[1]}"
    for node in "${NODES[@]}"; do
        ip -n "$node" link set lo up
        ip -n "$node" addr add "$(addr "$node")/24" dev "$IFACE"
        ip -n "$node" link set "$IFACE" up
    done
    {
        echo "127.0.0.1 localhost"
        for node in "${NODES[@]}"; do echo "$(addr "$node") $node"; done
    } > "$DIR/hosts"
}

start_munge() {
    # A munged of our own: the one-node script stops the machine's munged if it started it,
    # which would cut this cluster off mid-test.
    mkdir -p "$MUNGE_DIR"
    [[ -s $MUNGE_DIR/munge.key ]] || mungekey --create --keyfile="$MUNGE_DIR/munge.key" >/dev/null
    chown -R munge:munge "$MUNGE_DIR"
    chmod 755 "$MUNGE_DIR"
    chmod 400 "$MUNGE_DIR/munge.key"
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed"
    for _ in $(seq 50); do munge_ok && return; sleep 0.2; done
    die "munged did not start (see $MUNGE_DIR/munged.log)"
}

write_config() {
    local cpus mem_mib proctrack node
    cpus=$(nproc --all)
    # both nodes are this machine: each gets half of its memory, a little under MemTotal/2
    mem_mib=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.45)}' /proc/meminfo)
    proctrack=$(cgroup_proctrack "$DIR" slurm_two_nodes.sh)
    cat > "$CONF" <<SLURM
# Written by launch/ci/slurm_two_nodes.sh: two nodes, each a network namespace of this machine.
ClusterName=megarl-ci2
SlurmctldHost=${NODES[0]}($(addr "${NODES[0]}"))
SlurmUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
FirstJobId=$FIRST_JOB_ID
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d-%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
$(scheduling_settings "$DIR" "$proctrack")
# a node whose slurmd stops answering is set DOWN (and its jobs ended) after this many seconds
SlurmdTimeout=20
SLURM
    for node in "${NODES[@]}"; do
        echo "NodeName=$node NodeAddr=$(addr "$node") CPUs=$cpus RealMemory=$mem_mib State=UNKNOWN" >> "$CONF"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
}

wait_idle() {
    local states="" node
    for _ in $(seq 120); do
        states=$(on_node "${NODES[0]}" sinfo -h -N -o '%N=%t' 2>/dev/null | sort -u | tr '\n' ' ' || true)
        local ready=0
        for node in "${NODES[@]}"; do
            [[ " $states" =~ \ $node=(idle|mix|alloc)\  ]] && ready=$((ready + 1))
            [[ " $states" =~ \ $node=(down|drain) ]] && \
                on_node "${NODES[0]}" scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
        done
        if [[ $ready -eq ${#NODES[@]} ]]; then
            say "nodes up: $states(slurmctld $(addr "${NODES[0]}"):$CTLD_PORT, SLURM_CONF=$CONF)"
            return
        fi
        sleep 0.5
    done
    die "nodes not idle after 60 s (${states:-no answer from slurmctld}); see $DIR/log/"
}

up() {
    check_tools
    down >/dev/null
    mkdir -p "$DIR"
    # a clean slate: no jobs recovered from an earlier cluster's state, fresh logs
    rm -rf "$DIR/spool" "$DIR/log" "$DIR/run"
    mkdir -p "$DIR/spool/ctld" "$DIR/log" "$DIR/run"
    for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/d-$node"; done
    # whatever fails from here on (a command, or die), nothing of the half-made cluster stays
    trap 'rc=$?; if [[ $rc -ne 0 ]]; then echo "slurm_two_nodes: up failed: cleaning up" >&2; down >&2; fi' EXIT
    make_nodes
    start_munge
    write_config
    on_node "${NODES[0]}" slurmctld -f "$CONF"
    local node
    for node in "${NODES[@]}"; do on_node "$node" slurmd -f "$CONF" -N "$node"; done
    wait_idle
    trap - EXIT
}

# TERM, then KILL after a grace period, every pid given that is still alive.
kill_all() {
    [[ $# -gt 0 ]] || return 0
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 50); do
        local alive=()
        for p in "$@"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
        [[ ${#alive[@]} -eq 0 ]] && return 0
        sleep 0.1
    done
    kill -KILL "$@" 2>/dev/null || true
}

down() {
    local node pids=() pid
    set +e
    for node in "${NODES[@]}"; do
        [[ -e /run/netns/$node ]] && pids+=($(ip netns pids "$node" 2>/dev/null))
    done
    # daemons `up` started outside the namespaces, or that a failed `up` left in the root one
    for pid in "$DIR"/run/*.pid "$MUNGE_DIR/munged.pid"; do
        [[ -s $pid ]] && pids+=("$(cat "$pid")")
    done
    kill_all "${pids[@]}"
    for node in "${NODES[@]}"; do
        # anything that entered a namespace while the first ones were stopping
        [[ -e /run/netns/$node ]] && { kill -KILL $(ip netns pids "$node") 2>/dev/null; ip netns del "$node"; }
    done
    ip link del "$IFACE" 2>/dev/null  # only if a failed `up` left it in the root namespace
    rm -f "$DIR"/run/*.pid "$MUNGE_DIR/munged.pid" "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    # the nodes' cgroups (proctrack/cgroup: slurm_<node>/uid_*/job_*), left when a node was
    # killed with its jobs running; empty ones only, the machine's other Slurms have their own
    for node in "${NODES[@]}"; do
        find /sys/fs/cgroup/*/"slurm_$node" -depth -type d -exec rmdir {} + 2>/dev/null
    done
    set -e
    say "down: no namespace, link or daemon of this cluster left"
}

case ${1:-} in
    up) up ;;
    down) down ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    exec) shift; [[ $# -gt 0 ]] || die "exec needs a command"; on_node "${NODES[0]}" "$@" ;;
    *) echo "usage: $0 up|down|env|exec CMD..." >&2; exit 2 ;;
esac
