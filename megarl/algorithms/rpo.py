"""RPO, DPO with an auxiliary SFT term (Pang et al. 2024, "Iterative Reasoning Preference
Optimization", arXiv:2404.19733, Sec. 2): the preference loss plus the negative log-likelihood of
each pair's chosen answer, length-normalised::

    L = L_pref + alpha * NLL_w,    NLL_w = -log pi(y_w | x) / |y_w|

(``log pi(y_w | x)`` summed over the chosen answer's tokens, ``|y_w|`` its token count), per pair,
then the mean over the step's pairs like the preference loss. The NLL keeps the chosen answer's
likelihood up where DPO alone lets both answers' fall (the paper finds the term crucial on
reasoning tasks). ``alpha`` is ``dpo.rpo_alpha`` (0: plain DPO; the paper's experiments weigh the
two terms equally, alpha = 1). It adds to any pairwise ``dpo.loss_type`` (sigmoid, ipo):
``megarl.algorithms.dpo.dpo_loss`` adds it per pair. TRL's ``DPOConfig.rpo_alpha`` weighs the
same term, but averages the NLL over all chosen tokens of its batch rather than per answer; the
per-answer mean is the paper's, and it adds up over micro-batches and data-parallel shards like
every pair's loss.
"""

from __future__ import annotations

import torch


def chosen_nll(chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """``[P]``: each chosen answer's mean negative log-likelihood per token (its summed log-probs
    ``chosen_logps`` over its ``chosen_tokens``; an empty answer counts 1)."""
    return -chosen_logps / chosen_tokens.clamp(min=1).to(chosen_logps.dtype)
