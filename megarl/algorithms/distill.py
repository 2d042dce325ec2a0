"""The teacher's per-token reverse KL on the student's samples: the advantage term of on-policy
distillation (``megarl.algorithms.opd`` says why) and what a step logs of it. Pure tensor functions."""

from __future__ import annotations

import torch

from megarl.algorithms.masked import masked_mean


@torch.no_grad()
def reverse_kl_advantages(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                          coef: float) -> torch.Tensor:
    """``-coef * (student - teacher)`` on the masked tokens ``[B, T]``, 0 elsewhere: each sampled
    token's log-prob under the student minus the teacher's, its one-sample reverse KL (k1)."""
    if student.shape != teacher.shape or student.shape != mask.shape:
        raise ValueError(f"student {tuple(student.shape)}, teacher {tuple(teacher.shape)} and mask "
                         f"{tuple(mask.shape)} log-probs must have one shape")
    dtype = torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)  # bf16 in: fp32
    term = -coef * (student.to(dtype) - teacher.to(dtype))
    return torch.where(mask.bool(), term, torch.zeros((), dtype=dtype, device=term.device))


def teacher_metrics(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """What a step logs of the teacher: the student's reverse KL to it per response token (k1, the
    mean of ``log pi - log pi_teacher`` over the student's tokens), the same per sequence (each
    sample's sum, averaged over samples: KL(pi(y|x) || pi_teacher(y|x))), and the teacher's mean
    log-prob of the student's tokens. Both KLs: the per-token one can rise while the student learns,
    when its answers shorten towards a terse teacher's (fewer tokens share the answer's KL), and
    only the per-sequence one says whether the distributions over whole answers came closer."""
    diff = (student.float() - teacher.float()) * mask
    answered = mask.sum(dim=1) > 0
    per_sequence = diff.sum(dim=1)[answered].mean() if answered.any() else torch.zeros(())
    return {"distill/reverse_kl": float(masked_mean(student.float() - teacher.float(), mask)),
            "distill/reverse_kl_seq": float(per_sequence),
            "distill/teacher_logprob": float(masked_mean(teacher.float(), mask))}
