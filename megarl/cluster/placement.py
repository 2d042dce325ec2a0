"""Where each role's ranks run: Ray placement groups, colocated or disaggregated.

A role with ``colocate_with: null`` (and the rollout with its own setting) gets
its own placement group, one bundle per rank. A role colocated with another
puts its rank i on that role's bundle i, and the bundle is sized for both: on a
GPU cluster this is the colocated setup where vLLM and Megatron share devices;
on CPU the bundles are (logical) CPUs and the same code runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.config.schema import RunConfig
from megarl.platform import current_platform


@dataclass
class Slot:
    """How one role is placed: a placement group and the first of its bundles."""

    placement_group: Any
    bundle_offset: int
    cpus_per_rank: float
    gpus_per_rank: float


def role_ranks(cfg: RunConfig) -> dict[str, int]:
    ranks = {name: role.parallel.ranks for name, role in cfg.roles().items()}
    ranks["rollout"] = cfg.rollout.engines
    return ranks


def placement_errors(cfg: RunConfig) -> list[str]:
    """Colocation that cannot work: unknown hosts, chains, more guest ranks than host bundles."""
    errors = []
    ranks = role_ranks(cfg)
    hosts = {name: role.colocate_with for name, role in cfg.roles().items()}
    hosts["rollout"] = cfg.rollout.colocate_with
    for guest, host in hosts.items():
        if host is None:
            continue
        where = f"{guest}.colocate_with" if guest != "rollout" else "rollout.colocate_with"
        if host not in ranks:
            errors.append(f"{where}={host!r} is not a role of this run ({', '.join(sorted(ranks))})")
        elif hosts.get(host) is not None:
            errors.append(f"{where}={host!r}, which is itself colocated: colocate with {hosts[host]!r} instead")
        elif ranks[guest] > ranks[host]:
            errors.append(f"{where}={host!r}: {ranks[guest]} ranks do not fit on the {ranks[host]} bundles of "
                          f"{host}")
    return errors


def place(cfg: RunConfig) -> dict[str, Slot]:
    """Creates the placement groups (waiting until Ray can grant them) and returns each role's slot."""
    import ray
    from ray.util.placement_group import placement_group

    gpu = current_platform().is_gpu
    demand = {name: (role.cpus_per_rank, role.gpus_per_rank if gpu else 0.0) for name, role in cfg.roles().items()}
    demand["rollout"] = (1.0, float(cfg.rollout.tp) if gpu else 0.0)
    host_of = {name: role.colocate_with or name for name, role in cfg.roles().items()}
    host_of["rollout"] = cfg.rollout.colocate_with or "rollout"
    ranks = role_ranks(cfg)
    groups = {}
    for host in sorted({h for h in host_of.values()}):
        bundles = []
        for i in range(ranks[host]):
            cpus = sum(demand[g][0] for g, h in host_of.items() if h == host and i < ranks[g])
            gpus = sum(demand[g][1] for g, h in host_of.items() if h == host and i < ranks[g])
            bundles.append({"CPU": cpus, **({"GPU": gpus} if gpus else {})})
        groups[host] = placement_group(bundles, strategy="PACK", name=f"megarl-{cfg.name}-{host}")
    ray.get([pg.ready() for pg in groups.values()], timeout=600)
    return {name: Slot(groups[host_of[name]], 0, *demand[name]) for name in host_of}
