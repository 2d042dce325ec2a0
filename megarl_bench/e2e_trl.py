"""TRL's side of ``megarl bench e2e``: the same GRPO run through TRL's ``GRPOTrainer``.

Everything TRL is told comes from the megarl recipe, so the two runs differ only in
the system: the same HF folder, the same prompts in the same order (the prompt list
megarl's own data pipeline serves, fed to TRL unshuffled), the same chat template,
group size, prompts per step, response length, sampling, learning rate, KL
coefficient (k3 in the loss, as megarl), clipping, token-mean loss and reward
(megarl's :class:`~megarl.rewards.combined.RunReward`, so both score identically).

TRL generates with transformers' ``generate`` (``use_vllm=False``): TRL's vLLM mode
needs CUDA. Importing this module imports nothing heavy; ``run_trl`` imports TRL.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megarl.config.schema import RunConfig
from megarl_bench.e2e_records import StepRecord, SystemResult

# megarl's algorithm options that TRL's GRPOTrainer has no counterpart for here.
_UNSUPPORTED = {
    "algorithm.kl_in_reward": (lambda a: a.kl_in_reward, "TRL puts the KL term in the loss only"),
    "algorithm.dual_clip": (lambda a: a.dual_clip is not None, "TRL's GRPO has no dual clip"),
    "algorithm.entropy_coef": (lambda a: a.entropy_coef != 0.0, "kept at 0 for a like-for-like loss"),
    "algorithm.dynamic_sampling": (lambda a: a.dynamic_sampling, "TRL does not drop uniform groups"),
    "algorithm.overlong_buffer": (lambda a: a.overlong_buffer > 0, "no overlong penalty in TRL's GRPO"),
    "algorithm.minibatches": (lambda a: a.minibatches != 1, "one optimizer step per rollout batch only"),
}


def grpo_settings(cfg: RunConfig, steps: int, output_dir: str | Path, cpu: bool = True) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments equivalent to ``cfg``'s GRPO run, or a ValueError
    naming each recipe field that has no TRL equivalent.

    One optimizer step per rollout batch, as megarl: TRL generates
    ``generation_batch_size = per_device_train_batch_size * gradient_accumulation_steps``
    completions at once (prompts_per_step x n) and steps the optimizer once after
    accumulating them in micro-batches of the actor's ``micro_batch_size``.
    """
    a, r, o = cfg.algorithm, cfg.rollout, cfg.actor.optim
    errors = []
    if a.name != "grpo":
        errors.append(f"algorithm.name={a.name!r}: the TRL comparison runs GRPO only")
    if a.kl_coef > 0 and a.kl_estimator != "k3":
        errors.append(f"algorithm.kl_estimator={a.kl_estimator!r}: TRL's GRPO uses k3")
    if a.aggregation != "token-mean":
        errors.append(f"algorithm.aggregation={a.aggregation!r}: only token-mean maps to TRL (loss_type='dapo')")
    errors += [f"{name}: {why}" for name, (active, why) in _UNSUPPORTED.items() if active(a)]
    if cfg.critic is not None or cfg.reward_model is not None:
        errors.append("critic / reward_model: the TRL comparison uses rule/remote rewards only")
    if any(t.kind == "model" for t in cfg.rewards):
        errors.append("rewards: a 'model' term needs megarl's reward-model group; TRL's side cannot score it")
    if cfg.actor.parallel.ranks != 1:
        errors.append(f"actor.parallel: {cfg.actor.parallel.ranks} ranks; the TRL comparison is single-process")
    batch = cfg.data.prompts_per_step * r.n
    micro = cfg.actor.micro_batch_size
    if batch % micro:
        errors.append(f"actor.micro_batch_size={micro} must divide prompts_per_step x n = {batch}")
    if cfg.actor.precision.dtype not in ("float32", "bfloat16"):
        errors.append(f"actor.precision.dtype={cfg.actor.precision.dtype!r}: use float32 or bfloat16")
    if steps < 1:
        errors.append(f"steps={steps} must be >= 1")
    if errors:
        raise ValueError("recipe not comparable with TRL's GRPOTrainer: " + "; ".join(errors))
    return dict(
        output_dir=str(output_dir),
        max_steps=steps,
        seed=cfg.seed,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_generations=r.n,
        num_iterations=a.ppo_epochs,
        max_completion_length=r.max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=max(r.top_k, 0),  # megarl/vLLM -1 and TRL 0 both mean "no top-k"
        learning_rate=o.lr,
        lr_scheduler_type="constant_with_warmup" if o.warmup_steps else "constant",
        warmup_steps=o.warmup_steps,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_epsilon=o.adam_eps,
        max_grad_norm=o.clip_grad,
        beta=a.kl_coef,
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        loss_type="dapo",  # token-mean over the whole accumulated batch, as megarl's global denominators
        scale_rewards="group" if a.norm_std else "none",
        model_init_kwargs={"dtype": cfg.actor.precision.dtype},
        bf16=cfg.actor.precision.dtype == "bfloat16",
        fp16=False,
        use_cpu=cpu,
        use_vllm=False,  # TRL's vLLM mode needs CUDA
        gradient_checkpointing=False,  # GRPOConfig turns it on by default; megarl does not recompute
        shuffle_dataset=False,  # the prompts arrive already in megarl's order
        remove_unused_columns=False,  # the reward reads the item_index column
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def bench_prompts(cfg: RunConfig, steps: int) -> list:
    """The prompt items megarl's run serves in its first ``steps`` steps, in order."""
    from megarl.data.prompts import prompt_dataset

    dataset = prompt_dataset(cfg.data)  # the stream megarl's loop draws from
    return [item for _ in range(steps) for item in dataset.next_batch()]


def _completion_text(completion: Any) -> str:
    # chat prompts give [{"role": "assistant", "content": text}]; plain prompts give text
    return completion[-1]["content"] if isinstance(completion, list) else completion


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids TRL's generation gets (it tokenizes inside apply_chat_template)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def run_trl(cfg: RunConfig, steps: int, output_dir: Path, progress=print) -> SystemResult:
    """Trains ``steps`` GRPO steps with TRL in this process and times each optimizer step."""
    started = time.perf_counter()
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")  # vLLM is unused here
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.data.tokenize import encode_prompt
    from megarl.rewards.base import RewardInput
    from megarl.rewards.combined import RunReward
    from megarl.trainer.run import hf_folder

    settings = grpo_settings(cfg, steps, output_dir, cpu=not torch.cuda.is_available())
    model_dir = hf_folder(cfg.actor.model.path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    items = bench_prompts(cfg, steps)
    if any(item.messages is None for item in items):
        raise ValueError("the TRL comparison needs chat prompts (reasoning_gym sources give them)")
    # TRL has no prompt truncation: the prompts must fit as they are, as they do in megarl's run
    same_ids = 0
    for index, item in enumerate(items):
        ids = _chat_ids(tokenizer, item.messages)
        if len(ids) > cfg.data.max_prompt_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens > data.max_prompt_len {cfg.data.max_prompt_len}")
        same_ids += ids == encode_prompt(tokenizer, item)
    reward = RunReward(cfg.rewards)
    timer = _StepTimer(TrainerCallback)

    def megarl_reward(prompts, completions, completion_ids, item_index, **_) -> list[float]:
        inputs = [RewardInput(prompt=tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False),
                              response=_completion_text(c), metadata=items[i].metadata)
                  for p, c, i in zip(prompts, completions, item_index, strict=True)]
        scores, _parts = reward.score(inputs)
        timer.generated(sum(len(ids) for ids in completion_ids), float(scores.mean()))
        return scores.tolist()

    dataset = Dataset.from_list([{"prompt": item.messages, "item_index": i} for i, item in enumerate(items)])
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=megarl_reward, args=GRPOConfig(**settings),
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[timer.callback])
    progress(f"TRL {trl.__version__}: GRPOTrainer built in {time.perf_counter() - started:.1f} s; "
             f"{steps} steps of {len(items) // steps} prompts x {settings['num_generations']}")
    trainer.train()
    total = time.perf_counter() - started
    records = timer.records()
    batch = cfg.data.prompts_per_step * cfg.rollout.n
    logged = [round(mean * batch) for mean in timer.logged_mean_lengths]
    notes = [f"TRL {trl.__version__} GRPOTrainer, transformers generate (use_vllm=False: TRL's vLLM mode needs CUDA)",
             f"prompt ids identical to megarl's for {same_ids}/{len(items)} prompts",
             "completion tokens agree with TRL's logged completions/mean_length x completions: "
             + ("yes" if logged == [s.tokens for s in records] else f"NO (logged {logged})")]
    return SystemResult(system=f"TRL {trl.__version__} (HF generate)", steps=records,
                        overhead_s=total - sum(s.seconds for s in records), samples_per_step=batch, notes=notes,
                        startup_s=timer.first_began - started)  # its imports included, as megarl's


def run_trl_process(cfg: RunConfig, steps: int, output_dir: Path, threads: int, quiet: bool = False) -> SystemResult:
    """:func:`run_trl` in a fresh process: torch there reads the OpenMP settings of this
    process's environment (this one imported torch before the bench could set them) and
    TRL shares nothing with megarl's driver. ``quiet`` sends its stdout to stderr."""
    import multiprocessing

    output_dir.mkdir(parents=True, exist_ok=True)
    result_path = output_dir / "bench_result.json"
    result_path.unlink(missing_ok=True)
    started = time.perf_counter()
    process = multiprocessing.get_context("spawn").Process(
        target=_trl_child, args=(cfg, steps, str(output_dir), threads, quiet, str(result_path)), name="trl-bench")
    process.start()
    process.join()
    total = time.perf_counter() - started
    if process.exitcode != 0 or not result_path.is_file():
        raise RuntimeError(f"the TRL run failed (exit code {process.exitcode}); its traceback is above")
    data = json.loads(result_path.read_text())
    records = [StepRecord(**s) for s in data["steps"]]
    # start-up counts from the parent's side: process start and imports included
    return SystemResult(system=data["system"], steps=records, overhead_s=total - sum(s.seconds for s in records),
                        samples_per_step=data["samples_per_step"], notes=data["notes"], startup_s=data["startup_s"])


def _trl_child(cfg: RunConfig, steps: int, output_dir: str, threads: int, quiet: bool, result_path: str) -> None:
    if quiet:
        os.dup2(2, 1)  # --json: stdout carries only the report
    import torch

    torch.set_num_threads(threads)
    result = run_trl(cfg, steps, Path(output_dir))
    Path(result_path).write_text(json.dumps(asdict(result)))


class _StepTimer:
    """Times optimizer steps (on_step_begin .. on_step_end: generation, reward, reference,
    forward/backward of every micro-batch and the optimizer step) and collects what the
    reward function saw. TRL generates once per optimizer step here, so the k-th reward
    call belongs to the k-th step."""

    def __init__(self, callback_base: type):
        timer = self
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self.rewards: list[float] = []
        self.logged_mean_lengths: list[float] = []
        self._began = 0.0
        self.first_began = 0.0  # when the first step started

        class Callback(callback_base):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._began = time.perf_counter()
                timer.first_began = timer.first_began or timer._began

            def on_step_end(self, args, state, control, **kwargs):
                timer.seconds.append(time.perf_counter() - timer._began)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "completions/mean_length" in logs:
                    timer.logged_mean_lengths.append(float(logs["completions/mean_length"]))

        self.callback = Callback()

    def generated(self, tokens: int, mean_reward: float) -> None:
        self.tokens.append(tokens)
        self.rewards.append(mean_reward)

    def records(self) -> list[StepRecord]:
        if not len(self.seconds) == len(self.tokens) == len(self.rewards):
            raise RuntimeError(f"TRL ran {len(self.seconds)} optimizer steps but generated {len(self.tokens)} "
                               "batches; the one-generation-per-step assumption does not hold")
        return [StepRecord(tokens=t, seconds=s, reward=r)
                for t, s, r in zip(self.tokens, self.seconds, self.rewards, strict=True)]
