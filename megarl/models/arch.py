"""What a model is (``ModelArch``), and the registry of the families that know each kind.

``ModelArch`` is the one description of a model that megarl builds, converts, syncs
and plans for. Everything that differs between model families (which config fields
they read, the megatron-core options they need, their checkpoint tensors, how each
shard is cut from them, vLLM's layout of them, their parameter count) sits behind
``Family``, one implementation per HF ``model_type`` under ``megarl.models.families``.
Generic code asks ``family_of(arch)``; it never branches on the family's name.

The registry lives here, next to ``ModelArch``, because ``ModelArch.num_parameters``
asks the family while the families need ``ModelArch``: a module of its own would make
the two import each other. ``megarl.models`` imports the families package on first
use, so the registry is full before anything can look a family up.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from megarl.models.recipes import Recipe, ShardLayout


class ArchError(ValueError):
    """An HF config megarl cannot reproduce; the message names the field and the file."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # "default" | "llama3" | "linear" | "yarn" (DeepSeek-V3: its family reads it)
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class BlockOptions:
    """How a family's transformer layer is built: what ``megarl.models.gpt`` and
    ``megarl.models.block`` build from, so that no generic code decides them for every family.

    The defaults are the Llama-style layer: SwiGLU, RMSNorm weights applied as they are, two
    norms per layer, one rotary base, 1/sqrt(head_dim) attention scale."""

    activation: Activation = "silu"  # of the gated MLP: silu (SwiGLU) or tanh-approximated GELU (GeGLU)
    zero_centred_norms: bool = False  # every RMSNorm weight w is applied as (1 + w), as stored in HF (Gemma)
    qk_norm: bool = False  # an RMSNorm over each head's query and key (one head_dim weight each)
    # a norm on the attention's and on the MLP's output too, before each residual add (four per layer)
    sandwich_norms: bool = False
    window: int | None = None  # sliding window of W tokens, self included (HF semantics)
    # with a window: the 0-based layers that attend to everything (None: every layer is windowed)
    global_layers: tuple[int, ...] | None = None
    local_rope_theta: float | None = None  # the windowed layers' own rotary base (None: the model's)
    softmax_scale: float | None = None  # the attention's score scale (None: 1 / sqrt(head_dim))

    def is_windowed(self, layer: int) -> bool:
        """Whether 0-based ``layer`` attends within the window."""
        return self.window is not None and (self.global_layers is None or layer not in self.global_layers)


@dataclass(frozen=True)
class ModelArch:
    family: str  # the HF model_type; picks the Family
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    rope: RopeConfig
    sliding_window: int | None = None
    num_experts: int | None = None
    moe_topk: int | None = None
    dtype: str = "float32"  # the checkpoint's torch dtype name
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelArch:
        data = dict(data)
        data["rope"] = RopeConfig(**data["rope"])
        return cls(**data)

    def num_parameters(self) -> int:
        """Parameter count of the HF model (unpadded vocab, tied embeddings counted once).

        The layers' share is the family's ``layer_params`` at tp = ep = 1: the same count the
        planner splits over ranks, so the two cannot drift apart."""
        def count() -> int:
            family = family_of(self)
            layers = sum(sum(dense) + sum(expert) for dense, expert in
                         (family.layer_params_at(self, i, 1, 1) for i in range(self.num_layers)))
            embed = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
            return layers + embed + self.hidden_size  # + final norm

        return self.derived("num_parameters", count)

    def derived(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per architecture object: the planner's search asks for the same
        whole-model counts (parameters, MoE layers) tens of thousands of times, and each walks
        every layer. Kept beside the fields, not in them, so equality and ``to_dict`` ignore it."""
        cache = self.__dict__.setdefault("_derived", {})  # a frozen dataclass: not through setattr
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    def mismatches(self, other: ModelArch) -> list[str]:
        """Fields that differ between two architectures (dtype excluded), as 'name: a != b'; of the
        families' ``extra`` fields (Gemma-3's global layers, a shared expert's width), those both
        sides hold: one written before a family read a field has no value to compare."""
        mine, theirs = self.to_dict(), other.to_dict()
        differ = [
            f"{key}: {mine[key]!r} != {theirs[key]!r}"
            for key in mine
            if key not in ("dtype", "extra") and mine[key] != theirs[key]
        ]
        # compared as a checkpoint's megarl.json holds them (a tuple read back is a list)
        mine_extra, theirs_extra = json.loads(json.dumps(self.extra)), json.loads(json.dumps(other.extra))
        return differ + [f"extra.{key}: {mine_extra[key]!r} != {theirs_extra[key]!r}"
                         for key in sorted(mine_extra.keys() & theirs_extra.keys())
                         if mine_extra[key] != theirs_extra[key]]


class Family(Protocol):
    """Everything megarl needs to know about one model family (one HF ``model_type``).

    Per-layer hooks get ``prefix``, the HF name prefix of the layer (``model.layers.3.``),
    and ``rest``, a parameter's name inside its layer. Whole-model tensors (embeddings,
    final norm, output layer) are the same for every family and handled by the callers.
    """

    model_type: str

    def read_hf_config(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        """The family's own ModelArch fields (qkv_bias, sliding_window, num_experts, moe_topk)
        from an HF config; raises ArchError naming the field for anything unsupported."""
        ...

    def block_options(self, arch: ModelArch) -> BlockOptions:
        """How this family's layer is built (activation, norms, attention pattern)."""
        ...

    def transformer_config_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        """Extra megatron-core TransformerConfig fields of this family (e.g. MoE routing)."""
        ...

    def layer_spec_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        """Arguments of ``megarl.platform.gpt_layer_spec`` for this family."""
        ...

    def finish_model(self, model: Any, arch: ModelArch) -> None:
        """Changes the built megatron-core GPTModel chunk in place where the layer spec cannot
        (e.g. Gemma's embedding scale); called once per chunk, before the weights are loaded."""
        ...

    def hf_layer_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        """Every HF tensor of one layer, with its shape, in checkpoint order."""
        ...

    def layer_recipe(self, arch: ModelArch, rest: str, prefix: str, layout: ShardLayout) -> Recipe | None:
        """The HF pieces of the megatron-core layer parameter ``rest`` on the rank at ``layout``
        (canonical names: see ``megarl.convert.mapping``); None for a name the family lacks."""
        ...

    def vllm_layer_names(self, arch: ModelArch, prefix: str) -> list[str]:
        """vLLM's parameters of one layer (NotImplementedError where the sync cannot fill them)."""
        ...

    def vllm_layer_recipe(self, arch: ModelArch, rest: str, prefix: str, tp_rank: int, tp: int) -> Recipe | None:
        """The HF pieces of vLLM's layer parameter ``rest`` on vLLM TP rank ``tp_rank`` of ``tp``."""
        ...

    def layer_params(self, arch: ModelArch, tp: int, ep: int, etp: int | None = None) -> tuple[list[int], list[int]]:
        """Element counts of one layer's parameter tensors on one rank, split as megatron-core
        splits them: (dense, expert). The planner's one parameter count."""
        ...

    def layer_params_at(self, arch: ModelArch, layer: int, tp: int, ep: int,
                        etp: int | None = None) -> tuple[list[int], list[int]]:
        """``layer_params`` of 0-based ``layer`` (families whose layers differ: DeepSeek-V3's dense ones)."""
        ...


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Makes ``family`` the one for its model_type (``megarl.models.families`` registers them all)."""
    if family.model_type in _FAMILIES:
        raise ValueError(f"model family {family.model_type!r} is registered twice")
    _FAMILIES[family.model_type] = family
    return family


def family_names() -> tuple[str, ...]:
    """The supported model_types, in registration order."""
    return tuple(_FAMILIES)


def family_of(arch: ModelArch | str) -> Family:
    """The family of an architecture (or of a model_type name)."""
    name = arch if isinstance(arch, str) else arch.family
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ArchError(f"model family {name!r} is not supported; supported: {', '.join(_FAMILIES)}") from None


def positive_count(cfg: dict[str, Any], key: str, source: str, default: Any = None) -> int:
    """``cfg[key]`` (or ``default`` when it is missing or null) as a count: a whole number > 0, or
    ArchError naming the field (a head count of 0 would divide by zero, "32" or 3.5 mean a broken file)."""
    value = cfg.get(key) if cfg.get(key) is not None else default
    if value is None:
        raise ArchError(f"{source}: required field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 1:
        raise ArchError(f"{source}: {key}={value!r} must be a positive whole number")
    return int(value)


def required(cfg: dict[str, Any], key: str, source: str) -> Any:
    """``cfg[key]``, or ArchError naming the field when it is missing or null."""
    if key not in cfg or cfg[key] is None:
        raise ArchError(f"{source}: required field {key!r} is missing")
    return cfg[key]


def rope_from_config(cfg: dict[str, Any], source: str) -> RopeConfig:
    """The rotary embedding of an HF config (its ``rope_parameters`` or ``rope_theta`` and
    ``rope_scaling``); ArchError naming the field for a kind megarl does not reproduce."""
    # transformers >= 5 writes "rope_parameters" (with rope_theta inside); older files
    # have "rope_theta" and an optional "rope_scaling".
    field_name = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    key = "rope_type" if "rope_type" in params else "type"
    kind = params.get(key, "default") or "default"
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind == "linear":
        return RopeConfig(theta=float(theta), kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=float(theta), kind="llama3", factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )
    raise ArchError(f"{source}: rope type {kind!r} (field {field_name}.{key}) is not "
                    "supported; supported: default, linear, llama3")
