"""A hostile checkpoint runs no code: its pickles are refused, naming the file, and the
payload (which writes a marker file when unpickled) never runs.

Three places of a torch_dist checkpoint are pickles: ``.metadata`` (torch unpickles it with
plain ``pickle.load``), the byte items inside ``*.distcp`` (megatron's ShardedObjects, which
torch loads with ``weights_only=False``) and ``common.pt`` (megatron's ``torch.load`` without
``weights_only``, unsafe under ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_tokens

from megarl.config.schema import ParallelConfig
from megarl.convert import jobs
from megarl.distributed.spmd import SpmdError
from megarl.platform.safe_checkpoint import UnsafeCheckpointError, load_strategies, read_metadata


class _Payload:
    """Unpickling this writes ``marker``: what a hostile checkpoint would do, made visible."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


@pytest.fixture(scope="module")
def checkpoint(tiny_models, tmp_path_factory, pools) -> Path:
    out = tmp_path_factory.mktemp("safe") / "ckpt"
    out.mkdir()
    pools.get(1).run(jobs.hf_to_mcore, hf_dir=str(tiny_models["llama"]), out_dir=str(out),
                     parallel=ParallelConfig(), dtype="float32")
    return out


def _copy(checkpoint: Path, tmp_path: Path) -> tuple[Path, Path]:
    hostile = tmp_path / "hostile"
    shutil.copytree(checkpoint, hostile)
    return hostile, tmp_path / "marker"


def _convert(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli.main", "convert", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def _refused_in_one_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "starting" not in proc.stdout, "ranks were started before the input was checked"
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def test_the_payload_is_live(tmp_path):
    """The oracle for the tests below: plain pickle does run the payload."""
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.read_text() == "code ran"


def test_hostile_metadata_is_refused_by_convert_and_by_the_loader(checkpoint, tmp_path, pools):
    hostile, marker = _copy(checkpoint, tmp_path)
    (hostile / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    out = tmp_path / "out"

    # the CLI refuses before any rank starts
    for args in (["mcore-to-hf", "--ckpt", str(hostile), "--out", str(out), "--no-tokenizer"],
                 ["reshard", "--ckpt", str(hostile), "--out", str(out)]):
        _refused_in_one_line(_convert(*args), f"{hostile / '.metadata'}: refused to load", "builtins.exec")
    # the loader every rank uses (convert, a role whose model path is a checkpoint, resume) refuses too
    with pytest.raises(UnsafeCheckpointError, match="builtins.exec"):
        read_metadata(hostile)
    load_strategies()  # installs the restricted reader, as each rank does before loading
    from torch.distributed.checkpoint import FileSystemReader

    with pytest.raises(UnsafeCheckpointError, match="not a checkpoint-metadata type"):
        FileSystemReader(str(hostile)).read_metadata()
    with pytest.raises(SpmdError, match="refused to load"):
        pools.get(1).run(jobs.checkpoint_logits, ckpt_dir=str(hostile), parallel=ParallelConfig(),
                         tokens=random_tokens())
    assert not marker.exists(), "the checkpoint ran code"
    assert not out.exists()


def test_hostile_object_inside_the_shards_is_refused(checkpoint, tmp_path, pools):
    """A ShardedObject's bytes (a layer's _extra_state) replaced by the payload: the metadata is
    legitimate, only the object torch would unpickle with weights_only=False is not."""
    hostile, marker = _copy(checkpoint, tmp_path)
    metadata = pickle.loads((hostile / ".metadata").read_bytes())  # our own, trusted file
    key = next(k for k in metadata.storage_data if "_extra_state" in k.fqn)
    info = metadata.storage_data[key]
    payload = io.BytesIO()
    torch.save([_Payload(marker)], payload)
    data = hostile / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload.getvalue())
    info.offset, info.length = offset, len(payload.getvalue())
    (hostile / ".metadata").write_bytes(pickle.dumps(metadata))

    _refused_in_one_line(_convert("mcore-to-hf", "--ckpt", str(hostile), "--out", str(tmp_path / "out"),
                                  "--no-tokenizer"),
                         f"{data}: object {key.fqn!r}: refused to load with weights_only=True (it names exec")
    with pytest.raises(SpmdError, match="refused to load with weights_only=True"):
        pools.get(1).run(jobs.checkpoint_logits, ckpt_dir=str(hostile), parallel=ParallelConfig(),
                         tokens=random_tokens())
    assert not marker.exists(), "the checkpoint ran code"


def test_hostile_common_state_is_refused_even_when_torch_is_told_to_unpickle(checkpoint, tmp_path, monkeypatch):
    hostile, marker = _copy(checkpoint, tmp_path)
    torch.save({"payload": _Payload(marker)}, hostile / "common.pt")
    unsafe = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}

    _refused_in_one_line(_convert("mcore-to-hf", "--ckpt", str(hostile), "--out", str(tmp_path / "out"),
                                  "--no-tokenizer", env=unsafe), f"{hostile / 'common.pt'}: refused to load")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    _, common = load_strategies()
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True"):
        common.load_common(hostile)
    assert not marker.exists(), "the checkpoint ran code"

    # what megatron-core's own loader does with that variable set: the hole this closes
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    TorchCommonLoadStrategy().load_common(hostile)
    assert marker.read_text() == "code ran"


def test_every_checkpoint_load_goes_through_the_safe_loader():
    """megarl loads dist checkpoints in one function; no other module calls megatron's loader."""
    root = Path(__file__).resolve().parents[1] / "megarl"
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "dist_checkpointing.load(" in p.read_text() or "FileSystemReader(" in p.read_text())
    assert callers == ["convert/checkpoint.py"], callers
