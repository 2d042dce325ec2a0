"""The ``megarl`` command."""

from __future__ import annotations

import argparse
import signal
import sys

from megarl import __version__

# The page of the documentation site (docs/, mkdocs.yml) that explains each command; its --help ends
# with it (tests/test_docs_site.py checks that every command has one and that the page exists).
DOC_PAGES = {
    "train": "docs/guides/rl-algorithms.md",
    "sft": "docs/guides/supervised.md",
    "rm": "docs/guides/supervised.md",
    "dpo": "docs/guides/supervised.md",
    "convert": "docs/guides/conversion.md",
    "plan": "docs/guides/planner.md",
    "bench": "docs/guides/benchmarks.md",
    "demo": "docs/quickstart.md",
}


def build_parser() -> argparse.ArgumentParser:
    from megarl.cli import demo
    from megarl.cli import train as train_cli
    from megarl.convert import cli as convert_cli
    from megarl_bench import cli as bench_cli

    parser = argparse.ArgumentParser(
        prog="megarl",
        description="megarl: Megatron-based 3D-parallel RLHF. Run `megarl COMMAND --help` for details.",
    )
    parser.add_argument("--version", action="version", version=f"megarl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train_cli.add_parser(sub)
    convert_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    demo.add_parser(sub)
    from megarl.cli import plan as plan_cli  # megarl plan: layouts that fit

    plan_cli.add_parser(sub)
    from megarl.cli import supervised  # megarl sft / rm / dpo: the supervised stages

    supervised.add_parsers(sub)
    for name, command in sub.choices.items():
        settings = "; every setting: docs/reference/configuration.md" if name in ("train", "sft", "rm", "dpo") else ""
        command.epilog = f"Documentation: {DOC_PAGES[name]}{settings} (as a site: mkdocs serve)"
    return parser


_signals_received: list[int] = []


def _exit_on_sigterm() -> None:
    # SIGTERM (Slurm's scancel, kill) unwinds like Ctrl-C: rank processes are stopped and
    # temporary outputs removed by the `finally`/`except` blocks on the way out.
    def handler(signum, frame):
        # Once: a second SIGTERM (a launcher repeating it) must not cut the cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _signals_received.append(signum)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _exit_on_sigterm()
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("megarl: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        # A signal that arrives while Ray waits (ray.wait / ray.get) comes out as Ray's own
        # SystemExit(1): the launcher still gets 128 + the signal, as from anywhere else.
        if _signals_received:
            raise SystemExit(128 + _signals_received[0]) from None
        raise


if __name__ == "__main__":
    sys.exit(main())
