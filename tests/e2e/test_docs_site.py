"""The documentation site (mkdocs.yml, docs/): `mkdocs build --strict` is green, and it is not blind (a page that
links a missing page fails it); every page is in the navigation; the performance page's plots are the ones
bench/plots.py draws from the committed results; the README stays one page and links into the site."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.local_server import ROOT

pytestmark = pytest.mark.e2e
MKDOCS = [sys.executable, "-m", "mkdocs"]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MKDOCS, "build", "--strict", "-f", str(config), "-d", str(site)], capture_output=True,
                          text=True, timeout=300, cwd=config.parent, env={"NO_MKDOCS_2_WARNING": "1",
                                                                          "PATH": "/usr/bin:/bin"})


def test_the_site_builds_strictly(tmp_path) -> None:
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    for page in ("index", "concepts", "configuration", "openai", "performance"):
        assert (tmp_path / "site" / (page if page == "index" else f"{page}/index")).with_suffix(".html").is_file()


def test_a_broken_link_fails_the_build(tmp_path) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "concepts.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "no-such-page.md" in done.stderr + done.stdout


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == set(re.findall(r":\s*([\w-]+\.md)\s*$", nav, re.M)), "mkdocs.yml's nav and docs/*.md differ"


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def test_the_plots_are_what_bench_draws(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "plots.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn == sorted(p.name for p in (ROOT / "docs" / "img").glob("*.png")) and drawn
    for name in drawn:
        assert _png_size(tmp_path / name) == _png_size(ROOT / "docs" / "img" / name)
        assert f"img/{name}" in (ROOT / "docs" / "performance.md").read_text()


def test_the_readme_is_one_page_and_links_the_site() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).is_file(), target
