"""Options of ``megarl bench logprob`` (parsed without importing torch: --help stays fast)."""

from __future__ import annotations

import argparse
import sys


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


DESCRIPTION = """\
Peak memory of log p(label) + entropy over vocab-parallel logits: megarl's chunked path
against the naive one, for each vocabulary size and tensor-parallel size, forward only
(as the log-prob roles run it) and forward + backward (as a policy loss with an entropy
bonus trains through it).

Paths, each on the same TP-local logits [batch, seq, padded_vocab/tp] of every rank:
  naive   gather the full vocabulary (megatron-core's gather_from_tensor_model_parallel_region),
          log_softmax over the real vocabulary, gather the labels, entropy -(p * log p).sum(-1)
  megarl  next_token_logprobs(logits, tokens, entropy=True): chunks of tokens, max / sum-exp /
          label logit all-reduced over the TP group, softmax recomputed chunk by chunk in backward
  split   token_logprobs(logits[:, :-1]) and token_entropy(logits[:, :-1]) as two calls (shown
          for comparison: each call's slice and gradient cost a logits-sized buffer in backward)

Each tp runs as tp real ranks (torch.distributed, gloo on CPU) started by megarl.

How memory is measured: torch's CPU allocator keeps no peak statistics, so a dispatch mode
(megarl_bench.tensor_memory.TensorMemory) sees every operator of the path, forward and
backward, counts each newly allocated tensor storage until it is freed, and records the peak
of the live total. Storages that existed before (the input logits) never count; outputs and
the gradient w.r.t. the logits do. Per rank; the table shows the worst rank. As a cross-check
the process's peak-RSS rise over the same block is printed (VmHWM reset before it): it also
sees kernel scratch memory and allocator slack.

PASS: megarl / naive <= 0.25 and every value (log-probs, entropy, gradient) within 1e-3 of the
naive path (5e-2 for bfloat16). Memory needed: about 6x the full logits per rank for the naive
path, so the defaults are modest; on a large machine pass e.g. --batch 8 --seq 1024."""


def add_parser(bs: argparse._SubParsersAction) -> None:
    p = bs.add_parser("logprob", help="peak memory of vocab-parallel log-probs/entropy vs gathering the vocabulary",
                      formatter_class=argparse.RawDescriptionHelpFormatter, description=DESCRIPTION)
    p.add_argument("--vocab", type=_int_list, default=[49152, 128256],
                   help="vocabulary sizes, comma-separated (default 49152,128256: SmolLM2, Llama-3)")
    p.add_argument("--tp", type=_int_list, default=[1, 2], help="tensor-parallel sizes, comma-separated (default 1,2)")
    p.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="logits dtype")
    p.add_argument("--vocab-pad-multiple", type=int, default=128,
                   help="the output layer's padding: padded vocab = multiple of lcm(this, tp) (default 128)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run_logprob_cmd)


def run_logprob_cmd(args: argparse.Namespace) -> int:
    from megarl_bench.logprob import LogprobBenchArgs, dumps, format_table, run_logprob_bench

    bench = LogprobBenchArgs(vocabs=args.vocab, tps=args.tp, batch=args.batch, seq=args.seq, dtype=args.dtype,
                             vocab_pad_multiple=args.vocab_pad_multiple)
    progress = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    result = run_logprob_bench(bench, progress=progress)
    print(dumps(result) if args.json else format_table(result), flush=True)
    return 0 if result["passed"] else 1
