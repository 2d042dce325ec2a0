"""Every algorithm by its ``algorithm.name``.

Adding one: a module with an :class:`~megarl.algorithms.base.Algorithm` subclass, and its line in
``_REGISTERED`` below (settings whose default differs from the others' go in
``megarl.config.schema.ALGORITHM_DEFAULTS``).
"""

from __future__ import annotations

from megarl.algorithms.base import Algorithm
from megarl.algorithms.cispo import CISPO
from megarl.algorithms.dr_grpo import DrGRPO
from megarl.algorithms.entropy_cov import ClipCov, KLCov
from megarl.algorithms.grpo import GRPO
from megarl.algorithms.gspo import GSPO
from megarl.algorithms.opd import OPD
from megarl.algorithms.ppo import PPO
from megarl.algorithms.reinforce_pp import ReinforcePP
from megarl.algorithms.rloo import RLOO
from megarl.algorithms.sapo import SAPO
from megarl.config.schema import RunConfig

_REGISTERED: tuple[Algorithm, ...] = (
    GRPO(),
    DrGRPO(),
    RLOO(),
    ReinforcePP(),
    PPO(),
    GSPO(),
    CISPO(),
    SAPO(),
    ClipCov(),
    KLCov(),
    OPD(),
)
_BY_NAME = {algorithm.name: algorithm for algorithm in _REGISTERED}
ALGORITHMS: tuple[str, ...] = tuple(_BY_NAME)


def _unknown(name: str) -> str:
    return f"algorithm.name={name!r} must be one of {', '.join(ALGORITHMS)}"


def get_algorithm(name: str) -> Algorithm:
    """The algorithm called ``name``; ValueError naming the known ones otherwise."""
    if name not in _BY_NAME:
        raise ValueError(_unknown(name))
    return _BY_NAME[name]


def algorithm_errors(run: RunConfig) -> list[str]:
    """The algorithm settings of ``run`` that cannot work, one line each (an unknown name: that line alone)."""
    name = run.algorithm.name
    return [_unknown(name)] if name not in _BY_NAME else _BY_NAME[name].validate(run)
