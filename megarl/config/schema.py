"""Typed configuration: one dataclass per concern, nested per role.

Loaded from YAML with dotted overrides (``actor.parallel.tp=4``) by
``megarl.config.loader``; checked by ``megarl.config.validate`` before any
process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")


@dataclass
class ParallelConfig:
    """How one role's model is split. dp is derived: world_size / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline stages (model chunks) per pipeline rank
    cp: int = 1
    ep: int = 1  # expert parallel (MoE only)
    sequence_parallel: bool = False
    # An explicit uneven pipeline split (megatron-core's first/last-stage layer counts);
    # the remaining layers are spread evenly over the middle stages.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    world_size: int | None = None  # ranks of the role; defaults to tp * pp * cp
    dp: int | None = None  # optional: when given, must equal world_size / (tp * pp * cp)

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def ranks(self) -> int:
        return self.world_size if self.world_size is not None else self.model_parallel_size * (self.dp or 1)

    @property
    def data_parallel_size(self) -> int:
        return self.ranks // self.model_parallel_size


@dataclass
class PrecisionConfig:
    dtype: str = "float32"  # parameter / compute dtype: float32 | bfloat16 | float16
    fp8: str | None = None  # Transformer Engine FP8 format (GPU only): e4m3 | hybrid
    fp8_recipe: str = "delayed"  # delayed | tensorwise | mxfp8 | blockwise
    fp8_amax_history_len: int = 1024


@dataclass
class ModelConfig:
    path: str = ""  # an HF model directory, or a megarl (megatron-core) checkpoint
    vocab_pad_multiple: int = 128  # padded vocab = multiple of lcm(this, tp)


@dataclass
class RoleConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)


@dataclass
class RunConfig:
    """A run: the roles that hold Megatron models. Roles left without a model path are unused."""

    name: str = "megarl"
    output_dir: str = "runs/megarl"
    seed: int = 1234
    actor: RoleConfig = field(default_factory=RoleConfig)
    reference: RoleConfig | None = None
    critic: RoleConfig | None = None
    reward: RoleConfig | None = None

    def roles(self) -> dict[str, RoleConfig]:
        named = {"actor": self.actor, "reference": self.reference,
                 "critic": self.critic, "reward": self.reward}
        return {name: role for name, role in named.items() if role is not None}
