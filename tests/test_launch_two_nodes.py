"""launch/megarl.sbatch on two nodes: a real two-node Slurm, and a two-node Ray, on this machine.

launch/ci/slurm_two_nodes.sh makes each node a Linux network namespace (megarl-n1 at
10.231.0.1, megarl-n2 at 10.231.0.2, joined by a veth pair, no route anywhere else) running
its own slurmd; slurmctld runs on node 1. The tiny CPU GRPO recipe is submitted with
--nodes 2: the Ray head starts on node 1, a Ray worker on node 2, and each Ray node declares
2 logical CPUs, so that the actor and the reference (colocated: one bundle of 2 CPUs) fill one
node and the rollout engine (1 CPU) must run on the other. Where each role's processes run
is read from the run's workers.json / engines.json and each process's network namespace;
the weight sync (gloo) and the data then cross between the nodes' addresses.

Needs root (namespaces, daemons) and slurm-wlm + munge installed; skips otherwise. Runtime on
a loaded 2-core machine: 1-2.5 min for the run, ~2 min each for the cancel and the node death
(each waits until every rank and engine runs), 6-7 min in all. Under heavy load Ray's head
can fail to start (its raylet gives up waiting for its agents); the launcher then stops at
once naming the node, and a job that failed that way is submitted once more (printed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUBMIT = ROOT / "launch" / "submit.sh"
CLUSTER = ROOT / "launch" / "ci" / "slurm_two_nodes.sh"
RECIPE = ROOT / "model_configs" / "tiny_cpu_grpo.yaml"
NODES = {"megarl-n1": "10.231.0.1", "megarl-n2": "10.231.0.2"}
RAY_START_FAILED = "exited before all nodes joined"


def _run(cmd: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def _on_node1(*cmd: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Slurm's clients run on node 1: slurmctld listens only inside the namespaces."""
    return _run(["bash", str(CLUSTER), "exec", *cmd], env=env, timeout=timeout)


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "a two-node Slurm in network namespaces needs root (ip netns, slurmd, munged)"
    for tool in ("ip", "nsenter", "unshare", "slurmctld", "slurmd", "sbatch", "munged", "mungekey"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 util-linux slurm-wlm munge)"
    probe = _run(["unshare", "--net", "--mount", "--uts", "true"])
    if probe.returncode != 0:
        return f"this kernel refuses new namespaces: unshare --net --mount --uts: {probe.stderr.strip()}"
    return None


def _netns_inode(node: str) -> int:
    return os.stat(f"/run/netns/{node}").st_ino


def _node_of(pid: int, inodes: dict[str, int]) -> str | None:
    """The node (network namespace) a process runs in; None if it is gone or in neither."""
    try:
        inode = int(re.search(r"\[(\d+)\]", os.readlink(f"/proc/{pid}/ns/net")).group(1))
    except (OSError, AttributeError):
        return None
    return next((node for node, ino in inodes.items() if ino == inode), None)


def _node_pids(inodes: dict[str, int]) -> dict[str, set[int]]:
    """Every process in each node's namespace."""
    pids: dict[str, set[int]] = {node: set() for node in inodes}
    for entry in Path("/proc").glob("[0-9]*"):
        node = _node_of(int(entry.name), inodes)
        if node is not None:
            pids[node].add(int(entry.name))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class Cluster:
    def __init__(self, env: dict):
        self.env = env
        self.inodes = {node: _netns_inode(node) for node in NODES}
        # slurmctld, slurmscriptd and the slurmds: everything else in a node belongs to a job
        self.daemons = _node_pids(self.inodes)

    def job_pids(self) -> dict[str, set[int]]:
        now = _node_pids(self.inodes)
        return {node: pids - self.daemons[node] for node, pids in now.items()}


@pytest.fixture(scope="module")
def cluster(subprocesses):
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    try:
        up = _run(["bash", str(CLUSTER), "up"], timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
        print(up.stdout.strip())
        env = {**os.environ, "MEGARL_RAY_OBJECT_STORE_MIB": "512", "MEGARL_RAY_TIMEOUT_S": "180",
               # no `ray stop` at the end: it would kill every Ray of this machine, other tests' too
               "MEGARL_RAY_STOP_ALL": "0"}
        # Ray inside the job must not join a Ray that this pytest process may have started.
        env.pop("RAY_ADDRESS", None)
        yield Cluster(env)
    finally:
        down = _run(["bash", str(CLUSTER), "down"], timeout=120)
        print(down.stdout.strip(), down.stderr.strip())
        left = _run(["ip", "netns", "list"]).stdout
        assert down.returncode == 0 and not any(node in left for node in NODES), down.stdout + down.stderr + left


def _job(c: Cluster, job_id: int) -> dict[str, str]:
    out = _on_node1("scontrol", "show", "job", "--oneliner", str(job_id), env=c.env).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


RUNNING = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None)


def _wait_done(c: Cluster, job_id: int, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        job = _job(c, job_id)
        if job.get("JobState") not in RUNNING:
            return job
        if time.monotonic() > deadline:
            _on_node1("scancel", str(job_id), env=c.env)
            pytest.fail(f"job {job_id} still {job.get('JobState')} after {timeout} s")
        time.sleep(1)


def _log(out: Path, job_id: int) -> str:
    log = out / "logs" / f"slurm-{job_id}.log"
    return log.read_text() if log.exists() else ""


def _submit(c: Cluster, policy: Path, out: Path, *overrides: str) -> int:
    cmd = ["bash", str(SUBMIT), "--no-check", "--nodes", "2", "--ray-cpus-per-node", "2",
           "--job-name", "megarl-2n", "--sbatch-arg", f"--output={out.parent}/slurm-%j.out", str(RECIPE),
           f"actor.model.path={policy}", f"reference.model.path={policy}", f"output_dir={out}",
           # actor + reference: one bundle of 2 CPUs, a whole node; the engine's 1 CPU: the other
           "reference.colocate_with=actor", *overrides]
    res = _on_node1(*cmd, env=c.env)
    assert res.returncode == 0, res.stdout + res.stderr
    return int(res.stdout.strip().split(";")[0])


def _start(c: Cluster, policy: Path, tmp: Path, *overrides: str) -> tuple[int, Path, float]:
    """Submits; returns once both Ray nodes have joined (job id, output dir, submit time). A job
    whose Ray did not start (an overloaded machine) is submitted once more."""
    for attempt in (1, 2):
        out = tmp / f"run{attempt}"
        t0 = time.monotonic()
        job_id = _submit(c, policy, out, *overrides)
        while "wait_for_ray: 2 node(s)" not in _log(out, job_id):
            job = _job(c, job_id)
            if job.get("JobState") not in RUNNING:
                text = _log(out, job_id)
                if attempt == 1 and RAY_START_FAILED in text:
                    print(f"job {job_id}: Ray did not start, submitting again:\n{text[-1500:]}")
                    break
                pytest.fail(f"job {job_id} ended {job.get('JobState')} before Ray joined:\n{text[-4000:]}")
            assert time.monotonic() - t0 < 300, f"Ray not up within 300 s:\n{_log(out, job_id)[-3000:]}"
            time.sleep(1)
        else:
            return job_id, out, t0
    raise AssertionError("unreachable")


def _placement(c: Cluster, out: Path, job_id: int, timeout: float = 300) -> dict[str, str]:
    """Waits until the run has written workers.json and engines.json, and returns the node each
    rank, engine and vLLM process runs on (read while they run: the network namespace of the pid)."""
    deadline = time.monotonic() + timeout
    while not ((out / "workers.json").exists() and (out / "engines.json").exists()):
        job = _job(c, job_id)
        assert job.get("JobState") in RUNNING, f"job ended {job.get('JobState')}:\n{_log(out, job_id)[-4000:]}"
        assert time.monotonic() < deadline, f"no workers.json after {timeout} s:\n{_log(out, job_id)[-3000:]}"
        time.sleep(0.5)
    where: dict[str, str] = {}
    for role, pids in json.loads((out / "workers.json").read_text()).items():
        for rank, pid in enumerate(pids):
            where[f"{role} rank {rank} (pid {pid})"] = _node_of(pid, c.inodes)
    for engine in json.loads((out / "engines.json").read_text()):
        where[f"rollout engine {engine['engine']} (pid {engine['pid']})"] = _node_of(engine["pid"], c.inodes)
        for proc in engine["processes"]:
            where[f"  its {proc['title']} (pid {proc['pid']})"] = _node_of(proc["pid"], c.inodes)
    for what, node in where.items():
        print(f"placement: {what} on {node} ({NODES.get(node)})")
    return where


def _node_of_role(where: dict[str, str], prefix: str) -> str:
    return next(node for what, node in where.items() if what.startswith(prefix))


def test_two_node_run_places_roles_on_both_nodes(cluster, tiny_policy, tmp_path):
    job_id, out, t0 = _start(cluster, tiny_policy, tmp_path)
    where = _placement(cluster, out, job_id)
    job = _wait_done(cluster, job_id, timeout=420)
    wall = time.monotonic() - t0
    text = _log(out, job_id)
    print(f"two-node run: job {job_id} {job['JobState']} in {wall:.0f} s (Slurm RunTime {job.get('RunTime')})")
    print("\n".join(line for line in text.splitlines()
                    if "wait_for_ray" in line or "Local node IP" in line or line.startswith(("megarl", "step"))))
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", text[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2] and all("reward/mean" in r for r in rows)
    # Ray: the head on node 1's address, the worker on node 2's
    assert ("wait_for_ray: 2 node(s), 4 CPUs, 0 GPUs joined: 10.231.0.1 (megarl-n1), 10.231.0.2 (megarl-n2)"
            in text), text[-4000:]
    assert "megarl train exited with 0" in text and "Ray stopped" in text
    # the actor (with its colocated reference) on one node, the engine and its vLLM on the other
    actor, engine = _node_of_role(where, "actor rank 0"), _node_of_role(where, "rollout engine 0")
    assert {actor, engine} == set(NODES), where
    assert _node_of_role(where, "reference rank 0") == actor
    assert all(node == engine for what, node in where.items() if what.startswith("  its VLLM")), where
    deadline = time.monotonic() + 20
    while any(cluster.job_pids().values()) and time.monotonic() < deadline:
        time.sleep(1)
    left = {node: {p: _cmdline(p) for p in pids} for node, pids in cluster.job_pids().items() if pids}
    assert not left, f"processes left in the nodes after the job: {left}"


def test_scancel_stops_every_process_on_both_nodes(cluster, tiny_policy, tmp_path):
    job_id, out, _ = _start(cluster, tiny_policy, tmp_path, "trainer.steps=1000")
    _placement(cluster, out, job_id)  # ranks, engine and vLLM all running, on both nodes
    running = cluster.job_pids()
    for node, pids in running.items():
        assert any("raylet" in _cmdline(p) for p in pids), f"no raylet on {node}"
    print({node: len(pids) for node, pids in running.items()}, "processes of the job before scancel")
    t0 = time.monotonic()
    assert _on_node1("scancel", str(job_id), env=cluster.env).returncode == 0
    alive = running
    while any(alive.values()) and time.monotonic() - t0 < 60:
        time.sleep(0.5)
        alive = cluster.job_pids()
    gone_s = time.monotonic() - t0
    job = _wait_done(cluster, job_id, timeout=60)
    print(f"scancel: every process of job {job_id} on both nodes gone after {gone_s:.1f} s; "
          f"job {job['JobState']} after {time.monotonic() - t0:.1f} s")
    left = {node: {p: _cmdline(p) for p in pids} for node, pids in alive.items() if pids}
    assert not left and gone_s <= 30, f"after {gone_s:.0f} s still running: {left}"
    assert job["JobState"] == "CANCELLED", job
    text = _log(out, job_id)
    assert "signal received: stopping" in text and "Ray stopped" in text, text[-3000:]


def test_a_dead_worker_node_ends_the_run_naming_it(cluster, tiny_policy, tmp_path):
    """Node 2 dies mid-run: its slurmd, Ray and ranks all killed at once (SIGKILL). Runs last:
    node 2 stays down; the fixture's `down` removes it."""
    job_id, out, _ = _start(cluster, tiny_policy, tmp_path, "trainer.steps=1000")
    where = _placement(cluster, out, job_id)
    on_n2 = sorted({what.split(" (")[0].strip() for what, node in where.items() if node == "megarl-n2"})
    time.sleep(3)  # into the first step
    t0 = time.monotonic()
    for pid in _node_pids(cluster.inodes)["megarl-n2"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log = out / "logs" / f"slurm-{job_id}.log"
    while "megarl train exited with" not in log.read_text():
        assert time.monotonic() - t0 < 180, f"the run did not end 180 s after node 2 died:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    driver_s = time.monotonic() - t0
    job = _wait_done(cluster, job_id, timeout=180)
    job_s = time.monotonic() - t0
    text = log.read_text()
    lines = [line for line in text.splitlines()
             if "failed" in line or "left the Ray cluster" in line or "nodes alive" in line
             or "megarl train exited" in line or "Ray stopped" in line]
    print(f"node death ({', '.join(on_n2)} on megarl-n2): driver exited after {driver_s:.1f} s, "
          f"job {job['JobState']} ({job.get('Reason')}) after {job_s:.1f} s\n" + "\n".join(lines))
    assert job["JobState"] not in ("COMPLETED", "CANCELLED"), job
    assert re.search(r"megarl train exited with [1-9]", text), text[-3000:]
    assert "wait_for_ray: node 10.231.0.2 (megarl-n2): " in text and "left the Ray cluster" in text, text[-3000:]
    left = cluster.job_pids()
    deadline = time.monotonic() + 20
    while left["megarl-n1"] and time.monotonic() < deadline:
        time.sleep(1)
        left = cluster.job_pids()
    assert not left["megarl-n1"], {p: _cmdline(p) for p in left["megarl-n1"]}
