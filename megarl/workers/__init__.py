"""Roles as SPMD groups of Ray actors: the WorkerGroup that drives one, and per-rank state.

Rank functions import their state from the submodule (``from megarl.workers.state import
state, current_rank``); the package does not re-export ``state``, which would shadow the
submodule of the same name.
"""

from megarl.workers.group import PendingCall, RankAddress, WorkerGroup, WorkerGroupError
from megarl.workers.state import RankContext, RankState, current_rank

__all__ = ["PendingCall", "RankAddress", "RankContext", "RankState", "WorkerGroup", "WorkerGroupError",
           "current_rank"]
