"""A trained role's checkpoint exports to an HF folder that transformers loads, whatever the
role's model path was: ``bundled:NAME``, or a megarl checkpoint (a run resumed or fine-tuned
from one). Both used to leave the checkpoint's ``hf/`` empty, and the export was a bare
``model.safetensors`` (mode 0600) that nothing could load.

The bundled model here is a stand-in: a tiny Llama with SmolLM2's tokenizer, put where
``bundled:SmolLM2-135M-Instruct`` resolves (``$MEGARL_CACHE/models/``) for the ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_policy, hf_logits, random_tokens
from safetensors.torch import load_file

from megarl.config.schema import ParallelConfig
from megarl.convert.checkpoint import hf_side_dir
from megarl.distributed.spmd import SpmdPool
from megarl.models.bundled import SMOLLM2
from megarl.workers import checkpoint_fns, megatron_model

BUNDLED = f"bundled:{SMOLLM2}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory, smollm2) -> Path:
    root = tmp_path_factory.mktemp("cache")
    build_tiny_policy(root / "models" / SMOLLM2, smollm2)
    return root


def _save_role(pool: SpmdPool, source: str, out: Path) -> Path:
    """What a run does for a role: load it from ``source``, then checkpoint it."""
    pool.run(megatron_model.load, key="export", source=source, parallel=ParallelConfig())
    out.mkdir()
    pool.run(checkpoint_fns.save, key="export", out_dir=str(out), source=source)
    pool.run(megatron_model.unload, key="export")
    return out


def test_side_files_come_from_where_the_model_is(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE", str(cache))
    assert hf_side_dir(BUNDLED) == cache / "models" / SMOLLM2
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "megarl.json").write_text("{}")
    assert hf_side_dir(ckpt) == ckpt / "hf"
    assert hf_side_dir(cache) == cache


def test_checkpoints_of_bundled_and_checkpoint_sources_export_to_loadable_hf(cache, tmp_path, cli):
    standin = cache / "models" / SMOLLM2
    with SpmdPool(1, env={"MEGARL_CACHE": str(cache)}) as pool:
        from_bundled = _save_role(pool, BUNDLED, tmp_path / "from_bundled")
        from_checkpoint = _save_role(pool, str(from_bundled), tmp_path / "from_checkpoint")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    umask = os.umask(0o022)
    os.umask(umask)
    tokens = random_tokens(vocab=1000)
    expected = hf_logits(standin, tokens)
    for ckpt in (from_bundled, from_checkpoint):
        side = {p.name for p in (ckpt / "hf").iterdir()}
        assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= side, side
        out = tmp_path / f"{ckpt.name}_hf"
        proc = cli("convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == \
            {p.name: oct(0o666 & ~umask) for p in out.iterdir()}
        original, exported = load_file(standin / "model.safetensors"), load_file(out / "model.safetensors")
        assert sorted(original) == sorted(exported) and all(torch.equal(original[n], exported[n]) for n in original)
        assert AutoTokenizer.from_pretrained(out)("2 + 3 =")["input_ids"] == \
            AutoTokenizer.from_pretrained(standin)("2 + 3 =")["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            assert torch.equal(model(tokens).logits, expected)
