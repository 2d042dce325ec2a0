"""An OpenEnv environment package of our own, for ``env.kind: openenv:megarl.envs.examples.openenv_sums``
(``model_configs/cpu_openenv_sums.yaml``): reasoning-gym's chain_sum questions, one per episode.

Laid out as OpenEnv's environment packages are (the adapter finds the parts the same way): the
``Action`` / ``Observation`` models and the ``EnvClient`` here, the ``Environment`` in ``server/``.
It lives in megarl so that installing megarl installs it; OpenEnv's own environments come from its
repository, which CI cannot reach.
"""

from megarl.envs.examples.openenv_sums.client import SumsEnv
from megarl.envs.examples.openenv_sums.models import SumsAction, SumsObservation

__all__ = ["SumsAction", "SumsEnv", "SumsObservation"]
