"""A corpus of hostile inputs to the CLI entry points (issue 11, item 7: config, data and rewards).

Every case must be answered with a non-zero exit and ONE line on stderr that names the
field, file or line; no traceback; within seconds; before any Ray or rank process starts;
and with nothing written (the run's output_dir is not created). Cases run in-process
through ``megarl.cli.main.main`` (with the trainer, Ray and rank pools replaced by tripwires),
``megarl train`` both with and without ``--check``; a few also run as real subprocesses.

Kinds (the issue's): ``range`` (values outside their domain), ``late`` (inputs known before
Ray starts but checked only in the run), ``traceback`` (a Python traceback today), ``yaml``
(duplicate keys, alias bombs). The remote reward client's total deadline and answer cap are
checked at the end against loopback servers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import Cli

ROOT = Path(__file__).resolve().parent.parent

# A tiny Llama (config.json only: validation reads no weights unless a folder has them).
LLAMA = {
    "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
IN_PROCESS_LIMIT_S = 10.0  # "within seconds" on a loaded 2-core machine; a valid --check takes ~0.3 s warm
SUBPROCESS_LIMIT_S = 60.0  # includes the interpreter start and the torch import


@dataclass
class Paths:
    tmp: Path
    model: Path  # config.json only
    data: Path  # 8 good JSONL rows
    out: Path  # the recipe's output_dir; must never be created

    def recipe(self, changes: dict | None = None) -> str:
        """The base recipe (valid) as YAML, with dotted ``changes`` applied."""
        base = {
            "name": "bad-input", "output_dir": str(self.out),
            "actor": {"model": {"path": str(self.model)}, "parallel": {"tp": 1, "world_size": 1},
                      "micro_batch_size": 2},
            "rollout": {"max_model_len": 256, "max_tokens": 64, "n": 2},
            "data": {"source": str(self.data), "prompts_per_step": 2, "max_prompt_len": 128},
            "rewards": [{"kind": "format"}],
            "trainer": {"steps": 1, "tensorboard": False, "wandb": False},
        }
        for dotted, value in (changes or {}).items():
            node, keys = base, dotted.split(".")
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = value
        return yaml.safe_dump(base, sort_keys=False)


@dataclass
class Case:
    id: str
    kind: str  # range | late | traceback | yaml
    expect: str  # a substring of the one error line: the field, file or line it names
    command: str = "train"  # train (run with and without --check) | plan | bench
    args: tuple[str, ...] = ()  # train: dotted overrides; plan / bench: the arguments after the command
    recipe: Callable[[Paths], str | bytes] | None = None  # train: the recipe text (default: the base recipe)


def change(**changes) -> Callable[[Paths], str]:
    """The base recipe with ``changes`` (dotted keys written with '__' for '.')."""
    return lambda p: p.recipe({k.replace("__", "."): v for k, v in changes.items()})


def data_file(content: bytes, name: str = "bad.jsonl", **changes) -> Callable[[Paths], str]:
    def make(p: Paths) -> str:
        (p.tmp / name).write_bytes(content)
        return p.recipe({"data.source": str(p.tmp / name), **{k.replace("__", "."): v for k, v in changes.items()}})
    return make


def remote(**term) -> Callable[[Paths], str]:
    return lambda p: p.recipe({"rewards": [{"kind": "remote", **term}]})


# a valid held-out set (reasoning-gym generates it offline), which the eval cases change
EVAL_SET = {"name": "sums", "source": "reasoning_gym:chain_sum", "size": 8, "max_prompt_len": 64}


def evals(*sets: dict, **section) -> Callable[[Paths], str]:
    """The base recipe with an ``eval`` section: each of ``sets`` changes EVAL_SET."""
    return lambda p: p.recipe({"eval": {"sets": [{**EVAL_SET, **s} for s in sets], **section}})


def raw(text: str | bytes) -> Callable[[Paths], str | bytes]:
    """A recipe given as text; '{model}', '{data}' and '{out}' are filled in."""
    def make(p: Paths) -> str | bytes:
        if isinstance(text, bytes):
            return text
        return text.replace("{model}", str(p.model)).replace("{data}", str(p.data)).replace("{out}", str(p.out))
    return make


BASE_YAML = """name: bad-input
output_dir: {out}
actor:
  model: {path: {model}}
  parallel: {tp: 1, world_size: 1}
  micro_batch_size: 2
rollout: {max_model_len: 256, max_tokens: 64, n: 2}
rewards: [{kind: format}]
trainer: {steps: 1, tensorboard: false, wandb: false}
data:
  source: {data}
  prompts_per_step: 2
  max_prompt_len: 128
"""

# 10**6 values from 400 bytes, in a free-form field (data.task_config) that the loader keeps:
# each level repeats the one before ten times. (Deeper bombs take gigabytes; this one only
# needs to be past the limit, and to cost seconds rather than hours where it is accepted.)
ALIAS_BOMB = BASE_YAML + "  task_config:\n" + "".join(
    ["    l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n"]
    + [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 6)]
)

PLAN = ("--model", "llama3.1-8b", "--gpus", "8")

CASES = [
    # ---------------------------------------------------------------- ranges nobody checks
    Case("steps-zero", "range", "trainer.steps=0 must be >= 1", args=("trainer.steps=0",)),
    Case("rollout-weights-unknown", "range", "rollout.weights: 'int4' is not one of model, fp8, fp8_emulated",
         args=("rollout.weights=int4",)),
    Case("fp8-block-without-fp8", "range", "rollout.fp8_block=128 needs rollout.weights=fp8 or fp8_emulated",
         args=("rollout.fp8_block=128",)),
    Case("fp8-with-logprob-check", "late", "set trainer.verify_sync=never",
         args=("rollout.weights=fp8_emulated",)),
    Case("fp8-in-float32", "late", "rollout.weights=fp8 needs rollout.dtype=bfloat16 or float16",
         args=("rollout.weights=fp8", "trainer.verify_sync=never", "rollout.dtype=float32")),
    Case("expert-parallel-dense", "late", "rollout.expert_parallel needs a mixture-of-experts actor",
         args=("rollout.expert_parallel=true",)),
    Case("steps-negative", "range", "trainer.steps=-3 must be >= 1", args=("trainer.steps=-3",)),
    Case("max-tokens-zero", "range", "rollout.max_tokens=0 must be >= 1", args=("rollout.max_tokens=0",)),
    Case("max-tokens-negative", "range", "rollout.max_tokens=-5", args=("rollout.max_tokens=-5",)),
    Case("max-prompt-len-zero", "range", "data.max_prompt_len=0", args=("data.max_prompt_len=0",)),
    Case("token-budget-zero", "range", "actor.max_tokens_per_microbatch=0",
         args=("actor.max_tokens_per_microbatch=0",)),
    Case("micro-batch-negative", "range", "actor.micro_batch_size=-2 must be >= 1",
         args=("actor.micro_batch_size=-2",)),
    Case("world-size-negative", "range", "actor.parallel.world_size=-2 must be >= 1",
         args=("actor.parallel.world_size=-2",)),
    Case("dp-zero", "range", "actor.parallel.dp=0 must be >= 1", args=("actor.parallel.dp=0",)),
    Case("tp-zero", "range", "actor.parallel.tp=0 must be >= 1", args=("actor.parallel.tp=0",)),
    Case("engines-zero", "range", "rollout.engines=0", args=("rollout.engines=0",)),
    Case("epochs-zero", "range", "algorithm.ppo_epochs=0 must be >= 1", args=("algorithm.ppo_epochs=0",)),
    Case("group-size-one", "range", "rollout.n=1", args=("rollout.n=1",)),
    Case("group-size-zero", "range", "rollout.n=0 must be >= 1",
         args=("rollout.n=0", "algorithm.name=reinforce_pp")),
    Case("model-len-beyond-model", "range", "rollout.max_model_len=512 is longer than the model's 256 positions",
         args=("rollout.max_model_len=512",)),
    Case("kv-cache-cannot-hold-a-sequence", "range", "rollout.kv_cache_gib=1 does not hold one sequence",
         recipe=lambda p: p.recipe({"actor.model.path": str(p.tmp / "long"), "rollout.max_model_len": 2**22})),
    Case("kv-cache-zero", "range", "rollout.kv_cache_gib=0 must be >= 1", args=("rollout.kv_cache_gib=0",)),
    Case("max-num-seqs-zero", "range", "rollout.max_num_seqs=0 must be >= 1", args=("rollout.max_num_seqs=0",)),
    Case("gpu-memory-utilization", "range", "rollout.gpu_memory_utilization=1.5 must be in (0, 1]",
         args=("rollout.gpu_memory_utilization=1.5",)),
    Case("clip-low-negative", "range", "algorithm.clip_low=-0.2 must be in [0, 1)", args=("algorithm.clip_low=-0.2",)),
    Case("clip-low-one", "range", "algorithm.clip_low=1.0 must be in [0, 1)", args=("algorithm.clip_low=1.0",)),
    Case("clip-high-negative", "range", "algorithm.clip_high=-0.1 must be >= 0", args=("algorithm.clip_high=-0.1",)),
    Case("dual-clip-below-one", "range", "algorithm.dual_clip=0.5 must be > 1", args=("algorithm.dual_clip=0.5",)),
    Case("temperature-zero", "range", "rollout.temperature=0.0 must be > 0", args=("rollout.temperature=0",)),
    Case("temperature-negative", "range", "rollout.temperature=-1.0", args=("rollout.temperature=-1",)),
    Case("temperature-nan", "range", "rollout.temperature=nan", args=("rollout.temperature=.nan",)),
    Case("top-p-zero", "range", "rollout.top_p=0.0 must be in (0, 1]", args=("rollout.top_p=0",)),
    Case("top-p-above-one", "range", "rollout.top_p=1.5 must be in (0, 1]", args=("rollout.top_p=1.5",)),
    Case("top-k-negative", "range", "rollout.top_k=-5 must be >= -1", args=("rollout.top_k=-5",)),
    Case("gamma-above-one", "range", "algorithm.gamma=1.5 must be in [0, 1]", args=("algorithm.gamma=1.5",)),
    Case("kl-coef-negative", "range", "algorithm.kl_coef=-0.1 must be >= 0", args=("algorithm.kl_coef=-0.1",)),
    Case("value-clip-zero", "range", "algorithm.value_clip=0.0 must be > 0", args=("algorithm.value_clip=0",)),
    Case("overlong-buffer-beyond-response", "range", "algorithm.overlong_buffer=100 is longer than the responses",
         args=("algorithm.overlong_buffer=100",)),
    Case("lr-infinite", "range", "actor.optim.lr=inf", args=("actor.optim.lr=.inf",)),
    Case("adam-beta2-one", "range", "actor.optim.adam_beta2=1.0 must be in [0, 1)",
         args=("actor.optim.adam_beta2=1.0",)),
    Case("cpus-per-rank-zero", "range", "actor.cpus_per_rank=0.0 must be > 0", args=("actor.cpus_per_rank=0",)),
    Case("prompts-per-step-zero", "range", "data.prompts_per_step=0 must be >= 1", args=("data.prompts_per_step=0",)),
    Case("prompts-per-step-over-file", "range", "data.prompts_per_step=16 is more than the 8 prompts",
         args=("data.prompts_per_step=16",)),
    Case("prompts-per-step-over-generated", "range", "data.prompts_per_step=8 is more than the data.size=4",
         args=("data.source=reasoning_gym:basic_arithmetic", "data.size=4", "data.prompts_per_step=8")),
    Case("data-size-zero", "range", "data.size=0 must be >= 1",
         args=("data.source=reasoning_gym:basic_arithmetic", "data.size=0")),
    Case("step-timeout-zero", "range", "trainer.step_timeout_s=0.0 must be > 0", args=("trainer.step_timeout_s=0",)),
    Case("collective-timeout-negative", "range", "trainer.collective_timeout_s=-1.0",
         args=("trainer.collective_timeout_s=-1",)),
    Case("save-every-negative", "range", "trainer.save_every=-1 must be >= 0", args=("trainer.save_every=-1",)),
    Case("bucket-zero", "range", "trainer.bucket_mib=0.0 must be > 0", args=("trainer.bucket_mib=0",)),
    Case("staleness-negative", "range", "trainer.max_staleness=-1 must be >= 0", args=("trainer.max_staleness=-1",)),
    Case("critic-warmup-without-critic", "range", "trainer.critic_warmup=2 needs a critic",
         args=("trainer.critic_warmup=2",)),
    Case("staleness-colocated", "late", "trainer.max_staleness=1 needs rollout on its own resources",
         args=("trainer.max_staleness=1", "rollout.colocate_with=actor")),
    Case("cpu-cores-unknown", "late", "trainer.cpu_cores: 'all' is not one of auto, bundle",
         args=("trainer.cpu_cores=all",)),
    Case("schedule-unknown", "late", "trainer.schedule: 'eager' is not one of exact, opportunistic",
         args=("trainer.schedule=eager",)),
    Case("opportunistic-in-lockstep", "late", "trainer.schedule=opportunistic needs trainer.max_staleness >= 1",
         args=("trainer.schedule=opportunistic",)),
    Case("partial-unknown", "late", "rollout.partial: 'resume' is not one of continue, regenerate",
         args=("rollout.partial=resume",)),
    Case("granularity-unknown", "late", "rollout.granularity: 'prompt' is not one of batch, group",
         args=("rollout.granularity=prompt",)),
    # multi-turn episodes (env): every problem named by its field before any engine starts
    Case("env-unknown-kind", "range", "env.kind='game' must be one of single_turn, tools, remote",
         args=("env={kind: game}",)),
    Case("env-tools-empty", "range", "env.tools is empty", args=("env={kind: tools}",)),
    Case("env-unknown-tool", "range", "env.tools[0]: unknown tool 'abacus'",
         args=("env={kind: tools, tools: [{name: abacus}]}",)),
    Case("env-unknown-tool-option", "range", "env.tools[0]: tool 'calculator' has no option 'digits'",
         args=("env={kind: tools, tools: [{name: calculator, options: {digits: 3}}]}",)),
    Case("env-max-turns-zero", "range", "env.max_turns=0 must be >= 1",
         args=("env={kind: tools, tools: [{name: calculator}], max_turns: 0}",)),
    Case("env-unknown-parser", "range", "env.tool_parser='xml' must be one of hermes",
         args=("env={kind: tools, tools: [{name: calculator}], tool_parser: xml}",)),
    Case("env-remote-url", "range", "env.url must be http(s)://host[:port]/path", args=("env={kind: remote}",)),
    Case("env-prelude-role", "range", "env.prelude[0] must be a mapping with role",
         args=("env={kind: tools, tools: [{name: calculator}], prelude: [{role: robot, content: hi}]}",)),
    Case("env-unknown-credit", "range", "env.credit: 'step' is not one of episode, turn",
         args=("env={kind: tools, tools: [{name: calculator}], credit: step}",)),
    Case("env-turn-credit-gspo", "range", "env.credit='turn': gspo weighs whole sequences by one advantage",
         args=("env={kind: tools, tools: [{name: calculator}], credit: turn}", "algorithm.name=gspo")),
    Case("env-model-reward", "range", "rewards: a model term cannot score episodes",
         args=("env={kind: tools, tools: [{name: calculator}]}", "rewards=[{kind: model}]",
               "reward_model={model: {path: '{model}'}}")),
    Case("plan-prompt-len-zero", "range", "--prompt-len=0 must be >= 1", "plan", PLAN + ("--prompt-len", "0")),
    Case("plan-response-len-zero", "range", "--response-len=0 must be >= 1", "plan", PLAN + ("--response-len", "0")),
    Case("plan-prompts-negative", "range", "--prompts=-4 must be >= 1", "plan", PLAN + ("--prompts", "-4")),
    Case("plan-tflops-infinite", "range", "--gpu-tflops=inf", "plan", PLAN + ("--gpu-tflops", "inf")),
    Case("plan-memory-nan", "range", "--gpu-memory-gib=nan", "plan", PLAN + ("--gpu-memory-gib", "nan")),
    Case("plan-gpus-per-node-zero", "range", "--gpus-per-node=0 must be >= 1", "plan",
         PLAN + ("--gpus-per-node", "0")),
    Case("plan-gpus-zero", "range", "--gpus N (>= 1)", "plan", ("--model", "llama3.1-8b", "--gpus", "0")),
    Case("bench-refit-repeats-zero", "range", "--repeats=0 must be >= 1", "bench",
         ("refit", "--model", "{model}", "--repeats", "0")),
    Case("bench-logprob-batch-zero", "range", "--batch=0 must be >= 1", "bench", ("logprob", "--batch", "0")),
    Case("bench-scaling-ranks-zero", "range", "--ranks=0 must be >= 1", "bench", ("scaling", "--ranks", "0,2")),
    Case("bench-memory-tolerance-zero", "range", "--tolerance=0.0 must be > 0", "bench",
         ("memory", "--tolerance", "0")),
    # ---------------------------------------------------------------- checks that run too late
    Case("data-empty-file", "late", "bad.jsonl has no rows", recipe=data_file(b"")),
    Case("data-blank-lines", "late", "bad.jsonl has no rows", recipe=data_file(b"\n  \n")),
    Case("data-malformed-line", "late", "bad.jsonl:2: invalid JSON",
         recipe=data_file(b'{"prompt": "1+1"}\n{"prompt": \n')),
    Case("data-wrong-key", "late", "bad.jsonl:1: missing key 'prompt'", recipe=data_file(b'{"question": "1+1"}\n')),
    Case("data-non-object-row", "late", "bad.jsonl:2: a row must be a JSON object",
         recipe=data_file(b'{"prompt": "a"}\n["a", "b"]\n')),
    Case("data-prompt-not-text", "late", "bad.jsonl:1: 'prompt': prompt must be a string",
         recipe=data_file(b'{"prompt": 5}\n')),
    Case("data-not-utf8", "late", "bad.jsonl:2: not UTF-8",
         recipe=data_file(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')),
    Case("data-unknown-format", "late", "unknown format '.json'", recipe=data_file(b'{"prompt": "a"}\n', "p.json")),
    Case("data-missing-file", "late", "data.source: ", args=("data.source=/no/such/prompts.jsonl",)),
    Case("data-task-config", "late", "data.task_config: reasoning-gym task 'basic_arithmetic'",
         args=("data.source=reasoning_gym:basic_arithmetic", "data.task_config={no_such_option: 3}")),
    Case("data-task-unknown", "late", "reasoning-gym has no task 'no_such_task'",
         args=("data.source=reasoning_gym:no_such_task",)),
    Case("data-instruction-without-question", "late", "data.instruction='Solve it.' must contain {question}",
         args=("data.source=reasoning_gym:basic_arithmetic", "data.instruction=Solve it.")),
    Case("remote-url-scheme", "late", "rewards[0].url='ftp://scorer/score' must be http(s)",
         recipe=remote(url="ftp://scorer/score")),
    Case("remote-url-no-host", "late", "rewards[0].url='http:///score' must be http(s)",
         recipe=remote(url="http:///score")),
    Case("remote-url-port", "late", "rewards[0].url='http://scorer:99999/score' has a port outside",
         recipe=remote(url="http://scorer:99999/score")),
    Case("remote-url-space", "late", "must not contain spaces", recipe=remote(url="http://scorer/sc ore")),
    Case("remote-url-missing", "late", "rewards[0].url is required", recipe=remote()),
    Case("remote-timeout-zero", "late", "rewards[0].timeout_s=0.0 must be > 0",
         recipe=remote(url="http://scorer/score", timeout_s=0)),
    Case("remote-timeout-infinite", "late", "rewards[0].timeout_s=inf",
         recipe=remote(url="http://scorer/score", timeout_s=float("inf"))),
    Case("remote-concurrency-zero", "late", "rewards[0].max_concurrency=0 must be >= 1",
         recipe=remote(url="http://scorer/score", max_concurrency=0)),
    Case("remote-retries-negative", "late", "rewards[0].max_retries=-1 must be >= 0",
         recipe=remote(url="http://scorer/score", max_retries=-1)),
    Case("reward-extractor-unknown", "late", "rewards[0].extractor: unknown answer extractor 'nope'",
         recipe=lambda p: p.recipe({"rewards": [{"kind": "format", "extractor": "nope"}]})),
    Case("reward-kind-unknown", "late", "rewards[0].kind='oracle'",
         recipe=lambda p: p.recipe({"rewards": [{"kind": "oracle"}]})),
    Case("weights-contradict-config", "late", "model.embed_tokens.weight is [50, 64], config.json says [100, 64]",
         recipe=lambda p: p.recipe({"actor.model.path": str(p.tmp / "wrong_vocab")})),
    Case("weights-missing-tensor", "late", "lm_head.weight is missing",
         recipe=lambda p: p.recipe({"actor.model.path": str(p.tmp / "no_head")})),
    Case("output-dir-is-file", "late", "is a file, not a directory",
         recipe=lambda p: p.recipe({"output_dir": str(p.data)})),
    Case("output-dir-under-file", "late", "which is a file",
         recipe=lambda p: p.recipe({"output_dir": str(p.data / "run")})),
    Case("model-path-missing", "late", "actor.model.path: ", args=("actor.model.path=/no/such/model",)),
    # ---------------------------------------------------------------- held-out evaluation
    Case("eval-every-negative", "range", "eval.every=-1 must be >= 0", recipe=evals({}, every=-1)),
    Case("eval-samples-zero", "range", "eval.sets[0].samples=0 must be >= 1", recipe=evals({"samples": 0})),
    Case("eval-size-zero", "range", "eval.sets[0].size=0 must be >= 1", recipe=evals({"size": 0})),
    Case("eval-max-tokens-zero", "range", "eval.sets[0].max_tokens=0 must be >= 1", recipe=evals({"max_tokens": 0})),
    Case("eval-temperature-negative", "range", "eval.sets[0].temperature=-1.0 must be >= 0",
         recipe=evals({"temperature": -1})),
    Case("eval-samples-greedy", "range", "eval.sets[1].samples=4 needs eval.sets[1].temperature > 0",
         recipe=evals({}, {"name": "sampled", "samples": 4})),
    Case("eval-name-missing", "range", "eval.sets[0].name is not set", recipe=evals({"name": ""})),
    Case("eval-name-slash", "range", "eval.sets[0].name='a/b' must not contain '/'", recipe=evals({"name": "a/b"})),
    Case("eval-name-twice", "range", "eval.sets[1].name='sums' is also eval.sets[0].name", recipe=evals({}, {})),
    Case("eval-source-missing", "range", "eval.sets[0].source is not set", recipe=evals({"source": ""})),
    Case("eval-unknown-key", "yaml", "unknown key 'eval.sets[0].sample' (did you mean 'eval.sets[0].samples'?)",
         recipe=evals({"sample": 4})),
    Case("eval-context", "late", "eval.sets[0]: max_prompt_len + max_tokens = 320 exceeds rollout.max_model_len=256",
         recipe=evals({"max_prompt_len": 256})),
    Case("eval-task-unknown", "late", "eval.sets[0].source: reasoning-gym has no task 'no_such_task'",
         recipe=evals({"source": "reasoning_gym:no_such_task"})),
    Case("eval-task-config", "late", "eval.sets[0].task_config: reasoning-gym task 'chain_sum' refuses it",
         recipe=evals({"task_config": {"no_such_option": 3}})),
    Case("eval-file-missing", "late", "eval.sets[0].source: prompt file /no/such/eval.jsonl does not exist",
         recipe=evals({"source": "/no/such/eval.jsonl"})),
    Case("eval-seeds-overlap-training", "late", "eval.sets[0].seed=100: its entries (reasoning-gym seeds 100..107) "
         "overlap the training data's (data.seed=0, data.size=1000)",
         args=("data.source=reasoning_gym:chain_sum",), recipe=evals({"seed": 100})),
    # ---------------------------------------------------------------- tracebacks today
    Case("micro-batch-zero", "traceback", "actor.micro_batch_size=0 must be >= 1", args=("actor.micro_batch_size=0",)),
    Case("world-size-zero", "traceback", "actor.parallel.world_size=0 must be >= 1",
         args=("actor.parallel.world_size=0",)),
    Case("minibatches-zero", "traceback", "algorithm.minibatches=0 must be >= 1", args=("algorithm.minibatches=0",)),
    Case("rollout-tp-zero", "traceback", "rollout.tp=0 must be >= 1", args=("rollout.tp=0",)),
    Case("recipe-not-utf8", "traceback", "recipe.yaml:2: not UTF-8", recipe=raw(b"name: a\noutput_dir: caf\xe9\n")),
    Case("recipe-control-character", "traceback", "unacceptable character #x0000",
         recipe=raw("name: a\x00b\n")),
    Case("recipe-non-string-key", "traceback", "actor: key 1 is not a field name",
         recipe=raw("actor:\n  1: x\n")),
    Case("recipe-nested-too-deep", "traceback", "nested too deeply", recipe=raw("name: " + "[" * 5000 + "]" * 5000)),
    Case("recipe-is-directory", "yaml", "is a directory", recipe=None, args=("{tmp}",)),
    Case("plan-recipe-rollout-tp-zero", "traceback", "rollout.tp=0 must be >= 1", "plan",
         ("--model", "{recipe:rollout.tp=0}")),
    *[Case(f"plan-{flag[2:]}-zero", "traceback", f"{flag}=0", "plan", PLAN + (flag, "0"))
      for flag in ("--prompts", "--n", "--micro-batch", "--max-num-seqs", "--gpu-memory-gib", "--gpu-tflops",
                   "--hbm-gbps", "--nvlink-gbps", "--interconnect-gbps", "--pcie-gbps", "--train-mfu",
                   "--prefill-mfu", "--hbm-efficiency", "--link-efficiency")],
    Case("bench-refit-rollout-tp-zero", "traceback", "--rollout-tp=0 must be >= 1", "bench",
         ("refit", "--model", "{model}", "--rollout-tp", "0")),
    # ---------------------------------------------------------------- YAML
    # a second, complete actor block: YAML keeps the last one without a word
    Case("yaml-duplicate-role", "yaml", "recipe.yaml:14:1: duplicate key 'actor' (first at line 3)",
         recipe=raw(BASE_YAML + "actor:\n  model: {path: {model}}\n  parallel: {tp: 1, world_size: 1}\n"
                    "  micro_batch_size: 1\n")),
    Case("yaml-duplicate-nested", "yaml", "recipe.yaml:7:3: duplicate key 'parallel' (first at line 5)",
         recipe=raw(BASE_YAML.replace("  micro_batch_size: 2\n", "  micro_batch_size: 2\n  parallel: {tp: 1}\n"))),
    Case("yaml-duplicate-in-flow", "yaml", "duplicate key 'n' (first at line 7)",
         recipe=raw(BASE_YAML.replace("n: 2}", "n: 2, n: 4}"))),
    Case("yaml-alias-bomb", "yaml", "values once its anchors and aliases are expanded", recipe=raw(ALIAS_BOMB)),
    Case("yaml-recursive-alias", "yaml", "recursive alias",
         recipe=raw(BASE_YAML + "  task_config: {loop: &a [1, *a]}\n")),
    Case("yaml-syntax-error", "yaml", "recipe.yaml:4:1: invalid YAML: while parsing a flow node",
         recipe=raw("name: a\nactor:\n  model: [\n")),
    Case("yaml-top-level-list", "yaml", "the top level must be a mapping", recipe=raw("- a\n- b\n")),
    Case("yaml-too-large", "yaml", "larger than 1 MiB", recipe=raw(BASE_YAML + "# " + "x" * 2**21 + "\n")),
    Case("yaml-override-unparsable", "yaml", "override 'actor.parallel.tp=[': cannot parse value: column 2",
         args=("actor.parallel.tp=[",)),
    Case("yaml-override-duplicate-key", "yaml", "duplicate key 'tp'", args=("actor.parallel={tp: 1, tp: 2}",)),
]


class _Started(Exception):
    """A tripwire: the CLI went on to start the trainer, Ray or a pool of ranks."""


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    import torch
    from safetensors.torch import save_file

    from megarl.convert.mapping import hf_tensor_shapes
    from megarl.models.hf_arch import arch_from_hf_config

    def model(name: str, config: dict) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    p = Paths(tmp_path, model("llama", LLAMA), tmp_path / "prompts.jsonl", tmp_path / "out")
    p.data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(8)))
    model("long", {**LLAMA, "max_position_embeddings": 2**23})
    # weights that contradict config.json: a 50-token embedding for a 100-token vocabulary
    shapes = hf_tensor_shapes(arch_from_hf_config(LLAMA))
    wrong = model("wrong_vocab", LLAMA)
    save_file({name: torch.zeros((50, 64) if name == "model.embed_tokens.weight" else shape)
               for name, shape in shapes.items()}, str(wrong / "model.safetensors"))
    no_head = model("no_head", LLAMA)
    save_file({name: torch.zeros(shape) for name, shape in shapes.items() if name != "lm_head.weight"},
              str(no_head / "model.safetensors"))
    return p


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """The modules validation imports, loaded once: the time limit is on the CLI's work, not on
    the first import of torch (the subprocess tests time a cold start)."""
    import reasoning_gym  # noqa: F401

    import megarl.cli.main  # noqa: F401
    import megarl.convert.checkpoint  # noqa: F401
    import megarl.convert.hf_io  # noqa: F401
    import megarl.validation.checks  # noqa: F401


@pytest.fixture
def tripwires(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the trainer, Ray or a pool of ranks raises _Started instead."""
    def started(*args, **kwargs):
        raise _Started("a Ray or rank process would start")

    loop = types.ModuleType("megarl.trainer.loop")
    loop.train = started
    monkeypatch.setitem(sys.modules, "megarl.trainer.loop", loop)
    import megarl.cluster.ray_env
    import megarl.distributed.spmd

    monkeypatch.setattr(megarl.cluster.ray_env, "ensure_ray", started)
    monkeypatch.setattr(megarl.distributed.spmd.SpmdPool, "__init__", started)


def _argv(case: Case, p: Paths) -> list[str]:
    def fill(arg: str) -> str:
        if arg.startswith("{recipe:"):  # a recipe file with one dotted change, for `plan --model`
            key, value = arg[len("{recipe:"):-1].split("=")
            path = p.tmp / "plan-recipe.yaml"
            path.write_text(p.recipe({key: yaml.safe_load(value)}))
            return str(path)
        return arg.replace("{model}", str(p.model)).replace("{tmp}", str(p.tmp))

    if case.command != "train":
        return [case.command, *map(fill, case.args)]
    if case.args and case.args[0] == "{tmp}":  # the recipe argument itself is wrong
        return ["train", fill(case.args[0])]
    text = (case.recipe or (lambda q: q.recipe()))(p)
    recipe = p.tmp / "recipe.yaml"
    recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    return ["train", str(recipe), *case.args]


def _modes(case: Case) -> list[list[str]]:
    return [["--check"], []] if case.command == "train" else [[]]


@pytest.mark.usefixtures("tripwires")
@pytest.mark.parametrize("case", CASES, ids=[f"{c.kind}:{c.id}" for c in CASES])
def test_refused_in_one_line_before_anything_starts(case: Case, paths: Paths, capsys: pytest.CaptureFixture):
    from megarl.cli.main import main

    for extra in _modes(case):
        argv = _argv(case, paths) + extra
        capsys.readouterr()
        began = time.monotonic()
        try:
            code = main(argv)
        except _Started:
            pytest.fail(f"{' '.join(extra) or 'without --check'}: accepted; the run would start Ray")
        except SystemExit as e:  # argparse refusals
            code = e.code
        elapsed = time.monotonic() - began
        err = capsys.readouterr().err.strip()
        mode = " ".join(extra) or "without --check"
        assert code not in (0, None), f"{mode}: exit code {code}; stderr: {err!r}"
        assert "Traceback" not in err, f"{mode}: {err}"
        assert len(err.splitlines()) == 1, f"{mode}: not one line: {err!r}"
        assert case.expect in err, f"{mode}: {err!r} does not name {case.expect!r}"
        assert elapsed < IN_PROCESS_LIMIT_S, f"{mode}: took {elapsed:.1f} s"
        assert not paths.out.exists(), f"{mode}: output_dir was created"


def test_the_corpus_covers_every_kind():
    kinds = {c.kind for c in CASES}
    assert kinds == {"range", "late", "traceback", "yaml"}
    assert len({c.id for c in CASES}) == len(CASES)


def test_a_valid_base_recipe_passes(paths: Paths, capsys: pytest.CaptureFixture):
    """The corpus's base recipe is accepted, so each case fails for its own fault only."""
    from megarl.cli.main import main

    recipe = paths.tmp / "recipe.yaml"
    recipe.write_text(paths.recipe())
    assert main(["train", str(recipe), "--check"]) == 0, capsys.readouterr().err
    recipe.write_text(BASE_YAML.replace("{model}", str(paths.model)).replace("{data}", str(paths.data))
                      .replace("{out}", str(paths.out)))
    assert main(["train", str(recipe), "--check"]) == 0, capsys.readouterr().err


def test_a_valid_eval_section_passes(paths: Paths, capsys: pytest.CaptureFixture):
    """A greedy and a sampled set over the training task, past its seeds, are accepted."""
    from megarl.cli.main import main

    recipe = paths.tmp / "recipe.yaml"
    recipe.write_text(evals({}, {"name": "sampled", "samples": 4, "temperature": 1.0, "max_tokens": 32},
                            every=2)(paths))
    assert main(["train", str(recipe), "data.source=reasoning_gym:chain_sum", "--check"]) == 0, \
        capsys.readouterr().err


def test_modest_anchors_and_merge_keys_still_load(paths: Paths):
    from megarl.config.loader import load_config
    from megarl.config.schema import RunConfig

    recipe = paths.tmp / "anchors.yaml"
    recipe.write_text(BASE_YAML.replace("{model}", str(paths.model)).replace("{data}", str(paths.data))
                      .replace("{out}", str(paths.out))
                      .replace("  parallel: {tp: 1, world_size: 1}\n",
                               "  parallel: &one {tp: 1, world_size: 1}\n")
                      + "reference:\n  model: {path: " + str(paths.model) + "}\n  parallel:\n    <<: *one\n"
                      "    tp: 1\n")
    cfg = load_config(RunConfig, recipe)
    assert cfg.reference.parallel.world_size == 1


# ---------------------------------------------------------------- real processes

def _cli(cli: Cli, *args: str, env_extra: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    began = time.monotonic()
    result = cli(*args, env=env, timeout=300)
    return result, time.monotonic() - began


@pytest.mark.parametrize("case_id", ["yaml-duplicate-role", "micro-batch-zero", "data-malformed-line",
                                     "plan-micro-batch-zero"])
def test_subprocess_refuses_without_starting_ray(case_id: str, paths: Paths, cli: Cli):
    # Without --check only: the run that would start Ray if the refusal came late. `train --check`
    # takes the same path to the same line, and test_refused_in_one_line_before_anything_starts
    # runs every case in both modes (in this process, under tripwires); one interpreter start-up
    # per case is what this test adds: the real entry point, and stderr free of import noise.
    case = next(c for c in CASES if c.id == case_id)
    ray_tmp = paths.tmp / "ray"  # where a Ray started by this process would put its session
    result, elapsed = _cli(cli, *_argv(case, paths), env_extra={"RAY_TMPDIR": str(ray_tmp)})
    err = result.stderr.strip()
    assert result.returncode not in (0, None), err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert case.expect in err, err
    assert elapsed < SUBPROCESS_LIMIT_S
    assert not ray_tmp.exists() and not paths.out.exists()


# ---------------------------------------------------------------- the remote reward client

class _RawServer:
    """A loopback TCP server that answers each connection with ``handle(conn)``."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.stop = threading.Event()
        self.handle = handle
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5)
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(65536)
                self.handle(conn)
            except OSError:
                pass  # the client gave up: what the tests want

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def raw_server() -> Iterator[Callable[[Callable[[socket.socket], None]], _RawServer]]:
    servers: list[_RawServer] = []

    def start(handle: Callable[[socket.socket], None]) -> _RawServer:
        servers.append(_RawServer(handle))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _sample():
    from megarl.rewards import RewardInput

    return [RewardInput(prompt="p", response="r", metadata={})]


def test_remote_deadline_bounds_the_whole_call_not_each_read(raw_server):
    """A server that trickles a valid answer a byte every 0.1 s never trips a 0.5 s read timeout,
    but the attempt as a whole must end at 0.5 s."""
    from megarl.rewards.remote import RemoteReward, RemoteRewardError

    body = b'{"rewards": [1.0]}' + b" " * 200

    def trickle(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
        conn.sendall(f"Content-Length: {len(body)}\r\n\r\n".encode())
        for byte in body:
            conn.sendall(bytes([byte]))
            time.sleep(0.1)

    server = raw_server(trickle)
    reward = RemoteReward(server.url, timeout_s=0.5, max_retries=0)
    began = time.monotonic()
    with pytest.raises(RemoteRewardError, match="timed out after 0.5 s"):
        reward(_sample())
    assert time.monotonic() - began < 2.0  # the trickle takes 20 s


def test_remote_deadline_bounds_trickled_headers(raw_server):
    from megarl.rewards.remote import RemoteReward, RemoteRewardError

    def slow_headers(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        for _ in range(100):
            conn.sendall(b"X-Wait: 1\r\n")
            time.sleep(0.1)

    server = raw_server(slow_headers)
    reward = RemoteReward(server.url, timeout_s=0.5, max_retries=1, backoff_s=0.01)
    began = time.monotonic()
    with pytest.raises(RemoteRewardError, match="2 attempts; last failure: timed out after 0.5 s"):
        reward(_sample())
    assert time.monotonic() - began < 3.0


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "close-delimited"])
def test_remote_answer_size_is_capped(raw_server, declared):
    from megarl.rewards.remote import RemoteReward, RemoteRewardError

    sent = []

    def flood(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     + (b"Content-Length: 1000000000\r\n" if declared else b"Connection: close\r\n") + b"\r\n")
        conn.sendall(b'{"rewards": [1.0], "pad": "')
        for _ in range(64):  # up to 64 MiB, far past the cap
            conn.sendall(b"x" * 2**20)
            sent.append(1)

    server = raw_server(flood)
    reward = RemoteReward(server.url, timeout_s=10, max_retries=2, max_response_bytes=2**20)
    with pytest.raises(RemoteRewardError, match=r"larger than 1048576 bytes \(max_response_bytes\); not retried"):
        reward(_sample())
    assert reward.stats.requests == 1  # a server that floods is wrong, not busy
    assert len(sent) < 64  # the client stopped reading at the cap


def test_remote_a_small_answer_still_scores(raw_server):
    from megarl.rewards.remote import RemoteReward

    def answer(conn: socket.socket) -> None:
        body = b'{"rewards": [0.5]}'
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    server = raw_server(answer)
    assert RemoteReward(server.url, timeout_s=2, max_response_bytes=64)(_sample()) == [0.5]


@pytest.mark.parametrize("url, problem", [
    ("ftp://h/score", "must be http(s)"), ("http:///score", "must be http(s)"),
    ("http://h:70000/score", "port outside"), ("http://h/a b", "spaces"), ("http://u:pw@h/score", "credentials"),
])
def test_remote_url_problems(url, problem):
    from megarl.rewards.remote import RemoteReward, url_problem

    assert problem in url_problem(url)
    with pytest.raises(ValueError, match="RemoteReward: url"):
        RemoteReward(url)
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        RemoteReward("http://h/score", timeout_s=float("inf"))
