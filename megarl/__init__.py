"""megarl: Megatron-based, 3D-parallel RLHF at extreme scale."""

__version__ = "0.1.0"
