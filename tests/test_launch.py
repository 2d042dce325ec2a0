"""launch/: the sbatch script on a real one-node Slurm, and the submit helper.

The Slurm tests bring up slurmctld + slurmd on this machine (launch/ci/slurm_localhost.sh,
which apt-installs slurm-wlm and munge when missing; it needs root), submit the tiny CPU
GRPO recipe through launch/submit.sh, and check what Slurm and the run recorded. Ray runs
inside the job (head on the node, joined by the driver through RAY_ADDRESS). A whole run to
completion is checked on two nodes (tests/test_launch_two_nodes.py asserts all the one-node
run did, and more), so here the job is cancelled once it trains (~40 s on a loaded 2-core
machine; ~1 s for the rest). The container path (pyxis / Apptainer) is checked only as a
command line (--dry-run).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUBMIT = ROOT / "launch" / "submit.sh"
SLURM_CTL = ROOT / "launch" / "ci" / "slurm_localhost.sh"
RECIPE = ROOT / "model_configs" / "tiny_cpu_grpo.yaml"


def _run(cmd: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def run(subprocesses):
    """``_run``, for a test that runs the launch scripts (programs: an integration test)."""
    return _run


# -- submit.sh: the command line ----------------------------------------------------------

def test_submit_help_explains_options(run):
    out = run(["bash", str(SUBMIT), "--help"])
    assert out.returncode == 0
    for option in ("--nodes", "--gpus-per-node", "--image", "--runtime", "--dry-run", "--venv"):
        assert option in out.stdout


def test_submit_dry_run_builds_the_sbatch_command(run):
    out = run(["bash", str(SUBMIT), "--dry-run", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
                "--image", "nvcr.io#me/megarl:0.1", "--mounts", "/data:/data", "--sbatch-arg=--qos=high",
                str(RECIPE), "actor.parallel.tp=2", "rewards=[{kind: remote}]"])
    assert out.returncode == 0, out.stderr
    words = shlex.split(out.stdout)
    assert words[0] == "env"
    at = words.index("sbatch")
    envs = dict(w.split("=", 1) for w in words[1:at])
    assert envs["MEGARL_CONTAINER_IMAGE"] == "nvcr.io#me/megarl:0.1"
    assert envs["MEGARL_CONTAINER_RUNTIME"] == "pyxis"
    assert envs["MEGARL_CONTAINER_MOUNTS"] == "/data:/data"
    assert envs["MEGARL_GPUS_PER_NODE"] == "8"
    assert "MEGARL_VENV" not in envs  # the image carries the software
    sbatch = words[at:]
    for flag in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu", "--qos=high"):
        assert flag in sbatch
    script = sbatch.index(str(ROOT / "launch" / "megarl.sbatch"))
    assert sbatch[script + 1:] == [str(RECIPE), "actor.parallel.tp=2", "rewards=[{kind: remote}]"]


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0", str(RECIPE)], "--nodes must be an integer >= 1"),
    (["--runtime", "docker", str(RECIPE)], "--runtime must be pyxis or apptainer"),
    (["no/such.yaml"], "recipe no/such.yaml: no such file"),
    ([str(RECIPE), "trainer.steps"], "override 'trainer.steps' is not key=value"),
    (["--bogus", str(RECIPE)], "unknown option --bogus"),
])
def test_submit_rejects_bad_input_naming_it(args, message, run):
    out = run(["bash", str(SUBMIT), "--dry-run", *args])
    assert out.returncode == 2
    assert message in out.stderr


def test_local_help_and_a_missing_recipe(run):
    local = str(ROOT / "launch" / "local.sh")
    assert "ray start --head" in run(["bash", local, "--help"]).stdout
    missing = run(["bash", local, "no/such.yaml"])
    assert missing.returncode == 2 and "recipe no/such.yaml: no such file" in missing.stderr


def test_the_job_reads_output_dir_and_names_a_bad_override(run):
    py = sys.executable
    ok = run([py, str(ROOT / "launch" / "output_dir.py"), str(RECIPE), "output_dir=/tmp/x"])
    assert ok.returncode == 0 and ok.stdout.strip() == "/tmp/x", ok.stderr
    bad = run([py, str(ROOT / "launch" / "output_dir.py"), str(RECIPE), "trainer.stepz=3"])
    assert bad.returncode == 2 and "trainer.stepz" in bad.stderr


# -- a real one-node Slurm ----------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm(subprocesses):
    if os.geteuid() != 0:
        pytest.skip("bringing up Slurm needs root (it starts slurmctld/slurmd and may apt-get install)")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("slurm-wlm is not installed and apt-get is not available to install it")
    up = _run(["bash", str(SLURM_CTL), "up"], timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    conf = _run(["bash", str(SLURM_CTL), "env"]).stdout.split("=", 1)[1].strip()
    env = {**os.environ, "SLURM_CONF": conf}
    # Ray inside the job must not join a Ray that this pytest process may have started.
    env.pop("RAY_ADDRESS", None)
    yield env
    _run(["bash", str(SLURM_CTL), "down"])


def _submit(env: dict, policy: Path, out: Path, *overrides: str) -> int:
    cmd = ["bash", str(SUBMIT), "--no-check", "--ray-cpus-per-node", "16", "--job-name", "megarl-test",
           "--sbatch-arg", f"--output={out.parent}/slurm-%j.out", str(RECIPE),
           f"actor.model.path={policy}", f"reference.model.path={policy}", f"output_dir={out}", *overrides]
    # 16 logical CPUs: placement asks one per rank, more than this machine's cores (see
    # megarl.cluster.ray_env). No `ray stop` at the end: other Rays may run on this machine.
    job_env = {**env, "MEGARL_RAY_OBJECT_STORE_MIB": "512", "MEGARL_RAY_STOP_ALL": "0"}
    res = _run(cmd, env=job_env)
    assert res.returncode == 0, res.stdout + res.stderr
    return int(res.stdout.strip().split(";")[0])


def _job(env: dict, job_id: int) -> dict[str, str]:
    out = _run(["scontrol", "show", "job", "--oneliner", str(job_id)], env=env).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait_done(env: dict, job_id: int, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        job = _job(env, job_id)
        if job.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None):
            return job
        if time.monotonic() > deadline:
            _run(["scancel", str(job_id)], env=env)
            pytest.fail(f"job {job_id} still {job.get('JobState')} after {timeout} s")
        time.sleep(2)


def _job_processes(job_id: int) -> set[int]:
    """Every process of the job, steps included: those in its cgroup (proctrack/cgroup, where
    cgroup v1's freezer exists), and any process whose environment carries its SLURM_JOB_ID
    (every step and what it starts, Ray's daemons included, inherit it; this also covers
    machines without the freezer, where the script falls back to proctrack/linuxproc)."""
    pids = set()
    for procs in Path("/sys/fs/cgroup/freezer").glob(f"slurm*/uid_*/job_{job_id}/**/cgroup.procs"):
        pids |= {int(p) for p in procs.read_text().split()}
    marker = f"SLURM_JOB_ID={job_id}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0"):
                pids.add(int(environ.parent.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists()}


def test_scancel_stops_the_driver_and_ray(slurm, tiny_policy, tmp_path):
    out = tmp_path / "run"
    job_id = _submit(slurm, tiny_policy, out, "trainer.steps=1000")
    log = out / "logs" / f"slurm-{job_id}.log"
    deadline = time.monotonic() + 240
    while not (log.exists() and "megarl train " in log.read_text().split("joined", 1)[-1]):
        assert _job(slurm, job_id).get("JobState") in ("PENDING", "RUNNING"), _job(slurm, job_id)
        assert time.monotonic() < deadline, "Ray did not come up within 240 s"
        time.sleep(1)
    time.sleep(3)  # the driver is starting: its process tree exists
    running = _job_processes(job_id)
    assert any("raylet" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore")
               for p in _alive(running)), "no raylet inside the job"
    _run(["scancel", str(job_id)], env=slurm)
    job = _wait_done(slurm, job_id, timeout=90)
    assert job["JobState"] == "CANCELLED", job
    text = log.read_text()
    assert "signal received: stopping" in text and "Ray stopped" in text, text[-3000:]
    deadline = time.monotonic() + 30
    while _alive(running) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _alive(running), f"processes of the cancelled job survive: {sorted(_alive(running))}"
