"""The GPU machine's checks of megarl's rollout path, one step per call (containers/gpu/smoke.sh).

Each step appends one JSON line to $OUT/summary.jsonl: its name, whether it passed, its numbers
and, on failure, the error's last line. Steps:

  probe      the machine and the versions; vLLM imports
  ipc        two processes on the one GPU exchange tensors through the sync group's same-device
             channel (CUDA IPC): bit for bit, and at what rate
  engine     vLLM in this process (no Ray), tiny Llama in bf16: which model runner, greedy tokens,
             prompt log-probs against transformers on the GPU, sleep (memory freed) and wake (the
             same greedy tokens)
  fp8        the same model through vLLM's online FP8 (rollout.weights: fp8): log-prob gap and KL
             against bf16
  r3         rollout routing replay on a tiny Qwen3-MoE: every sample's routes recorded
  grpo       `megarl train`: GRPO with actor, reference and vLLM colocated on the GPU, 3 steps,
             verify_sync=every (GRPO_ARGS adds overrides, e.g. rollout.weights=fp8)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp/megarl-gpu-out"))
WORK = Path(os.environ.get("SMOKE_WORK", "/tmp/megarl-smoke"))
TOKENIZER = Path(os.environ.get("SMOKE_TOKENIZER", ".gpu_stage/tokenizer"))


def record(step: str, ok: bool, **numbers) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"step": step, "ok": ok, **numbers}, default=str)
    print(line, flush=True)
    for folder in (OUT, WORK):  # WORK's copy outlives the command (the next part reads it)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "summary.jsonl", "a") as f:
            f.write(line + "\n")


def tiny_hf(family: str, vocab: int = 512, tokenizer: bool = False) -> Path:
    """A random tiny model as an HF folder (bf16), made once per machine."""
    import transformers

    path = WORK / f"{family}-{vocab}"
    if (path / "config.json").exists():
        return path
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.02)
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
    else:  # qwen3_moe: 4 experts, 2 per token, head_dim 32
        config = transformers.Qwen3MoeConfig(**common, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path)
    if tokenizer:
        for f in TOKENIZER.iterdir():
            (path / f.name).write_bytes(f.read_bytes())
    return path


def tokens(batch: int, seq: int, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, seq), generator=g).tolist()


# -- steps --------------------------------------------------------------------------------------


def probe() -> dict:
    import importlib.util

    free, total = torch.cuda.mem_get_info()
    out = {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "memory_gib": round(total / 2**30, 1), "free_gib": round(free / 2**30, 1), "python": sys.version.split()[0],
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    for name in ("vllm", "ray", "megatron.core", "transformers", "transformer_engine", "triton"):
        if importlib.util.find_spec(name) is None:
            out[name] = "missing"
            continue
        module = __import__(name, fromlist=["_"])
        out[name] = getattr(module, "__version__", "?")
    import vllm._C_stable_libtorch  # noqa: F401 - vLLM's CUDA ops against this torch
    from vllm import LLM  # noqa: F401 - the import itself is the check
    return out


def _ipc_rank(rank: int, port: int, sizes: list[int], out: dict) -> None:
    from megarl.reshard.group import open_sync_group

    torch.cuda.set_device(0)
    group = open_sync_group("127.0.0.1", port, rank, 2, "nccl", timeout_s=60)
    tensors = [torch.arange(n, device="cuda", dtype=torch.float32).to(torch.bfloat16) for n in sizes]
    torch.cuda.synchronize()
    started = time.perf_counter()
    if rank == 0:
        works = [group.send([t], 1, tag=i) for i, t in enumerate(tensors)]
    else:
        received = [torch.empty_like(t) for t in tensors]
        works = [group.recv([r], 0, tag=i) for i, r in enumerate(received)]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    if rank == 1:
        out["equal"] = all(torch.equal(a, b) for a, b in zip(tensors, received, strict=True))
        out["seconds"] = seconds
        out["gb_per_s"] = sum(t.numel() * 2 for t in tensors) / seconds / 1e9
        out["same_device_peers"] = sorted(group.peers_on_this_device)
    group.close()


def ipc() -> dict:
    import torch.multiprocessing as mp

    from megarl.distributed.bringup import free_port

    port, sizes = free_port(), [7, 1 << 20, 128 << 20]  # 128 Mi bf16 elements: 256 MiB
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=_ipc_rank, args=(r, port, sizes, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        result = dict(out)
        result["exitcodes"] = [p.exitcode for p in procs]
    if result.get("equal") is not True or result["exitcodes"] != [0, 0]:
        raise RuntimeError(f"same-device exchange failed: {result}")
    return result


def _runner_class(engine) -> str:
    return engine.llm.collective_rpc(lambda self: type(self.model_runner).__module__)[0]


def engine() -> dict:
    import transformers

    from megarl.rollout.sampling import SamplingConfig
    from megarl.rollout.vllm_engine import VLLMEngine

    path = tiny_hf("llama")
    eng = VLLMEngine(str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.2)
    out = {"runner": _runner_class(eng)}
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    prompts = tokens(4, 16, seed=1)
    before = [s[0].response_ids for s in eng.generate(prompts, greedy)]
    sequences = tokens(2, 32, seed=2)
    scored = torch.tensor(eng.prompt_logprobs(sequences))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        ids = torch.tensor(sequences, device="cuda")
        logits = hf(ids).logits.float()
    want = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0].cpu()
    out["logprob_vs_transformers_max_abs"] = float((scored - want).abs().max())
    out["logprob_vs_transformers_mean_abs"] = float((scored - want).abs().mean())
    del hf
    torch.cuda.empty_cache()
    awake = torch.cuda.mem_get_info()[0]
    eng.sleep()
    asleep = torch.cuda.mem_get_info()[0]
    eng.wake_up_weights()
    eng.wake_up_kv_cache()
    after = [s[0].response_ids for s in eng.generate(prompts, greedy)]
    out["sleep_freed_gib"] = round((asleep - awake) / 2**30, 2)
    out["same_greedy_tokens_after_wake"] = before == after
    torch.save({"sequences": sequences, "bf16": scored}, WORK / "bf16_logprobs.pt")
    eng.shutdown()
    if before != after:
        raise RuntimeError(f"greedy tokens changed across sleep/wake: {before} vs {after}")
    return out


def fp8() -> dict:
    from megarl.rollout.vllm_engine import VLLMEngine

    path = tiny_hf("llama")
    saved = torch.load(WORK / "bf16_logprobs.pt", weights_only=True)
    eng = VLLMEngine(str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.2,
                     weights="fp8")
    dtypes = eng.llm.collective_rpc(lambda self: sorted({str(p.dtype) for p in self.model_runner.model.parameters()}))
    scored = torch.tensor(eng.prompt_logprobs(saved["sequences"]))
    eng.shutdown()
    diff = scored - saved["bf16"]
    # on fixed random tokens (not samples, so no KL estimate here: the fp8 GRPO run's mismatch/kl_k3
    # is over its own samples)
    return {"param_dtypes": dtypes[0], "logprob_vs_bf16_max_abs": float(diff.abs().max()),
            "logprob_vs_bf16_mean_abs": float(diff.abs().mean()),
            "token_mult_prob_error_vs_bf16": float(torch.exp(diff.abs()).mean())}


def r3() -> dict:
    from megarl.rollout.sampling import SamplingConfig
    from megarl.rollout.vllm_engine import VLLMEngine

    path = tiny_hf("qwen3_moe")
    eng = VLLMEngine(str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.2,
                     routing_replay=True)
    out = {"runner": _runner_class(eng)}
    samples = eng.generate(tokens(3, 12, seed=3), SamplingConfig(n=2, temperature=1.0, max_tokens=10, seed=0))
    shapes = [list(s.routes.shape) for group in samples for s in group]
    out["route_shapes"] = shapes
    out["all_samples_routed"] = all(s.routes is not None for group in samples for s in group)
    eng.shutdown()
    return out


def grpo() -> dict:
    """A colocated GRPO run of a tiny Llama with SmolLM2's tokenizer; its per-step numbers."""
    extra = os.environ.get("GRPO_ARGS", "").split()
    name = os.environ.get("GRPO_NAME", "grpo")
    policy = tiny_hf("llama", vocab=49152, tokenizer=True)
    data = WORK / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?", "answer": str(a + b)}) + "\n"
                            for a in range(4) for b in range(4)))
    run_dir = WORK / name
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from length_reward import serve  # the trainer tests' reward: varied scores for a random model

    url, _ = serve()
    args = [f"actor.model.path={policy}", f"reference.model.path={policy}", f"output_dir={run_dir}",
            f"data.source={data}", "rewards=[{kind: remote, url: '" + url + "'}]", *extra]
    started = time.perf_counter()
    recipe = "containers/gpu/colocated_grpo.yaml"
    # within the step's own limit, so that the metrics of the steps that ran come back
    limit = float(os.environ.get("GRPO_LIMIT_S", 240))
    try:
        proc = subprocess.run([sys.executable, "-m", "megarl.cli.main", "train", recipe, *args],
                              capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        stderr = _text(e.stderr) + f"\ntimed out after {limit} s"
        proc = subprocess.CompletedProcess(e.cmd, 124, _text(e.stdout), stderr)
    (OUT / f"{name}.log").write_text(proc.stdout + proc.stderr)
    seconds = time.perf_counter() - started
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    keep = ("sync/", "time/", "mismatch/")
    steps = [{k: v for k, v in m.items() if k.startswith(keep) or k == "step"} for m in metrics]
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        failure = run_dir / "failure.log"  # the full error (the CLI prints its first line)
        if failure.exists():
            detail = failure.read_text()
            (OUT / f"{name}.failure.log").write_text(detail)
            tail += detail.strip().splitlines()[-4:]
        raise RuntimeError(f"megarl train exited {proc.returncode}: {' | '.join(tail)}; steps logged: {steps}")
    return {"run_seconds": round(seconds, 1), "args": extra, "steps": steps}


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


STEPS = {"probe": probe, "ipc": ipc, "engine": engine, "fp8": fp8, "r3": r3, "grpo": grpo}


def main() -> None:
    step = sys.argv[1]
    name = os.environ.get("GRPO_NAME", step) if step == "grpo" else step
    WORK.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        numbers = STEPS[step]()
    except BaseException as e:  # noqa: BLE001 - every failure is a result to report
        traceback.print_exc()
        record(name, False, step_seconds=round(time.perf_counter() - started, 1),
               error=f"{type(e).__name__}: {str(e)[-1500:]}")
        sys.exit(1)
    record(name, True, step_seconds=round(time.perf_counter() - started, 1), **numbers)


if __name__ == "__main__":
    main()
