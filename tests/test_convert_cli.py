"""`megarl convert` as a user runs it: a subprocess that starts its own ranks."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import hf_logits, random_tokens
from safetensors.torch import load_file, save_file

from megarl.config.schema import ParallelConfig
from megarl.convert import jobs


def megarl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "megarl.cli.main", *args], capture_output=True, text=True,
                          timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"megarl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def llama_with_side_files(tiny_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "llama"
    shutil.copytree(tiny_models["llama"], path)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256, "marker": "megarl-test"}))
    return path


@pytest.fixture(scope="module")
def ckpt22(llama_with_side_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "ckpt22"
    proc = megarl("convert", "hf-to-mcore", "--hf", str(llama_with_side_files), "--out", str(out),
                  "--tp", "2", "--pp", "2")
    assert "peak memory per rank" in proc.stdout and "of weights converted" in proc.stdout
    return out


def test_round_trip_hf_mcore_hf_is_bitwise(llama_with_side_files, ckpt22, tmp_path):
    back = tmp_path / "back"
    megarl("convert", "mcore-to-hf", "--ckpt", str(ckpt22), "--out", str(back))
    original, returned = load_file(llama_with_side_files / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(original) == sorted(returned)
    for name in original:
        assert original[name].dtype == returned[name].dtype, name
        assert torch.equal(original[name], returned[name]), name
    for side in ("tokenizer_config.json", "generation_config.json"):
        assert (back / side).read_text() == (llama_with_side_files / side).read_text()
    config = json.loads((back / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["dtype"] == "float32"


def test_reshard_keeps_logits(ckpt22, llama_with_side_files, tmp_path, pools):
    tokens = random_tokens()
    expected = hf_logits(llama_with_side_files, tokens)
    ck11, ck21 = tmp_path / "ck11", tmp_path / "ck21"
    megarl("convert", "reshard", "--ckpt", str(ckpt22), "--out", str(ck11), "--tp", "1", "--pp", "1")
    megarl("convert", "reshard", "--ckpt", str(ck11), "--out", str(ck21), "--tp", "2", "--pp", "1")
    assert json.loads((ck21 / "megarl.json").read_text())["written_at_layout"]["tp"] == 2
    for ckpt, (tp, pp) in ((ck11, (1, 1)), (ck21, (2, 1)), (ck21, (1, 2))):
        results = pools.get(4).run(jobs.checkpoint_logits, ckpt_dir=str(ckpt),
                                   parallel=ParallelConfig(tp=tp, pp=pp, world_size=4), tokens=tokens)
        (logits,) = [r["logits"] for r in results if r["logits"] is not None]
        assert (logits - expected).abs().max().item() <= 1e-3


def _max_dlogit(stdout: str) -> float:
    return float(re.search(r"max \|dlogit\|\s+(\S+)", stdout).group(1))


def test_verify_passes_and_catches_wrong_weights(ckpt22, llama_with_side_files, tmp_path):
    ok = megarl("convert", "verify", "--hf", str(llama_with_side_files), "--ckpt", str(ckpt22), "--tp", "2",
                "--pp", "2", "--seq", "32")
    assert "PASS" in ok.stdout and _max_dlogit(ok.stdout) <= 1e-3
    # The same model with one weight off by 1%: verify must fail, and say so.
    wrong = tmp_path / "wrong"
    shutil.copytree(llama_with_side_files, wrong)
    tensors = load_file(wrong / "model.safetensors")
    tensors["model.layers.2.mlp.down_proj.weight"] *= 1.01
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    bad = megarl("convert", "verify", "--hf", str(wrong), "--ckpt", str(ckpt22), "--tp", "2", "--seq", "32",
                 check=False)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL" in bad.stdout and _max_dlogit(bad.stdout) > 1e-3


def _refused(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "starting" not in proc.stdout, "ranks were started before the input was checked"
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def test_refusals_before_any_rank_starts(llama_with_side_files, ckpt22, tiny_models, tmp_path):
    # config.json that does not describe its tensors
    lying = tmp_path / "lying"
    shutil.copytree(llama_with_side_files, lying)
    config = json.loads((lying / "config.json").read_text())
    config["intermediate_size"] = 96
    (lying / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    _refused(megarl("convert", "hf-to-mcore", "--hf", str(lying), "--out", str(out), check=False),
             "model.layers.0.mlp.gate_proj.weight: shape [128, 64] in the checkpoint, [96, 64] from config.json")
    assert not out.exists()
    # a layout that does not divide the model
    _refused(megarl("convert", "hf-to-mcore", "--hf", str(llama_with_side_files), "--out", str(out),
                    "--tp", "3", check=False), "--tp=3 does not divide num_attention_heads=4")
    _refused(megarl("convert", "hf-to-mcore", "--hf", str(llama_with_side_files), "--out", str(out),
                    "--pp", "3", check=False), "--pp=3 does not divide num_hidden_layers (4)")
    # a checkpoint of another model
    _refused(megarl("convert", "verify", "--hf", str(tiny_models["mistral"]), "--ckpt", str(ckpt22), check=False),
             "does not match", "family: 'mistral' != 'llama'", "sliding_window")
    # an existing output
    _refused(megarl("convert", "reshard", "--ckpt", str(ckpt22), "--out", str(ckpt22), check=False),
             "already exists")
    # not a checkpoint
    _refused(megarl("convert", "mcore-to-hf", "--ckpt", str(llama_with_side_files), "--out", str(out),
                    check=False), "is not a megarl checkpoint")


def test_corrupt_weights_are_refused_by_name(llama_with_side_files, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_with_side_files, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])  # tensors cut off
    _refused(megarl("convert", "hf-to-mcore", "--hf", str(broken), "--out", str(tmp_path / "out"), check=False),
             "model.safetensors is not a readable safetensors file")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_conversion_leaves_nothing_behind(signum, llama_with_side_files, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli.main", "convert", "hf-to-mcore", "--hf",
                             str(llama_with_side_files), "--out", str(out), "--tp", "2", "--pp", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "starting 4 rank(s)" in proc.stdout.readline()
    time.sleep(2)  # the ranks are starting and the temporary output exists
    assert any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir())
    proc.send_signal(signum)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "a partial output was left behind"


def test_help_explains():
    text = megarl("convert", "--help").stdout
    for command in ("hf-to-mcore", "mcore-to-hf", "reshard", "verify", "torchrun"):
        assert command in text
    assert "--tol" in megarl("convert", "verify", "--help").stdout


def test_export_at_tp2_pp2_assembles_each_tensor_once(ckpt22, llama_with_side_files, tmp_path, pools):
    """Exporting from a TP>1 layout: replicated norms are offered by every TP rank but
    must be assembled once (a second copy used to be emitted and silently overwritten)."""
    out = tmp_path / "export22"
    out.mkdir()
    pools.get(4).run(jobs.mcore_to_hf, ckpt_dir=str(ckpt22), out_dir=str(out),
                     parallel=ParallelConfig(tp=2, pp=2, world_size=4))
    original, returned = load_file(llama_with_side_files / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(returned)
    assert all(torch.equal(original[n], returned[n]) for n in original)
