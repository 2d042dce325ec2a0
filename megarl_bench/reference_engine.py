"""The receiving side of the refit benchmarks' reference transfers (``bench/reference_transfers.py``).

A ``VLLMEngine`` whose workers can also receive plain buffers (the raw-transfer floor) and whole HF
tensors loaded through vLLM's own ``load_weights`` (the peers' full-tensor way). Only the benchmarks
start it (``start_engine(..., engine_class=ReferenceTransferEngine)``); runs use ``VLLMEngine``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from megarl.rollout.vllm_engine import VLLMEngine
from megarl.rollout.worker_extension import WeightSyncExtension


class ReferenceTransferExtension(WeightSyncExtension):
    def megarl_receive_raw(self, sources_json: str) -> str:
        """Receives plain byte counts from each source (the benchmark's raw-transfer reference)."""
        sources = json.loads(sources_json)[str(self._megarl_group.rank)]
        started = time.perf_counter()
        works, buffers = [], []
        for src, nbytes in sources:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            buffers.append(buffer)
            works.append(self._megarl_group.recv([buffer], src, 0))
        for work in works:
            work.wait()
        return json.dumps({"seconds": time.perf_counter() - started, "bytes": sum(n for _, n in sources)})

    def megarl_receive_full(self, tensors_json: str) -> str:
        """The full-tensor baseline (and fallback): every HF tensor whole from sync rank 0,
        loaded through vLLM's own ``load_weights``, which keeps this worker's slice."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        listing = json.loads(tensors_json)  # [[name, shape, dtype], ...] in any order
        model = self._megarl_model()
        started = time.perf_counter()
        # Prepacked (emptied) weights must exist again before vLLM's loaders copy into them.
        modules = self._megarl_modules()
        for name, param in model.named_parameters():
            if param.numel() == 0:
                module = modules[name.rsplit(".", 1)[0]]
                param.data = torch.empty(self._megarl_logical_shape(name, param, module), dtype=param.dtype,
                                         device=param.device)
        received = 0
        index = torch.empty(1, dtype=torch.int64)
        for _ in listing:
            self._megarl_group.recv([index], 0, 1).wait()
            name, shape, dtype = listing[int(index)]
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self._megarl_group.recv([tensor], 0, 2).wait()
            received += tensor.numel() * tensor.element_size()
            model.load_weights([(name, tensor)])
        process_weights_after_loading(model, self.model_runner.model_config, next(model.parameters()).device)
        return json.dumps({"rank": self._megarl_group.rank, "bytes_received": received,
                           "seconds": time.perf_counter() - started})


class ReferenceTransferEngine(VLLMEngine):
    worker_extension = f"{__name__}.ReferenceTransferExtension"

    def receive_full_tensors(self, listing: list[tuple[str, list[int], str]]) -> list[dict[str, Any]]:
        stats = [json.loads(s) for s in self.llm.collective_rpc("megarl_receive_full", args=(json.dumps(listing),))]
        self.llm.reset_prefix_cache()
        return stats

    def receive_raw(self, sources: dict[int, list[tuple[int, int]]]) -> list[dict[str, Any]]:
        payload = json.dumps({str(rank): pairs for rank, pairs in sources.items()})
        return [json.loads(s) for s in self.llm.collective_rpc("megarl_receive_raw", args=(payload,))]
