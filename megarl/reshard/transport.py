"""Executing a sync-plan fragment over a torch.distributed process group.

Both sides run the same loop over their fragment's buckets: post every send and
receive of the bucket, wait, unpack the packed messages, then let the receiver
finalise the parameters the bucket completed (on CPU, vLLM re-packs its GEMM
weights). On CPU a bucket's parameters are finalised on this same thread right
after the next bucket's sends and receives are posted, while its bytes move on the
process group's own threads: parameters a bucket completed are not touched by
later buckets, at most one bucket waits to be finalised (received weights cannot
pile up behind a slow finaliser), and what finalising frees is reused by the next
bucket's allocations (one thread, one allocator arena). On GPU it runs in line,
on the stream the receive was ordered on. Direct messages read from and land in
the parameters themselves; staging buffers exist only for packed messages, and a
bucket's are gone before the next bucket posts anything, so staging memory stays
under the bucket cap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.platform import current_platform
from megarl.reshard import delta as changed_only
from megarl.reshard.plan import dtype_of

ParamLookup = Callable[[str], torch.Tensor]


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    peak_staging_bytes: int = 0
    seconds: float = 0.0
    finalize_seconds: float = 0.0
    wait_seconds: float = 0.0  # blocked on the bytes themselves (the rest is this rank's own work)
    delta_elements: int = 0  # a delta sync's receiver: elements its messages cover ...
    changed_elements: int = 0  # ... and how many of them changed (were sent)


def region(tensor: torch.Tensor, dim: int, offset: int, length: int) -> torch.Tensor:
    return tensor.narrow(dim, offset, length)


def run_fragment(group, fragment: dict, params: ParamLookup,
                 finalize: Callable[[str], None] | None = None,
                 prepare: Callable[[list[str]], None] | None = None,
                 delta: changed_only.DeltaSide | None = None) -> TransferStats:
    """Runs this rank's part of a plan on ``group`` (a ProcessGroup with send/recv).

    ``prepare`` (receiver) is given the parameters a bucket writes into before anything of
    the bucket is looked up or allocated; ``finalize`` each parameter once its last bucket landed.
    ``delta`` (``trainer.delta_sync``): the changed elements only, or a full sync that keeps what
    the next one compares against (``megarl.reshard.delta``).
    """
    stats = TransferStats()
    started = time.perf_counter()
    platform = current_platform()
    overlap = finalize is not None and platform.finalizes_in_background
    waiting: list[str] = []  # completed by the previous bucket, finalised while this one moves

    def finalize_all(names: list[str]) -> None:
        t0 = time.perf_counter()
        for name in names:
            finalize(name)
        stats.finalize_seconds += time.perf_counter() - t0

    for b, bucket in enumerate(fragment["buckets"]):
        if prepare is not None and bucket["recv"]:
            prepare(sorted({item[0] for message in bucket["recv"] for item in message["items"]}))
        if delta is not None and delta.mode == "delta":
            # headers first (the receiver learns each body's size), so no overlap with finalising
            if waiting:
                finalize_all(waiting)
                waiting = []
            sends = changed_only.post_sends(group, b, bucket, params, delta, stats)
            changed_only.receive(group, b, bucket, params, delta, stats)
            for work, _ in sends:
                work.wait()
            del sends
        else:
            posted = _post_bucket(group, bucket, params, stats)
            if waiting:
                finalize_all(waiting)
                waiting = []
            # The bucket's staging buffers and views of its parameters live only in ``posted``:
            # nothing of one bucket is still referenced while the next one allocates.
            _finish_bucket(posted, params, stats)
            del posted
            if delta is not None:
                changed_only.keep_after_full(b, bucket, params, delta)
        # On GPU the sends and receives are queued, not done: wait for them here, so staging
        # stays within one bucket and the timings are of the transfer, not of the enqueueing.
        platform.synchronize()
        if overlap:
            waiting = bucket["complete"]
        elif finalize is not None and bucket["complete"]:
            finalize_all(bucket["complete"])  # in order, on this thread's stream
    if waiting:
        finalize_all(waiting)
    stats.seconds = time.perf_counter() - started
    return stats


def _post_bucket(group, bucket: dict, params: ParamLookup, stats: TransferStats) -> tuple[list, list]:
    """Posts every send and receive of ``bucket``; (their works, the packed receives to unpack)."""
    works, unpack, staging = [], [], 0
    for message in bucket["send"]:
        dtype = dtype_of(message["dtype"])
        if message["direct"]:
            ((name, dim, offset, length),) = message["items"]
            payload = region(params(name), dim, offset, length)
            if payload.dtype != dtype or not payload.is_contiguous():
                payload = payload.to(dtype).contiguous()
                staging += payload.numel() * payload.element_size()
        else:
            payload = torch.cat([region(params(name), dim, offset, length).to(dtype).reshape(-1)
                                 for name, dim, offset, length in message["items"]])
            staging += payload.numel() * payload.element_size()
        works.append(group.send([payload], message["peer"], message["tag"]))
        stats.bytes_sent += message["nbytes"]
        stats.messages += 1
    for message in bucket["recv"]:
        dtype = dtype_of(message["dtype"])
        if message["direct"]:
            ((name, dim, offset, length),) = message["items"]
            target = region(params(name), dim, offset, length)
            works.append(group.recv([target], message["peer"], message["tag"]))
        else:
            buffer = torch.empty(message["nbytes"] // dtype.itemsize, dtype=dtype,
                                 device=params(message["items"][0][0]).device)
            staging += message["nbytes"]
            works.append(group.recv([buffer], message["peer"], message["tag"]))
            unpack.append((buffer, message["items"]))
        stats.bytes_received += message["nbytes"]
        stats.messages += 1
    stats.peak_staging_bytes = max(stats.peak_staging_bytes, staging)
    return works, unpack


def _finish_bucket(posted: tuple[list, list], params: ParamLookup, stats: TransferStats) -> None:
    works, unpack = posted
    t0 = time.perf_counter()
    for work in works:
        work.wait()
    stats.wait_seconds += time.perf_counter() - t0
    for buffer, items in unpack:
        position = 0
        for name, dim, offset, length in items:
            target = region(params(name), dim, offset, length)
            n = target.numel()
            target.copy_(buffer[position:position + n].view(target.shape))
            position += n
    works.clear()
    unpack.clear()
