#!/usr/bin/env bash
# Builds and runs the sbatch command line for a megarl run (launch/megarl.sbatch).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
usage() {
    cat <<USAGE
usage: launch/submit.sh [options] RECIPE.yaml [dotted.override=value ...]

Submits launch/megarl.sbatch: Ray over the allocation's nodes, then \`megarl train\` with the
recipe and overrides. The recipe is validated here first (\`megarl train --check\`), so a bad
override fails before anything is queued.

allocation:
  --nodes N               nodes (default 1)
  --gpus-per-node G       GPUs per node, requested with --gpus-per-node and declared to Ray
                          (default 0: a CPU run)
  --ray-cpus-per-node C   logical CPUs each Ray node declares (default: the node's CPUs);
                          a CPU-only run on a small node needs ~16
  --partition P, --account A, --time T, --job-name NAME
  --sbatch-arg ARG        any other sbatch option, repeatable (e.g. --sbatch-arg=--qos=high)
software (one of):
  --venv PATH             virtualenv to activate on the nodes (default: the active one)
  --image IMAGE           container image: pyxis/enroot (e.g. nvcr.io#org/megarl:tag) or,
                          with --runtime apptainer, a .sif file
  --runtime R             pyxis (default) | apptainer
  --mounts SRC:DST[,...]  extra container mounts (the submit directory is always mounted)
  --setup CMD             shell code run first in the job, e.g. "module load cuda/13.0"
other:
  --no-check              skip the local \`megarl train --check\`
  --dry-run               print the command (environment assignments + sbatch ...) and exit,
                          without checking the recipe
  -h, --help              this text

Environment such as HF_HOME, WANDB_API_KEY and NCCL_* is passed on to the job as it is.
The job writes OUTPUT_DIR/logs/slurm-JOBID.log besides Slurm's own output file.

example:
  launch/submit.sh --nodes 4 --gpus-per-node 8 --image nvcr.io#me/megarl:0.1 \\
      model_configs/smollm2_135m_cpu.yaml actor.parallel.tp=2 trainer.steps=100
USAGE
}
die() { echo "submit.sh: error: $*" >&2; exit 2; }
need() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value"; }
positive_int() { [[ $2 =~ ^[0-9]+$ && $2 -ge $3 ]] || die "$1 must be an integer >= $3, got '$2'"; }

NODES=1 GPUS=0 RAY_CPUS="" PARTITION="" ACCOUNT="" TIME="" JOB_NAME=megarl
VENV=${VIRTUAL_ENV:-} IMAGE="" RUNTIME=pyxis MOUNTS="" SETUP="" CHECK=1 DRY_RUN=0
EXTRA=()
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --nodes) need "$@"; NODES=$2; shift 2 ;;
        --gpus-per-node) need "$@"; GPUS=$2; shift 2 ;;
        --ray-cpus-per-node) need "$@"; RAY_CPUS=$2; shift 2 ;;
        --partition) need "$@"; PARTITION=$2; shift 2 ;;
        --account) need "$@"; ACCOUNT=$2; shift 2 ;;
        --time) need "$@"; TIME=$2; shift 2 ;;
        --job-name) need "$@"; JOB_NAME=$2; shift 2 ;;
        --sbatch-arg) need "$@"; EXTRA+=("$2"); shift 2 ;;
        --sbatch-arg=*) EXTRA+=("${1#--sbatch-arg=}"); shift ;;
        --venv) need "$@"; VENV=$2; shift 2 ;;
        --image) need "$@"; IMAGE=$2; shift 2 ;;
        --runtime) need "$@"; RUNTIME=$2; shift 2 ;;
        --mounts) need "$@"; MOUNTS=$2; shift 2 ;;
        --setup) need "$@"; SETUP=$2; shift 2 ;;
        --no-check) CHECK=0; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[[ $# -ge 1 ]] || die "no recipe given (see --help)"
RECIPE=$1
shift
[[ -f $RECIPE ]] || die "recipe $RECIPE: no such file"
for o in "$@"; do [[ $o == *=* ]] || die "override '$o' is not key=value"; done
positive_int --nodes "$NODES" 1
positive_int --gpus-per-node "$GPUS" 0
[[ -z $RAY_CPUS ]] || positive_int --ray-cpus-per-node "$RAY_CPUS" 1
[[ $RUNTIME == pyxis || $RUNTIME == apptainer ]] || die "--runtime must be pyxis or apptainer, got '$RUNTIME'"
[[ -z $IMAGE || $RUNTIME == pyxis || -f $IMAGE ]] || die "--image $IMAGE: no such .sif file"
[[ -z $VENV || -n $IMAGE || -f $VENV/bin/activate ]] || die "--venv $VENV has no bin/activate"

ENVS=(MEGARL_LAUNCH_DIR="$HERE" MEGARL_GPUS_PER_NODE="$GPUS")
[[ -n $RAY_CPUS ]] && ENVS+=(MEGARL_RAY_CPUS_PER_NODE="$RAY_CPUS")
[[ -n $SETUP ]] && ENVS+=(MEGARL_SETUP="$SETUP")
if [[ -n $IMAGE ]]; then
    ENVS+=(MEGARL_CONTAINER_IMAGE="$IMAGE" MEGARL_CONTAINER_RUNTIME="$RUNTIME")
    [[ -n $MOUNTS ]] && ENVS+=(MEGARL_CONTAINER_MOUNTS="$MOUNTS")
elif [[ -n $VENV ]]; then
    ENVS+=(MEGARL_VENV="$(cd "$VENV" && pwd)")
fi
CMD=(sbatch --parsable --nodes="$NODES" --ntasks-per-node=1 --job-name="$JOB_NAME")
[[ $GPUS -gt 0 ]] && CMD+=(--gpus-per-node="$GPUS")
[[ -n $PARTITION ]] && CMD+=(--partition="$PARTITION")
[[ -n $ACCOUNT ]] && CMD+=(--account="$ACCOUNT")
[[ -n $TIME ]] && CMD+=(--time="$TIME")
CMD+=(${EXTRA[@]+"${EXTRA[@]}"} "$HERE/megarl.sbatch" "$RECIPE" "$@")

if [[ $DRY_RUN == 1 ]]; then
    printf '%q ' env "${ENVS[@]}" "${CMD[@]}"
    echo
    exit 0
fi
if [[ $CHECK == 1 && -z $IMAGE ]]; then
    command -v megarl >/dev/null || die "megarl is not installed here: activate its venv or pass --no-check"
    megarl train "$RECIPE" "$@" --check >/dev/null || die "the recipe did not validate (see above)"
fi
env "${ENVS[@]}" "${CMD[@]}"
