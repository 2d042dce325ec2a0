"""What each rank runs for a ``megarl convert`` command (called through an SpmdPool).

Every function here is collective: all ranks of the pool call it with the same
arguments. Each returns a small dict of statistics (bytes moved, peak memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.schema import ParallelConfig, PrecisionConfig
from megarl.convert.checkpoint import HF_DIR, load_model, read_meta, save_model, write_meta
from megarl.convert.hf_io import HFReader, HFWriter, copy_side_files
from megarl.convert.lora_export import ADAPTER_DIR, merge_into_base, read_lora_meta, save_peft_adapter
from megarl.convert.weights import export_hf_tensors, load_hf_weights
from megarl.distributed.parallel import megatron_parallel
from megarl.models.forward import forward_outputs, full_logits
from megarl.models.gpt import TORCH_DTYPES, ModelSpec, build_model_chunks
from megarl.models.hf_arch import arch_from_hf_dir
from megarl.utils.memory import current_rss, peak_rss, reset_peak_rss


class _Memory:
    """Peak memory of this job on this rank, above what the process held when it started."""

    def __init__(self) -> None:
        reset_peak_rss()
        self.baseline = current_rss()

    def stats(self, weights_bytes: int = 0, **extra: Any) -> dict[str, Any]:
        peak = peak_rss()
        return {"rank": dist.get_rank(), "peak_rss": peak, "baseline_rss": self.baseline,
                "peak_above_baseline": peak - self.baseline, "weights_bytes": weights_bytes, **extra}


def _weights_bytes(chunks: list) -> int:
    return sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())


def spec_from_checkpoint(ckpt_dir: str, parallel: ParallelConfig, dtype: str | None = None) -> ModelSpec:
    meta = read_meta(ckpt_dir)
    from megarl.models.hf_arch import ModelArch

    return ModelSpec(
        arch=ModelArch.from_dict(meta["arch"]),
        parallel=parallel,
        precision=PrecisionConfig(dtype=dtype or meta["dtype"]),
        value_head=meta["value_head"],
        padded_vocab_override=meta["padded_vocab"],
    )


def hf_to_mcore(hf_dir: str, out_dir: str, parallel: ParallelConfig, dtype: str,
                vocab_pad_multiple: int = 128, value_head: bool = False) -> dict[str, Any]:
    memory = _Memory()
    arch = arch_from_hf_dir(hf_dir)
    spec = ModelSpec(arch, parallel, PrecisionConfig(dtype=dtype), vocab_pad_multiple, value_head)
    with megatron_parallel(parallel) as info:
        chunks = build_model_chunks(spec)
        reader = HFReader(hf_dir)
        loaded = load_hf_weights(chunks, reader, spec, info)
        save_model(chunks, out_dir)
        if dist.get_rank() == 0:
            hf_side = Path(out_dir) / HF_DIR
            hf_side.mkdir(exist_ok=True)
            copy_side_files(hf_dir, hf_side)
            write_meta(out_dir, arch, spec.padded_vocab, dtype, parallel, value_head, source=str(hf_dir))
        dist.barrier()
        weights = _weights_bytes(chunks)
    return memory.stats(weights, bytes_read=reader.bytes_read, params_loaded=loaded)


def _load_checkpoint(chunks: list, spec: ModelSpec, info, ckpt_dir: str) -> bool:
    """Fills ``chunks`` from ``ckpt_dir``, with the adapters of a LoRA checkpoint (``lora.json``)
    built first so that theirs load too; whether it was one."""
    lora = read_lora_meta(ckpt_dir)
    if lora is not None:
        from megarl.models.lora import apply_lora

        apply_lora(chunks, spec, info.tp_rank, info.tp, lora)
    load_model(chunks, ckpt_dir)
    return lora is not None


def mcore_to_hf(ckpt_dir: str, out_dir: str, parallel: ParallelConfig,
                dtype: str | None = None, max_shard_bytes: int = 5 * 1024**3) -> dict[str, Any]:
    memory = _Memory()
    spec = spec_from_checkpoint(ckpt_dir, parallel)
    out_dtype = TORCH_DTYPES[dtype or spec.precision.dtype]
    with megatron_parallel(parallel) as info:
        chunks = build_model_chunks(spec)
        if _load_checkpoint(chunks, spec, info, ckpt_dir):
            # a LoRA checkpoint: its adapters as PEFT saves them, and the merged model beside them
            save_peft_adapter(chunks, Path(out_dir) / ADAPTER_DIR, base_model=read_meta(ckpt_dir)["source"])
            merge_into_base(chunks)
        writer = HFWriter(out_dir, max_shard_bytes) if dist.get_rank() == 0 else None
        export_hf_tensors(chunks, spec, info, writer.add if writer else (lambda n, t: None), out_dtype)
        if writer is not None:
            writer.close()
            copy_side_files(Path(ckpt_dir) / HF_DIR, out_dir)
            _set_config_dtype(Path(out_dir) / "config.json", dtype or spec.precision.dtype, spec.value_head)
        dist.barrier()
        weights = _weights_bytes(chunks)
    return memory.stats(weights, bytes_written=writer.bytes_written if writer else 0)


def _set_config_dtype(config_path: Path, dtype: str, value_head: bool = False) -> None:
    """The exported config's dtype; a value-head model (reward model, critic) becomes the family's
    sequence classifier with one label, which is how transformers and vLLM load a score head."""
    import json

    from megarl.utils.atomic import write_text_atomic

    if config_path.is_file():
        cfg = json.loads(config_path.read_text())
        cfg["dtype"] = dtype
        cfg.pop("torch_dtype", None)
        if value_head:
            cfg["architectures"] = [a.replace("ForCausalLM", "ForSequenceClassification")
                                    for a in cfg.get("architectures") or []]
            cfg["num_labels"], cfg["id2label"], cfg["label2id"] = 1, {"0": "LABEL_0"}, {"LABEL_0": 0}
            if cfg.get("pad_token_id") is not None and cfg.get("pad_token_id") == cfg.get("eos_token_id"):
                # transformers scores a sequence's last token that is not padding; megarl (and vLLM's
                # last-token pooling) score the last token, the eos a finished response ends with.
                # Padding that equals the eos would move transformers' score one token back, so the
                # classifier has none: one sequence per call scores as megarl does (transformers
                # refuses a padded batch without a pad token rather than scoring the wrong token).
                cfg["pad_token_id"] = None
        write_text_atomic(config_path, json.dumps(cfg, indent=2))


def reshard(ckpt_dir: str, out_dir: str, parallel: ParallelConfig) -> dict[str, Any]:
    memory = _Memory()
    meta = read_meta(ckpt_dir)
    spec = spec_from_checkpoint(ckpt_dir, parallel)
    with megatron_parallel(parallel):
        chunks = build_model_chunks(spec)
        load_model(chunks, ckpt_dir)
        save_model(chunks, out_dir)
        if dist.get_rank() == 0:
            import shutil

            if (Path(ckpt_dir) / HF_DIR).is_dir():
                shutil.copytree(Path(ckpt_dir) / HF_DIR, Path(out_dir) / HF_DIR)
            else:  # a checkpoint written without side files: reshard it all the same
                (Path(out_dir) / HF_DIR).mkdir()
            write_meta(out_dir, spec.arch, spec.padded_vocab, spec.precision.dtype, parallel,
                       spec.value_head, source=meta.get("source", str(ckpt_dir)))
        dist.barrier()
        weights = _weights_bytes(chunks)
    return memory.stats(weights)


def _outputs(chunks: list, spec: ModelSpec, tokens: torch.Tensor, num_microbatches: int) -> torch.Tensor | None:
    """Last-stage outputs: full-vocab logits (real vocab only), or per-token values [b, s, 1]."""
    if spec.value_head:
        outputs = forward_outputs(chunks, list(tokens.chunk(num_microbatches)))
        return None if outputs is None else torch.cat(outputs).float().cpu()
    logits = full_logits(chunks, tokens, num_microbatches)
    return None if logits is None else logits[..., : spec.arch.vocab_size]


def _on_reporting_rank(info, value):
    # One copy of the result: the first tensor- and data-parallel rank of the last stage.
    return value if value is not None and info.tp_rank == 0 and info.dp_rank == 0 else None


def checkpoint_logits(ckpt_dir: str, parallel: ParallelConfig, tokens: torch.Tensor,
                      num_microbatches: int = 1) -> dict[str, Any]:
    """fp32 outputs of ``tokens`` from a checkpoint loaded at ``parallel`` (logits or values)."""
    spec = spec_from_checkpoint(ckpt_dir, parallel, dtype="float32")
    with megatron_parallel(parallel) as info:
        chunks = build_model_chunks(spec)
        _load_checkpoint(chunks, spec, info, ckpt_dir)
        return {"logits": _on_reporting_rank(info, _outputs(chunks, spec, tokens, num_microbatches))}


def hf_logits(hf_dir: str, parallel: ParallelConfig, tokens: torch.Tensor,
              num_microbatches: int = 1, value_head: bool = False) -> dict[str, Any]:
    """Same as ``checkpoint_logits`` but loading straight from an HF directory."""
    spec = ModelSpec(arch_from_hf_dir(hf_dir), parallel, PrecisionConfig(dtype="float32"),
                     value_head=value_head)
    with megatron_parallel(parallel) as info:
        chunks = build_model_chunks(spec)
        load_hf_weights(chunks, HFReader(hf_dir), spec, info)
        return {"logits": _on_reporting_rank(info, _outputs(chunks, spec, tokens, num_microbatches))}
