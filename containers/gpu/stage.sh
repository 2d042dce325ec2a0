#!/usr/bin/env bash
# Builds, on a machine with PyPI, what the bare GPU machine lacks (vLLM, Ray, megatron-core and
# vLLM's Python dependencies, for its Python 3.12 and torch 2.11.0+cu130), in pieces that each
# fit one device command (64 MiB with the working tree):
#   $STAGE/vllm.tar.xz  vLLM 0.26.0, megatron-core 0.16.1, vLLM's dependencies   (~55 MiB)
#   $STAGE/ray.tar.xz   Ray 2.60.0                                            (~30 MiB)
#   $STAGE/tokenizer/   SmolLM2's tokenizer files, for the runs' tiny models (~3.5 MiB)
# containers/gpu/smoke.sh unpacks them on the machine. What makes vLLM fit (~300 MiB as a wheel):
#   - only Hopper's device code: FlashAttention's two libraries (440 MiB) go, attention runs on
#     vLLM's Triton backend (VLLM_ATTENTION_BACKEND=TRITON_ATTN), and the other architectures'
#     SASS in vLLM's kernels is zeroed (containers/gpu/prune_fatbin.py), the two kernel libraries compress to 28 MiB instead of 63;
#   - vLLM's optional kernel packages, its Rust server binary, DeepGEMM's and CUTLASS's headers
#     (JIT only), mistral_common's tokenizer files and pycountry's translations are left out.
# Run from the repository root: bash containers/gpu/stage.sh   (STAGE defaults to .gpu_stage)
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=${STAGE:-.gpu_stage}
CACHE=${CACHE:-/tmp/megarl-gpu-wheels}
REQUIREMENTS=containers/gpu/requirements-stage.txt
PLATFORM=(--python-version 3.12 --implementation cp --only-binary=:all:)
for n in 17 24 26 27 28 31 34 35; do PLATFORM+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORM+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)

mkdir -p "$CACHE" "$STAGE"
python3 -m pip download -q --no-deps -d "$CACHE" "${PLATFORM[@]}" -r "$REQUIREMENTS"
site=$(mktemp -d)/site
trap 'rm -rf "$(dirname "$site")"' EXIT
python3 -m pip install -q --no-deps --no-compile --no-index --find-links "$CACHE" --target "$site" \
    "${PLATFORM[@]}" -r "$REQUIREMENTS"

rm -rf "$site"/bin \
    "$site"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$site"/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so \
    "$site"/vllm/vllm-rs "$site"/vllm/third_party/deep_gemm "$site"/vllm/third_party/fmha_sm100 \
    "$site"/mistral_common/data "$site"/pycountry/locales \
    "$site"/ray/jars "$site"/ray/dashboard/client/build/static/js/*.map
# vllm_flash_attn refuses to import without one of its libraries, and vLLM's model modules import it
# (for FlashAttention's helpers) whatever the attention backend: let it import, FA2/FA3 unavailable
python3 - "$site/vllm/vllm_flash_attn/__init__.py" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
guard = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError("
assert guard in text, "vllm_flash_attn's import guard moved: update containers/gpu/stage.sh"
open(path, "w").write(text.replace(guard, "if False:  # megarl's GPU stage: no FlashAttention, TRITON_ATTN\n    raise ImportError("))
EOF
# a dependency missing here shows on the machine only as an ImportError minutes into a run
python3 containers/gpu/missing_requirements.py "$site"
python3 containers/gpu/prune_fatbin.py --keep 90 \
    "$site"/vllm/_C_stable_libtorch.abi3.so "$site"/vllm/_moe_C_stable_libtorch.abi3.so

ray=(ray "$(cd "$site" && ls -d ray-*.dist-info)")
tar -C "$site" -cf - --exclude=./ray --exclude="./${ray[1]}" . | xz -8 -T0 > "$STAGE/vllm.tar.xz.partial"
tar -C "$site" -cf - "${ray[@]}" | xz -8 -T0 > "$STAGE/ray.tar.xz.partial"
mv "$STAGE/vllm.tar.xz.partial" "$STAGE/vllm.tar.xz"
mv "$STAGE/ray.tar.xz.partial" "$STAGE/ray.tar.xz"

# the tokenizer of the runs' tiny models (their weights are made on the machine)
python3 - "$STAGE/tokenizer" <<'EOF'
import shutil, sys
from pathlib import Path
from megarl.models.bundled import smollm2_path
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
for f in smollm2_path().iterdir():
    if f.is_file() and f.suffix not in (".safetensors", ".bin") and f.name != "config.json":
        shutil.copy(f, out / f.name)
EOF
ls -l "$STAGE"
