"""Run validation: every check a config passes before any process starts.

It sits at the top of the layers, beside the CLI, because it consults every layer below
(model architectures, placement, rewards, rollout layouts, data). Messages name the dotted field.
"""

from megarl.validation.checks import validate_run

__all__ = ["validate_run"]
