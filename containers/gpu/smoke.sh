#!/usr/bin/env bash
# megarl's rollout path on a bare single-GPU machine (CUDA, Python 3.12, torch 2.11; no vLLM, Ray
# or megatron-core), in two commands that follow each other while the machine stays warm, each
# carrying one piece that containers/gpu/stage.sh built:
#   bash containers/gpu/smoke.sh engine   # carry .gpu_stage/vllm.tar.xz: probe, ipc, engine, fp8, r3
#   bash containers/gpu/smoke.sh ray      # carry .gpu_stage/ray.tar.xz and .gpu_stage/tokenizer:
#                                         # colocated GRPO in bf16 and with FP8 rollout, the gpu-marked tests
# Naming steps after the part runs only those (e.g. `smoke.sh engine engine`, then
# `smoke.sh ray grpo r3 fp8`: engine steps named in the ray part run there, after the runs).
# Unpacked packages stay in /tmp/megarl-site between commands. Every step runs under its own time
# limit; each appends a JSON line to $OUT/summary.jsonl (containers/gpu/smoke_steps.py), and the
# output of all goes to $OUT/<part>.log. Run from the repository root.
set -u
PART=${1:?usage: smoke.sh engine|ray}
OUT=${OUT:-/tmp/megarl-gpu-out}
STAGE=${STAGE:-.gpu_stage}
SITE=/tmp/megarl-site
mkdir -p "$OUT" "$SITE"
LOG="$OUT/$PART.log"
# vLLM's Triton attention and PyTorch sampling (the staged build carries neither FlashAttention nor
# FlashInfer, whose sampler vLLM's V2 model runner imports unless told not to); callables through
# collective_rpc (the steps ask the workers which model runner they run)
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    VLLM_ATTENTION_BACKEND=TRITON_ATTN VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ALLOW_INSECURE_SERIALIZATION=1 RAY_ADDRESS= \
    OUT SMOKE_TOKENIZER=$STAGE/tokenizer
export PATH=$SITE/bin:$PATH

unpack() {  # $1: a piece of the stage
    [ -f "$STAGE/$1" ] || { echo "$STAGE/$1 was not carried" | tee -a "$LOG"; return 1; }
    local t0=$SECONDS
    xz -dc -T0 "$STAGE/$1" | tar -C "$SITE" -xf - && echo "unpacked $1 in $((SECONDS - t0)) s" | tee -a "$LOG"
}

step() {  # $1: limit in seconds, $2...: the step and its arguments
    local limit=$1 t0=$SECONDS
    shift
    echo "== $* (limit ${limit}s)" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "== $* exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
    [ $rc -eq 124 ] && echo "{\"step\": \"$*\", \"ok\": false, \"error\": \"timed out after ${limit} s\"}" >>"$OUT/summary.jsonl"
    # what a killed step left behind must not starve the next one of GPU memory
    pkill -9 -f "VLLM::" 2>/dev/null; pkill -9 -f "ray::" 2>/dev/null
    pkill -9 -f raylet 2>/dev/null; pkill -9 -f gcs_server 2>/dev/null
    return 0
}

S="python3 containers/gpu/smoke_steps.py"
shift
STEPS="$*"  # optional: only these steps of the part (e.g. "engine fp8"); all by default
wanted() { [ -z "$STEPS" ] || [[ " $STEPS " == *" $1 "* ]]; }
case $PART in
engine)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
    unpack vllm.tar.xz || exit 1
    for s in probe ipc engine fp8 r3; do
        if wanted "$s"; then
            case $s in probe) l=60 ;; ipc) l=45 ;; engine) l=180 ;; *) l=150 ;; esac
            step $l $S "$s"
        fi
    done
    ;;
ray)
    [ -d "$SITE/vllm" ] || { echo "vLLM is not unpacked: run 'smoke.sh engine' first (same warm machine)"; exit 1; }
    unpack ray.tar.xz || exit 1
    # the runs need the engine that the engine part started; without one they would fail the same way,
    # unless they are named (a short session can skip the engine step and go straight to the runs).
    # vLLM's first start on a fresh machine takes ~75 s of the run (imports, two spawned processes,
    # Triton's kernels compiled at the first generate).
    if [ -n "$STEPS" ] || grep -q '"step": "engine", "ok": true' /tmp/megarl-smoke/summary.jsonl 2>/dev/null; then
        if wanted grpo; then
            GRPO_NAME=grpo_bf16 GRPO_LIMIT_S=$((${GRPO_S:-240} - 10)) step "${GRPO_S:-240}" $S grpo
        fi
        if wanted grpo_fp8; then
            GRPO_NAME=grpo_fp8 GRPO_ARGS="rollout.weights=fp8 trainer.verify_sync=never" GRPO_LIMIT_S=$((${GRPO_FP8_S:-200} - 10)) \
                step "${GRPO_FP8_S:-200}" $S grpo
        fi
    else
        echo "no GRPO runs: the engine step did not pass" | tee -a "$LOG"
    fi
    for s in r3 fp8; do  # engine steps put off to this part
        [ -n "$STEPS" ] && wanted "$s" && step 60 $S "$s"
    done
    if wanted pytest; then
        step 130 python3 -m pytest -v -rA -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 100
    fi
    ;;
*) echo "unknown part $PART (engine | ray)"; exit 2 ;;
esac
echo "== summary" | tee -a "$LOG"
cat "$OUT/summary.jsonl"
