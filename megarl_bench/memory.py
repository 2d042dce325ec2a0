"""``megarl bench memory``: the planner's memory model against real megatron-core models.

For each case (a model from tiny to ~100M parameters, a tp/pp/dp layout of up to 8
ranks, a dtype) it builds the model with megarl's own code path (``build_model_chunks``,
``wrap_ddp``, ``build_optimizer`` with the distributed optimizer) on CPU ranks, runs one
training step of one micro-batch and measures, on one rank of every pipeline stage:

- weights: bytes of the rank's parameters;
- gradients: bytes of DDP's grad buffers (the ``main_grad`` storage);
- optimizer: bytes of the optimizer's state (Adam moments) and of any main parameters
  that are not the model's own storage (fp32 copies of bf16 weights);
- activations: the peak over the step of the bytes of the distinct storages autograd holds
  for backward (``torch.autograd.graph.saved_tensors_hooks``; a storage counts from when it is
  first saved until it is freed), parameters and DDP buffers excluded. Under full recompute
  it is the larger of the checkpointed inputs with the head at the end of forward, and the
  checkpointed inputs with the unit that backward reruns (the hooks see the rerun too).

Optimizer CPU offload has no rows: on CPU ranks every optimizer state is host memory already,
and megatron-core 0.16.1 does not build its hybrid optimizer there (the precision-aware path it
runs on asks for Transformer Engine's version, None here; without that path the distributed
optimizer hands it main-parameter shards that torch.optim refuses as non-leaf tensors). megarl
leaves it off on CPU (``megarl.models.train.offload_kwargs``); the planner's offload model is
arithmetic on the optimizer shard that the rows above measure.

It prints the planner's estimate (``megarl.plan.memory.trained_rank`` with the
``sdpa`` attention of the CPU local spec) next to each, the ratio, and PASS when the
estimate is within the tolerance.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from megarl.models.hf_arch import ModelArch, RopeConfig

COMPONENTS = ("weights", "gradients", "optimizer", "activations")
SELECTIVE_MODULES = ("core_attn", "mlp")  # what the selective-recompute case recomputes


def bench_arch(name: str, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int,
               experts: int | None = None) -> ModelArch:
    """A Llama-shaped (or Mixtral-shaped, with experts) architecture for the benchmark."""
    return ModelArch(
        family="mixtral" if experts else "llama", vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, norm_eps=1e-5,
        tie_embeddings=False, qkv_bias=False, max_position_embeddings=4096, rope=RopeConfig(theta=10000.0),
        num_experts=experts, moe_topk=2 if experts else None, extra={"name": name},
    )


MODELS = {
    # ~0.2M parameters: the shape of the tests' tiny models (vocab padded 250 -> 256)
    "tiny": bench_arch("tiny", 64, 128, 4, 4, 2, 250),
    # ~13M: a small GQA model
    "small": bench_arch("small", 256, 704, 8, 8, 4, 8000),
    # ~101M: GPT-2-small-sized Llama (16 heads so that tp=8 divides them)
    "100m": bench_arch("100m", 768, 2048, 12, 16, 8, 16000),
    # a tiny mixture of experts (4 experts, top-2)
    "moe": bench_arch("moe", 64, 128, 2, 4, 2, 250, experts=4),
}


@dataclass(frozen=True)
class Case:
    model: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world: int = 1
    dtype: str = "float32"
    micro_batch: int = 2
    seq_len: int = 128
    recompute: str = "none"  # none | selective | full (uniform, recompute_layers per unit) | block
    recompute_layers: int = 1
    lora_rank: int = 0  # > 0: LoRA on every target, the base frozen

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    def label(self) -> str:
        extra = f" ep={self.ep}" if self.ep > 1 else ""
        if self.recompute != "none":
            extra += f" rc={self.recompute}" + (f"/{self.recompute_layers}" if self.recompute != "selective" else "")
        if self.lora_rank:
            extra += f" lora={self.lora_rank}"
        return f"{self.model} tp={self.tp} pp={self.pp} dp={self.dp}{extra} {self.dtype}"

    def recompute_config(self):
        from megarl.config.schema import RecomputeConfig

        if self.recompute == "none":
            return None
        if self.recompute == "selective":
            return RecomputeConfig("selective", modules=list(SELECTIVE_MODULES))
        method = "block" if self.recompute == "block" else "uniform"
        return RecomputeConfig("full", method=method, num_layers=self.recompute_layers)


CASES = [
    Case("tiny", tp=2, world=2),
    Case("tiny", pp=2, world=2),
    Case("small", world=2, dtype="bfloat16"),
    Case("moe", ep=2, world=2),
    Case("100m", tp=2, pp=2, world=8, dtype="bfloat16"),
    Case("small", tp=4, world=8),
    Case("small", pp=4, world=8, dtype="bfloat16"),
    Case("100m", tp=8, world=8),
    Case("tiny", world=8),
    # activation recompute (``--only rc=``)
    Case("small", world=2, dtype="bfloat16", recompute="full", recompute_layers=1),
    Case("small", world=2, dtype="bfloat16", recompute="full", recompute_layers=2),
    Case("small", world=2, dtype="bfloat16", recompute="block", recompute_layers=4),
    Case("small", world=2, dtype="bfloat16", recompute="selective"),
    # LoRA against the full fine-tuning of the same model (``--only small``): adapters train, the base is frozen
    Case("small", world=2, dtype="bfloat16", lora_rank=8),
    Case("small", tp=2, world=2, dtype="bfloat16", lora_rank=8),
]
QUICK_CASES = [Case("tiny", tp=2, world=2), Case("small", pp=2, world=2, dtype="bfloat16")]


def _storage_ptr(t) -> int:
    return t.untyped_storage().data_ptr()


def measure_rank(arch: ModelArch, tp: int, pp: int, ep: int, dtype: str, micro_batch: int,
                 seq_len: int, recompute=None, lora_rank: int = 0) -> dict | None:
    """On every rank of an SpmdPool: build, step once, measure. Returns one rank per pipeline stage."""
    import weakref

    import torch

    from megarl.config.schema import OptimizerConfig, ParallelConfig, PrecisionConfig
    from megarl.distributed.parallel import megatron_parallel
    from megarl.models.gpt import ModelSpec, build_model_chunks
    from megarl.models.train import build_optimizer, lm_loss_fn, logits_forward, train_step, wrap_ddp

    world = torch.distributed.get_world_size()
    par = ParallelConfig(tp=tp, pp=pp, ep=ep, world_size=world)
    with megatron_parallel(par) as info:
        spec = ModelSpec(arch, par, PrecisionConfig(dtype), recompute=recompute)
        chunks = build_model_chunks(spec)
        if lora_rank:
            from megarl.config.lora import LoraConfig
            from megarl.models.lora import apply_lora

            apply_lora(chunks, spec, info.tp_rank, info.tp, LoraConfig(rank=lora_rank))
        chunks = wrap_ddp(chunks, use_distributed_optimizer=True)
        optimizer = build_optimizer(chunks, OptimizerConfig(lr=1e-4, use_distributed_optimizer=True))
        params = {id(p): p for chunk in chunks for p in chunk.parameters()}.values()
        buffers = [buf for chunk in chunks for buf in list(chunk.buffers) + list(chunk.expert_parallel_buffers)]
        model_storage = {_storage_ptr(p) for p in params}
        for buf in buffers:
            model_storage.add(_storage_ptr(buf.grad_data))
            if buf.param_data is not None:
                model_storage.add(_storage_ptr(buf.param_data))

        # Live bytes of saved storages: counted when first saved, uncounted when freed. A weak
        # finalizer, not a reference, so that backward (and recompute) frees them as it would.
        live = {"now": 0, "peak": 0}
        tracked: set[int] = set()

        def freed(ptr: int, nbytes: int) -> None:
            tracked.discard(ptr)
            live["now"] -= nbytes

        def pack(t):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in model_storage and ptr not in tracked:
                tracked.add(ptr)
                live["now"] += storage.nbytes()
                live["peak"] = max(live["peak"], live["now"])
                weakref.finalize(storage, freed, ptr, storage.nbytes())
            return t

        gen = torch.Generator().manual_seed(info.dp_rank)
        tokens = torch.randint(0, arch.vocab_size, (micro_batch, seq_len + 1), generator=gen)
        batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                 "loss_mask": torch.ones(micro_batch, seq_len)}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            train_step(chunks, optimizer, [batch], lm_loss_fn(arch.vocab_size), logits_forward)
        activations = live["peak"]

        inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        opt_bytes = _optimizer_bytes([opt.optimizer for opt in inner], model_storage)
        result = {
            "stage": info.pp_rank,
            "weights": sum(p.numel() * p.element_size() for p in params),
            "gradients": sum(buf.grad_data.numel() * buf.grad_data.element_size() for buf in buffers),
            "optimizer": opt_bytes,
            "activations": activations,
        }
        del chunks, optimizer
        if info.tp_rank == 0 and info.dp_rank == 0:
            return result
        return None


def _optimizer_bytes(optimizers: list, model_storage: set[int]) -> int:
    """Bytes of the optimizers' state tensors and of main parameters that are not model storage."""
    import torch

    total, seen = 0, set()
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.numel() > 1 and _storage_ptr(value) not in seen:
                    seen.add(_storage_ptr(value))
                    total += value.untyped_storage().nbytes()
        for group in opt.param_groups:
            for p in group["params"]:
                ptr = _storage_ptr(p)
                if ptr not in model_storage and ptr not in seen:  # fp32 main copies of bf16 weights
                    seen.add(ptr)
                    total += p.untyped_storage().nbytes()
    return total


def estimate(case: Case, stage: int) -> dict[str, float]:
    from megarl.plan.memory import Layout, Workload, trained_rank

    layout = Layout(tp=case.tp, pp=case.pp, dp=case.dp, ep=case.ep)
    method = "block" if case.recompute == "block" else "uniform"
    work = Workload(dtype=case.dtype, micro_batch=case.micro_batch, seq_len=case.seq_len, attention="sdpa",
                    recompute="full" if case.recompute == "block" else case.recompute,
                    recompute_method=method, recompute_layers=case.recompute_layers,
                    recompute_modules=SELECTIVE_MODULES, lora_rank=case.lora_rank)
    rank = trained_rank(MODELS[case.model], layout, work, stage, microbatches=1)
    return {"weights": rank.weights, "gradients": rank.gradients, "optimizer": rank.optimizer,
            "activations": rank.activations_per_microbatch}


def compare(case: Case, measured: dict, tolerance: float) -> list[dict]:
    est = estimate(case, measured["stage"])
    rows = []
    for comp in (*COMPONENTS, "total"):
        m = sum(measured[c] for c in COMPONENTS) if comp == "total" else measured[comp]
        e = sum(est[c] for c in COMPONENTS) if comp == "total" else est[comp]
        ratio = e / m if m else (1.0 if e == 0 else float("inf"))
        rows.append({"case": case.label(), "stage": measured["stage"], "component": comp, "measured": m,
                     "model": e, "ratio": ratio, "ok": abs(ratio - 1) <= tolerance})
    return rows


def run_memory_bench(cases: list[Case], tolerance: float = 0.15, progress=print) -> list[dict]:
    """Runs every case (one pool of ranks per world size) and returns the comparison rows."""
    from megarl.distributed.spmd import SpmdPool

    rows: list[dict] = []
    for world in sorted({c.world for c in cases}):
        progress(f"starting {world} rank(s) ...")
        with SpmdPool(world) as pool:
            for case in (c for c in cases if c.world == world):
                progress(f"  {case.label()}")
                results = pool.run(measure_rank, arch=MODELS[case.model], tp=case.tp, pp=case.pp, ep=case.ep,
                                   dtype=case.dtype, micro_batch=case.micro_batch, seq_len=case.seq_len,
                                   recompute=case.recompute_config(), lora_rank=case.lora_rank)
                for measured in sorted((r for r in results if r), key=lambda r: r["stage"]):
                    rows += compare(case, measured, tolerance)
    return rows


def format_table(rows: list[dict], tolerance: float) -> str:
    lines = [f"planner memory model vs megatron-core measured, per rank (tolerance {tolerance:.0%}); "
             "activations = saved for backward in one micro-batch",
             f"{'case':<50} {'stage':>5} {'component':<14} {'measured MiB':>13} {'model MiB':>10} "
             f"{'model/meas':>10}  result"]
    for r in rows:
        lines.append(f"{r['case']:<50} {r['stage']:>5} {r['component']:<14} {r['measured'] / 2**20:>13.3f} "
                     f"{r['model'] / 2**20:>10.3f} {r['ratio']:>10.3f}  {'PASS' if r['ok'] else 'FAIL'}")
    failed = sum(not r["ok"] for r in rows)
    lines.append(f"{len(rows) - failed}/{len(rows)} within {tolerance:.0%}" + (f"; {failed} FAIL" if failed else ""))
    return "\n".join(lines)


def dumps(rows: list[dict]) -> str:
    return json.dumps({"rows": rows, "cases": [asdict(c) for c in CASES]}, indent=2)


def add_parser(bench_sub) -> None:
    """Registers ``megarl bench memory``."""
    p = bench_sub.add_parser(
        "memory", help="the planner's per-GPU memory model vs megatron-core's measured memory",
        description="Builds megatron-core GPT models (tiny to ~100M parameters) on CPU ranks at tp/pp/dp "
                    "layouts of up to 8 ranks, runs one training micro-step with the distributed optimizer, and "
                    "prints per rank and pipeline stage the measured bytes of weights, DDP gradient buffers, "
                    "optimizer state and activations saved for backward next to the planner's estimate, the ratio "
                    "and PASS/FAIL against the tolerance. About 4 minutes on 2 cores (--quick: about 40 s).")
    p.add_argument("--quick", action="store_true", help="two 2-rank cases only")
    p.add_argument("--only", metavar="TEXT[,TEXT]", help="only the cases whose label contains one of the "
                   "comma-separated TEXTs (e.g. 'rc=,moe')")
    p.add_argument("--tolerance", type=float, default=0.15, help="allowed |model/measured - 1| (default 0.15)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of the table")
    p.set_defaults(run=_run_cmd)


def _run_cmd(args) -> int:
    import sys

    progress = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    cases = QUICK_CASES if args.quick else CASES
    if args.only:
        cases = [c for c in cases if any(text in c.label() for text in args.only.split(","))]
    rows = run_memory_bench(cases, args.tolerance, progress)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows, args.tolerance), flush=True)
    return 0 if all(r["ok"] for r in rows) else 1
