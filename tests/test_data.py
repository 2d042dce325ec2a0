"""Prompt data: loaders and their errors, reasoning-gym prompts, the resumable dataset,
the SmolLM2 chat template, token-budget micro-batching, packing and padding."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from megarl.data import (
    PromptDataset,
    PromptItem,
    from_reasoning_gym,
    load_jsonl,
    load_parquet,
    load_prompts,
    pack_sequences,
    pad_right,
    token_budget_microbatches,
    tokenize_prompts,
)
from megarl.data.batching import plan_microbatches, plan_shared_prompts
from megarl.rewards import ReasoningGymReward, RewardInput

# ---------------------------------------------------------------- loaders


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl_prompts_and_messages(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "What is 2+2?", "answer": "4", "id": 1}),
        "",
        json.dumps({"prompt": "What is 3+3?", "answer": "6", "id": 2}),
    ])
    items = load_jsonl(path)
    assert [i.prompt for i in items] == ["What is 2+2?", "What is 3+3?"]
    assert items[1].metadata == {"answer": "6", "id": 2} and items[1].messages is None
    assert load_jsonl(path, metadata_keys=["answer"])[0].metadata == {"answer": "4"}
    assert load_prompts(path)[0].prompt == "What is 2+2?"

    row = {"msgs": [{"role": "user", "content": "hi"}], "answer": "x"}
    chat = _write_jsonl(tmp_path / "c.jsonl", [json.dumps(row)])
    item = load_jsonl(chat, prompt_key=None, messages_key="msgs")[0]
    assert item.messages == [{"role": "user", "content": "hi"}] and item.metadata == {"answer": "x"}


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "ok"', r"bad\.jsonl:2: invalid JSON"),
    ('["not", "an", "object"]', r"bad\.jsonl:2: a row must be a JSON object"),
    ('{"question": "no prompt key"}', r"bad\.jsonl:2: missing key 'prompt'"),
    ('{"prompt": 3}', r"bad\.jsonl:2: 'prompt': prompt must be a string"),
])
def test_load_jsonl_names_file_and_line(tmp_path, line, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"prompt": "fine"}), line])
    with pytest.raises(ValueError, match=message):
        load_jsonl(path)


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        load_jsonl(tmp_path / "missing.jsonl")
    path = _write_jsonl(tmp_path / "m.jsonl", [json.dumps({"msgs": [{"role": "robot", "content": "x"}]})])
    with pytest.raises(ValueError, match=r"m\.jsonl:1: 'msgs': messages\[0\] has role 'robot'"):
        load_jsonl(path, prompt_key=None, messages_key="msgs")
    with pytest.raises(ValueError, match="exactly one of prompt_key"):
        load_jsonl(path, prompt_key="prompt", messages_key="msgs")
    with pytest.raises(ValueError, match="unknown format '.csv'"):
        load_prompts(tmp_path / "p.csv")
    with pytest.raises(ValueError, match="exactly one of messages"):
        PromptItem()


def test_load_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    if importlib.util.find_spec("pyarrow") is None:
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="needs pyarrow"):
            load_parquet(path)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    assert [(i.prompt, i.metadata) for i in load_parquet(path)] == [("a", {"answer": "1"}), ("b", {"answer": "2"})]


# ---------------------------------------------------------------- reasoning-gym prompts


def test_from_reasoning_gym_builds_scorable_chat_prompts():
    items = from_reasoning_gym("basic_arithmetic", size=5, seed=0, system_prompt="Be brief.")
    assert len(items) == 5
    first = items[0]
    assert first.messages[0] == {"role": "system", "content": "Be brief."}
    assert first.messages[1]["role"] == "user"
    assert first.messages[1]["content"].startswith(first.metadata["entry"]["question"])
    assert first.messages[1]["content"].endswith("Give the final answer inside <answer></answer>.")
    assert first.metadata["answer"] == first.metadata["entry"]["answer"]
    # The metadata is what the reward needs: the same items score a correct answer 1.
    reward = ReasoningGymReward("basic_arithmetic")
    samples = [RewardInput("", f"<answer>{i.metadata['answer']}</answer>", i.metadata) for i in items]
    assert reward(samples) == [1.0] * 5
    again = from_reasoning_gym("basic_arithmetic", size=5, seed=0, instruction_template="Q: {question} {x}")
    assert again[0].messages == [{"role": "user", "content": f"Q: {first.metadata['entry']['question']} {{x}}"}]
    with pytest.raises(ValueError, match="must contain '{question}'"):
        from_reasoning_gym("basic_arithmetic", size=5, seed=0, instruction_template="no slot")


# ---------------------------------------------------------------- dataset


def _take(dataset: PromptDataset, n: int) -> list[list[int]]:
    return [dataset.next_batch() for _ in range(n)]


def test_dataset_epochs_are_deterministic_permutations():
    items = list(range(10))
    dataset = PromptDataset(items, batch_size=3, seed=7)
    assert len(dataset) == 3
    epoch0, epoch1 = _take(dataset, 3), _take(dataset, 3)
    assert all(len(b) == 3 for b in epoch0 + epoch1)
    seen0 = [x for b in epoch0 for x in b]
    assert len(set(seen0)) == 9  # one item of 10 left over (drop_last)
    assert epoch0 != epoch1  # reshuffled per epoch
    assert _take(PromptDataset(items, batch_size=3, seed=7), 6) == epoch0 + epoch1  # same seed, same batches
    assert _take(PromptDataset(items, batch_size=3, seed=8), 3) != epoch0
    assert _take(PromptDataset(items, batch_size=3, shuffle=False), 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]
    tail = PromptDataset(items, batch_size=4, shuffle=False, drop_last=False)
    assert len(tail) == 3 and _take(tail, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]


@pytest.mark.parametrize("k", [0, 1, 3, 4, 7])
def test_dataset_resume_gives_the_same_next_batches(k):
    items = [f"prompt {i}" for i in range(11)]
    original = PromptDataset(items, batch_size=4, seed=3)
    _take(original, k)
    state = json.loads(json.dumps(original.state_dict()))  # as a checkpoint stores it
    assert all(type(v) is int for v in state.values())
    resumed = PromptDataset(items, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    assert _take(resumed, 6) == _take(original, 6)
    assert resumed.state_dict() == original.state_dict()


def test_dataset_rejects_mismatched_state():
    dataset = PromptDataset(list(range(10)), batch_size=2, seed=1)
    state = dataset.state_dict()
    with pytest.raises(ValueError, match="num_items is 10 in the checkpoint but 9 now"):
        PromptDataset(list(range(9)), batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed is 1 in the checkpoint but 2 now"):
        PromptDataset(list(range(10)), batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(KeyError, match="missing 'position'"):
        dataset.load_state_dict({k: v for k, v in state.items() if k != "position"})
    with pytest.raises(ValueError, match="batch_size 11 > 10 prompts"):
        PromptDataset(list(range(10)), batch_size=11)


# ---------------------------------------------------------------- chat template (SmolLM2)


@pytest.fixture(scope="module")
def tokenizer():
    # The class AutoTokenizer resolves to for this folder (TokenizersBackend in transformers 5),
    # named directly: importing AutoTokenizer's registry costs seconds that this test does not need.
    from transformers import PreTrainedTokenizerFast

    from megarl.models.bundled import smollm2_path

    return PreTrainedTokenizerFast.from_pretrained(smollm2_path())


def test_chat_template_prompt_ids(tokenizer):
    items = from_reasoning_gym("basic_arithmetic", size=3, seed=0)
    result = tokenize_prompts(tokenizer, items, max_prompt_len=512)
    assert result.kept == [0, 1, 2] and not result.dropped and not result.truncated
    text = tokenizer.decode(result.ids[1])
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt
    assert items[1].metadata["entry"]["question"] in text
    assert text.endswith("<answer></answer>.<|im_end|>\n<|im_start|>assistant\n")  # generation prompt
    assert text.count("<|im_start|>") == 3  # template's special tokens once: no extra BOS
    plain = tokenize_prompts(tokenizer, [PromptItem(prompt=items[1].messages[0]["content"])], 512)
    assert plain.ids == [result.ids[1]]  # plain text goes in as one user message
    raw = tokenize_prompts(tokenizer, [PromptItem(prompt="2+2=")], 512, use_chat_template=False)
    assert tokenizer.decode(raw.ids[0]) == "2+2="


def test_overlong_prompts(tokenizer):
    items = [PromptItem(prompt="hi"), PromptItem(prompt="word " * 200), PromptItem(prompt="yo")]
    limit = len(tokenize_prompts(tokenizer, items[:1], 512).ids[0]) + 2
    with pytest.raises(ValueError, match=rf"prompt 1 has \d+ tokens > max_prompt_len {limit}"):
        tokenize_prompts(tokenizer, items, limit)
    filtered = tokenize_prompts(tokenizer, items, limit, overlong="filter")
    assert filtered.kept == [0, 2] and filtered.dropped == [1]
    cut = tokenize_prompts(tokenizer, items, limit, overlong="truncate_left")
    assert cut.truncated == [1] and len(cut.ids[1]) == limit
    assert tokenizer.decode(cut.ids[1]).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="overlong must be one of"):
        tokenize_prompts(tokenizer, items, limit, overlong="drop")


# ---------------------------------------------------------------- batching


@pytest.mark.parametrize("seed", range(5))
def test_microbatches_respect_budget_and_cover_once(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
    budget = 1024
    groups = token_budget_microbatches(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) * max(lengths[i] for i in g) <= budget for g in groups)
    assert groups == token_budget_microbatches(lengths, budget)  # deterministic
    # Greedy closes a group only when the next sample would not fit.
    for group, following in zip(groups, groups[1:], strict=False):
        assert (len(group) + 1) * lengths[group[0]] > budget or not following


def test_microbatch_examples_and_errors():
    assert token_budget_microbatches([4, 8, 4, 2, 8], 16) == [[1, 4], [0, 2, 3]]
    assert token_budget_microbatches([], 16) == []
    with pytest.raises(ValueError, match="sample 2 has 17 tokens > max_tokens 16"):
        token_budget_microbatches([1, 2, 17], 16)


def test_pack_round_trips():
    rng = random.Random(0)
    seqs = [[rng.randrange(1000) for _ in range(rng.randint(1, 50))] for _ in range(40)]
    packed = pack_sequences(seqs, max_len=64)
    assert packed.unpack() == seqs
    assert sorted(i for row in packed.seq_index for i in row) == list(range(40))
    for row, cu in zip(packed.tokens, packed.cu_seqlens, strict=True):
        assert cu[0] == 0 and cu[-1] == len(row) <= 64
    positions = packed.position_ids()
    assert [len(p) for p in positions] == [len(r) for r in packed.tokens]
    assert sum(p.count(0) for p in positions) == 40  # one restart per sequence
    # First fit: no sequence of a later row would fit into an earlier one (rows only grow).
    for r, cu in enumerate(packed.cu_seqlens):
        for later in packed.seq_index[r + 1:]:
            assert all(cu[-1] + len(seqs[i]) > 64 for i in later)
    small = pack_sequences([[1, 2], [3, 4, 5], [6]], max_len=4)
    assert small.tokens == [[3, 4, 5, 6], [1, 2]] and small.cu_seqlens == [[0, 3, 4], [0, 2]]
    with pytest.raises(ValueError, match="sequence 1 has 5 tokens > max_len 4"):
        pack_sequences([[1], [1, 2, 3, 4, 5]], max_len=4)
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        pack_sequences([[]], max_len=4)


def test_pad_right():
    tokens, mask = pad_right([[5, 6, 7], [8], []], pad_id=0)
    assert tokens.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert mask.dtype == torch.bool and mask.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    tokens, mask = pad_right([[1, 2]], pad_id=9, pad_to=4)
    assert tokens.tolist() == [[1, 2, 9, 9]] and mask.sum().item() == 2
    with pytest.raises(ValueError, match="pad_to 1 is shorter"):
        pad_right([[1, 2]], pad_id=0, pad_to=1)


def _rows_of(plan, lengths):
    """The plan's input rows with token ``1000 * sequence + position`` (-1: padding)."""
    rows = torch.full((plan.rows, plan.width), -1)
    for k, i in enumerate(plan.index):
        rows[plan.row[k], plan.start[k]:plan.start[k] + lengths[i]] = 1000 * i + torch.arange(lengths[i])
    return rows


@pytest.mark.parametrize("mode", [{"max_tokens": 40}, {"pack": True}, {"pack": True, "max_tokens": 70}])
def test_microbatch_plans_cover_every_sequence_and_never_cross_a_boundary(mode):
    rng = random.Random(1)
    lengths = [rng.randint(2, 32) for _ in range(23)]
    plans = plan_microbatches(lengths, width=32, micro_batch_size=3, multiple=2, **mode)
    assert sorted(i for p in plans for i in p.index) == list(range(23))
    assert plans == plan_microbatches(lengths, width=32, micro_batch_size=3, multiple=2, **mode)
    for plan in plans:
        assert plan.width % 2 == 0 and plan.width <= (32 if mode != {"pack": True, "max_tokens": 70} else 70)
        budget = mode.get("max_tokens")
        if budget is not None:
            assert plan.rows * (plan.width - 1) <= budget  # up to rounding the width to the multiple
        if "pack" not in mode:
            assert not plan.packed and plan.width - 1 <= max(plan.length) <= plan.width
        else:
            assert plan.rows == 1 and plan.width <= budget + 1 if budget else plan.rows <= 3
        rows = _rows_of(plan, lengths)
        # a label position's prediction target is the next token of the same sequence
        index, valid = plan.label_gather()
        targets = rows[:, 1:].reshape(-1)[index]
        for k, i in enumerate(plan.index):
            assert valid[k].sum() == lengths[i] - 1
            assert targets[k, :lengths[i] - 1].tolist() == [1000 * i + t for t in range(1, lengths[i])]
        for r, bounds in enumerate(plan.segments()):
            # each row: its sequences back to back from column 0, then (maybe) a padding tail
            assert bounds[0] == 0 and bounds[-1] == plan.width and bounds == sorted(set(bounds))
            members = sorted(plan.start[k] for k in range(len(plan.index)) if plan.row[k] == r)
            assert members == bounds[:len(members)]
    packed_tokens = sum(p.rows * p.width for p in plans)
    if "pack" in mode:
        assert packed_tokens < 0.8 * 32 * 23  # most of the padding is gone


def test_fixed_plans_keep_todays_microbatches():
    plans = plan_microbatches([5, 3, 8, 2], width=8, micro_batch_size=2)
    assert [(p.index, p.rows, p.width) for p in plans] == [([0, 1], 2, 8), ([2, 3], 2, 8)]
    # a width the sequence dimension must divide by (2 x cp = 4 chunks, say) is padded up to it
    plans = plan_microbatches([5, 3, 6, 2], width=6, micro_batch_size=2, multiple=4)
    assert [(p.index, p.rows, p.width, p.length) for p in plans] == [([0, 1], 2, 8, [5, 3]), ([2, 3], 2, 8, [6, 2])]
    with pytest.raises(ValueError, match="4 sequences per data-parallel rank are not a multiple of micro_batch_size=3"):
        plan_microbatches([5, 3, 8, 2], width=8, micro_batch_size=3)
    with pytest.raises(ValueError, match="sequence 2 has 9 tokens > width 8"):
        plan_microbatches([5, 3, 9, 2], width=8, micro_batch_size=2, pack=True)


def test_packed_plan_example():
    # rows as long as the longest sequence (7), filled longest first: [7], [5, 2], [3]; two rows each
    first, second = plan_microbatches([5, 3, 2, 7], width=8, micro_batch_size=2, pack=True)
    assert first.index == [3, 0, 2] and first.row == [0, 1, 1] and first.start == [0, 0, 5]
    assert first.packed and first.width == 7 and first.segments() == [[0, 7], [0, 5, 7]]
    assert second.index == [1] and not second.packed and second.width == 3


def test_shared_prompt_plan_example():
    # two groups: sequences 0-2 share a 3-token prompt, 3-4 a 2-token one; a budget of 9 tokens
    # per row splits the first group (3 + 2 + 3 = 8 fits, + 4 does not) and gives its last response
    # a row of its own with its own copy of the prompt; rows of 8, 7 and 5 tokens then take a
    # micro-batch each (two rows padded to 8 would break the budget)
    lengths, prompts = [5, 6, 7, 4, 3], [3, 3, 3, 2, 2]
    same = [False, True, True, False, True]
    plans = plan_shared_prompts(lengths, prompts, same, micro_batch_size=8, max_tokens=9)
    rows = [(p.index, p.row, p.start, p.width) for p in plans]
    assert rows == [([0, 1], [0, 0], [3, 5], 8), ([2], [0], [3], 7), ([3, 4], [0, 0], [2, 4], 5)], rows
    # a budget of 16: both groups whole in one row each (12 and 5 tokens), one micro-batch each
    assert [(p.index, p.rows) for p in plan_shared_prompts(lengths, prompts, same, 8, max_tokens=16)] == \
        [([0, 1, 2], 1), ([3, 4], 1)]
    assert [(p.index, p.rows) for p in plan_shared_prompts(lengths, prompts, same, 8, max_tokens=24)] == \
        [([0, 1, 2, 3, 4], 2)]
    first = plans[0]
    assert first.width == 8 and first.shared == [3, 3] and first.packed
    assert first.columns(1).tolist() == [0, 1, 2, 5, 6, 7]
    positions, segment, prefix = first.layout()
    assert positions.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5]]  # each response continues from the prompt
    # the second response may see the prompt and itself, not the first response
    allowed = [segment[0, k] in (segment[0, 6], prefix[0, 6]) for k in range(7)]
    assert allowed == [True, True, True, False, False, True, True]
    index, valid = first.label_gather()  # label positions: each token's column but the last, width - 1 = 7 per row
    assert index[1, :5].tolist() == [0, 1, 2, 5, 6] and valid[1].all() and not valid[0, 4]
    with pytest.raises(ValueError, match="varlen"):
        first.segments()
    # without a budget: micro_batch_size responses per row, one row per micro-batch
    plans = plan_shared_prompts(lengths, prompts, same, micro_batch_size=2)
    assert [p.index for p in plans] == [[0, 1], [2], [3, 4]]
    with pytest.raises(ValueError, match="sequence 1: prompt of 6 tokens"):
        plan_shared_prompts([5, 6], [3, 6], [False, True], micro_batch_size=2)
