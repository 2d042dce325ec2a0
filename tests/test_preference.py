"""SFT, reward-model (Bradley-Terry), DPO and KTO losses of megarl's Megatron updates against TRL's
trainers (SFTTrainer, RewardTrainer, DPOTrainer, KTOTrainer) on the same tiny model and the same
batch, as TRL's own collator builds it, fp32, at tp1 and tp2 x pp2; plus the loss formulas by hand."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import rank_jobs
import torch
from conftest import moved_copy, with_smollm2_tokenizer

from megarl.algorithms.bradley_terry import bradley_terry_loss
from megarl.algorithms.dpo import PairLogprobs, dpo_loss
from megarl.algorithms.kto import kl_reference_point, kto_loss
from megarl.config.schema import OptimizerConfig, ParallelConfig
from megarl.config.supervised import DpoConfig
from megarl.workers.rank_batch import RankBatch

trl = pytest.importorskip("trl")

LAYOUTS = [ParallelConfig(world_size=1), ParallelConfig(tp=2, pp=2, world_size=4)]
# context parallelism: each rank holds 2 of 2 cp chunks of every row (megarl.platform.cp_attention)
CP_LAYOUTS = [ParallelConfig(cp=2, world_size=2),
              ParallelConfig(tp=2, cp=2, pp=1, sequence_parallel=True, world_size=4)]
SUMS = [(1, 2), (3, 4), (5, 6), (7, 8)]
OPTIM = OptimizerConfig(lr=1e-4)


def _pairs() -> list[dict]:
    return [{"prompt": f"What is {a} + {b}?", "chosen": f" {a + b}", "rejected": f" {a + b + 1}, I think"}
            for a, b in SUMS]


def _interleave(batch: dict) -> dict:
    """TRL's [chosen..., rejected...] rows -> megarl's pairs on consecutive rows."""
    n = batch["input_ids"].shape[0] // 2
    order = [i for k in range(n) for i in (k, k + n)]
    return {k: v[order] for k, v in batch.items()}


def _megarl_batch(tokens: torch.Tensor, attention: torch.Tensor, completion: torch.Tensor, denom: float
                  ) -> RankBatch:
    # label position t predicts token t + 1: a completion token at t + 1 is trained
    return RankBatch(tokens=tokens, mask=completion[:, 1:].float(), seq_lens=attention.sum(1), denoms=[denom])


def _step(pools, layout: ParallelConfig, **kwargs) -> dict[str, float]:
    (out,) = [r for r in pools.get(layout.world_size).run(rank_jobs.preference_step, parallel=layout, optim=OPTIM,
                                                          **kwargs) if r is not None]
    result, _ = out
    return result.steps[0]


@pytest.fixture(scope="module")
def policy_dir(tiny_policy):
    return tiny_policy


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory, smollm2, policy_dir):
    """The policy with its weights moved: a reference that differs, so DPO's log-ratios are not 0."""
    return moved_copy(policy_dir, tmp_path_factory.mktemp("pref") / "reference", smollm2)


def _trl_args(cls, tmp_path, **kwargs):
    # bf16=False: TRL's configs default to bf16, and the reference model it prepares at construction
    # would then run under bf16 autocast (~1e-3 per token off fp32)
    return cls(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, report_to=[], use_cpu=True,
               bf16=False, **kwargs)


def test_dpo_and_bradley_terry_formulas_by_hand():
    # one pair: policy (-3, -5), reference (-4, -4), 2 and 4 answer tokens, beta 0.5
    pairs = PairLogprobs(*(torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.0, 2.0, 4.0)))
    delta = (-3 + 4) - (-5 + 4)  # 2
    loss, metrics = dpo_loss(pairs, DpoConfig(beta=0.5), denom=1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.5 * delta)))
    assert metrics["dpo/margin"].item() == pytest.approx(1.0) and metrics["dpo/accuracy"].item() == 1.0
    cdpo, _ = dpo_loss(pairs, DpoConfig(beta=0.5, label_smoothing=0.1), denom=1)
    assert cdpo.item() == pytest.approx(0.9 * math.log1p(math.exp(-1.0)) + 0.1 * math.log1p(math.exp(1.0)))
    ipo, _ = dpo_loss(pairs, DpoConfig(beta=0.5, loss_type="ipo"), denom=1)
    assert ipo.item() == pytest.approx((1 / 2 - (-1) / 4 - 1 / (2 * 0.5)) ** 2)
    bt, metrics = bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), denom=2,
                                     margin=torch.tensor([0.5, 0.0]))
    assert bt.item() == pytest.approx((math.log1p(math.exp(-0.5)) + math.log1p(math.exp(2.0))) / 2)
    assert metrics["rm/accuracy"].item() == 0.5
    assert DpoConfig(beta=0, label_smoothing=0.7).problems() == [
        "dpo.beta must be a positive number, got 0", "dpo.label_smoothing must be in [0, 0.5), got 0.7"]
    from megarl.config.loader import enumeration_errors

    assert enumeration_errors(DpoConfig(loss_type="orpo"), "dpo") == [
        "dpo.loss_type: 'orpo' is not one of sigmoid, ipo, kto"]


def test_kto_formula_by_hand():
    # a desirable and an undesirable answer: policy (-3, -5), reference (-4, -4): log-ratios (1, -1)
    settings = DpoConfig(beta=0.5, loss_type="kto", desirable_weight=2.0, undesirable_weight=0.5)
    policy, ref, desirable = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.0]), torch.tensor([True, False])
    loss, metrics = kto_loss(policy, ref, desirable, 0.5, settings, denom=2, desirable_count=1)

    def sigmoid(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    desirable_loss = 2.0 * (1 - sigmoid(0.5 * (1 - 0.5)))  # w_d (1 - sigmoid(beta (r - z)))
    undesirable_loss = 0.5 * (1 - sigmoid(0.5 * (0.5 - (-1))))  # w_u (1 - sigmoid(beta (z - r)))
    assert loss.item() == pytest.approx((desirable_loss + undesirable_loss) / 2)
    assert metrics["kto/kl"].item() == 0.5
    assert metrics["kto/reward_chosen"].item() == pytest.approx(0.5)
    assert metrics["kto/reward_rejected"].item() == pytest.approx(-0.5)
    # halves of the step (denom 2, one example each) add up to the whole step's loss
    halves = [kto_loss(policy[i:i + 1], ref[i:i + 1], desirable[i:i + 1], 0.5, settings, 2, 1)[0] for i in (0, 1)]
    assert sum(h.item() for h in halves) == pytest.approx(loss.item())
    # the reference point: the mismatched pairs' mean log-ratio, never below 0
    assert kl_reference_point(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0])) == 0.5
    assert kl_reference_point(torch.tensor([-3.0, -2.0]), torch.tensor([-2.0, -2.0])) == 0.0
    with pytest.raises(ValueError, match="kto"):
        dpo_loss(PairLogprobs(*(torch.zeros(1) for _ in range(6))), settings, denom=1)
    assert DpoConfig(loss_type="kto", label_smoothing=0.1, desirable_weight=0, undesirable_weight=-1).problems() == [
        "dpo.label_smoothing applies to loss_type sigmoid only",
        "dpo.desirable_weight must be a positive number, got 0",
        "dpo.undesirable_weight must be a positive number, got -1"]


def _dpo_case(tmp_path, policy_dir, reference_dir, loss_type: str) -> tuple[float, dict]:
    """TRL's DPO loss of its first batch, and megarl's step arguments for the same rows."""
    import transformers
    from datasets import Dataset

    policy = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(policy_dir)
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, processing_class=tokenizer,
                             args=_trl_args(trl.DPOConfig, tmp_path, beta=0.5, loss_type=[loss_type]),
                             train_dataset=Dataset.from_list(_pairs()))
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, dict(batch)).item()
    rows = _interleave(batch)
    return expected, dict(kind="dpo", model_dir=str(policy_dir), ref_dir=str(reference_dir),
                          settings=DpoConfig(beta=0.5, loss_type=loss_type),
                          batch=_megarl_batch(rows["input_ids"], rows["attention_mask"], rows["completion_mask"], 4))


@pytest.mark.parametrize("loss_type,layout", [("sigmoid", LAYOUTS[0]), ("ipo", LAYOUTS[0]), ("sigmoid", LAYOUTS[1])],
                         ids=["sigmoid-tp1", "ipo-tp1", "sigmoid-tp2pp2"])
def test_dpo_loss_equals_trl(pools, tmp_path, policy_dir, reference_dir, loss_type, layout):
    expected, step = _dpo_case(tmp_path, policy_dir, reference_dir, loss_type)
    ours = _step(pools, layout, **step)
    assert ours["dpo_loss"] == pytest.approx(expected, abs=2e-5), (ours, expected)
    assert 0.0 <= ours["dpo/accuracy"] <= 1.0 and ours["grad_norm"] > 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp1", "tp2pp2"])
def test_kto_loss_equals_trl(pools, tmp_path, policy_dir, reference_dir, layout):
    """TRL unpairs the pairs (4 chosen answers, desirable, then the 4 rejected ones) and, within
    each batch of 8, pairs every prompt with the previous example's answer for the KL rows;
    megarl's step gets TRL's collated rows and computes the reference point and the loss itself.
    The moved weights are the policy here, the tiny policy the reference: that way round the KL
    rows' mean log-ratio is positive, so the reference point is not clamped to 0 and counts."""
    import transformers
    from datasets import Dataset

    policy_dir, reference_dir = reference_dir, policy_dir
    policy = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(policy_dir)
    weights = {"desirable_weight": 1.25, "undesirable_weight": 0.8}
    args = _trl_args(trl.KTOConfig, tmp_path, beta=0.5, **weights)
    args.per_device_train_batch_size = 8  # the whole unpaired set: desirable and undesirable rows in one batch
    trainer = trl.KTOTrainer(model=policy, ref_model=ref, processing_class=tokenizer, args=args,
                             train_dataset=Dataset.from_list(_pairs()))
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["label"].tolist() == [True] * 4 + [False] * 4
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, dict(batch)).item()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train" if trainer.model.training else "eval"].items()}
    assert trl_metrics["kl"] > 0.1, trl_metrics
    rows = _megarl_batch(batch["input_ids"], batch["attention_mask"], batch["completion_mask"], 8)
    kl_rows = _megarl_batch(batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"], 8)
    ours = _step(pools, layout, kind="kto", model_dir=str(policy_dir), ref_dir=str(reference_dir),
                 settings=DpoConfig(beta=0.5, loss_type="kto", **weights),
                 batch=replace(rows, desirable=batch["label"].bool()), kl_rows=kl_rows)
    assert ours["kto_loss"] == pytest.approx(expected, abs=2e-5), (ours, expected, trl_metrics)
    assert ours["kto/kl"] == pytest.approx(trl_metrics["kl"], abs=2e-5), (ours, trl_metrics)
    for name in ("chosen", "rejected"):
        got, want = ours[f"kto/reward_{name}"], trl_metrics[f"rewards/{name}"]
        assert got == pytest.approx(want, abs=2e-5), (name, ours, trl_metrics)
    assert ours["grad_norm"] > 0


def test_unpaired_kto_rows_equal_trl(tmp_path, policy_dir):
    """TRL's unpaired records (conversational ``prompt`` / ``completion`` and a ``label``): megarl's
    KTO rows and KL rows (each prompt with the previous example's answer, cyclically) are the
    token rows, completion marks and labels of TRL's ``KTOTrainer`` batch. One documented
    difference: megarl ends an answer at the template's end-of-turn token, TRL keeps (and
    trains on) the newline the template writes after it."""
    import transformers
    from datasets import Dataset

    from megarl.data.supervised import kto_batch, kto_example, kto_kl_rows

    tokenizer = transformers.AutoTokenizer.from_pretrained(policy_dir)
    records = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "completion": [{"role": "assistant", "content": f"{a + b + i % 2}"}], "label": i % 2 == 0}
               for i, (a, b) in enumerate([*SUMS, (2, 2), (4, 1)])]
    model = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    args = _trl_args(trl.KTOConfig, tmp_path)
    args.per_device_train_batch_size = len(records)
    trainer = trl.KTOTrainer(model=model, ref_model=copy.deepcopy(model), processing_class=tokenizer, args=args,
                             train_dataset=Dataset.from_list(records))
    batch = next(iter(trainer.get_train_dataloader()))
    newline = tokenizer.encode("\n")

    def trl_rows(prefix: str) -> list[tuple[list[int], list[int]]]:
        out = []
        for ids, attention, completion in zip(batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"],
                                              batch[f"{prefix}completion_mask"], strict=True):
            keep = attention.bool()
            ids, completion = ids[keep].tolist(), completion[keep].tolist()
            assert ids[-len(newline):] == newline  # the template's newline after its end of turn
            out.append((ids[:-len(newline)], completion[:-len(newline)]))
        return out

    def our_rows(rows: dict) -> list[tuple[list[int], list[int]]]:
        return [(rows["tokens"][i, :n].tolist(), [0, *rows["mask"][i, :n - 1].long().tolist()])
                for i, n in enumerate(rows["seq_lens"].tolist())]

    examples = [kto_example(r, tokenizer, f"record {i}", max_len=128) for i, r in enumerate(records)]
    ours = kto_batch(examples, pad_id=0)
    assert ours["desirable"].tolist() == batch["label"].tolist() == [True, False] * 3
    assert our_rows(ours) == trl_rows("")
    assert our_rows(kto_kl_rows(examples, pad_id=0, max_len=128)) == trl_rows("KL_")


def _sft_case(tmp_path, policy_dir) -> tuple[float, dict]:
    """TRL's SFT loss (completion tokens only) of its first batch, and megarl's step arguments."""
    import transformers
    from datasets import Dataset

    model = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(policy_dir)
    data = [{"prompt": p["prompt"], "completion": p["chosen"] + " is the sum" * (i % 3)} for i, p in
            enumerate(_pairs())]  # answers of different lengths: the mean is over tokens, not answers
    trainer = trl.SFTTrainer(model=model, processing_class=tokenizer, train_dataset=Dataset.from_list(data),
                             args=_trl_args(trl.SFTConfig, tmp_path))
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, dict(batch)).item()
    completion = (batch["labels"] != -100).long()
    return expected, dict(kind="sft", model_dir=str(policy_dir),
                          batch=_megarl_batch(batch["input_ids"], batch["attention_mask"], completion,
                                              float(completion[:, 1:].sum())))


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp1", "tp2pp2"])
def test_sft_loss_equals_trl(pools, tmp_path, policy_dir, layout):
    expected, step = _sft_case(tmp_path, policy_dir)
    ours = _step(pools, layout, **step)
    assert ours["sft_loss"] == pytest.approx(expected, abs=2e-5), (ours, expected)


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory, smollm2, policy_dir):
    """The tiny policy's backbone with a one-output score head (an HF sequence classifier); pad
    id 0, not EOS, so transformers scores the EOS ending each answer, as megarl does."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(policy_dir, num_labels=1, pad_token_id=0)
    torch.manual_seed(3)
    model = transformers.LlamaForSequenceClassification.from_pretrained(policy_dir, config=config,
                                                                       dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(std=0.5)
    path = tmp_path_factory.mktemp("pref") / "reward"
    model.save_pretrained(path)
    return with_smollm2_tokenizer(path, smollm2)


def _rm_case(tmp_path, reward_dir) -> tuple[float, dict]:
    """TRL's Bradley-Terry loss of its first batch, and megarl's step arguments."""
    import transformers
    from datasets import Dataset

    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(reward_dir)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    trainer = trl.RewardTrainer(model=model, processing_class=tokenizer, train_dataset=Dataset.from_list(_pairs()),
                                args=_trl_args(trl.RewardConfig, tmp_path))
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, dict(batch)).item()
    rows = _interleave({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
    return expected, dict(kind="rm", model_dir=str(reward_dir),
                          batch=_megarl_batch(rows["input_ids"], rows["attention_mask"], rows["attention_mask"], 4))


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp1", "tp2pp2"])
def test_reward_model_loss_equals_trl(pools, tmp_path, reward_dir, layout):
    expected, step = _rm_case(tmp_path, reward_dir)
    ours = _step(pools, layout, **step)
    assert ours["rm_loss"] == pytest.approx(expected, abs=2e-5), (ours, expected)


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo"])
def test_context_parallel_steps_equal_trl_and_the_unsplit_step(pools, tmp_path, policy_dir, reference_dir,
                                                               reward_dir, stage):
    """At cp 2 and at tp 2 x cp 2 with sequence parallelism (each rank attending with its 2 of 4
    chunks of every row): the loss equals TRL's, the gradient norm equals the unsplit step's, and
    so do the updated model's log-probs (a reward model: its scores) of the batch."""
    loss = {"sft": "sft_loss", "rm": "rm_loss", "dpo": "dpo_loss"}[stage]
    expected, step = {"sft": lambda: _sft_case(tmp_path, policy_dir), "rm": lambda: _rm_case(tmp_path, reward_dir),
                      "dpo": lambda: _dpo_case(tmp_path, policy_dir, reference_dir, "sigmoid")}[stage]()
    batch = step["batch"]
    if batch.tokens.shape[1] % 4 == 0:  # a width 2 cp chunks do not split: the micro-batches pad it
        batch.tokens = torch.cat([batch.tokens, batch.tokens[:, -1:] * 0], dim=1)
        batch.mask = torch.cat([batch.mask, batch.mask[:, -1:] * 0], dim=1)

    def run(layout):
        (out,) = [r for r in pools.get(layout.world_size).run(rank_jobs.preference_step, parallel=layout,
                                                               optim=OPTIM, after=True, **step) if r is not None]
        result, after = out
        return result.steps[0], after

    unsplit, unsplit_after = run(LAYOUTS[0])
    for layout in CP_LAYOUTS:
        split, split_after = run(layout)
        assert split[loss] == pytest.approx(expected, abs=2e-5), (layout, split, expected)
        assert split["grad_norm"] == pytest.approx(unsplit["grad_norm"], rel=1e-4), (layout, split, unsplit)
        torch.testing.assert_close(split_after, unsplit_after, atol=2e-5, rtol=0)
