"""``megarl bench logprob``: peak memory of vocab-parallel log-probs + entropy vs the naive path.

The computation is what a policy loss with an entropy bonus needs from TP-local logits
[batch, seq, vocab/tp]: log p(label) and the entropy of every prediction at positions
[:, :-1], forward only (as the log-prob roles run it) or forward + backward (as training
runs it, with the gradient w.r.t. the logits shard).

- naive: gather the full vocabulary (megatron-core's gather_from_tensor_model_parallel_region,
  differentiable), then ``log_softmax`` over the real vocabulary, ``gather`` the labels, and
  entropy ``-(p * log p).sum(-1)``;
- megarl: ``token_logprobs`` + ``token_entropy`` (chunked, never gathers the vocabulary).

Each TP size runs on real torch.distributed groups (an SpmdPool of tp ranks, gloo on CPU);
every rank measures both paths on its own logits shard and reports its peak. Memory is the
peak of tensor storage the computation allocates beyond its inputs (``TensorMemory``: a
dispatch mode that counts new storages until they are freed; outputs and gradients count).
The process peak-RSS rise over the same block (VmHWM reset before it) is printed beside it
as a cross-check that also sees kernel scratch memory and allocator slack.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

TARGET_RATIO = 0.25
MODES = ("fwd", "fwd+bwd")


@dataclass
class LogprobBenchArgs:
    vocabs: list[int] = field(default_factory=lambda: [49152, 128256])
    tps: list[int] = field(default_factory=lambda: [1, 2])
    batch: int = 2
    seq: int = 512
    dtype: str = "float32"
    vocab_pad_multiple: int = 128


def check_args(args: LogprobBenchArgs) -> None:
    from megarl.config.loader import ConfigError

    errors = []
    if not args.vocabs or any(v < 2 for v in args.vocabs):
        errors.append(f"--vocab must list sizes >= 2, got {args.vocabs}")
    if not args.tps or any(t < 1 for t in args.tps):
        errors.append(f"--tp must list sizes >= 1, got {args.tps}")
    if args.batch < 1 or args.seq < 2:
        errors.append(f"--batch must be >= 1 and --seq >= 2, got {args.batch} and {args.seq}")
    if args.dtype not in ("float32", "bfloat16"):
        errors.append(f"--dtype must be float32 or bfloat16, got {args.dtype}")
    if args.vocab_pad_multiple < 1:
        errors.append("--vocab-pad-multiple must be >= 1")
    if errors:
        raise ConfigError("invalid benchmark:\n  " + "\n  ".join(errors))


def _measure(fn) -> tuple[Any, int, int]:
    """(fn's result, peak tensor bytes allocated in fn, cross-check): the cross-check is the rise of
    the CUDA caching allocator's peak on GPU (``torch.cuda.max_memory_allocated``), else the
    process's peak-RSS rise."""
    from megarl.utils.memory import current_rss, peak_rss, reset_peak_rss
    from megarl_bench.tensor_memory import TensorMemory

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with TensorMemory() as memory:
            result = fn()
        torch.cuda.synchronize()
        return result, memory.peak_bytes, max(torch.cuda.max_memory_allocated() - before, 0)
    reset_peak_rss()
    rss_before = current_rss()
    with TensorMemory() as memory:
        result = fn()
    return result, memory.peak_bytes, max(peak_rss() - rss_before, 0)


def _backward(lp: torch.Tensor, ent: torch.Tensor, weights: torch.Tensor) -> None:
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()


def _megarl_path(logits: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, vocab: int, backward: bool,
                 chunk_rows: int | None = None):
    from megarl.models.logprobs import next_token_logprobs

    with torch.set_grad_enabled(backward):
        lp, ent = next_token_logprobs(logits, tokens, vocab, entropy=True, chunk_rows=chunk_rows)
        if backward:
            _backward(lp, ent, weights)
    return lp.detach(), ent.detach()


def _split_path(logits: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, vocab: int, backward: bool,
                chunk_rows: int | None = None):
    """token_logprobs and token_entropy (these functions) on the slice logits[:, :-1], two calls."""
    from megarl.models.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs

    with torch.set_grad_enabled(backward):
        lp = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], vocab, chunk_rows)
        ent = vocab_parallel_entropy(logits[:, :-1], vocab, chunk_rows)
        if backward:
            _backward(lp, ent, weights)
    return lp.detach(), ent.detach()


def _naive_path(logits: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, vocab: int, backward: bool,
                chunk_rows: int | None = None):
    """Gather, then the textbook math on the full vocabulary (``chunk_rows`` is megarl's: unused)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    with torch.set_grad_enabled(backward):
        tp = ps.get_tensor_model_parallel_world_size()
        full = gather_from_tensor_model_parallel_region(logits) if tp > 1 else logits
        logp = torch.log_softmax(full[:, :-1, :vocab].float(), dim=-1)
        lp = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        del full, logp
        if backward:
            _backward(lp, ent, weights)
    return lp.detach(), ent.detach()


PATHS = {"megarl": _megarl_path, "split": _split_path, "naive": _naive_path}


def _warm_up(vocab: int, width: int, dtype: str, backward: bool, device: torch.device) -> None:
    """Runs every path once on a few tokens: one-time lazy set-up (thread pools, kernels' first
    use) then does not land in the first measured path's RSS rise."""
    logits = torch.randn(1, 4, width).to(device=device, dtype=getattr(torch, dtype))
    tokens = torch.randint(0, vocab, (1, 4)).to(device)
    for path in PATHS.values():
        path(logits.detach().requires_grad_(backward), tokens, torch.ones(2, 1, 3, device=device), vocab, backward)


def measure_case(vocab: int, padded: int, batch: int, seq: int, dtype: str, backward: bool,
                 chunk_rows: int | None = None) -> dict[str, float]:
    """On every rank of a TP group (megatron parallel state set up): each path on this rank's shard.

    ``chunk_rows`` overrides megarl's tokens per chunk (tests use it to see chunking at tiny sizes).
    """
    from megatron.core import parallel_state as ps

    from megarl.platform import current_platform

    device = current_platform().rank_device()
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(1000 + rank)
    # Logits of a trained model's scale; this rank's shard only (the naive path gathers the rest).
    local = (torch.randn(batch, seq, padded // tp, generator=g) * 4).to(device=device, dtype=getattr(torch, dtype))
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7)).to(device)
    weights = torch.randn(2, batch, seq - 1, generator=torch.Generator().manual_seed(8)).to(device)
    _warm_up(vocab, padded // tp, dtype, backward, device)
    out: dict[str, float] = {"input_bytes": local.numel() * local.element_size()}
    results = {}
    # megarl first: a path measured later may reuse heap pages an earlier one freed, which
    # hides part of its RSS rise (the tensor count is not affected by the order).
    for name, path in PATHS.items():
        leaf = local.detach().requires_grad_(backward)  # same storage for every path, its own .grad
        (lp, ent), out[f"{name}_bytes"], out[f"{name}_rss"] = _measure(
            lambda path=path, leaf=leaf: path(leaf, tokens, weights, vocab, backward, chunk_rows))
        results[name] = (lp, ent, leaf.grad)
        del leaf
    lp_n, ent_n, grad_n = results["naive"]
    for name in ("megarl", "split"):
        lp, ent, grad = results[name]
        out[f"{name}_diff"] = max((lp - lp_n).abs().max().item(), (ent - ent_n).abs().max().item(),
                                  (grad.float() - grad_n.float()).abs().max().item() if backward else 0.0)
    return out


def run_rank_cases(tp: int, cases: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Every case on this rank under one tp layout (run on each rank of an SpmdPool)."""
    import torch.distributed as dist

    from megarl.config.schema import ParallelConfig
    from megarl.distributed.parallel import megatron_parallel

    with megatron_parallel(ParallelConfig(tp=tp, world_size=dist.get_world_size())):
        return [measure_case(**case) for case in cases]


def run_logprob_bench(args: LogprobBenchArgs, progress=print) -> dict[str, Any]:
    from megarl.distributed.spmd import SpmdPool
    from megarl.models.layout import padded_vocab_size

    check_args(args)
    rows = []
    for tp in args.tps:
        cases = [{"vocab": v, "padded": padded_vocab_size(v, args.vocab_pad_multiple, tp), "batch": args.batch,
                  "seq": args.seq, "dtype": args.dtype, "backward": mode == "fwd+bwd"}
                 for v in args.vocabs for mode in MODES]
        progress(f"tp={tp}: starting {tp} rank(s), {len(cases)} cases...")
        with SpmdPool(tp) as pool:
            per_rank = pool.run(run_rank_cases, tp=tp, cases=cases)
        for i, case in enumerate(cases):
            ranks = [r[i] for r in per_rank]
            rows.append(_row(tp, case, ranks))
    return {"args": asdict(args), "target_ratio": TARGET_RATIO, "rows": rows,
            "passed": all(r["pass"] for r in rows)}


def _row(tp: int, case: dict[str, Any], ranks: list[dict[str, float]]) -> dict[str, Any]:
    """One table row: the worst rank's peaks and ratios, the largest value differences."""
    def worst(key: str) -> float:
        return max(r[key] for r in ranks)

    mib = 2**20
    # float32 agrees to rounding; bfloat16 gradients are rounded to bfloat16 by both paths.
    tolerance = 1e-3 if case["dtype"] == "float32" else 5e-2
    row = {"case": f"V={case['vocab']} tp={tp} {'fwd+bwd' if case['backward'] else 'fwd'}",
           "vocab": case["vocab"], "padded_vocab": case["padded"], "tp": tp, "backward": case["backward"],
           "logits_mib": worst("input_bytes") / mib}
    for name in PATHS:
        row[f"{name}_mib"] = worst(f"{name}_bytes") / mib
        row[f"{name}_rss_mib"] = worst(f"{name}_rss") / mib
    for name in ("megarl", "split"):
        row[f"{name}_ratio"] = max(r[f"{name}_bytes"] / max(r["naive_bytes"], 1) for r in ranks)
        row[f"{name}_max_abs_diff"] = worst(f"{name}_diff")
    row["values_match"] = max(row["megarl_max_abs_diff"], row["split_max_abs_diff"]) <= tolerance
    row["pass"] = row["megarl_ratio"] <= TARGET_RATIO and row["values_match"]
    return row


def format_table(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [f"log-probs + entropy of {a['batch']} x {a['seq']} tokens from TP-local {a['dtype']} logits.",
             "MiB = peak tensor storage a path allocates beyond its input logits, worst rank (outputs and",
             "gradients included); RSS = the process's peak-RSS rise over the same block (cross-check; on",
             "GPU the rise of torch.cuda.max_memory_allocated instead).",
             "megarl = next_token_logprobs(logits, tokens, entropy=True); split = token_logprobs + token_entropy",
             "on logits[:, :-1] (two calls); naive = gather vocab + log_softmax. ratio = megarl / naive.",
             f"{'case':<24}{'logits':>8}{'naive':>9}{'megarl':>8}{'split':>8}{'ratio':>7}{'target':>7}"
             f"{'split/n':>8}{'naiveRSS':>9}{'megarlRSS':>10}{'max|diff|':>10}  result"]
    for r in result["rows"]:
        diff = max(r["megarl_max_abs_diff"], r["split_max_abs_diff"])
        verdict = "PASS" if r["pass"] else ("FAIL(values)" if not r["values_match"] else "FAIL")
        lines.append(f"{r['case']:<24}{r['logits_mib']:>8.1f}{r['naive_mib']:>9.1f}{r['megarl_mib']:>8.1f}"
                     f"{r['split_mib']:>8.1f}{r['megarl_ratio']:>7.3f}{result['target_ratio']:>7.2f}"
                     f"{r['split_ratio']:>8.3f}{r['naive_rss_mib']:>9.1f}{r['megarl_rss_mib']:>10.1f}"
                     f"{diff:>10.2e}  {verdict}")
    lines.append("all PASS" if result["passed"] else "some cases FAIL")
    return "\n".join(lines)


def dumps(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2)
