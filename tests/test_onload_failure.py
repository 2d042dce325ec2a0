"""An onload that fails partway (a device allocation refused: colocated, the GPU is shared) keeps
the host copies it has not restored, and a second onload restores them bit for bit. Before, the
copies were dropped first and a failure lost the weights (GPU review, H)."""

from __future__ import annotations

import pytest
import torch

from megarl.workers import offload_fns
from megarl.workers.megatron_model import HeldModel
from megarl.workers.state import state


class _FailingOnce:
    """``torch`` with ``empty`` refusing its n-th call, like an allocation the device turns down."""

    def __init__(self, fail_at: int):
        self.calls, self.fail_at = 0, fail_at

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError("simulated: the device refused the allocation")
        return torch.empty(*args, **kwargs)


def test_a_failed_onload_loses_nothing(monkeypatch):
    torch.manual_seed(0)
    chunk = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    want = [p.detach().clone() for p in chunk.parameters()]
    state["onload-test"] = HeldModel(spec=None, info=None, chunks=[chunk], layout_context=None)
    try:
        assert offload_fns.offload("onload-test", ("params",)) == sum(w.numel() * 4 for w in want)
        assert all(p.untyped_storage().nbytes() == 0 for p in chunk.parameters())
        monkeypatch.setattr(offload_fns, "torch", _FailingOnce(fail_at=3))
        with pytest.raises(torch.OutOfMemoryError):
            offload_fns.onload("onload-test")
        monkeypatch.setattr(offload_fns, "torch", torch)
        offload_fns.onload("onload-test")
        assert all(torch.equal(p, w) for p, w in zip(chunk.parameters(), want, strict=True))
        assert "offloaded" not in state["onload-test"].extra
    finally:
        del state["onload-test"]
