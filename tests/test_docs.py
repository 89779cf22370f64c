"""The documentation: the site builds strictly and the README stays a short guide.

`mkdocs build --strict` fails on a link to a page or file that is not there, a page left out of
the nav, or an absolute link; a link to a missing anchor (reported by mkdocs 1.6+ as an INFO line)
fails here too. CI installs mkdocs with the test extra, so there a missing mkdocs is a failure.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250


def test_readme_is_a_short_guide():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the details to a page under docs/"
    )


def test_readme_links_resolve():
    """mkdocs checks the site's links; the README is not part of the site, so its own are checked here."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+://", t) and not t.startswith("#")]
    assert local, "the README links to no docs page"
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_docs_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI"):
            pytest.fail("mkdocs is not installed (the test extra installs it): the docs site must be built in CI")
        pytest.skip("mkdocs is not installed (pip install 'mkdocs>=1.5')")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "does not contain an anchor" not in output, output
    assert (tmp_path / "site" / "index.html").exists()
