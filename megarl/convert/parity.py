"""Logit parity against transformers, the oracle for every conversion.

The reference runs transformers in fp32 with *eager* attention: the same order of
operations as megatron-core's unfused attention, so a difference measures the
conversion rather than kernel rounding (transformers' own SDPA and eager paths
differ by up to ~1e-3 on some inputs of a 30-layer model). Inputs are real text
when the model has a tokenizer: uniformly random token ids drive activations to
extremes that real text does not, and with them the fp32 rounding noise.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Parity:
    max_abs_logit: float
    mean_abs_logprob: float
    top1_agreement: float


def hf_reference_logits(hf_dir: str, tokens: torch.Tensor, value_head: bool = False) -> torch.Tensor:
    """fp32 logits of ``tokens`` [b, s] from transformers (per-token scores for a value head)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if value_head else AutoModelForCausalLM
    with _loading(hf_dir, "transformers cannot load the model"):
        model = auto.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    if value_head:
        with torch.no_grad():
            hidden = model.model(tokens).last_hidden_state
            return model.score(hidden)
    with torch.no_grad():
        return model(tokens).logits.float()


@contextlib.contextmanager
def _loading(hf_dir: str, what: str) -> Iterator[None]:
    """Turns whatever transformers raises on a broken folder into one line naming the folder."""
    from megarl.config.loader import ConfigError

    try:
        yield
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"{hf_dir}: {what} ({type(e).__name__}: {first})") from e


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor) -> Parity:
    if reference.shape != candidate.shape:
        raise ValueError(f"logit shapes differ: reference {list(reference.shape)}, "
                         f"candidate {list(candidate.shape)}")
    ref, cand = reference.double(), candidate.double()
    dlogprob = (torch.log_softmax(ref, -1) - torch.log_softmax(cand, -1)).abs()
    return Parity(
        max_abs_logit=(ref - cand).abs().max().item(),
        mean_abs_logprob=dlogprob.mean().item(),
        top1_agreement=(ref.argmax(-1) == cand.argmax(-1)).double().mean().item(),
    )


# A fixed passage for parity checks: chat-formatted where the tokenizer has a template.
_PASSAGE = [
    {"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold "
                                "half as many clips in May. How many clips did Natalia sell altogether?"},
    {"role": "assistant", "content": "In May she sold 48 / 2 = 24 clips, so altogether she sold "
                                     "48 + 24 = 72 clips in April and May."},
    {"role": "user", "content": "Explain in two sentences why the sky looks blue during the day and "
                                "red at sunset, then name the capital of France."},
    {"role": "assistant", "content": "Air scatters short blue wavelengths of sunlight far more than red "
                                     "ones, so the daytime sky glows blue; at sunset the light crosses "
                                     "more air and mostly red remains. The capital of France is Paris."},
]


def verification_tokens(hf_dir: str, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """[batch, seq] token ids: windows of a fixed passage, or random ids without a tokenizer."""
    from pathlib import Path

    from megarl.models.hf_arch import arch_from_hf_dir

    vocab = arch_from_hf_dir(hf_dir).vocab_size
    has_tokenizer = any((Path(hf_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
    if not has_tokenizer:
        return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    from transformers import AutoTokenizer

    with _loading(hf_dir, "its tokenizer does not load"):
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(_PASSAGE, tokenize=False)
    else:
        text = "\n".join(turn["content"] for turn in _PASSAGE)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < seq + batch * 7:
        ids = ids + ids
    # Each row starts a little later in the passage, so rows differ.
    return torch.tensor([ids[7 * row: 7 * row + seq] for row in range(batch)])
