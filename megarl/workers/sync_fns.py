"""Rank functions of the actor's side of a weight sync (run through its WorkerGroup)."""

from __future__ import annotations

import torch.distributed as dist

from megarl.distributed.bringup import free_port
from megarl.platform import current_platform
from megarl.reshard.delta import DeltaSide, continued
from megarl.reshard.group import SameDevice, node_ip, open_sync_group
from megarl.reshard.plan import meta_fingerprint
from megarl.reshard.source import expected_checksums, source_meta, source_tensors
from megarl.reshard.transport import run_fragment
from megarl.workers.megatron_model import held
from megarl.workers.state import state

SYNC_STATE_KEY = "weight_sync"


def meta(key: str) -> dict | None:
    model = held(key)
    return source_meta(model.chunks, model.spec, model.info)


def backend() -> str:
    """This rank's torch.distributed backend (the sync group's, for the ranks and the engines)."""
    return current_platform().backend


def address() -> tuple[str, int]:
    """Where this rank will host the sync group's store."""
    return node_ip(), free_port()


def join(host: str, port: int, rank_map: dict[int, int], world_size: int, backend: str,
         timeout_s: float = 120.0, same_device: SameDevice = "auto") -> int | None:
    sync_rank = rank_map.get(dist.get_rank())
    leave()
    if sync_rank is not None:
        group = open_sync_group(host, port, sync_rank, world_size, backend, timeout_s, same_device)
        state[SYNC_STATE_KEY] = {"group": group, "plans": {}}
    return sync_rank


def install(fragments: dict[int, dict]) -> None:
    sync = state.get(SYNC_STATE_KEY)
    if sync is not None:
        fragment = fragments[sync["group"].rank]
        sync["plans"][fragment["plan_id"]] = fragment


def _fragment(key: str, plan_id: str) -> dict:
    fragment = state[SYNC_STATE_KEY]["plans"].get(plan_id)
    if fragment is None:
        raise RuntimeError(f"weight-sync plan {plan_id} is not installed on this rank")
    current = meta(key)
    if current is None or meta_fingerprint(current["params"]) != fragment["fingerprint"]:
        raise RuntimeError("stale weight-sync plan: this rank's parameters or layout changed since the plan "
                           "was made; build a new plan (WeightSync.setup)")
    return fragment


def check(key: str, plan_id: str) -> str | None:
    """Why the installed plan no longer fits this rank, or None (a stale plan is not a rank failure)."""
    try:
        if SYNC_STATE_KEY in state:
            _fragment(key, plan_id)
        elif meta(key) is not None:
            return ("stale weight-sync plan: this rank now sources weights but is not in the plan; "
                    "build a new plan (WeightSync.setup)")
    except RuntimeError as e:
        return str(e)
    return None


def _delta_side(sync: dict, plan_id: str, mode: str | None) -> DeltaSide | None:
    """``trainer.delta_sync``: a full sync starts a new copy of what is sent (one copy of this rank's
    shards, in the engines' dtype); a delta one compares against it."""
    sync["delta"] = continued(sync.get("delta"), plan_id, mode, "this actor rank")
    return None if sync["delta"] is None else sync["delta"][1]


def send(key: str, plan_id: str, delta: str | None = None) -> dict | None:
    """Sends this rank's shards; WeightSync.sync has just run ``check`` on every rank. ``delta``:
    "full" or "delta" under ``trainer.delta_sync`` (``megarl.reshard.delta``), None without it."""
    from megarl.utils.memory import current_rss, peak_rss, reset_peak_rss

    if SYNC_STATE_KEY not in state:
        return None
    fragment = state[SYNC_STATE_KEY]["plans"].get(plan_id)
    if fragment is None:
        raise RuntimeError(f"weight-sync plan {plan_id} is not installed on this rank")
    model = held(key)
    reset_peak_rss()
    rss_at_start = current_rss()
    tensors = source_tensors(model.chunks, model.spec, model.info)
    side = _delta_side(state[SYNC_STATE_KEY], plan_id, delta)
    stats = run_fragment(state[SYNC_STATE_KEY]["group"], fragment, tensors.__getitem__, delta=side)
    return {"rank": state[SYNC_STATE_KEY]["group"].rank, "bytes_sent": stats.bytes_sent, "seconds": stats.seconds,
            "peak_staging_bytes": stats.peak_staging_bytes, "messages": stats.messages,
            "peak_rss_above_start": peak_rss() - rss_at_start,
            "largest_param_bytes": max(t.numel() * t.element_size() for t in tensors.values())}


def checksums(key: str, plan_id: str) -> dict[tuple[int, str], float] | None:
    if SYNC_STATE_KEY not in state:
        return None
    model = held(key)
    return expected_checksums(_fragment(key, plan_id), model.chunks, model.spec, model.info)


def leave() -> None:
    sync = state.pop(SYNC_STATE_KEY, None)
    if sync is not None:
        sync["group"].close()
