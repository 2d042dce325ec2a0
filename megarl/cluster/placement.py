"""Where each role's ranks run: Ray placement groups, colocated or disaggregated.

A role with ``colocate_with: null`` (and the rollout with its own setting) gets
its own placement group, one bundle per rank. A role colocated with another
puts its rank i on that role's bundle i: the bundle's CPUs are added up and its
devices shared (each role asks for its fraction of them). On a GPU cluster this is
the colocated setup where vLLM and Megatron take turns on the same devices (the
trainer offloads one while the other runs); on CPU the bundles are (logical) CPUs
and the same code runs.
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


def role_hosts(cfg: RunConfig) -> dict[str, str]:
    """Whose bundles each role (and the rollout) runs on: its own, or those of its ``colocate_with``."""
    hosts = {name: role.colocate_with or name for name, role in cfg.roles().items()}
    hosts["rollout"] = cfg.rollout.colocate_with or "rollout"
    return hosts


def role_ranks(cfg: RunConfig) -> dict[str, int]:
    ranks = {name: role.parallel.ranks for name, role in cfg.roles().items()}
    ranks["rollout"] = cfg.rollout.engines
    return ranks


def placement_errors(cfg: RunConfig, gpu: bool | None = None) -> list[str]:
    """Colocation that cannot work: unknown hosts, chains, more guest ranks than host bundles."""
    errors = []
    gpu = current_platform().gpus_per_rank > 0 if gpu is None else gpu
    if gpu and cfg.rollout.colocate_with is not None and cfg.rollout.tp > 1:
        # an engine's TP workers live in one Ray actor, and a fractional share of a bundle
        # exposes a single device to it
        errors.append(f"rollout.colocate_with={cfg.rollout.colocate_with!r} needs rollout.tp=1 on GPU "
                      f"(got {cfg.rollout.tp}); give the rollout its own GPUs for tensor-parallel engines")
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


def capacity_errors(cfg: RunConfig, gpu: bool | None = None) -> list[str]:
    """A run that a local Ray instance (no RAY_ADDRESS) cannot place: more CPUs or GPUs in its
    bundles than the instance has. Ray would wait for them (``place``: ten minutes) instead of
    saying so. A cluster's resources are known only once joined: ``place`` waits there."""
    import os

    from megarl.cluster.ray_env import DEFAULT_LOCAL_CPUS

    if os.environ.get("RAY_ADDRESS"):
        return []
    gpu = current_platform().gpus_per_rank > 0 if gpu is None else gpu
    bundles, _ = bundle_plan(cfg, gpu)
    wanted = {kind: sum(b.get(kind, 0.0) for group in bundles.values() for b in group) for kind in ("CPU", "GPU")}
    have = {"CPU": max(DEFAULT_LOCAL_CPUS, os.cpu_count() or 1), "GPU": current_platform().visible_gpus() or 0}
    errors = []
    for kind, unit in (("CPU", "cores (local Ray's logical CPUs)"), ("GPU", "GPUs")):
        if wanted[kind] > have[kind]:
            ranks = ", ".join(f"{name} {n}" for name, n in role_ranks(cfg).items() if n)
            errors.append(f"the run's ranks ({ranks}) ask for {wanted[kind]:g} {unit} and this machine has "
                          f"{have[kind]:g}: lower the world sizes, cpus_per_rank or rollout.engines, or join a "
                          "cluster (RAY_ADDRESS)")
    return errors


def bundle_plan(cfg: RunConfig, gpu: bool) -> tuple[dict[str, list[dict[str, float]]], dict[str, tuple[float, float]]]:
    """Pure: the bundles of each host's placement group, and what each role's rank asks of its bundle.

    Colocated roles add up their CPUs, but share devices: a shared bundle holds the most
    GPUs any one of its roles needs, and each role asks for its share of them (e.g. actor,
    reference and a TP-1 vLLM engine on one GPU ask a third each), so Ray packs them onto
    the same device instead of reserving a GPU per role.
    """
    demand = {name: (role.cpus_per_rank, role.gpus_per_rank if gpu else 0.0) for name, role in cfg.roles().items()}
    demand["rollout"] = (1.0, float(cfg.rollout.tp) if gpu else 0.0)
    host_of = role_hosts(cfg)
    ranks = role_ranks(cfg)
    bundles: dict[str, list[dict[str, float]]] = {}
    asks: dict[str, tuple[float, float]] = {}
    for host in sorted(set(host_of.values())):
        sharing = [g for g, h in host_of.items() if h == host]
        gpus = max(demand[g][1] for g in sharing)
        bundles[host] = []
        for i in range(ranks[host]):
            cpus = sum(demand[g][0] for g in sharing if i < ranks[g])
            bundles[host].append({"CPU": cpus, **({"GPU": gpus} if gpus else {})})
        for g in sharing:
            asks[g] = (demand[g][0], gpus / len(sharing) if gpus else 0.0)
    return bundles, asks


def place(cfg: RunConfig) -> dict[str, Slot]:
    """Creates the placement groups (waiting until Ray can grant them) and returns each role's slot."""
    import ray
    from ray.util.placement_group import placement_group

    # the cluster's GPUs, not the driver's: a driver on a login or head node without a GPU must
    # still ask for the workers' GPUs (else Ray hides them and every rank silently runs on CPU)
    bundles, asks = bundle_plan(cfg, ray.cluster_resources().get("GPU", 0) > 0)
    host_of = role_hosts(cfg)
    groups = {host: placement_group(b, strategy="PACK", name=f"megarl-{cfg.name}-{host}")
              for host, b in bundles.items()}
    ray.get([pg.ready() for pg in groups.values()], timeout=600)
    return {name: Slot(groups[host_of[name]], 0, *asks[name]) for name in host_of}
