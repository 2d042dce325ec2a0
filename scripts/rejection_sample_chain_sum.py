"""The distillation recipe's teacher data: SmolLM2-135M-Instruct's own correct answers to reasoning-gym
chain_sum training questions (rejection sampling), as SFT records {"prompt", "response"}.

A teacher fine-tuned on these keeps the student's answer format, so on-policy distillation
(model_configs/cpu_opd.yaml) teaches the sums rather than a new format. Training questions use seed
7; the recipes' held-out questions use seed 100000.

    python scripts/rejection_sample_chain_sum.py runs/cpu-opd-teacher-data.jsonl
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--questions", type=int, default=512)
    parser.add_argument("--samples", type=int, default=4,
                        help="answers sampled per question; the first correct one is kept")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import reasoning_gym
    from vllm import LLM, SamplingParams

    from megarl.models.bundled import smollm2_path
    from megarl.rewards.extract import last_number

    data = reasoning_gym.create_dataset("chain_sum", size=args.questions, seed=7, min_terms=2, max_terms=2,
                                        min_digits=1, max_digits=1)
    entries = list(data)
    llm = LLM(model=str(smollm2_path()), dtype="bfloat16", max_model_len=512, max_num_seqs=64, seed=0)
    outs = llm.chat([[{"role": "user", "content": e["question"]}] for e in entries],
                    SamplingParams(n=args.samples, temperature=1.0, max_tokens=64, seed=0))
    kept = 0
    with open(args.out, "w") as f:
        for entry, out in zip(entries, outs, strict=True):
            for sample in out.outputs:
                answer = last_number(sample.text)
                if sample.finish_reason == "stop" and answer is not None and data.score_answer(answer, entry) >= 1.0:
                    f.write(json.dumps({"prompt": entry["question"], "response": sample.text.strip()}) + "\n")
                    kept += 1
                    break
    print(f"{args.out}: {kept} of {len(entries)} questions answered correctly")


if __name__ == "__main__":
    main()
