"""``megarl bench logprob``'s measurement: the tensor-memory counter and the verdicts (in-process, fast)."""

from __future__ import annotations

import torch

from megarl_bench.logprob import _row, format_table
from megarl_bench.tensor_memory import TensorMemory


def test_tensor_memory_counts_new_storages_until_freed():
    x = torch.zeros(1000)  # exists before: never counted
    with TensorMemory() as memory:
        view = x[10:]  # a view of an input: no new storage
        y = x * 2  # 4000 bytes
        z = y.view(10, 100)  # a view of y: still 4000
        y.add_(1)  # in place: still 4000
        del y, z  # freed: 0
        w = torch.empty(500)  # 2000
    assert memory.peak_bytes == 4000 and memory.live_bytes == 2000
    del w, view
    assert memory.live_bytes == 0


def test_tensor_memory_sees_autograd_backward():
    x = torch.randn(100, 100, requires_grad=True)
    with TensorMemory() as memory:
        torch.log_softmax(x, -1).sum().backward()
    # the saved log-softmax output (40 kB) is alive while backward writes x.grad (40 kB)
    assert memory.peak_bytes >= 80_000
    assert memory.live_bytes == 40_000  # x.grad remains


def _rank(megarl: int, naive: int, diff: float = 1e-6) -> dict[str, float]:
    return {"input_bytes": 100, "megarl_bytes": megarl, "split_bytes": megarl, "naive_bytes": naive,
            "megarl_rss": 0, "split_rss": 0, "naive_rss": 0, "megarl_diff": diff, "split_diff": diff}


def test_rows_pass_only_under_the_target_ratio_with_matching_values():
    case = {"vocab": 1000, "padded": 1024, "dtype": "float32", "backward": True}
    good = _row(2, case, [_rank(20, 100), _rank(24, 100)])
    assert good["pass"] and good["megarl_ratio"] == 0.24  # the worst rank counts
    assert not _row(2, case, [_rank(20, 100), _rank(26, 100)])["pass"]
    assert not _row(2, case, [_rank(20, 100, diff=0.1)])["pass"]
    table = format_table({"args": {"batch": 1, "seq": 2, "dtype": "float32"}, "target_ratio": 0.25,
                          "rows": [good], "passed": True})
    assert "V=1000 tp=2 fwd+bwd" in table and "PASS" in table
