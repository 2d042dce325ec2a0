#!/usr/bin/env bash
# The RLHF pipeline on one machine: SFT -> reward model -> PPO, each stage a megarl command on
# the previous stage's output (model_configs/cpu_rlhf_{sft,rm,ppo}.yaml): a supervised stage
# leaves its last checkpoint at <output_dir>/final, which the next stage's recipe names.
# Usage: bash examples/rlhf_pipeline.sh                    (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
megarl sft model_configs/cpu_rlhf_sft.yaml
megarl rm model_configs/cpu_rlhf_rm.yaml
megarl train model_configs/cpu_rlhf_ppo.yaml
