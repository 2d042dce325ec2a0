"""``megarl sft / rm / dpo`` end to end on CPU (a tiny Llama with SmolLM2's tokenizer, Ray workers):
SFT and DPO resume bit for bit, the reward model exports as a transformers sequence classifier
that ranks the held-out pairs as the run measured, and bad data is refused naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.cli.main import main


@pytest.fixture(scope="module")
def policy(tiny_policy) -> Path:
    return tiny_policy


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sft_records(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} + {i + 1}?"},
                          {"role": "assistant", "content": f"{2 * i + 1}"},
                          {"role": "user", "content": "And doubled?"},
                          {"role": "assistant", "content": f"{4 * i + 2}"}]} for i in range(n)]


def _pair_records(n: int) -> list[dict]:
    return [{"prompt": f"What is {i} + {i + 1}?", "chosen": f"{2 * i + 1}", "rejected": f"{2 * i + 3}, I think",
             **({"margin": 0.5} if i % 2 else {})} for i in range(n)]


def _recipe(tmp_path: Path, name: str, policy: Path, data: Path, **extra: str) -> Path:
    text = f"""name: {name}
output_dir: {tmp_path / name}
model:
  model: {{path: "{policy}"}}
  parallel: {{tp: 1, world_size: 1}}
  optim: {{lr: 1.0e-3, warmup_steps: 0}}
  micro_batch_size: 4
data: {{train: "{data}", eval_size: 4, batch_size: 4, max_len: 128}}
trainer: {{steps: 3, checkpoint_every: 1, tensorboard: false}}
"""
    path = tmp_path / f"{name}.yaml"
    path.write_text(text + "".join(f"{k}: {v}\n" for k, v in extra.items()))
    return path


def _history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_times(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history]


@pytest.mark.parametrize("stage,records", [("sft", _sft_records(16)), ("dpo", _pair_records(12))])
def test_a_stage_learns_and_resumes_bit_for_bit(tmp_path, policy, stage, records, starts_processes):
    data = _write_jsonl(tmp_path / "train.jsonl", records)
    whole = _recipe(tmp_path, "whole", policy, data)
    assert main([stage, str(whole)]) == 0
    expected = _history(tmp_path / "whole")
    assert [h["step"] for h in expected] == [0, 1, 2, 3]
    loss = f"model/{stage}_loss"
    assert expected[-1]["eval/heldout/loss"] < expected[0]["eval/heldout/loss"]  # it learns the held-out answers
    parted = _recipe(tmp_path, "parted", policy, data)
    assert main([stage, str(parted), "trainer.steps=2"]) == 0
    assert main([stage, str(parted)]) == 0  # resumes after step 2's checkpoint
    got = _history(tmp_path / "parted")
    assert [h["step"] for h in got] == [0, 1, 2, 3]
    # step 2 of the first part was its last step: it evaluated there; the uninterrupted run did not
    assert [h[loss] for h in _without_times(got)[1:]] == [h[loss] for h in _without_times(expected)[1:]]
    assert got[-1]["eval/heldout/loss"] == expected[-1]["eval/heldout/loss"]
    assert (tmp_path / "parted" / "plots" / f"{stage}_loss.png").is_file()
    assert (tmp_path / "parted" / "final").resolve() == (tmp_path / "parted/checkpoints/step_000003/model")
    if stage == "dpo":  # the reference's log-probs computed once at the start, its group then stopped
        once = _recipe(tmp_path, "once", policy, data)
        assert main([stage, str(once), "dpo.precompute_reference=true"]) == 0
        got = _history(tmp_path / "once")
        for h, e in zip(got, expected, strict=True):  # other batch shapes: equal to float rounding
            assert h.get(loss, 0.0) == pytest.approx(e.get(loss, 0.0), abs=1e-5)
            assert h.get("eval/heldout/loss", 0.0) == pytest.approx(e.get("eval/heldout/loss", 0.0), abs=1e-5)


@pytest.mark.parametrize("source", ["hf", "megarl"])
def test_the_reward_model_exports_as_a_sequence_classifier_ranking_pairs_as_measured(tmp_path, policy, source,
                                                                                    starts_processes):
    """From a language model (an HF folder, or a megarl checkpoint such as an SFT stage's): the
    backbone is read, the score head starts from its initialisation."""
    import transformers

    from megarl.config.loader import load_config
    from megarl.config.supervised import SupervisedConfig
    from megarl.trainer.supervised import load_stage_data

    start = policy
    if source == "megarl":
        start = tmp_path / "lm-ckpt"
        assert main(["convert", "hf-to-mcore", "--hf", str(policy), "--out", str(start)]) == 0
        from megarl.models.hf_arch import arch_from_hf_dir
        from megarl.validation.role_checks import weights_errors

        # as `megarl train`'s reward model, a language model's checkpoint is refused before start
        (error,) = weights_errors("reward_model", str(start), arch_from_hf_dir(policy))
        assert "is a language model's checkpoint (no value head)" in error
    data = _write_jsonl(tmp_path / "pairs.jsonl", _pair_records(12))
    recipe = _recipe(tmp_path, "rm", start, data)
    assert main(["rm", str(recipe)]) == 0
    final = _history(tmp_path / "rm")[-1]
    out = tmp_path / "rm-hf"
    assert main(["convert", "mcore-to-hf", "--ckpt", str(tmp_path / "rm/checkpoints/step_000003/model"),
                 "--out", str(out)]) == 0
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    cfg = load_config(SupervisedConfig, recipe)
    cfg.stage = "rm"
    held_out = load_stage_data(cfg, transformers.AutoTokenizer.from_pretrained(policy)).eval
    with torch.no_grad():
        scores = [[model(torch.tensor([seq.tokens])).logits[0, 0].item() for seq in (p.chosen, p.rejected)]
                  for p in held_out]
    accuracy = sum(c > r for c, r in scores) / len(scores)
    assert accuracy == final["eval/heldout/accuracy"]
    loss = sum(torch.nn.functional.softplus(torch.tensor(r - c)).item() for c, r in scores) / len(scores)
    assert loss == pytest.approx(final["eval/heldout/loss"], abs=1e-4)


@pytest.mark.parametrize("stage,record,message", [
    ("dpo", {"prompt": "2+2?", "chosen": "4"}, "bad.jsonl:3: 'rejected' is missing"),
    ("sft", {"messages": [{"role": "user", "content": "hi"}]}, "bad.jsonl:3: the conversation has no assistant"),
    ("sft", {"prompt": "hi", "response": 4}, "bad.jsonl:3: 'response' is missing or not a non-empty text"),
    ("rm", {"prompt": "2+2?", "chosen": "4", "rejected": "5", "margin": "big"}, "bad.jsonl:3: 'margin' must be"),
    ("dpo", {"prompt": "2+2?", "completion": "4", "label": "yes"}, "bad.jsonl:3: 'label' must be true"),
    ("dpo", {"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "bad.jsonl:3: an unpaired record ({prompt, "),
    ("dpo", None, "data.train: unpaired records ({prompt, completion, label}) train with `megarl dpo` and "
                  "dpo.loss_type: kto, not dpo loss_type sigmoid"),
])
def test_bad_records_are_refused_before_any_process_starts(tmp_path, policy, capsys, stage, record, message):
    good = _pair_records(2) if stage != "sft" else _sft_records(2)
    if "unpaired" in message or "label" in message:  # a file of unpaired (KTO) records
        good = _unpaired_records(1)
    data = _write_jsonl(tmp_path / "bad.jsonl", [*good, record] if record else _unpaired_records(6))
    assert main([stage, str(_recipe(tmp_path, "bad", policy, data))]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "bad").exists()


def test_settings_are_refused_with_their_field(tmp_path, policy, capsys):
    data = _write_jsonl(tmp_path / "pairs.jsonl", _pair_records(12))
    recipe = _recipe(tmp_path, "cfg", policy, data, stage="dpo")
    assert main(["sft", str(recipe)]) == 2
    assert "run it with `megarl dpo`" in capsys.readouterr().err
    assert main(["dpo", str(recipe), "model.micro_batch_size=3", "dpo.beta=0"]) == 2
    err = capsys.readouterr().err
    assert "dpo.beta must be a positive number" in err and "model.micro_batch_size=3 must be even" in err
    assert main(["dpo", str(recipe), "--check"]) == 0
    assert "8 training and 4 held-out examples, 3 steps of 4 pairs" in capsys.readouterr().out
    # context parallelism splits right-padded rows (tests/test_preference.py -k context_parallel)
    assert main(["dpo", str(recipe), "model.parallel.cp=2", "model.parallel.world_size=2", "--check"]) == 0
    capsys.readouterr()
    assert main(["sft", str(_recipe(tmp_path, "packed", policy, _write_jsonl(tmp_path / "sft.jsonl", _sft_records(8)))),
                 "model.parallel.cp=2", "model.parallel.world_size=2", "model.pack_sequences=true"]) == 2
    assert "model.pack_sequences needs model.parallel.cp=1" in capsys.readouterr().err


def test_parquet_rows_are_records_and_a_bad_row_is_named(tmp_path, policy):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import transformers

    from megarl.data.supervised import DataError, load_examples

    tokenizer = transformers.AutoTokenizer.from_pretrained(policy)
    path = tmp_path / "pairs.parquet"
    # a column per field: the first row's keys set the schema, so margin is null where absent
    pq.write_table(pa.Table.from_pylist([{"margin": None, **r} for r in _pair_records(3)]), path)
    pairs = load_examples(str(path), "dpo", tokenizer, max_len=128)
    assert len(pairs) == 3 and pairs[1].margin == 0.5 and pairs[0].margin is None
    assert tokenizer.decode([t for t, c in zip(pairs[0].rejected.tokens, pairs[0].rejected.completion, strict=True)
                             if c]).startswith("3, I think")
    pq.write_table(pa.Table.from_pylist([*_pair_records(2), {"prompt": "x", "chosen": "1", "rejected": ""}]), path)
    with pytest.raises(DataError, match=r"pairs.parquet: row 2: 'rejected' is missing"):
        load_examples(str(path), "dpo", tokenizer, max_len=128)


def test_hugging_face_datasets_and_trl_conversational_pairs(tmp_path, smollm2):
    """``hf:<saved folder>@split`` reads a datasets folder; TRL's conversational pairs (an answer
    message after a prompt of messages; whole conversations sharing their start, as in
    UltraFeedback-binarized) give exactly the examples of the plain text pair; bad rows and a
    missing split are named."""
    import datasets
    import transformers

    from megarl.data.supervised import DataError, load_examples
    from megarl.validation.supervised_checks import _source_errors

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    user = {"role": "user", "content": "What is 2 + 3?"}
    plain = {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}
    explicit = {"prompt": [user], "chosen": [{"role": "assistant", "content": "5"}],
                "rejected": [{"role": "assistant", "content": "6"}]}
    implicit = {"prompt": "What is 2 + 3?", "chosen": [user, {"role": "assistant", "content": "5"}],
                "rejected": [user, {"role": "assistant", "content": "6"}]}
    folder = tmp_path / "pairs"
    datasets.DatasetDict({"train_prefs": datasets.Dataset.from_list([implicit, implicit]),
                          "test_prefs": datasets.Dataset.from_list([explicit])}).save_to_disk(str(folder))
    want = load_examples(str(_write_jsonl(tmp_path / "plain.jsonl", [plain])), "dpo", tokenizer, max_len=128)[0]
    for split, n in (("train_prefs", 2), ("test_prefs", 1)):
        pairs = load_examples(f"hf:{folder}@{split}", "dpo", tokenizer, max_len=128)
        assert len(pairs) == n
        assert (pairs[0].chosen, pairs[0].rejected) == (want.chosen, want.rejected), split
    with pytest.raises(DataError, match=r"has no split 'train' \(it has test_prefs, train_prefs\)"):
        load_examples(f"hf:{folder}", "dpo", tokenizer, max_len=128)
    other = {**implicit, "rejected": [{**user, "content": "What is 2 + 4?"}, {"role": "assistant", "content": "6"}]}
    bad = tmp_path / "bad"
    datasets.Dataset.from_list([implicit, other]).save_to_disk(str(bad))
    with pytest.raises(DataError, match=r"bad@train row 1: 'chosen' and 'rejected' must be one assistant message"):
        load_examples(f"hf:{bad}", "dpo", tokenizer, max_len=128)
    sft = tmp_path / "sft"
    datasets.Dataset.from_list([{"messages": [user, {"role": "assistant", "content": "5"}]}]).save_to_disk(str(sft))
    (example,) = load_examples(f"hf:{sft}", "sft", tokenizer, max_len=128)
    assert tokenizer.decode([t for t, c in zip(example.seq.tokens, example.seq.completion, strict=True) if c]) == \
        "5<|im_end|>"
    assert _source_errors("data.train", "hf:") == [
        "data.train='hf:' names no dataset (hf:<hub id or saved folder>[@split])"]


def test_a_conversation_ends_where_generation_ends(smollm2):
    """SmolLM2's template writes a newline after each ``<|im_end|>``; the engine stops at the eos
    (``<|im_end|>``) and never generates it. Training sequences end at the last eos, so a reward
    model learns its score at the token where PPO reads it, and an assistant turn's completion
    tokens are exactly what the policy generates for it (the newline stays context between turns)."""
    import transformers

    from megarl.data.supervised import conversation

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    eos = tokenizer.eos_token_id
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]
    seq = conversation(tokenizer, messages, "test", max_len=256)
    rendered = tokenizer.apply_chat_template(messages, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert rendered[-2:] == [eos, *tokenizer.encode("\n")]  # what the template writes
    assert list(seq.tokens) == rendered[:-1] and seq.tokens[-1] == eos
    turns = tokenizer.decode([t for t, c in zip(seq.tokens, seq.completion, strict=True) if c])
    assert turns == "4<|im_end|>6<|im_end|>"


def test_kto_rows_and_their_kl_rows(smollm2):
    """``dpo.loss_type: kto`` unpairs each pair into its chosen (desirable) and rejected answer;
    the KL rows give each row's prompt the same kind of answer of the previous pair (TRL's rows:
    it unpairs into [chosen..., rejected...] and cycles by one), and only the last answer of a
    multi-turn context is scored."""
    import transformers

    from megarl.data.supervised import kto_batch, kto_kl_rows, pair_example

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    context = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    records = [{"messages": [*context, {"role": "user", "content": f"What is {i} + {i}?"}], "chosen": f"{2 * i}",
                "rejected": f"{2 * i + 1}"} for i in range(3)]
    pairs = [pair_example(r, tokenizer, f"record {i}", max_len=128) for i, r in enumerate(records)]
    batch, kl = kto_batch(pairs, pad_id=0), kto_kl_rows(pairs, pad_id=0, max_len=128)
    assert batch["desirable"].tolist() == [True, False] * 3

    def decode(rows: dict, i: int, marked: bool) -> str:
        n = int(rows["seq_lens"][i])
        keep = rows["mask"][i, :n - 1] != 0 if marked else rows["mask"][i, :n - 1] == 0
        return tokenizer.decode(rows["tokens"][i, 1:n][keep])

    answers = [decode(batch, i, True) for i in range(6)]
    assert answers == [f"{v}<|im_end|>" for i in range(3) for v in (2 * i, 2 * i + 1)]  # not "Hello"
    for i in range(6):
        previous = (i - 2) % 6
        assert decode(kl, i, True) == answers[previous]
        assert decode(kl, i, False) == decode(batch, i, False)  # the row's own prompt
    with pytest.raises(ValueError, match="at least 2 pairs"):
        kto_kl_rows(pairs[:1], pad_id=0, max_len=128)


@pytest.fixture(scope="module")
def moved(tmp_path_factory, smollm2, policy) -> Path:
    """The tiny policy with its weights moved: a model whose log-probs differ from the policy's."""
    from conftest import moved_copy

    return moved_copy(policy, tmp_path_factory.mktemp("sup") / "moved", smollm2)


def _summed_logprobs(model_dir: Path, rows: dict) -> torch.Tensor:
    """transformers' log-probs of each row's marked tokens, summed [B]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    attention = (torch.arange(rows["tokens"].shape[1]) < rows["seq_lens"].unsqueeze(1)).long()
    with torch.no_grad():
        logits = model(input_ids=rows["tokens"], attention_mask=attention).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, rows["tokens"][:, 1:].unsqueeze(-1)).squeeze(-1)
    return (lp * rows["mask"]).sum(1)


def _unpaired_records(n: int) -> list[dict]:
    """TRL's unpaired records: each pair's chosen answer desirable, its rejected one not."""
    return [{"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"}
            for r in _pair_records(n) for key in ("chosen", "rejected")]


@pytest.mark.parametrize("records", ["pairs", "unpaired"])
def test_kto_learns_with_its_kl_reference_point(tmp_path, policy, moved, capsys, records, starts_processes):
    """``megarl dpo`` with ``dpo.loss_type: kto`` (its loss equals TRL's KTOTrainer's,
    ``tests/test_preference.py``), on pairs and on unpaired records, training the moved model
    against the tiny policy: the first step's KL reference point is transformers' mean log-ratio
    of that step's KL rows, and the held-out loss falls. (Resume is the DPO loop's, tested above.)"""
    import transformers

    from megarl.data.supervised import batch_indices, kto_kl_rows, load_examples

    rows = _pair_records(12) if records == "pairs" else _unpaired_records(12)
    # which way round gives these rows a positive mean log-ratio, so that the reference point is
    # not clamped to 0 and counts
    trained, reference = (moved, policy) if records == "pairs" else (policy, moved)
    data = _write_jsonl(tmp_path / "train.jsonl", rows)
    recipe = _recipe(tmp_path, "kto", trained, data, dpo="{loss_type: kto, beta: 0.5, undesirable_weight: 1.2}",
                     reference=f"{{model: {{path: \"{reference}\"}}, parallel: {{tp: 1, world_size: 1}}, "
                               "micro_batch_size: 4}")
    assert main(["dpo", str(recipe), "trainer.checkpoint_every=0"]) == 0  # one checkpoint: quicker
    history = _history(tmp_path / "kto")
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["eval/heldout/loss"] < history[0]["eval/heldout/loss"], history
    assert all("model/kto/reward_chosen" in h for h in history[1:]), history
    assert ("eval/heldout/accuracy" in history[0]) == (records == "pairs")  # unpaired: no pairs to rank
    # step 1's examples (the last 4 are held out) and their KL rows
    train = load_examples(str(data), "dpo", transformers.AutoTokenizer.from_pretrained(policy), max_len=128)[:-4]
    kl_rows = kto_kl_rows([train[i] for i in batch_indices(len(train), 4, 0, 0)], pad_id=2, max_len=128)
    z = float((_summed_logprobs(trained, kl_rows) - _summed_logprobs(reference, kl_rows)).mean())
    assert z > 0.1 and history[1]["model/kto/kl"] == pytest.approx(z, abs=1e-4), (z, history[1])
    if records == "unpaired":
        return
    capsys.readouterr()
    assert main(["dpo", str(recipe), "dpo.precompute_reference=true", "data.batch_size=1",
                 "model.micro_batch_size=2"]) == 2
    err = capsys.readouterr().err
    assert "dpo.precompute_reference does not apply to loss_type kto" in err
    assert "data.batch_size must be at least 2 for dpo.loss_type kto" in err
