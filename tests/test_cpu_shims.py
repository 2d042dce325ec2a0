"""Each megatron-core CPU shim is needed: without it its scenario fails as documented."""

from __future__ import annotations

import pytest
import rank_jobs

from megarl.platform import cpu_shims, current_platform

pytestmark = pytest.mark.skipif(current_platform().is_gpu, reason="the shims apply only without CUDA")

# The failure each shim's scenario shows without it: exception type, a fragment of its
# message, and the megatron-core file of the call site in the traceback.
EXPECTED = {
    "rng_tracker": ("AssertionError", "Torch not compiled with CUDA enabled",
                    "megatron/core/tensor_parallel/random.py"),
    "cuda_device_redirect": ("AssertionError", "Torch not compiled with CUDA enabled",
                             "megatron/core/tensor_parallel/layers.py"),
    "cuda_tensor_type": ("AssertionError", "", "megatron/core/optimizer/clip_grads.py"),
    "torch_norm_sequence_parallel": ("AssertionError", "sequence parallel not supported",
                                     "megatron/core/transformer/torch_norm.py"),
    "adam_step_state": ("KeyError", "'step'", "megatron/core/optimizer/distrib_optimizer.py"),
    "cuda_streams": ("RuntimeError", "requires CUDA", "megatron/core/transformer/moe/token_dispatcher.py"),
    "moe_te_names": ("NameError", "te_general_gemm", "megatron/core/transformer/moe/moe_utils.py"),
    "moe_split_sizes": ("TypeError", "all_to_all_single", "megatron/core/tensor_parallel/mappings.py"),
}


def test_every_shim_has_a_scenario():
    assert sorted(EXPECTED) == sorted(cpu_shims.SHIMS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shim_fixes_its_failure(name, pools, tiny_models):
    results = pools.get(2).run(rank_jobs.shim_check, name=name, dense=str(tiny_models["llama"]),
                               moe=str(tiny_models["mixtral"]))
    kind, fragment, site = EXPECTED[name]
    for rank, result in enumerate(results):
        failure = result["without"]
        assert failure is not None, f"rank {rank}: the scenario of {name} passed without the shim"
        assert failure.startswith(kind), failure
        assert fragment in failure.splitlines()[0], failure
        assert site in failure, failure
