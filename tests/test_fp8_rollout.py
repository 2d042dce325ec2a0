"""FP8 rollout weights. ``rollout.weights: fp8_emulated``: the rounding against values worked out by
hand, and a weight sync into a running vLLM that rounds exactly the linear weights as vLLM's online
FP8 quantization scales them (one scale per tensor a rank holds: fused qkv and gate/up share one);
oracle: transformers with the same rounding applied to its own weights by hand. ``rollout.weights:
fp8``: a weight sync into vLLM's own online FP8 (real FP8 weights and GEMMs); oracle: that vLLM
loading the checkpoint itself."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_hf, random_tokens, vllm_fused_linears

from megarl.config.schema import ParallelConfig
from megarl.rollout.fp8 import fake_quant_fp8
from megarl.workers import megatron_model


def test_per_tensor_scale_is_amax_over_448_and_rounds_to_e4m3():
    w = torch.tensor([[1.0, -2.0], [0.5, 0.3]])
    out = fake_quant_fp8(w)
    scale = 2.0 / 448  # amax 2 maps to E4M3's largest value
    # 1, -2 and 0.5 scale to 224, -448, 112: representable, back exactly; 0.3 scales to 67.2,
    # between E4M3's neighbours 64 and 72 (step 8 in [64, 128)): rounds to 64
    assert out[0, 0] == 1.0 and out[0, 1] == -2.0 and out[1, 0] == 0.5
    assert out[1, 1].item() == pytest.approx(64 * scale, rel=1e-6)


def test_cpu_fp8_quantization_is_vllms_arithmetic():
    """The CPU shim behind vLLM's ``scaled_fp8_quant`` (platform/vllm_cpu.py): hand-worked values,
    then vLLM's own ``QuantFP8.forward_native`` on random bf16 activations as the oracle."""
    from megarl.platform.vllm_cpu import _scaled_fp8_quant

    x = torch.tensor([[1.0, -2.0], [1.3, 7.0]])
    # dynamic per tensor: amax 7 -> scale 7 / 448 = 1 / 64; 1, -2, 7 scale to 64, -128, 448
    # (representable); 1.3 -> 83.2, between 80 and 88 (step 8 in [64, 128)): 80
    q, scale = _scaled_fp8_quant(x)
    assert q.dtype == torch.float8_e4m3fn and scale.tolist() == [1 / 64]
    assert q.float().tolist() == [[64.0, -128.0], [80.0, 448.0]]
    # dynamic per token: row amaxes 2 and 7 -> scales 2 / 448, 7 / 448; 1 -> 224, 1.3 -> 83.2 -> 80
    q, scale = _scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    assert scale.flatten().tolist() == pytest.approx([2 / 448, 7 / 448])
    assert q.float().tolist() == [[224.0, -448.0], [80.0, 448.0]]
    # a given (static) scale: 1 / 0.5 = 2; 300 / 0.5 = 600 clamps to E4M3's largest, 448
    q, _ = _scaled_fp8_quant(torch.tensor([1.0, 300.0]), torch.tensor([0.5]))
    assert q.float().tolist() == [2.0, 448.0]
    # all zeros: the scale is floored at 1 / (448 * 512), never 0 (no 0 / 0)
    _, scale = _scaled_fp8_quant(torch.zeros(3))
    assert scale.item() == pytest.approx(1 / (448 * 512))

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    activations = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)).bfloat16() * 3
    with set_current_vllm_config(VllmConfig()):
        for per_token in (False, True):
            group = GroupShape.PER_TOKEN if per_token else GroupShape.PER_TENSOR
            want_q, want_scale = QuantFP8(static=False, group_shape=group,
                                          compile_native=False).forward_native(activations)
            got_q, got_scale = _scaled_fp8_quant(activations, use_per_token_if_dynamic=per_token)
            assert torch.equal(got_q.float(), want_q.float()) and torch.equal(got_scale, want_scale)
        static = torch.tensor([0.02])
        want_q, _ = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR,
                             compile_native=False).forward_native(activations, static)
        assert torch.equal(_scaled_fp8_quant(activations, static)[0].float(), want_q.float())


def test_block_scales_are_per_tile_and_edge_tiles_are_partial():
    w = torch.tensor([[1.0, 100.0, 0.0], [3.0, -0.03, 0.0], [0.0, 0.0, 0.0]])
    # a 1 x 1 tile is its own amax: every value maps to +-448 and comes back exactly
    assert torch.equal(fake_quant_fp8(w, block=1), w)
    out = fake_quant_fp8(w, block=2)
    assert out.shape == w.shape and out.dtype == w.dtype
    # tile (0,0) = [[1, 100], [3, -0.03]]: scale 100 / 448; 1 -> 4.48 rounds to 4.5 (step 0.5 in [4, 8))
    scale = 100.0 / 448
    assert out[0, 0].item() == pytest.approx(4.5 * scale, rel=1e-6)
    assert out[0, 1].item() == pytest.approx(100.0, rel=1e-6)
    # the zero tiles stay zero (no 0 / 0)
    assert torch.equal(out[:, 2], torch.zeros(3)) and torch.equal(out[2], torch.zeros(3))
    with pytest.raises(ValueError, match="2-D"):
        fake_quant_fp8(torch.ones(4))


def _rounded_like_vllm(hf_dir, block):
    """The HF model with each linear weight rounded as vLLM holds it at TP 1: q/k/v as one fused
    tensor, gate/up as one, o and down alone; embeddings, norms and the LM head untouched."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for group in vllm_fused_linears(layer):
                fused = fake_quant_fp8(torch.cat([m.weight for m in group]), block)
                for m, part in zip(group, fused.split([m.weight.shape[0] for m in group]), strict=True):
                    m.weight.copy_(part)
    return model


def _logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(tokens, attention_mask=torch.ones_like(tokens)).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


def _synced_logprobs(actor, model, tokens: torch.Tensor, **engine_kwargs) -> torch.Tensor:
    """vLLM's prompt log-probs of ``tokens`` after one weight sync from ``actor`` (a Megatron rank
    group) loaded from ``model`` into an engine that started from random weights."""
    import ray

    from megarl.rollout.remote import start_engine, wait_ready
    from megarl.workers.weight_sync import WeightSync

    engine = start_engine(str(model), max_model_len=256, max_num_seqs=8, load_format="dummy", **engine_kwargs)
    try:
        wait_ready([engine])
        actor.run(megatron_model.load, key="actor", source=str(model), parallel=ParallelConfig())
        sync = WeightSync(actor, "actor", [engine], bucket_bytes=1 << 16)
        try:
            sync.setup()
            report = sync.sync(check=True)  # checksums are of the bytes as sent: they still agree
            assert report.bytes_ratio == 1.0 and not report.checksum_mismatches
        finally:
            sync.close()
        return torch.tensor(ray.get(engine.prompt_logprobs.remote(tokens.tolist())))
    finally:
        ray.kill(engine)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    # vocab 256, unpadded in vLLM: a dummy-loaded engine's padding rows keep random values that no
    # sync writes, and the checksums of the embedding and LM head would count them
    return build_tiny_hf("llama", tmp_path_factory.mktemp("fp8") / "llama", hidden_size=128, intermediate_size=256,
                         vocab_size=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture
def actor(groups):
    """One Megatron rank, started once for the module's two syncs (each test loads its own weights)."""
    return groups.get("actor-fp8", 1)


def test_emulated_sync_rounds_the_linear_weights_as_vllm_fp8_would(fp8_model, actor):
    import transformers

    tokens = random_tokens(batch=2, seq=24, vocab=256)
    got = _synced_logprobs(actor, fp8_model, tokens, tp=1, weights="fp8_emulated")
    rounded = _logprobs(_rounded_like_vllm(fp8_model, None), tokens)
    exact = _logprobs(transformers.AutoModelForCausalLM.from_pretrained(fp8_model).float().eval(), tokens)
    assert (got - rounded).abs().max() <= 1e-3, (got - rounded).abs().max()
    assert (got - exact).abs().max() > 1e-2  # the rounding is there, and large enough to tell apart


def test_sync_into_vllm_fp8_is_vllms_own_fp8_load(fp8_model, tmp_path, actor):
    """``rollout.weights: fp8`` at vLLM TP 2: vLLM's own online FP8 (a bfloat16 engine) quantizes
    each weight the sync hands it, one scale per fused tensor reduced over the TP ranks, and
    multiplies in FP8. Oracle: the same engine as it loaded the HF checkpoint itself with its FP8
    quantization. A sync of other weights moves its log-probs; a sync of the checkpoint's weights
    then gives back exactly the numbers of the load. The FP8 GEMMs are there: they differ from the
    unquantized model by far more than bfloat16 does (measured: 0.07 to 0.13 mean |difference|,
    bfloat16 alone 0.013)."""
    import ray
    import transformers

    from megarl.rollout.remote import start_engine, wait_ready
    from megarl.workers.weight_sync import WeightSync

    other = build_tiny_hf("llama", tmp_path / "other", seed=1, hidden_size=128, intermediate_size=256, vocab_size=256,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # one prompt: one forward. vLLM's dynamic activation scale is per tensor on CPU (per token on
    # Hopper), over every token of a forward: prompts batched differently score differently
    tokens = random_tokens(batch=1, seq=24, vocab=256)
    engine = start_engine(str(fp8_model), tp=2, max_model_len=256, max_num_seqs=8, weights="fp8", dtype="bfloat16")
    try:
        wait_ready([engine])
        loaded = torch.tensor(ray.get(engine.prompt_logprobs.remote(tokens.tolist())))
        after = []
        sync = WeightSync(actor, "actor", [engine], bucket_bytes=1 << 16)
        try:
            for source in (other, fp8_model):
                actor.run(megatron_model.load, key="actor", source=str(source), parallel=ParallelConfig())
                if sync.plan is None:
                    sync.setup()
                report = sync.sync(check=True)  # checksums: of the BF16 values sent
                assert report.bytes_ratio == 1.0 and not report.checksum_mismatches
                after.append(torch.tensor(ray.get(engine.prompt_logprobs.remote(tokens.tolist()))))
        finally:
            sync.close()
    finally:
        ray.kill(engine)
    assert (after[0] - loaded).abs().mean() > 0.1  # the other model's weights landed
    assert torch.equal(after[1], loaded), (after[1] - loaded).abs().max()
    exact = _logprobs(transformers.AutoModelForCausalLM.from_pretrained(fp8_model).to(torch.bfloat16).eval(), tokens)
    assert (loaded - exact).abs().mean() > 0.04, (loaded - exact).abs().mean()
