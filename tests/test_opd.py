"""On-policy distillation (megarl.algorithms.opd): the teacher's per-token reverse KL as the advantage,
against values worked out by hand and against torch.distributions' KL; the refusals before start.

Log-probs of the sampled tokens (float64), row 1's second token an environment's observation
(mask 0: not the policy's, never scored), the last column padding with garbage:

    student  -1.0  -2.0  -0.5 | 9      teacher  -0.5  -3.0  -0.5 | -9
             -0.2  (-3)  -1.0 | -1              -1.2  (-1)  -4.0 |  0

    A = -(student - teacher) = teacher - student:   0.5  -1.0   0.0 | 0
                                                    -1.0    0   -3.0 | 0
"""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms import get_algorithm
from megarl.algorithms.base import PolicyMicroBatch, ScoredBatch
from megarl.algorithms.distill import reverse_kl_advantages, teacher_metrics
from megarl.algorithms.registry import algorithm_errors
from megarl.config.loader import load_config
from megarl.config.schema import AlgorithmConfig, RunConfig

F64 = torch.float64
STUDENT = torch.tensor([[-1.0, -2.0, -0.5, 9.0], [-0.2, -3.0, -1.0, -1.0]], dtype=F64)
TEACHER = torch.tensor([[-0.5, -3.0, -0.5, -9.0], [-1.2, -1.0, -4.0, 0.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]], dtype=F64)
BY_HAND = [[0.5, -1.0, 0.0, 0.0], [-1.0, 0.0, -3.0, 0.0]]


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.detach().to(F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def scored(scores=(1.0, 0.0)) -> ScoredBatch:
    return ScoredBatch(torch.tensor(scores, dtype=F64), MASK, group_size=2, old_logprobs=STUDENT,
                       teacher_logprobs=TEACHER)


def test_each_token_is_credited_with_its_own_reverse_kl():
    close(reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=1.0), BY_HAND)
    close(reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=0.5), [[0.25, -0.5, 0, 0], [-0.5, 0, -1.5, 0]])
    with pytest.raises(ValueError, match="must have one shape"):
        reverse_kl_advantages(STUDENT, TEACHER[:, :3], MASK, coef=1.0)


def test_over_the_students_own_samples_the_advantage_averages_to_minus_the_reverse_kl():
    """Every token y of a 7-token vocabulary at 3 prefixes, weighted by the student's p(y): the mean
    advantage is -KL(student || teacher) as torch.distributions computes it from the logits."""
    gen = torch.Generator().manual_seed(0)
    student_logits, teacher_logits = torch.randn(3, 7, generator=gen, dtype=F64), torch.randn(3, 7, generator=gen,
                                                                                                 dtype=F64)
    student, teacher = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    advantages = reverse_kl_advantages(student, teacher, torch.ones(3, 7), coef=1.0)
    expected = (student.exp() * advantages).sum(-1)
    oracle = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=student_logits),
                                               torch.distributions.Categorical(logits=teacher_logits))
    close(expected, -oracle, atol=1e-12)
    assert (oracle > 0.05).all()  # the distributions differ: the check is not of zeros


def test_opd_learns_from_the_teacher_alone_and_only_on_the_policys_tokens():
    cfg = AlgorithmConfig(name="opd")
    assert cfg.teacher_kl_coef == 1.0 and AlgorithmConfig().teacher_kl_coef == 0.0
    opd = get_algorithm("opd")
    assert opd.needs_teacher(cfg) and opd.needs_old_logprobs(cfg) and not opd.needs_reference(cfg)
    for scores in ((1.0, 0.0), (0.0, 5.0)):  # the task reward changes nothing
        est = opd.estimate(cfg, scored(scores))
        close(est.advantages, BY_HAND)
        close(est.mask, MASK)
    with pytest.raises(ValueError, match="needs the teacher's and the actor's log-probs"):
        opd.estimate(cfg, ScoredBatch(torch.zeros(2), MASK, group_size=2))


def test_a_task_reward_mixed_with_the_teacher():
    """GRPO without the std (group [1, 0]: A = +-0.5 on every policy token) plus 0.5 x the teacher's term."""
    cfg = AlgorithmConfig(name="grpo", norm_std=False, teacher_kl_coef=0.5)
    est = get_algorithm("grpo").estimate(cfg, scored())
    close(est.advantages, [[0.5 + 0.25, 0.5 - 0.5, 0.5, 0.0], [-0.5 - 0.5, 0.0, -0.5 - 1.5, 0.0]])
    plain = get_algorithm("grpo").estimate(AlgorithmConfig(name="grpo", norm_std=False), scored())
    close(plain.advantages, [[0.5, 0.5, 0.5, 0], [-0.5, 0, -0.5, 0]])  # coefficient 0: no teacher, as before


def test_the_update_moves_each_token_towards_the_teacher():
    """On-policy (ratio 1), token-mean over the 5 policy tokens: d loss / d log pi(y_t) = -A_t / 5, so a
    gradient step raises the log-prob of tokens the teacher likes more than the student does."""
    cfg = AlgorithmConfig(name="opd")
    est = get_algorithm("opd").estimate(cfg, scored())
    lp = STUDENT.clone().requires_grad_()
    mb = PolicyMicroBatch(logprobs=lp, old_logprobs=STUDENT, advantages=est.advantages, mask=MASK, denom=5.0)
    loss, _ = get_algorithm("opd").loss(cfg, mb)
    loss.backward()
    close(lp.grad, -torch.tensor(BY_HAND, dtype=F64) / 5, atol=1e-12)


def test_the_step_logs_the_reverse_kl_per_policy_token():
    metrics = teacher_metrics(STUDENT, TEACHER, MASK)
    # (s - t) on the 5 policy tokens: -0.5, 1, 0, 1, 3 -> 4.5 / 5; per sequence (-0.5 + 1 + 0, 1 + 3)
    # -> (0.5 + 4) / 2; the teacher's: -9.2 / 5
    assert metrics == pytest.approx({"distill/reverse_kl": 0.9, "distill/reverse_kl_seq": 2.25,
                                     "distill/teacher_logprob": -1.84})
    # a shorter answer with the same sequence KL has the larger per-token one: only _seq compares them
    short = teacher_metrics(torch.tensor([[-0.1, -0.1, 0.0]]), torch.tensor([[-3.0, -0.1, 0.0]]),
                            torch.tensor([[1.0, 1.0, 0.0]]))
    long = teacher_metrics(torch.tensor([[-0.1, -0.1, -0.1, -0.1]]), torch.tensor([[-3.0, -0.1, -0.1, -0.1]]),
                           torch.ones(1, 4))
    assert short["distill/reverse_kl_seq"] == pytest.approx(long["distill/reverse_kl_seq"]) == pytest.approx(2.9)
    assert short["distill/reverse_kl"] == pytest.approx(1.45) and long["distill/reverse_kl"] == pytest.approx(0.725)


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.name=opd"], "algorithm.teacher_kl_coef=1.0 needs a teacher role (teacher.model.path)"),
    (["teacher.model.path=x"], "teacher is set but algorithm.teacher_kl_coef=0.0: nothing would read its log-probs"),
    (["teacher.model.path=x", "algorithm.teacher_kl_coef=-0.1"], "algorithm.teacher_kl_coef=-0.1 must be >= 0"),
    (["teacher.model.path=x", "algorithm.name=opd", "algorithm.teacher_kl_coef=0"],
     "algorithm.teacher_kl_coef=0.0: opd learns from the teacher alone, its weight must be > 0"),
    (["teacher.model.path=x", "algorithm.name=opd", "algorithm.dynamic_sampling=true"],
     "algorithm.dynamic_sampling drops groups whose task rewards are equal"),
])
def test_refused_naming_the_field(overrides, message):
    errors = algorithm_errors(load_config(RunConfig, None, overrides))
    assert any(line.startswith(message) for line in errors), errors


def test_a_teacher_of_another_tokenizer_is_refused_in_one_line_before_start(smollm2, tmp_path, capsys):
    """The bundled SmolLM2 beside copies of it: the same tokenizer passes, one more token does not; a
    folder with no tokenizer is held to the actor's vocabulary size."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from megarl.cli.main import main
    from megarl.convert.checkpoint import read_model_arch
    from megarl.validation.teacher_checks import teacher_errors

    def teacher_folder(name: str, extra_token: str | None) -> str:
        folder = tmp_path / name
        folder.mkdir()
        for file in smollm2.iterdir():  # the weights and config linked, the tokenizer's files copied
            if file.suffix == ".safetensors" or file.name == "config.json":
                (folder / file.name).symlink_to(file)
            else:
                shutil.copy(file, folder / file.name)
        if extra_token:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            tokenizer.add_tokens([extra_token])
            tokenizer.save_pretrained(str(folder))
        return str(folder)

    def errors(teacher: str) -> list[str]:
        cfg = load_config(RunConfig, None, [f"actor.model.path={smollm2}", f"teacher.model.path={teacher}",
                                            "algorithm.name=opd"])
        archs = {"actor": read_model_arch(cfg.actor.model.path), "teacher": read_model_arch(teacher)}
        return teacher_errors(cfg, archs)

    assert errors(teacher_folder("same", None)) == []
    other = teacher_folder("other", "<teacher_only>")
    assert errors(other) == ["teacher.model.path: its tokenizer (49153 tokens) is not the actor's (49152 tokens; 1 "
                             "token ids differ, e.g. '<teacher_only>'): the teacher must score the actor's token ids "
                             "as the same text"]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(json.loads((smollm2 / "config.json").read_text())
                                                 | {"vocab_size": 100}))
    assert errors(str(bare))[0].startswith("teacher.model.path: its vocabulary (100) is not the actor's (49152), "
                                           "and no tokenizer is there to compare")
    # as a user meets it: `megarl train --check`, one line, nothing started
    capsys.readouterr()
    assert main(["train", "--check", "algorithm.name=opd", f"teacher.model.path={other}"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("megarl train: error: invalid configuration: teacher.model.path: its tokenizer"), err
    assert "\n" not in err and "Traceback" not in err
