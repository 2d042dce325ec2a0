#!/usr/bin/env bash
# GPU bring-up on a bare CUDA machine (PyTorch and NCCL, none of megatron-core, Ray, vLLM or
# Transformer Engine): installs the wheels carried in WHEELS (megatron-core for the machine's
# Python; see the README's GPU section for how to download them), then runs, each under its own
# time limit so one hang cannot eat the others' time:
#   1. the gpu-marked tests (`python -m pytest -q -m gpu tests`; what the machine lacks is skipped
#      with its name, and test modules that need Ray/vLLM/TRL fail to collect, listed as such)
#   2. `megarl bench mfu` on llama3.2-1b and llama3.2-3b (BF16, seq 4096, the platform's spec)
# Logs go to OUT (default /tmp/megarl-gpu). Run from the repository root:
#   WHEELS=.whl OUT=/tmp/out bash containers/gpu_bringup.sh
set -u
OUT=${OUT:-/tmp/megarl-gpu}
WHEELS=${WHEELS:-.whl}
TEST_LIMIT_S=${TEST_LIMIT_S:-300}
MFU_LIMIT_S=${MFU_LIMIT_S:-300}
MFU_ARGS=${MFU_ARGS:-}  # e.g. "--arch llama3.2-1b --micro-batch 2"
mkdir -p "$OUT"

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/megarl-site "$WHEELS"/*.whl || { echo "installing $WHEELS/*.whl failed"; exit 1; }
    export PYTHONPATH=/tmp/megarl-site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 - <<'EOF'
import importlib.util, sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}, gpus {torch.cuda.device_count()}")
for name in ("megatron.core", "transformers", "transformer_engine", "vllm", "ray", "apex"):
    found = importlib.util.find_spec(name) is not None
    version = getattr(__import__(name, fromlist=["_"]), "__version__", "?") if found else "missing"
    print(f"  {name}: {version}")
EOF
} 2>&1 | tee "$OUT/machine.txt"

echo "== python -m pytest -q -m gpu tests (limit ${TEST_LIMIT_S}s)"
timeout "$TEST_LIMIT_S" python3 -m pytest -q -m gpu tests -p no:cacheprovider --continue-on-collection-errors \
    -rs 2>&1 | tee "$OUT/pytest_gpu.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_gpu.log"

echo "== megarl bench mfu (limit ${MFU_LIMIT_S}s)"
timeout "$MFU_LIMIT_S" python3 -m megarl.cli.main bench mfu $MFU_ARGS --json >"$OUT/mfu.json" 2>"$OUT/mfu.err"
echo "bench exit: $?"
tail -5 "$OUT/mfu.err"
python3 - "$OUT/mfu.json" <<'EOF'
import json, sys
from megarl_bench.mfu import format_table
try:
    print(format_table(json.load(open(sys.argv[1]))))
except Exception as e:  # noqa: BLE001 - a failed run leaves no JSON; mfu.err says why
    print(f"no MFU table: {e}")
EOF
