"""Placement of megarl's roles on Ray: bringing Ray up or joining it, placement groups."""

from megarl.cluster.ray_env import ensure_ray, shutdown_ray

__all__ = ["ensure_ray", "shutdown_ray"]
