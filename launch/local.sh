#!/usr/bin/env bash
# megarl on one machine through a Ray head of its own, the way a cluster job runs it:
# starts `ray start --head` here, waits for it, runs `megarl train` joined to it
# (RAY_ADDRESS), and stops that Ray on exit, error or Ctrl-C.
#
#   launch/local.sh RECIPE.yaml [dotted.override=value ...]
#
# (`megarl train` alone also works on one machine: it starts a private Ray in-process.
# This script is for a Ray that outlives the driver's imports, to watch with `ray status`,
# or to rehearse the Slurm launcher without Slurm.)
#
# Variables: MEGARL_RAY_CPUS (logical CPUs, default max(16, cores): placement asks one per
# rank), MEGARL_GPUS (default: every GPU Ray detects), MEGARL_RAY_PORT (default 6390),
# MEGARL_RAY_OBJECT_STORE_MIB (default 512). Only this script's own Ray is stopped, not
# other Ray instances on the machine.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { echo "megarl-local [$(date +%H:%M:%S)]: $*"; }
die() { echo "megarl-local: error: $*" >&2; exit 2; }
case ${1:-} in
    ""|-h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; [[ -n ${1:-} ]] && exit 0 || exit 2 ;;
esac
RECIPE=$1
shift
[[ -f $RECIPE ]] || die "recipe $RECIPE: no such file"
command -v megarl >/dev/null || die "megarl is not installed: activate its virtualenv"
megarl train "$RECIPE" "$@" --check >/dev/null || die "the recipe did not validate (see above)"

CORES=$(nproc)
CPUS=${MEGARL_RAY_CPUS:-$((CORES > 16 ? CORES : 16))}
PORT=${MEGARL_RAY_PORT:-6390}
OPTS=(--head --block --port="$PORT" --node-ip-address=127.0.0.1 --num-cpus="$CPUS" --include-dashboard=false
      --disable-usage-stats --object-store-memory=$((${MEGARL_RAY_OBJECT_STORE_MIB:-512} * 1024 * 1024)))
[[ -n ${MEGARL_GPUS:-} ]] && OPTS+=(--num-gpus="$MEGARL_GPUS")
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export RAY_AUTH_TOKEN
export RAY_ADDRESS=127.0.0.1:$PORT

RAY_PID="" DRIVER=""
cleanup() {
    local rc=$?
    trap - EXIT TERM INT
    set +e  # stop everything even if a step of the cleanup fails
    [[ -n $DRIVER ]] && kill -TERM "$DRIVER" 2>/dev/null && wait "$DRIVER" 2>/dev/null
    if [[ -n $RAY_PID ]]; then
        # `ray start --block` stops its own node's processes on SIGTERM (unlike `ray stop`,
        # which would stop every Ray of this user on the machine).
        kill -TERM "$RAY_PID" 2>/dev/null && wait "$RAY_PID" 2>/dev/null
        log "Ray stopped"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'log "signal received: stopping"; exit 143' TERM INT

log "Ray head at $RAY_ADDRESS with $CPUS logical CPUs"
ray start "${OPTS[@]}" >/dev/null 2>&1 &
RAY_PID=$!
python "$HERE/wait_for_ray.py" --nodes 1 --cpus-per-node "$CPUS" --timeout 120
log "megarl train $RECIPE $*"
megarl train "$RECIPE" "$@" &
DRIVER=$!
set +e
wait "$DRIVER"
RC=$?
set -e
DRIVER=""
log "megarl train exited with $RC"
exit "$RC"
