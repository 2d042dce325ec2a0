"""megatron-core parallel state for one layout, set up and torn down around a block.

Inside a rank of an SpmdPool (torch.distributed already initialised), a block of
work runs under one (tp, pp, cp, ep) layout; the same ranks can then run another
layout, which lets tests check many layouts on one set of processes.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megarl.config.schema import ParallelConfig
from megarl.platform import init_megatron_runtime


@dataclass(frozen=True)
class RankInfo:
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    edp_rank: int  # rank among the replicas of this rank's experts
    tp: int
    pp: int
    dp: int
    ep: int
    etp_rank: int = 0  # rank among those splitting each of this rank's experts
    etp: int = 1
    cp_rank: int = 0  # which share of each sequence this rank holds (context parallelism)
    cp: int = 1

    def replica(self, expert: bool = False) -> int:
        """Which copy of its shards this rank holds (0: the one that sends them in a weight sync or
        an export). Dense shards are copied over data x context parallelism; an expert's over its
        expert-data-parallel group."""
        return self.edp_rank if expert else self.dp_rank * self.cp + self.cp_rank


def rank_info() -> RankInfo:
    from megatron.core import parallel_state as ps

    return RankInfo(
        rank=torch.distributed.get_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp=ps.get_context_parallel_world_size(),
    )


@contextlib.contextmanager
def megatron_parallel(par: ParallelConfig, seed: int = 1234, timeout_minutes: int = 30) -> Iterator[RankInfo]:
    """Initialises megatron-core's parallel groups for ``par`` over all ranks of the job."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    init_megatron_runtime()
    world = torch.distributed.get_world_size()
    if world % par.model_parallel_size:
        raise ValueError(f"{world} ranks cannot hold tp*pp*cp={par.model_parallel_size}")
    groups_before = _process_groups()
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=par.tp,
            pipeline_model_parallel_size=par.pp,
            virtual_pipeline_model_parallel_size=par.vpp,
            context_parallel_size=par.cp,
            expert_model_parallel_size=par.ep,
            expert_tensor_parallel_size=par.expert_tp,
            distributed_timeout_minutes=timeout_minutes,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        yield rank_info()
    finally:
        ps.destroy_model_parallel()
        _destroy_groups_since(groups_before)


def _process_groups() -> set:
    from torch.distributed.distributed_c10d import _world

    return set(_world.pg_map)


def _destroy_groups_since(before: set) -> None:
    """Destroys the process groups created since ``before``.

    megatron-core's destroy_model_parallel() only forgets its groups; they stay alive,
    each gloo group with its own threads. A process that changes layout many times (a
    test session, a colocated role) would pile up thousands of threads.
    """
    for group in _process_groups() - before:
        torch.distributed.destroy_process_group(group)
    # The groups' threads end when the last reference goes; megatron-core's model objects
    # hold some in reference cycles, so collect them now rather than at some later GC.
    gc.collect()
