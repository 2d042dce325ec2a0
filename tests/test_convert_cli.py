"""`megarl convert` as a user runs it: a subprocess that starts its own ranks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import time

import pytest
import torch
from conftest import hf_logits, random_tokens
from safetensors.torch import load_file, save_file

from megarl.config.schema import ParallelConfig
from megarl.convert import jobs


@pytest.fixture(scope="module")
def megarl(cli):
    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = cli(*args, timeout=600)
        if check and proc.returncode != 0:
            raise AssertionError(f"megarl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    return run


@pytest.fixture(scope="module")
def llama_with_side_files(tiny_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "llama"
    shutil.copytree(tiny_models["llama"], path)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256, "marker": "megarl-test"}))
    return path


@pytest.fixture(scope="module")
def ckpt22(llama_with_side_files, tmp_path_factory, megarl):
    out = tmp_path_factory.mktemp("cli") / "ckpt22"
    proc = megarl("convert", "hf-to-mcore", "--hf", str(llama_with_side_files), "--out", str(out),
                  "--tp", "2", "--pp", "2")
    assert "peak memory per rank" in proc.stdout and "of weights converted" in proc.stdout
    return out


def test_round_trip_hf_mcore_hf_is_bitwise(llama_with_side_files, ckpt22, tmp_path, megarl):
    back = tmp_path / "back"
    # the tiny model has no tokenizer: exporting it is refused unless asked for explicitly
    megarl("convert", "mcore-to-hf", "--ckpt", str(ckpt22), "--out", str(back), "--no-tokenizer")
    original, returned = load_file(llama_with_side_files / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(original) == sorted(returned)
    for name in original:
        assert original[name].dtype == returned[name].dtype, name
        assert torch.equal(original[name], returned[name]), name
    for side in ("tokenizer_config.json", "generation_config.json"):
        assert (back / side).read_text() == (llama_with_side_files / side).read_text()
    config = json.loads((back / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["dtype"] == "float32"
    # readable like any file the user writes (safetensors writes through a 0600 temporary file)
    umask = os.umask(0o022)
    os.umask(umask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in back.iterdir()} == \
        {p.name: oct(0o666 & ~umask) for p in back.iterdir()}


@pytest.mark.parametrize("family,layout", [("qwen3", "--tp 2 --pp 2"), ("qwen3_moe", "--tp 2 --ep 2 --etp 1"),
                                           ("qwen2_moe", "--tp 2 --pp 2"), ("gemma3_text", "--tp 2 --pp 2")])
def test_round_trip_of_another_family_is_bitwise(family, layout, tiny_models, tmp_path, capsys, starts_processes):
    """The round trip above (a Llama) for the families with tensors of their own (Qwen3's QK-norms,
    Qwen3-MoE's router and experts, Qwen2-MoE's shared expert and its gate, Gemma-3's four norms per
    layer and QK-norms, its embedding tied); Qwen3-MoE written with
    attention over tp=2 and each expert whole over ep=2 (etp=1: two ranks in all)."""
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    _converted(capsys, "hf-to-mcore", "--hf", str(tiny_models[family]), "--out", str(ckpt), *layout.split())
    _converted(capsys, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--no-tokenizer")
    original, returned = load_file(tiny_models[family] / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(original) == sorted(returned)
    for name in original:
        assert original[name].dtype == returned[name].dtype, name
        assert torch.equal(original[name], returned[name]), name
    assert json.loads((back / "config.json").read_text())["model_type"] == family


def test_reshard_keeps_logits(ckpt22, llama_with_side_files, tmp_path, pools, capsys):
    tokens = random_tokens()
    expected = hf_logits(llama_with_side_files, tokens)
    ck11, ck21 = tmp_path / "ck11", tmp_path / "ck21"
    _converted(capsys, "reshard", "--ckpt", str(ckpt22), "--out", str(ck11), "--tp", "1", "--pp", "1")
    _converted(capsys, "reshard", "--ckpt", str(ck11), "--out", str(ck21), "--tp", "2", "--pp", "1")
    assert json.loads((ck21 / "megarl.json").read_text())["written_at_layout"]["tp"] == 2
    for ckpt, (tp, pp) in ((ck11, (1, 1)), (ck21, (2, 1)), (ck21, (1, 2))):
        results = pools.get(4).run(jobs.checkpoint_logits, ckpt_dir=str(ckpt),
                                   parallel=ParallelConfig(tp=tp, pp=pp, world_size=4), tokens=tokens)
        (logits,) = [r["logits"] for r in results if r["logits"] is not None]
        assert (logits - expected).abs().max().item() <= 1e-3


def _max_dlogit(stdout: str) -> float:
    return float(re.search(r"max \|dlogit\|\s+(\S+)", stdout).group(1))


def test_verify_passes_and_catches_wrong_weights(ckpt22, llama_with_side_files, tmp_path, capsys):
    ok = _converted(capsys, "verify", "--hf", str(llama_with_side_files), "--ckpt", str(ckpt22), "--tp", "2",
                    "--pp", "2", "--seq", "32")
    assert "PASS" in ok and _max_dlogit(ok) <= 1e-3
    # The same model with one weight off by 1%: verify must fail, and say so.
    wrong = tmp_path / "wrong"
    shutil.copytree(llama_with_side_files, wrong)
    tensors = load_file(wrong / "model.safetensors")
    tensors["model.layers.2.mlp.down_proj.weight"] *= 1.01
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    code, bad, err = _convert_in_process(capsys, "verify", "--hf", str(wrong), "--ckpt", str(ckpt22), "--tp", "2",
                                         "--seq", "32")
    assert code == 1, bad + err
    assert "FAIL" in bad and _max_dlogit(bad) > 1e-3


def _refused(capsys, argv: list[str], *fragments: str) -> None:
    """`megarl convert ARGV`, run in this process (each refusal comes before any rank starts, so no
    process of its own is needed: six interpreter start-ups saved), exits 2 naming ``fragments``."""
    code, stdout, stderr = _convert_in_process(capsys, *argv)
    assert code == 2, stdout + stderr
    assert "starting" not in stdout, "ranks were started before the input was checked"
    for fragment in fragments:
        assert fragment in stderr, stderr


def test_refusals_before_any_rank_starts(llama_with_side_files, ckpt22, tiny_models, tmp_path, capsys):
    # config.json that does not describe its tensors
    lying = tmp_path / "lying"
    shutil.copytree(llama_with_side_files, lying)
    config = json.loads((lying / "config.json").read_text())
    config["intermediate_size"] = 96
    (lying / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    _refused(capsys, ["hf-to-mcore", "--hf", str(lying), "--out", str(out)],
             "model.layers.0.mlp.gate_proj.weight: shape [128, 64] in the checkpoint, [96, 64] from config.json")
    assert not out.exists()
    # a layout that does not divide the model
    _refused(capsys, ["hf-to-mcore", "--hf", str(llama_with_side_files), "--out", str(out), "--tp", "3"],
             "--tp=3 does not divide num_attention_heads=4")
    _refused(capsys, ["hf-to-mcore", "--hf", str(llama_with_side_files), "--out", str(out), "--pp", "3"],
             "--pp=3 does not divide num_hidden_layers (4)")
    # a checkpoint of another model
    _refused(capsys, ["verify", "--hf", str(tiny_models["mistral"]), "--ckpt", str(ckpt22)],
             "does not match", "family: 'mistral' != 'llama'", "sliding_window")
    # an existing output
    _refused(capsys, ["reshard", "--ckpt", str(ckpt22), "--out", str(ckpt22)], "already exists")
    # not a checkpoint
    _refused(capsys, ["mcore-to-hf", "--ckpt", str(llama_with_side_files), "--out", str(out)],
             "is not a megarl checkpoint")


def test_corrupt_weights_are_refused_by_name(llama_with_side_files, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(llama_with_side_files, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])  # tensors cut off
    _refused(capsys, ["hf-to-mcore", "--hf", str(broken), "--out", str(tmp_path / "out")],
             "model.safetensors is not a readable safetensors file")


def _sigint_as_at_a_terminal() -> None:
    # A suite started in the background (`pytest ... &` from a script) ignores SIGINT, and a child
    # inherits that: Python then installs no Ctrl-C handler and the conversion runs to its end.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_conversion_leaves_nothing_behind(signum, llama_with_side_files, tmp_path, cli):
    out = tmp_path / "out"
    proc = cli.popen("convert", "hf-to-mcore", "--hf", str(llama_with_side_files), "--out", str(out), "--tp", "2",
                     "--pp", "2", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     preexec_fn=_sigint_as_at_a_terminal)
    assert "starting 4 rank(s)" in proc.stdout.readline()
    deadline = time.monotonic() + 30  # the ranks are starting: interrupt once the temporary output exists
    while not any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "no temporary output appeared"
        time.sleep(0.05)
    # A Ctrl-C that lands while Python runs a finaliser is reported there and lost; the user's
    # second one, 10 s later when nothing happened, is the retry (not sooner: a signal during
    # the cleanup would cut it short).
    for _ in range(3):
        proc.send_signal(signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
            break
    proc.wait(timeout=60)
    assert proc.returncode != 0, "the conversion finished instead of stopping"
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "a partial output was left behind"


def test_help_explains(megarl):
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


def _convert_in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """`megarl convert ARGV` in this process: an exception escaping it would be a traceback."""
    import argparse

    from megarl.convert import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    code = cli.main(parser.parse_args(["convert", *argv]))
    out = capsys.readouterr()
    return code, out.out, out.err


def _converted(capsys, *argv: str) -> str:
    """`megarl convert ARGV` run to success in this process (its ranks are processes of their own
    all the same); its output. The command line as a process of its own is ckpt22's, the Llama
    round trip's, --help's and the interrupted conversion's: the rest save an interpreter start-up
    (torch and megatron imported again) per command."""
    code, stdout, stderr = _convert_in_process(capsys, *argv)
    assert code == 0, f"megarl convert {' '.join(argv)} exited {code}:\n{stdout}\n{stderr}"
    return stdout


def _safetensors(path, header: object, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _edit_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# name: (what breaks the input, the command (HF = the broken HF folder, CKPT = the broken checkpoint,
# OUT = the output), the fragment the one error line must hold)
BAD_INPUTS = {
    "safetensors header not an object": (
        lambda hf, ck: _safetensors(hf / "model.safetensors", []),
        ["hf-to-mcore", "--hf", "HF", "--out", "OUT"], "the header is not a JSON object"),
    "safetensors shape not numbers": (
        lambda hf, ck: _safetensors(hf / "model.safetensors",
                                    {"w": {"dtype": "F32", "shape": ["a"], "data_offsets": [0, 4]}}, b"0000"),
        ["hf-to-mcore", "--hf", "HF", "--out", "OUT"], "tensor 'w' has a bad 'shape' ['a']"),
    "safetensors offsets malformed": (
        lambda hf, ck: _safetensors(hf / "model.safetensors",
                                    {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}, b"0000"),
        ["hf-to-mcore", "--hf", "HF", "--out", "OUT"], "tensor 'w' has bad 'data_offsets' [4]"),
    "index not JSON": (
        lambda hf, ck: ((hf / "model.safetensors").rename(hf / "model-00001-of-00001.safetensors"),
                        (hf / "model.safetensors.index.json").write_text('{"weight_map": ')),
        ["hf-to-mcore", "--hf", "HF", "--out", "OUT"], "model.safetensors.index.json is not valid JSON"),
    "index without a weight map": (
        lambda hf, ck: (hf / "model.safetensors.index.json").write_text('{"metadata": {}}'),
        ["hf-to-mcore", "--hf", "HF", "--out", "OUT"], "no 'weight_map' object"),
    "index pointing outside the folder": (
        lambda hf, ck: (hf / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"lm_head.weight": "../model.safetensors"}})),
        ["hf-to-mcore", "--hf", "HF", "--out", "OUT"],
        "weight_map['lm_head.weight'] = '../model.safetensors' is not a .safetensors file name"),
    "config field not a number": (
        lambda hf, ck: _edit_json(hf / "config.json", lambda c: c.update(hidden_size="64")),
        ["hf-to-mcore", "--hf", "HF", "--out", "OUT"], "field 'hidden_size' must be a positive integer, got '64'"),
    "config field zero": (
        lambda hf, ck: _edit_json(hf / "config.json", lambda c: c.update(num_attention_heads=0)),
        ["hf-to-mcore", "--hf", "HF", "--out", "OUT"], "field 'num_attention_heads' must be a positive integer, got 0"),
    "config rope factor zero": (
        lambda hf, ck: _edit_json(hf / "config.json", lambda c: c["rope_parameters"].update(factor=0)),
        ["hf-to-mcore", "--hf", "HF", "--out", "OUT"], "(rope_parameters): field 'factor' must be a positive number"),
    "verify: config field zero": (
        lambda hf, ck: _edit_json(hf / "config.json", lambda c: c.update(rms_norm_eps=0)),
        ["verify", "--hf", "HF", "--ckpt", "CKPT"], "field 'rms_norm_eps' must be a positive number, got 0"),
    "verify: config that does not describe the tensors": (
        lambda hf, ck: _edit_json(hf / "config.json", lambda c: c.update(intermediate_size=96)),
        ["verify", "--hf", "HF", "--ckpt", "CKPT"], "does not match its config.json"),
    "verify: truncated weights": (
        lambda hf, ck: (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:5000]),
        ["verify", "--hf", "HF", "--ckpt", "CKPT"], "model.safetensors is not a readable safetensors file"),
    "megarl.json not JSON": (
        lambda hf, ck: (ck / "megarl.json").write_text("{"),
        ["mcore-to-hf", "--ckpt", "CKPT", "--out", "OUT"], "megarl.json is not valid JSON"),
    "megarl.json padded_vocab not a number": (
        lambda hf, ck: _edit_json(ck / "megarl.json", lambda m: m.update(padded_vocab="256")),
        ["reshard", "--ckpt", "CKPT", "--out", "OUT"], "field 'padded_vocab' must be a positive integer, got '256'"),
    "megarl.json zero heads": (
        lambda hf, ck: _edit_json(ck / "megarl.json", lambda m: m["arch"].update(num_heads=0)),
        ["mcore-to-hf", "--ckpt", "CKPT", "--out", "OUT"],
        "megarl.json (arch): field 'num_heads' must be a positive integer, got 0"),
    "megarl.json arch incomplete": (
        lambda hf, ck: _edit_json(ck / "megarl.json", lambda m: m["arch"].pop("hidden_size")),
        ["verify", "--hf", "HF", "--ckpt", "CKPT"], "megarl.json (arch): missing field(s) hidden_size"),
    "reshard: no distributed checkpoint": (
        lambda hf, ck: [p.unlink() for p in ck.iterdir() if p.is_file() and p.name != "megarl.json"],
        ["reshard", "--ckpt", "CKPT", "--out", "OUT"], "holds no distributed checkpoint (metadata.json not found)"),
    "reshard: a shard file missing": (
        lambda hf, ck: (ck / "__1_0.distcp").unlink(),
        ["reshard", "--ckpt", "CKPT", "--out", "OUT"], "__1_0.distcp is listed in"),
    "common.pt corrupt": (
        lambda hf, ck: (ck / "common.pt").write_bytes(b"not a torch file"),
        ["reshard", "--ckpt", "CKPT", "--out", "OUT"],
        "common.pt: refused to load with weights_only=True (Unsupported operand 110)"),
    "export: no config.json": (
        lambda hf, ck: (ck / "hf" / "config.json").unlink(),
        ["mcore-to-hf", "--ckpt", "CKPT", "--out", "OUT"], "hf/config.json is missing"),
    "export: no tokenizer": (
        lambda hf, ck: None,
        ["mcore-to-hf", "--ckpt", "CKPT", "--out", "OUT"], "hf/tokenizer.json is missing"),
    "export: config of another model": (
        lambda hf, ck: _edit_json(ck / "hf" / "config.json", lambda c: c.update(num_hidden_layers=2)),
        ["mcore-to-hf", "--ckpt", "CKPT", "--out", "OUT", "--no-tokenizer"],
        "does not describe the checkpoint's model (num_layers: 4 != 2)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_one_line_before_any_rank_starts(case, llama_with_side_files, ckpt22, tmp_path, capsys):
    """Exit 2, one line naming the file and field (indented detail lines may follow it), no traceback,
    no rank started, nothing written."""
    hf, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    shutil.copytree(llama_with_side_files, hf)
    shutil.copytree(ckpt22, ckpt)
    breaks, argv, fragment = BAD_INPUTS[case]
    breaks(hf, ckpt)
    argv = [{"HF": str(hf), "CKPT": str(ckpt), "OUT": str(out)}.get(a, a) for a in argv]
    code, stdout, stderr = _convert_in_process(capsys, *argv)
    assert code == 2, stdout + stderr
    first, *details = stderr.strip().splitlines()
    assert first.startswith("megarl convert: error: ") and fragment in first, stderr
    assert all(line.startswith("  ") for line in details), stderr
    assert "starting" not in stdout, "ranks were started before the input was checked"
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]
