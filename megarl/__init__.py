"""megarl: Megatron-based, 3D-parallel RLHF at extreme scale."""

from megarl.utils import megatron_jit

__version__ = "0.1.0"

# megatron-core's fused functions compile at their first call, not as megatron-core is imported
# (about 1.6 s less at the start of every rank process: megarl.utils.megatron_jit)
megatron_jit.install()
