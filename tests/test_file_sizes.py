"""No module of the package grows past MAX_LINES: a file that long holds more than one purpose and
is split by purpose instead (issue 40)."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"
MAX_LINES = 500


def test_no_module_is_over_the_line_limit():
    too_long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        count = len(path.read_text(encoding="utf-8").splitlines())
        if count > MAX_LINES:
            too_long[str(path.relative_to(PACKAGE.parent))] = count
    assert not too_long, f"over {MAX_LINES} lines (split each by purpose): " + ", ".join(
        f"{name} ({count} lines)" for name, count in too_long.items())
