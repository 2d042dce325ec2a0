"""WorkerGroup on a local Ray: results, state, concurrency between groups, and failures.

Ray starts once for the module's session (5-15 s here) and each rank costs a few
seconds of imports, so the tests share a few small groups and run the tests that
tear a group down last.

The rank functions below live in this module; the ranks import it by name, so every
group gets this directory on its ``pythonpath``.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megarl.cluster import ensure_ray, shutdown_ray
from megarl.config.schema import ParallelConfig
from megarl.distributed.bringup import free_port
from megarl.workers import RankState, WorkerGroup, WorkerGroupError, current_rank
from megarl.workers.state import state

ray = pytest.importorskip("ray")  # a bare GPU machine has none (README, GPU)

TESTS_DIR = str(Path(__file__).resolve().parent)


# ------------------------------------------------------------------ rank functions


def whoami_and_all_reduce(value: float) -> dict:
    ctx = current_rank()
    total = torch.tensor([ctx.rank + value])
    dist.all_reduce(total)
    return dict(rank=dist.get_rank(), world=dist.get_world_size(), backend=dist.get_backend(),
                role=ctx.role, ctx_rank=ctx.rank, local_rank=ctx.local_rank, env_rank=os.environ["RANK"],
                pid=os.getpid(), total=total.item(), threads=torch.get_num_threads(),
                flag=os.environ.get("MEGARL_TEST_FLAG"))


def rank_of() -> int:
    return current_rank().rank


def remember(value: str) -> None:
    state["note"] = f"{current_rank().role}/{current_rank().rank}/{value}"


def recall() -> str:
    return state.require("note")


def megatron_tp2_info():
    from megarl.distributed.parallel import megatron_parallel, rank_info

    with megatron_parallel(ParallelConfig(tp=2, world_size=2)):
        return rank_info()


def pair_broadcast(port: int, pair_rank: int, value: float) -> float:
    """A two-member gloo group across two WorkerGroups, as a weight sync would make."""
    timeout = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=pair_rank == 0, timeout=timeout)
    group = dist.ProcessGroupGloo(store, pair_rank, 2, timeout)
    tensor = torch.tensor([value])
    group.broadcast(tensor, 0).wait()
    return tensor.item()


def raise_on(rank: int) -> None:
    if current_rank().rank == rank:
        raise ValueError(f"boom on rank {rank}")
    dist.barrier()  # the other ranks wait for a rank that never comes


def sleep_then_barrier(sleeper: int, seconds: float) -> None:
    if current_rank().rank == sleeper:
        time.sleep(seconds)
    dist.barrier()


def sleep(seconds: float) -> None:
    time.sleep(seconds)


# ------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def ray_session():
    ensure_ray()
    yield
    shutdown_ray()


class Groups:
    """Groups by role, restarted if a test tore one down."""

    def __init__(self) -> None:
        self._groups: dict[str, WorkerGroup] = {}

    def get(self, role: str, world_size: int, **options) -> WorkerGroup:
        options.setdefault("env", {"MEGARL_TEST_FLAG": "on"})
        group = self._groups.get(role)
        if group is None or not group.alive:
            group = self._groups[role] = WorkerGroup(role, world_size, pythonpath=[TESTS_DIR], **options)
        return group

    def close(self) -> None:
        for group in self._groups.values():
            group.shutdown()


@pytest.fixture(scope="module")
def groups(ray_session):
    g = Groups()
    yield g
    g.close()


def _fails(call, match: str) -> tuple[WorkerGroupError, float]:
    start = time.monotonic()
    with pytest.raises(WorkerGroupError, match=match) as info:
        call()
    return info.value, time.monotonic() - start


# --------------------------------------------------------------------------- tests


def test_rank_state_is_a_dict_with_helpful_errors():
    s = RankState()
    s["model"] = 1
    s["optimizer"] = 2
    assert dict(s) == {"model": 1, "optimizer": 2} and s.pop("optimizer") == 2
    with pytest.raises(KeyError, match="no 'engine'.*'model'"):
        s.require("engine")
    with pytest.raises(RuntimeError, match="not inside a WorkerGroup rank"):
        current_rank()


def test_run_returns_rank_results_over_a_gloo_group(groups):
    policy = groups.get("policy", 2)
    out = policy.run(whoami_and_all_reduce, value=1.0)
    assert [r["rank"] for r in out] == [r["ctx_rank"] for r in out] == [r["local_rank"] for r in out] == [0, 1]
    assert [r["env_rank"] for r in out] == ["0", "1"]
    assert all(r["world"] == 2 and r["backend"] == "gloo" and r["role"] == "policy" for r in out)
    assert [r["total"] for r in out] == [3.0, 3.0]  # (0 + 1) + (1 + 1)
    assert [r["pid"] for r in out] == policy.pids and len(set(policy.pids)) == 2
    assert all(r["threads"] == max(1, len(os.sched_getaffinity(0)) // 2) for r in out)
    assert [r["flag"] for r in out] == ["on", "on"]  # env reaches the ranks' processes

    assert policy.run_on([1, 0], rank_of) == [1, 0]


def test_state_persists_between_calls(groups):
    policy = groups.get("policy", 2)
    policy.run(remember, value="x")
    assert policy.run(recall) == ["policy/0/x", "policy/1/x"]
    policy.run_on([1], remember, value=ray.put("y"))  # a ref arrives as its value
    assert policy.run(recall) == ["policy/0/x", "policy/1/y"]


def test_megatron_core_tensor_parallel_over_the_group(groups):
    infos = groups.get("policy", 2).run(megatron_tp2_info)
    assert [(i.rank, i.tp_rank, i.tp, i.dp) for i in infos] == [(0, 0, 2, 1), (1, 1, 2, 1)]


def test_submit_lets_two_groups_meet_in_one_collective(groups):
    """Would deadlock (until the store's 30 s timeout) if submit waited for its result."""
    policy = groups.get("policy", 2)
    port = free_port()
    with WorkerGroup("rollout", 1, pythonpath=[TESTS_DIR]) as rollout:
        sender = policy.submit_on([0], pair_broadcast, port=port, pair_rank=0, value=7.0)
        receiver = rollout.submit(pair_broadcast, port=port, pair_rank=1, value=0.0)
        assert receiver.result(timeout_s=60) == [7.0]
        assert sender.result(timeout_s=60) == [7.0]
        assert sender.done()
        pid = rollout.pids[0]
    assert not rollout.alive
    assert _gone(pid, within_s=15), f"rollout rank (pid {pid}) still runs after shutdown"
    assert policy.alive


def _gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_a_raising_rank_fails_the_call_with_its_traceback(groups):
    policy = groups.get("policy", 2)
    error, elapsed = _fails(lambda: policy.run(raise_on, rank=1), r"'policy'.*raise_on failed on rank 1 of 2")
    assert "ValueError: boom on rank 1" in str(error) and "Traceback" in str(error)
    assert error.role == "policy" and error.ranks == [1]
    assert elapsed < 20, f"waited {elapsed:.1f} s for ranks blocked in a barrier"
    assert not policy.alive
    _fails(lambda: policy.run(recall), "is closed")


def test_a_killed_rank_fails_the_call_promptly(groups):
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}] * 2, strategy="PACK")
    try:
        victim = WorkerGroup("victim", 2, placement_group=pg, pythonpath=[TESTS_DIR], start_timeout_s=120)
        call = victim.submit(sleep_then_barrier, sleeper=1, seconds=300)
        time.sleep(1.0)  # rank 0 is in the barrier, rank 1 asleep
        assert not call.done()
        os.kill(victim.pids[1], signal.SIGKILL)
        error, elapsed = _fails(lambda: call.result(timeout_s=120), r"'victim'.*on rank 1 of 2.*process died")
        print(f"killed rank reported after {elapsed:.2f} s")
        assert elapsed < 60
        assert 1 in error.ranks and not victim.alive
        assert _gone(victim.pids[0], within_s=15), "the surviving rank was not torn down"
    finally:
        remove_placement_group(pg)


def test_timeout_names_the_silent_ranks(groups):
    sleepy = groups.get("sleepy", 1)
    error, elapsed = _fails(lambda: sleepy.run(sleep, seconds=120, timeout_s=2),
                            r"'sleepy'.*sleep timed out after 2.0 s; ranks \[0\] of 1 did not answer")
    assert error.ranks == [0] and elapsed < 10 and not sleepy.alive


def test_start_up_times_out_when_ray_cannot_place_the_ranks(ray_session):
    _fails(lambda: WorkerGroup("greedy", 1, num_cpus_per_rank=10_000, start_timeout_s=3),
           r"'greedy'.*start-up timed out.*not enough resources")
