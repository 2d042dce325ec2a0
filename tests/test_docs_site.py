"""The documentation site (mkdocs.yml, docs/): it builds with --strict, each command's --help names
its page, and, where headless Chromium is installed, the built pages render with the theme.

The build and the render are integration tests (they run programs: the ``subprocesses`` fixture);
the --help test is fast.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_command_help_names_its_page():
    from megarl.cli.main import DOC_PAGES, build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # the COMMAND subparsers
    assert set(commands) == set(DOC_PAGES), "a command without a documentation page, or a page for none"
    for name, command in commands.items():
        page = DOC_PAGES[name]
        assert (ROOT / page).is_file(), f"megarl {name} --help names {page}, which does not exist"
        assert command.format_help().rstrip().splitlines()[-1].startswith(f"Documentation: {page}")
        nav = (ROOT / "mkdocs.yml").read_text()
        assert page.removeprefix("docs/") in nav, f"{page} is not in mkdocs.yml's nav"


def test_site_builds_strict(subprocesses, tmp_path):
    """Every page in the nav, every link and anchor resolved, no warning: `mkdocs build --strict`."""
    pytest.importorskip("mkdocs", reason="mkdocs is installed by containers/install-cpu.sh")
    pytest.importorskip("material", reason="mkdocs-material is installed by containers/install-cpu.sh")
    start = time.monotonic()
    done = subprocesses.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    seconds = time.monotonic() - start
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    print(f"mkdocs build --strict: {seconds:.1f} s")
    for page in ("index.html", "quickstart/index.html", "reference/configuration/index.html", "results/index.html"):
        assert (tmp_path / "site" / page).is_file(), f"the build has no {page}"


def test_pages_render_in_chromium(subprocesses, tmp_path):
    """The quickstart and the configuration reference in headless Chromium: title, navigation, highlighted
    code blocks with the theme's copy buttons, one table row per schema field, the theme's header colour."""
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "scripts" / "render_docs.py")
    render_docs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = render_docs  # its dataclasses resolve their module through sys.modules
    spec.loader.exec_module(render_docs)
    if render_docs.find_browser() is None:
        pytest.skip("no headless Chromium (apt-get install chromium)")
    pytest.importorskip("material", reason="mkdocs-material is installed by containers/install-cpu.sh")
    problems = render_docs.render(None, tmp_path)
    assert not problems, "\n".join(problems)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["quickstart.png", "reference_configuration.png"]
