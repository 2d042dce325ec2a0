"""Functions the tests run on every rank of a shared SpmdPool (imported by the ranks)."""

from __future__ import annotations

import traceback
from dataclasses import replace

import torch
import torch.distributed as dist

from megarl.config.schema import AlgorithmConfig, OptimizerConfig, ParallelConfig, PrecisionConfig
from megarl.convert.hf_io import HFReader
from megarl.convert.weights import load_hf_weights
from megarl.distributed.parallel import megatron_parallel
from megarl.models.forward import forward_outputs
from megarl.models.gpt import ModelSpec, build_model_chunks
from megarl.models.hf_arch import arch_from_hf_dir
from megarl.models.train import build_optimizer, lm_loss_fn, logits_forward, train_step, wrap_ddp
from megarl.workers.rank_batch import RankBatch
from megarl.workers.rank_results import UpdateResult


def _model(hf_dir: str, par: ParallelConfig, info):
    spec = ModelSpec(arch_from_hf_dir(hf_dir), par, PrecisionConfig("float32"))
    chunks = build_model_chunks(spec)
    load_hf_weights(chunks, HFReader(hf_dir), spec, info)
    return chunks


def lm_train_losses(hf_dir: str, parallel: ParallelConfig, tokens: torch.Tensor, steps: int = 2,
                    lr: float = 1e-3, use_distributed_optimizer: bool = True,
                    clip_grad: float = 1.0) -> dict[str, list[float]] | None:
    """Global mean LM loss and grad norm of each of ``steps`` optimizer steps on one global batch.

    The global batch is split over data-parallel ranks; each rank's loss is averaged over
    the data-parallel group, so every layout reports the loss of the same global batch.
    """
    from megatron.core import parallel_state as ps

    with megatron_parallel(parallel) as info:
        raw = _model(hf_dir, parallel, info)
        vocab = arch_from_hf_dir(hf_dir).vocab_size
        chunks = wrap_ddp(raw, use_distributed_optimizer)
        optimizer = build_optimizer(chunks, OptimizerConfig(lr=lr, clip_grad=clip_grad,
                                                        use_distributed_optimizer=use_distributed_optimizer))
        local = tokens.chunk(info.dp)[info.dp_rank]
        batch = {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous(),
                 "loss_mask": torch.ones_like(local[:, 1:], dtype=torch.float)}
        losses, grad_norms = [], []
        for _ in range(steps):
            result = train_step(chunks, optimizer, [batch], lm_loss_fn(vocab), logits_forward)
            assert result.updated, "the optimizer skipped its step"
            grad_norms.append(float(result.grad_norm))
            if ps.is_pipeline_last_stage():
                loss = result.outputs[0]["lm_loss"].reshape(1)
                dist.all_reduce(loss, group=ps.get_data_parallel_group())
                losses.append(loss.item() / info.dp)
        if ps.is_pipeline_last_stage() and info.tp_rank == 0 and info.dp_rank == 0:
            return {"loss": losses, "grad_norm": grad_norms}
        return None


# --- scenarios that need a CPU shim -------------------------------------------------------


def _scenario_rng_tracker(dense: str, moe: str) -> None:
    with megatron_parallel(ParallelConfig(tp=2, world_size=2)):
        pass


def _scenario_forward(hf_dir: str, par: ParallelConfig) -> None:
    with megatron_parallel(par) as info:
        chunks = _model(hf_dir, par, info)
        forward_outputs(chunks, [torch.zeros(2, 8, dtype=torch.long)])


def _scenario_cuda_device_redirect(dense: str, moe: str) -> None:
    _scenario_forward(dense, ParallelConfig(tp=2, world_size=2))


def _scenario_cuda_tensor_type(dense: str, moe: str) -> None:
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    lm_train_losses(dense, ParallelConfig(tp=2, world_size=2), tokens, steps=1,
                    use_distributed_optimizer=False)


def _scenario_torch_norm_sequence_parallel(dense: str, moe: str) -> None:
    _scenario_forward(dense, ParallelConfig(tp=2, sequence_parallel=True, world_size=2))


def _scenario_cuda_streams(dense: str, moe: str) -> None:
    _scenario_forward(moe, ParallelConfig(world_size=2))


def _scenario_moe_te_names(dense: str, moe: str) -> None:
    _scenario_forward(moe, ParallelConfig(world_size=2))


def _scenario_moe_split_sizes(dense: str, moe: str) -> None:
    _scenario_forward(moe, ParallelConfig(ep=2, world_size=2))


def _scenario_adam_step_state(dense: str, moe: str) -> None:
    """Save and reload a distributed-optimizer checkpoint (torch Adam, fully reshardable)."""
    import os
    import shutil

    from megarl.workers import checkpoint_fns, megatron_model

    directory = f"/tmp/megarl-shim-adam-{os.environ['MASTER_PORT']}"
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
    dist.barrier()
    try:
        megatron_model.load("shim", dense, ParallelConfig(tp=2, world_size=2))
        megatron_model.lm_train_step("shim", torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0)))
        checkpoint_fns.save("shim", directory, dense)
        checkpoint_fns.load("shim", directory, optim=OptimizerConfig())
    finally:
        megatron_model.unload("shim")
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)


def shim_check(name: str, dense: str, moe: str) -> dict[str, str | None]:
    """Runs the scenario of shim ``name`` without it (expecting a failure), then with it."""
    from megarl.platform import cpu_shims, init_megatron_runtime

    init_megatron_runtime()
    scenario = globals()[f"_scenario_{name}"]
    without = None
    with cpu_shims.disabled(name):
        try:
            scenario(dense, moe)
        except Exception as e:
            without = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            _reset_parallel_state()
    scenario(dense, moe)
    return {"without": without}


def _reset_parallel_state() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


# --- GPU paths (Transformer Engine, BF16, FP8) --------------------------------------------


def gpu_logits(hf_dir: str, parallel: ParallelConfig, tokens: torch.Tensor, dtype: str,
               fp8: str | None = None) -> dict | None:
    """Logits of the platform's layer spec (Transformer Engine, or local) on the GPU, from HF weights."""
    from megarl.models.forward import full_logits
    from megarl.platform import current_platform

    arch = arch_from_hf_dir(hf_dir)
    spec = ModelSpec(arch, parallel, PrecisionConfig(dtype=dtype, fp8=fp8))
    with megatron_parallel(parallel) as info:
        chunks = build_model_chunks(spec)
        load_hf_weights(chunks, HFReader(hf_dir), spec, info)
        names = [name for name, _ in chunks[0].named_parameters()]
        logits = full_logits(chunks, tokens.to(current_platform().rank_device()))
        if logits is None or info.tp_rank or info.dp_rank:
            return None
        return {"logits": logits[..., : arch.vocab_size], "layer_spec": current_platform().layer_spec_kind,
                "param_names": names}


def gpu_train_losses(hf_dir: str, tokens: torch.Tensor, dtype: str, steps: int = 3) -> list | None:
    """Next-token loss before each of ``steps`` optimizer steps on one GPU (one rank, no parallelism)."""
    from megarl.platform import current_platform

    parallel = ParallelConfig()
    spec = ModelSpec(arch_from_hf_dir(hf_dir), parallel, PrecisionConfig(dtype=dtype))
    with megatron_parallel(parallel) as info:
        raw = build_model_chunks(spec)
        load_hf_weights(raw, HFReader(hf_dir), spec, info)
        chunks = wrap_ddp(raw)
        optimizer = build_optimizer(chunks, OptimizerConfig(lr=1e-3))
        local = tokens.to(current_platform().rank_device())
        batch = {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous(),
                 "loss_mask": torch.ones_like(local[:, 1:], dtype=torch.float)}
        return [float(train_step(chunks, optimizer, [batch], lm_loss_fn(spec.arch.vocab_size),
                                 logits_forward).outputs[0]["lm_loss"]) for _ in range(steps)]


def fp8_train_losses(hf_dir: str, parallel: ParallelConfig, tokens: torch.Tensor, steps: int = 3) -> list | None:
    """LM loss over a few steps of a BF16 model whose GEMMs run in FP8 (Transformer Engine)."""
    from megatron.core import parallel_state as ps

    arch = arch_from_hf_dir(hf_dir)
    spec = ModelSpec(arch, parallel, PrecisionConfig(dtype="bfloat16", fp8="hybrid", fp8_recipe="delayed"))
    with megatron_parallel(parallel) as info:
        raw = build_model_chunks(spec)
        load_hf_weights(raw, HFReader(hf_dir), spec, info)
        chunks = wrap_ddp(raw)
        optimizer = build_optimizer(chunks, OptimizerConfig(lr=1e-4))
        local = tokens.chunk(info.dp)[info.dp_rank].cuda()
        batch = {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous(),
                 "loss_mask": torch.ones_like(local[:, 1:], dtype=torch.float)}
        losses = []
        for _ in range(steps):
            result = train_step(chunks, optimizer, [batch], lm_loss_fn(arch.vocab_size), logits_forward)
            if ps.is_pipeline_last_stage():
                losses.append(result.outputs[0]["lm_loss"].item())
        return losses if ps.is_pipeline_last_stage() and info.tp_rank == 0 and info.dp_rank == 0 else None


def nccl_all_reduce() -> float:
    t = torch.full((4,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(t)
    return t.sum().item()


# --- a faulty transport, simulated inside the actor's processes ---------------------------


def corrupt_in_flight(param: str) -> None:
    """From now on this rank sends a perturbed copy of ``param`` (its own weights stay intact)."""
    from megarl.reshard import transport
    from megarl.workers import sync_fns

    def faulty_run(group, fragment, params, finalize=None, **options):
        def lookup(name):
            tensor = params(name)
            return tensor * 1.5 + 0.1 if name == param else tensor
        return transport.run_fragment(group, fragment, lookup, finalize, **options)

    sync_fns.run_fragment = faulty_run


def restore_send() -> None:
    from megarl.reshard import transport
    from megarl.workers import sync_fns

    sync_fns.run_fragment = transport.run_fragment


# --- vocab-parallel log-probabilities and entropy --------------------------------------------


def vocab_parallel_vs_naive(tp: int, vocab: int, padded: int, chunk_rows: int | None = None) -> dict | None:
    """Log-probs, entropy and their gradients from TP-local logits vs the full-vocabulary math.

    The logits are taken as ``[:, :-1]`` of a [3, 8, vocab/tp] shard, as the RL losses do:
    a non-contiguous view that the chunked path must walk without copying or modifying.
    """
    from megarl.models.logprobs import token_entropy, token_logprobs
    from megarl.models.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs

    with megatron_parallel(ParallelConfig(tp=tp, world_size=dist.get_world_size())) as info:
        g = torch.Generator().manual_seed(0)
        full = torch.randn(3, 8, padded, generator=g) * 3
        labels = torch.randint(0, vocab, (3, 7), generator=g)
        w_lp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
        local = full.chunk(tp, dim=-1)[info.tp_rank].clone().requires_grad_(True)
        before = local.detach().clone()
        if chunk_rows is None:
            lp, ent = token_logprobs(local[:, :-1], labels, vocab), token_entropy(local[:, :-1], vocab)
        else:
            lp = vocab_parallel_logprobs(local[:, :-1], labels, vocab, chunk_rows=chunk_rows)
            ent = vocab_parallel_entropy(local[:, :-1], vocab, chunk_rows=chunk_rows)
        assert torch.equal(local.detach(), before), "the log-prob/entropy path modified its input"
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()

        naive = full.clone().requires_grad_(True)
        logp = torch.log_softmax(naive[:, :-1, :vocab], dim=-1)
        lp_naive = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        ent_naive = -(logp.exp() * logp).sum(-1)
        ((lp_naive * w_lp).sum() + (ent_naive * w_ent).sum()).backward()
        expected_grad = naive.grad.chunk(tp, dim=-1)[info.tp_rank]
        return {"logprob": (lp - lp_naive).abs().max().item(), "entropy": (ent - ent_naive).abs().max().item(),
                "grad": (local.grad - expected_grad).abs().max().item()}


# --- token-budget micro-batches and sequence packing vs the padded path ---------------------


def _within(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> float:
    return (a - b).abs().masked_fill(~valid, 0).max().item()


def _held_params(key: str) -> torch.Tensor:
    from megarl.workers.megatron_model import held

    return torch.cat([p.detach().reshape(-1).float() for chunk in held(key).chunks for p in chunk.parameters()])


def packing_vs_padded(hf_dir: str, reward_dir: str, parallel: ParallelConfig, batch: RankBatch, algo: AlgorithmConfig,
                      optim: OptimizerConfig, budget: int) -> dict | None:
    """Max differences of log-probs, entropy, values, scores and one policy step between the
    padded path (fixed micro-batches of 2) and token-budget / packed micro-batches.

    Token-level results are compared at each sequence's label positions (the padded path
    also computes outputs on its padding, which the cut and packed paths leave at 0).
    """
    from megarl.workers import megatron_model, rl_fns
    from megarl.workers.microbatches import microbatches

    variants = {"budget": {"max_tokens_per_microbatch": budget},
                "packed": {"pack_sequences": True},
                "packed_budget": {"pack_sequences": True, "max_tokens_per_microbatch": budget},
                "shared": {"share_prompt": True},
                "shared_budget": {"share_prompt": True, "max_tokens_per_microbatch": budget}}
    width = batch.tokens.shape[1]
    valid = torch.arange(width - 1).unsqueeze(0) < (batch.seq_lens - 1).unsqueeze(1)
    out: dict[str, float] = {}

    def shard_valid(dp_rank: int, dp: int) -> torch.Tensor:
        return valid.chunk(dp)[dp_rank]

    megatron_model.load("pk", hf_dir, parallel)
    info = megatron_model.held("pk").info
    padded = rl_fns.logprobs("pk", batch, micro_batch_size=2, entropy=True)
    # the shared variants do share: every micro-batch holds a prompt once for several responses
    model = megatron_model.held("pk")
    mbs = microbatches(model, batch.shard(info.dp, info.dp_rank), 2, select=True, share=True)
    out["shared/rows_without_sharing"] = sum(len(set(mb.plan.row)) == len(mb.plan.row) for mb in mbs)
    for name, kwargs in variants.items():
        got = rl_fns.logprobs("pk", batch, micro_batch_size=2, entropy=True, **kwargs)
        if got is not None:
            v = shard_valid(info.dp_rank, info.dp)
            out[f"{name}/logprobs"] = _within(got.value.logprobs, padded.value.logprobs, v)
            out[f"{name}/entropy"] = _within(got.value.entropy, padded.value.entropy, v)
            out[f"{name}/zero_outside"] = got.value.logprobs.masked_fill(v, 0).abs().max().item()
    # one policy step on each path, from the same weights
    steps, params = {}, {}
    for name in ("padded", "packed_budget", "shared_budget"):
        kwargs = variants.get(name, {})
        megatron_model.load("pk", hf_dir, parallel)
        before = _held_params("pk")
        steps[name] = rl_fns.train_policy("pk", batch, algo, optim, micro_batch_size=2, **kwargs)
        params[name] = _held_params("pk")
    out["train/params_moved"] = (params["padded"] - before).abs().max().item()
    for name in ("packed_budget", "shared_budget"):
        out[f"train/{name}/params"] = (params["padded"] - params[name]).abs().max().item()
        if steps["padded"] is not None:
            for metric in ("pg_loss", "grad_norm", "entropy"):
                out[f"train/{name}/{metric}"] = abs(steps["padded"].steps[0][metric] - steps[name].steps[0][metric])
    # the critic / reward model path: a value head
    megatron_model.load("pk", reward_dir, parallel, value_head=True)
    padded_values = rl_fns.values("pk", batch, micro_batch_size=2)
    padded_scores = rl_fns.scores("pk", batch, micro_batch_size=2)
    for name, kwargs in variants.items():
        got_values = rl_fns.values("pk", batch, micro_batch_size=2, **kwargs)
        got_scores = rl_fns.scores("pk", batch, micro_batch_size=2, **kwargs)
        if got_values is not None:
            out[f"{name}/values"] = _within(got_values.value, padded_values.value, shard_valid(info.dp_rank, info.dp))
            out[f"{name}/scores"] = (got_scores.value - padded_scores.value).abs().max().item()
    megatron_model.unload("pk")
    return out or None


def preference_step(kind: str, model_dir: str, parallel: ParallelConfig, batch: RankBatch, optim: OptimizerConfig,
                    micro_batch_size: int = 2, ref_dir: str | None = None, settings=None, after: bool = False,
                    kl_rows: RankBatch | None = None) -> tuple[UpdateResult, torch.Tensor | None] | None:
    """One SFT / reward-model / DPO / KTO step at ``parallel`` (DPO, KTO: the reference's log-probs
    first, from its own megatron model at the same layout); the step's result from the reporting
    rank. KTO's mismatched rows ``kl_rows``: the reference's and then the policy's log-probs of them
    give the step's reference point. ``after``: the updated model's log-probs of the batch (a
    reward model: its scores) come back with the result, else None."""
    from megarl.algorithms.kto import kl_reference_point
    from megarl.workers import megatron_model, preference_fns, rl_fns
    from megarl.workers.rank_results import gather_shards

    def everywhere(rows: RankBatch, fn=rl_fns.logprobs) -> torch.Tensor:  # log-probs of ``rows`` [B, L-1], everywhere
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, fn("pref", rows, micro_batch_size=micro_batch_size))
        return gather_shards(parts)

    if kind in ("dpo", "kto"):
        megatron_model.load("pref", ref_dir, parallel)
        batch = replace(batch, ref_logprobs=everywhere(batch))
        ref_kl = everywhere(kl_rows) if kl_rows is not None else None
        megatron_model.unload("pref")
    megatron_model.load("pref", model_dir, parallel, value_head=kind == "rm")
    try:
        if kl_rows is not None:
            policy_kl = everywhere(kl_rows)  # before the step, no grad (TRL's KL_logps too)
            mask = kl_rows.mask
            batch = replace(batch, kto_kl=kl_reference_point((policy_kl * mask).sum(1), (ref_kl * mask).sum(1)))
        fn = {"sft": preference_fns.train_sft, "rm": preference_fns.train_reward_model,
              "dpo": preference_fns.train_dpo, "kto": preference_fns.train_kto}[kind]
        result = fn("pref", batch, settings, optim, micro_batch_size)
        updated = everywhere(batch, rl_fns.scores if kind == "rm" else rl_fns.logprobs) if after else None
        return None if result is None else (result, updated)
    finally:
        megatron_model.unload("pref")


def param_dtypes(hf_dir: str, dtype: str) -> list[str] | None:
    """The dtypes of a freshly built model's parameters, rank 0 only."""
    spec = ModelSpec(arch_from_hf_dir(hf_dir), ParallelConfig(), PrecisionConfig(dtype=dtype))
    with megatron_parallel(spec.parallel):
        chunks = build_model_chunks(spec)
        return sorted({str(p.dtype) for c in chunks for p in c.parameters()}) if dist.get_rank() == 0 else None


def moe_routing_step(hf_dir: str, parallel: ParallelConfig, moe, tokens: torch.Tensor) -> dict | None:
    """A MoE model built with the routing settings ``moe`` (a MoeConfig): its log-probs of ``tokens``,
    then one next-token training step on them (split over data-parallel ranks): the step's
    auxiliary-loss metrics and the summed |gradient| of the router weights. Rank 0 reports."""
    from megarl.workers import megatron_model

    megatron_model.load("moe", hf_dir, parallel, moe=moe)
    logprobs = megatron_model.token_logprobs("moe", tokens)
    model = megatron_model.held("moe")
    model.chunks = wrap_ddp(model.chunks)
    model.optimizer = build_optimizer(model.chunks, OptimizerConfig(lr=1e-3))
    local = tokens.chunk(model.info.dp)[model.info.dp_rank]
    batch = {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous(),
             "loss_mask": torch.ones_like(local[:, 1:], dtype=torch.float)}
    result = train_step(model.chunks, model.optimizer, [batch], lm_loss_fn(model.spec.arch.vocab_size),
                        logits_forward)
    router_grad = sum(float(p.main_grad.abs().sum()) for name, p in model.chunks[0].named_parameters()
                      if "router" in name)
    megatron_model.unload("moe")
    if dist.get_rank() != 0:
        return None
    return {"logprobs": logprobs, "moe": result.moe, "router_grad": router_grad}
