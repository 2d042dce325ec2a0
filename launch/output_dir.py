"""Prints the output_dir of a recipe with overrides, without validating the models.

    python launch/output_dir.py RECIPE.yaml [dotted.override=value ...]

The Slurm job needs the run directory before Ray starts (its log goes there), and a full
`megarl train --check` would cost the job ~15 s of imports; submit.sh validates before
queueing and the driver validates again. Recipe and override errors still end here,
naming the field (exit 2).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    from megarl.config.loader import ConfigError
    from megarl.recipes import load_run_config

    try:
        print(load_run_config(argv[0], argv[1:]).output_dir)
    except (ConfigError, FileNotFoundError) as e:
        print(f"output_dir.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
