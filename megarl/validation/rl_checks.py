"""Checks of what an RL run combines: algorithm, rewards, data, batch sizes and the trainer's
schedule; every message names the dotted field."""

from __future__ import annotations

from megarl.config.roles import row_split
from megarl.config.schema import RunConfig
from megarl.models.hf_arch import ModelArch

TEXT_REWARD_KINDS = ("reasoning_gym", "math_verify", "format")  # the rewards that read an answer extractor


def rl_errors(cfg: RunConfig, actor: ModelArch) -> list[str]:
    """Algorithm, rewards, rollout, data and batch sizes that cannot run together."""
    from pathlib import Path

    from megarl.algorithms.registry import algorithm_errors
    from megarl.cluster.placement import placement_errors
    from megarl.rewards.extract import resolve_extractor
    from megarl.rewards.remote import url_problem
    from megarl.rewards.terms import REWARD_KINDS, custom_term
    from megarl.rollout.vllm_layout import vllm_padded_vocab
    from megarl.utils.imports import is_import_path

    algo, rollout, data = cfg.algorithm, cfg.rollout, cfg.data
    # the algorithm's own rules and those every algorithm shares (megarl.algorithms.base.Algorithm.validate)
    errors = algorithm_errors(cfg)
    for i, term in enumerate(cfg.rewards):
        if is_import_path(term.kind):  # a recipe's own scorer: imported and made here, as the run will
            try:
                custom_term(term)
            except ValueError as e:
                errors.append(f"rewards[{i}].kind: {e}")
        elif term.kind not in REWARD_KINDS:
            errors.append(f"rewards[{i}].kind={term.kind!r} must be one of {', '.join(REWARD_KINDS)} "
                          "(or package.module:name)")
        elif term.options:
            errors.append(f"rewards[{i}].options are for a recipe's own scorer (kind: package.module:name), "
                          f"not {term.kind!r}")
        if term.kind == "model" and cfg.reward_model is None:
            errors.append(f"rewards[{i}].kind='model' needs a reward_model role")
        if term.kind == "remote":
            problem = url_problem(term.url) if term.url else "is required for a remote reward"
            if problem:
                errors.append(f"rewards[{i}].url={term.url!r} {problem}" if term.url else
                              f"rewards[{i}].url {problem}")
        if term.kind in TEXT_REWARD_KINDS:
            try:
                resolve_extractor(term.extractor)
            except ValueError as e:
                errors.append(f"rewards[{i}].extractor: {e}")
    if not cfg.rewards:
        errors.append("rewards: at least one reward term is needed")
    elif all(term.eval_only for term in cfg.rewards):
        errors.append("rewards: every term is eval_only, so nothing rewards training")
    for i, term in enumerate(cfg.rewards):
        if term.eval_only and term.kind == "model":
            errors.append(f"rewards[{i}]: a model term cannot be eval_only (the reward model scores training "
                          "batches only)")
    if actor.num_heads % rollout.tp or vllm_padded_vocab(actor.vocab_size) % rollout.tp:
        errors.append(f"rollout.tp={rollout.tp} does not divide the attention heads ({actor.num_heads}) or vLLM's "
                      f"padded vocabulary ({vllm_padded_vocab(actor.vocab_size)})")
    if rollout.engines < 1 or data.prompts_per_step < rollout.engines:
        errors.append(f"rollout.engines={rollout.engines} must be >= 1 and <= data.prompts_per_step")
    if data.max_prompt_len + rollout.max_tokens > rollout.max_model_len:
        errors.append(f"data.max_prompt_len + rollout.max_tokens = {data.max_prompt_len + rollout.max_tokens} "
                      f"exceeds rollout.max_model_len={rollout.max_model_len}")
    sequences = data.prompts_per_step * rollout.n
    for name, role in cfg.roles().items():
        split = row_split(name, role, algo.minibatches)
        if sequences % split.multiple:
            errors.append(f"{name}: {sequences} sequences per step (data.prompts_per_step x rollout.n) must split "
                          f"over dp={split.ranks} ranks into {split.minibatches} minibatch(es)"
                          + (f" of micro_batch_size={split.micro_batch}" if split.micro_batch > 1 else ""))
    if algo.overlong_buffer > rollout.max_tokens:
        errors.append(f"algorithm.overlong_buffer={algo.overlong_buffer} is longer than the responses "
                      f"(rollout.max_tokens={rollout.max_tokens})")
    if data.source.startswith("reasoning_gym:"):
        import reasoning_gym

        task = data.source.split(":", 1)[1]
        if task not in reasoning_gym.factory.DATASETS:
            errors.append(f"data.source: reasoning-gym has no task {task!r}")
    elif not data.source.startswith("verifiers:") and not Path(data.source).is_file():  # verifiers: data_errors
        errors.append(f"data.source: {data.source} does not exist")
    if cfg.trainer.critic_warmup > 0 and cfg.critic is None:
        errors.append(f"trainer.critic_warmup={cfg.trainer.critic_warmup} needs a critic (algorithm.name: ppo)")
    elif cfg.trainer.critic_warmup >= cfg.trainer.steps > 0:
        errors.append(f"trainer.critic_warmup={cfg.trainer.critic_warmup} leaves no step of trainer.steps="
                      f"{cfg.trainer.steps} to train the actor")
    if cfg.trainer.max_staleness > 0 and cfg.rollout.colocate_with is not None:
        # colocated, vLLM and the roles take turns on the same device: nothing to overlap
        errors.append(f"trainer.max_staleness={cfg.trainer.max_staleness} needs rollout on its own resources, but "
                      f"rollout.colocate_with={cfg.rollout.colocate_with!r}; colocated runs are synchronous "
                      "(max_staleness: 0)")
    return errors + schedule_errors(cfg) + placement_errors(cfg)


def schedule_errors(cfg: RunConfig) -> list[str]:
    """trainer.schedule / rollout.partial / rollout.granularity: opportunistic rollout needs
    something to overlap."""
    tr, errors = cfg.trainer, []
    if tr.schedule == "opportunistic" and tr.max_staleness < 1:
        errors.append("trainer.schedule=opportunistic needs trainer.max_staleness >= 1 (at 0 nothing generates "
                      "while the actor trains, so there is nothing to interrupt)")
    return errors


def data_errors(cfg: RunConfig) -> list[str]:
    """The prompts, read as the run will read them: every row of a file, or reasoning-gym's task options."""
    data = cfg.data
    if data.source.startswith("reasoning_gym:"):
        import reasoning_gym

        task = data.source.split(":", 1)[1]
        try:
            # one entry: the task's own config checks run on construction
            reasoning_gym.create_dataset(task, size=1, seed=data.seed, **data.task_config)
        except Exception as e:  # noqa: BLE001 - a third-party task refuses its options with any exception type
            return [f"data.task_config: reasoning-gym task {task!r} refuses it: {' '.join(str(e).split())}"]
        return []
    from megarl.data.prompts import from_verifiers, load_prompts
    from megarl.data.verifiers_source import is_verifiers_source

    try:
        items = (from_verifiers(data.source, data.task_config) if is_verifiers_source(data.source)  # its own dataset
                 else load_prompts(data.source, prompt_key=data.prompt_key))
    except (ValueError, OSError, ImportError) as e:
        return [f"data.source: {' '.join(str(e).split())}"]
    if len(items) < data.prompts_per_step:
        return [f"data.prompts_per_step={data.prompts_per_step} is more than the {len(items)} prompts in "
                f"{data.source}"]
    return []
