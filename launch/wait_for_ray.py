"""Waits until a Ray cluster has the nodes, CPUs and GPUs a launcher started.

    python launch/wait_for_ray.py --nodes 4 --cpus-per-node 64 --gpus-per-node 8
    python launch/wait_for_ray.py --nodes 4 --cpus-per-node 64 --lost --timeout 10

Joins RAY_ADDRESS (with RAY_AUTH_MODE/RAY_AUTH_TOKEN from the environment) and polls the
alive nodes' resources. Exits 0 once every expected node has joined (naming each node's
address and host), 1 with what is missing after --timeout seconds: the launcher then stops
instead of starting a driver that would wait forever for placement groups.

--lost, after a failed run: names each node that joined and is no longer alive (its address,
host and Ray's reason), waiting up to --timeout seconds for Ray to notice one; exits 1 if a
node was lost, 0 if all --nodes are still alive.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def joined(nodes: list[dict]) -> tuple[int, float, float]:
    """Alive nodes, and their total CPUs and GPUs, from ``ray.nodes()``."""
    alive = [n for n in nodes if n.get("Alive")]
    cpus = sum(n.get("Resources", {}).get("CPU", 0.0) for n in alive)
    gpus = sum(n.get("Resources", {}).get("GPU", 0.0) for n in alive)
    return len(alive), cpus, gpus


def describe(node: dict) -> str:
    """A node's address and host name, e.g. ``10.0.0.2 (gpu-017)``."""
    return f"{node.get('NodeManagerAddress', '?')} ({node.get('NodeManagerHostname', '?')})"


def lost_nodes(nodes: list[dict]) -> list[str]:
    """One line per node that joined and is gone, with the reason Ray recorded."""
    return [f"{describe(n)}: {n.get('DeathReasonMessage') or 'no reason recorded'}"
            for n in nodes if not n.get("Alive")]


def report_lost(ray, want_nodes: int, deadline: float) -> int:
    while True:
        nodes = ray.nodes()
        lost = lost_nodes(nodes)
        alive = sum(1 for n in nodes if n.get("Alive"))
        if lost or alive < want_nodes or time.monotonic() > deadline:
            break
        time.sleep(1)
    for line in lost:
        print(f"wait_for_ray: node {line} -- it left the Ray cluster", file=sys.stderr)
    if lost or alive < want_nodes:
        print(f"wait_for_ray: {alive}/{want_nodes} Ray nodes alive", file=sys.stderr)
        return 1
    print(f"wait_for_ray: all {want_nodes} Ray nodes still alive", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True, help="Ray nodes expected")
    p.add_argument("--cpus-per-node", type=float, required=True, help="logical CPUs each node declares")
    p.add_argument("--gpus-per-node", type=float, default=0, help="GPUs each node declares")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait before failing")
    p.add_argument("--lost", action="store_true",
                   help="report the nodes that left the cluster instead of waiting for nodes to join")
    args = p.parse_args(argv)
    if not os.environ.get("RAY_ADDRESS"):
        p.error("RAY_ADDRESS is not set: this joins a running cluster")

    import ray

    want = (args.nodes, args.nodes * args.cpus_per_node, args.nodes * args.gpus_per_node)
    deadline = time.monotonic() + args.timeout
    have = (0, 0.0, 0.0)
    while True:  # the head's GCS may still be starting
        try:
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="WARNING")
            break
        except ConnectionError as e:
            if time.monotonic() > deadline:
                print(f"wait_for_ray: no Ray head at {os.environ['RAY_ADDRESS']} after {args.timeout:g} s: {e}",
                      file=sys.stderr)
                return 1
            time.sleep(1)
    try:
        if args.lost:
            return report_lost(ray, args.nodes, deadline)
        while time.monotonic() < deadline:
            nodes = ray.nodes()
            have = joined(nodes)
            if all(h >= w for h, w in zip(have, want, strict=True)):
                where = ", ".join(sorted(describe(n) for n in nodes if n.get("Alive")))
                print(f"wait_for_ray: {have[0]} node(s), {have[1]:g} CPUs, {have[2]:g} GPUs joined: {where}",
                      flush=True)
                return 0
            time.sleep(1)
    finally:
        ray.shutdown()
    print(f"wait_for_ray: after {args.timeout:g} s only {have[0]}/{want[0]} nodes, {have[1]:g}/{want[1]:g} CPUs, "
          f"{have[2]:g}/{want[2]:g} GPUs joined", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
