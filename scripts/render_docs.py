"""Renders pages of the built documentation site in headless Chromium, saves screenshots, checks them.

    python scripts/render_docs.py                       # build the site, render, check; PNGs in /tmp/megarl-docs
    python scripts/render_docs.py --site SITE --out DIR

The site is served on 127.0.0.1 (a port the OS picks) and each page is loaded twice by Chromium: once
to dump the DOM after the theme's JavaScript ran, once for a screenshot. A page passes when its title,
heading and navigation are the expected ones, its code blocks are highlighted and carry the copy
button the theme's JavaScript adds, its tables are there (the configuration reference: one row per
schema field), and the screenshot shows the theme's header colour. A broken theme, template or asset
path fails one of these. Exits 1 naming every failed check; 2 when no Chromium is installed.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
HEADER_RGB = (63, 81, 181)  # Material's indigo, the primary colour in mkdocs.yml
NAV_SECTIONS = ("Quickstart", "Concepts", "Guides", "Reference", "Results")


@dataclass
class Page:
    path: str  # URL path under the site root
    title: str  # the <title> the page must have
    min_code_blocks: int
    min_table_rows: int = 0


class Dom(HTMLParser):
    """What the checks read from a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.title = ""
        self.h1 = ""
        self.nav_links: list[str] = []
        self.code_blocks = 0  # highlighted blocks (<div class="... highlight">)
        self.copy_buttons = 0  # added by the theme's JavaScript
        self.table_rows = 0  # rows with <td> cells, in every table
        self.stylesheets: list[str] = []
        self._capture: str | None = None  # the tag whose text is being collected
        self._text = ""
        self._row_counted = True

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if (tag == "title" and not self.title) or (tag == "h1" and not self.h1) or \
                (tag in ("a", "label") and "md-nav__link" in cls):
            self._capture, self._text = tag, ""
        elif tag == "div" and "highlight" in cls:
            self.code_blocks += 1
        elif tag == "button" and "md-code__button" in cls and a.get("data-md-type") == "copy":
            self.copy_buttons += 1
        elif tag == "tr":
            self._row_counted = False
        elif tag == "td" and not self._row_counted:
            self.table_rows += 1
            self._row_counted = True
        elif tag == "link" and a.get("rel") == "stylesheet":
            self.stylesheets.append(a.get("href", ""))

    def handle_endtag(self, tag):
        if tag != self._capture:
            return
        text = " ".join(self._text.replace("¶", "").split())
        if tag == "title":
            self.title = text
        elif tag == "h1":
            self.h1 = text
        else:
            self.nav_links.append(text)
        self._capture = None

    def handle_data(self, data):
        if self._capture is not None:
            self._text += data


def find_browser() -> str | None:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    return None


def build_site(site: Path) -> None:
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                   cwd=ROOT, check=True, capture_output=True, env=_env())


def _env() -> dict:
    import os

    return {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def _serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _chromium(browser: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args],
                              capture_output=True, text=True, timeout=timeout)


def header_colour(png: Path) -> tuple[int, int, int]:
    from PIL import Image

    with Image.open(png) as image:
        return image.convert("RGB").getpixel((image.width // 2, 4))


def check_page(browser: str, base: str, page: Page, out: Path, expected_rows: int = 0) -> list[str]:
    url = base + page.path
    dom_text = _chromium(browser, "--dump-dom", url).stdout
    dom = Dom()
    dom.feed(dom_text)
    problems = []
    if dom.title != page.title:
        problems.append(f"title {dom.title!r}, expected {page.title!r}")
    if not dom.h1:
        problems.append("no <h1>")
    missing = [s for s in NAV_SECTIONS if s not in dom.nav_links]
    if missing:
        problems.append(f"navigation lacks {missing} (has {len(dom.nav_links)} links)")
    if dom.code_blocks < page.min_code_blocks:
        problems.append(f"{dom.code_blocks} highlighted code blocks, expected at least {page.min_code_blocks}")
    if dom.copy_buttons < dom.code_blocks or not dom.copy_buttons:
        problems.append(f"{dom.copy_buttons} copy buttons for {dom.code_blocks} code blocks: the theme's "
                        "JavaScript did not run")
    if not any("assets/stylesheets/main" in s for s in dom.stylesheets):
        problems.append(f"no theme stylesheet linked ({dom.stylesheets})")
    if page.min_table_rows and dom.table_rows < page.min_table_rows:
        problems.append(f"{dom.table_rows} table rows, expected at least {page.min_table_rows}")
    if expected_rows and dom.table_rows != expected_rows:
        problems.append(f"{dom.table_rows} table rows, expected {expected_rows}")
    png = out / f"{page.path.strip('/').replace('/', '_') or 'index'}.png"
    _chromium(browser, f"--screenshot={png}", "--window-size=1280,1600", url)
    if not png.is_file() or png.stat().st_size < 10_000:
        problems.append(f"no screenshot at {png}")
    else:
        colour = header_colour(png)
        if max(abs(c - e) for c, e in zip(colour, HEADER_RGB, strict=True)) > 40:
            problems.append(f"header colour {colour}, expected about {HEADER_RGB}: the theme's CSS did not apply")
    return [f"{page.path}: {p}" for p in problems]


def config_table_rows() -> int:
    """Body rows of the configuration page's tables: one per field, plus the algorithm-defaults table."""
    text = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| field ")
            and not line.startswith("| algorithm ")]
    return len(rows)


PAGES = (
    Page("quickstart/", "Quickstart - megarl", min_code_blocks=5, min_table_rows=5),
    Page("reference/configuration/", "Configuration - megarl", min_code_blocks=1, min_table_rows=150),
)


def render(site: Path | None, out: Path) -> list[str]:
    browser = find_browser()
    if browser is None:
        raise FileNotFoundError("no headless Chromium: none of " + ", ".join(BROWSERS) + " is on PATH")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if site is None:
            site = Path(tmp) / "site"
            build_site(site)
        server, base = _serve(site)
        try:
            problems = []
            for page in PAGES:
                rows = config_table_rows() if page.path.startswith("reference/configuration") else 0
                problems += check_page(browser, base, page, out, expected_rows=rows)
            return problems
        finally:
            server.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, help="a built site (default: build one with mkdocs)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "megarl-docs",
                        help="where the screenshots go")
    args = parser.parse_args(argv)
    try:
        problems = render(args.site, args.out)
    except FileNotFoundError as e:
        print(f"render_docs: {e}", file=sys.stderr)
        return 2
    for page in PAGES:
        print(f"{args.out / (page.path.strip('/').replace('/', '_') + '.png')}")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(f"render_docs: {len(PAGES)} pages rendered and checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
