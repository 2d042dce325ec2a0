"""The same-device channel of the weight-sync group (megarl.reshard.same_device), two ranks in
two threads: messages go through handles in the group's store, arrive bit for bit in the order
they were posted, and leave no key or file behind; pairs on different devices use the group."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from megarl.distributed.bringup import free_port
from megarl.reshard.group import open_sync_group


def _pair(same_device: str, body) -> list:
    port, results, errors = free_port(), [None, None], []

    def rank(r: int) -> None:
        try:
            group = open_sync_group("127.0.0.1", port, r, 2, "gloo", timeout_s=30, same_device=same_device)
            results[r] = body(group)
            group.close()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def _exchange(group):
    sent = [torch.arange(12, dtype=torch.float32).reshape(3, 4) * k for k in (1, 2, 3)]
    if group.rank == 0:
        # two messages under one tag, and a bf16 one: the count in the key keeps them apart
        works = [group.send([sent[0]], 1, tag=7), group.send([sent[1]], 1, tag=7),
                 group.send([sent[2].to(torch.bfloat16)], 1, tag=8)]
        for w in works:
            w.wait()
        return group.peers_on_this_device
    got = [torch.empty(3, 4), torch.empty(3, 4), torch.empty(3, 4, dtype=torch.bfloat16)]
    works = [group.recv([got[0]], 0, tag=7), group.recv([got[1]], 0, tag=7), group.recv([got[2]], 0, tag=8)]
    for w in works:
        w.wait()
    assert torch.equal(got[0], sent[0]) and torch.equal(got[1], sent[1])
    assert torch.equal(got[2], sent[2].to(torch.bfloat16))
    return group.peers_on_this_device


@pytest.mark.parametrize("same_device,peers", [("shm", [{1}, {0}]), ("off", [set(), set()])])
def test_messages_arrive_in_order_through_the_chosen_path(same_device, peers):
    before = set(Path("/dev/shm").glob("megarl-sync-*"))
    assert [set(p) for p in _pair(same_device, _exchange)] == peers
    assert set(Path("/dev/shm").glob("megarl-sync-*")) == before


def test_cpu_pairs_use_the_group_by_default():
    """On CPU the platform has no same-device sharing: "auto" sends every pair through gloo."""
    assert _pair("auto", lambda g: g.peers_on_this_device) == [frozenset(), frozenset()]
