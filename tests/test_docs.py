"""The manual and the front door: docs/build-config.md is what the BuildConfig dataclass generates, mkdocs builds
docs/ with --strict (a broken link or anchor, or a page missing from the nav, fails), and the README stays a
front door (<= 250 lines) whose relative links exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import build_config_reference  # scripts/ (pytest's pythonpath)

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250


def test_the_build_config_reference_is_current():
    assert build_config_reference.PAGE.read_text() == build_config_reference.render(), (
        "docs/build-config.md is stale: BuildConfig changed; run `make docs` and commit the page")
    text = build_config_reference.render()
    from kiln.builder.config import DERIVED, BuildConfig
    from kiln.contract import option_names

    assert all(f"| `{name}` |" in text for name in option_names(BuildConfig))   # every field has its row
    assert all(f"| `{name}` | {rule} |" in text for name, rule in DERIVED.items())


def test_mkdocs_builds_the_manual_strictly(tmp_path):
    """--strict with mkdocs.yml's validation: a dead link, a missing anchor or a page left out of the nav fails."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (tmp_path / "site" / "build-config" / "index.html").is_file()


def test_the_readme_is_a_front_door_with_working_links():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for required in ("make demo", "make test", "kiln.LLM(", "kiln serve", "from openai import OpenAI",
                     "--frontend triton", "kiln bench", "kiln plan", "--tp-size", "pip install torch==2.13.0 ."):
        assert required in text, required
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert relative and all((ROOT / link).exists() for link in relative), [x for x in relative
                                                                             if not (ROOT / x).exists()]
