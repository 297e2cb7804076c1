"""The documentation site: its configuration page is generated from ``Settings`` and
current, and ``make docs`` builds the whole site with ``--strict``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from pydantic import Field, create_model

from service.config import Settings
from service.settings_reference import fields, render

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"


def test_every_setting_has_a_row_on_the_configuration_page() -> None:
    page = PAGE.read_text()
    paths = [path for path, _ in fields(Settings)]
    assert len(paths) > 50  # the walk reached the nested sections
    missing = [p for p in paths if f"| `{p}` |" not in page]
    assert not missing, f"settings with no row in docs/configuration.md: {missing}"


def test_the_configuration_page_is_current() -> None:
    assert PAGE.read_text() == render(), (
        "docs/configuration.md is stale: run `python -m service.settings_reference > "
        "docs/configuration.md` (or `make docs`)"
    )


def test_a_setting_added_without_its_row_is_caught() -> None:
    # The row check is not vacuous: a field added to Settings is walked and has no row.
    grown = create_model("Grown", __base__=Settings, new_knob=(int, Field(1)))
    assert "new_knob" in [path for path, _ in fields(grown)]
    assert "| `new_knob` |" not in PAGE.read_text()


@pytest.mark.slow
def test_make_docs_builds_the_site_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    run = subprocess.run(
        ["make", "--no-print-directory", "docs", f"SITE={site}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (site / "configuration" / "index.html").exists()
    assert (site / "api" / "index.html").exists()


README = (ROOT / "README.md").read_text()
#: A date in any common form: 2026-11-27, 2026/11/24, 27.11.2026, "November 2026",
#: "Nov 27".
MONTH = r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? "
DATE = re.compile(
    r"\b20\d\d[-/.]\d\d?[-/.]\d\d?\b|\b\d\d?[./]\d\d?[./]20\d\d\b"
    rf"|{MONTH}(?:\d\d?(?:st|nd|rd|th)?,? )?20\d\d\b|{MONTH}\d\d?\b"
)
#: A tracker reference: "issue 31", "issues 12 and 13", "#693", "PR 36308", "stop 51".
TRACKER = re.compile(r"\b(?:issues?|PRs?|pull|stops?|tasks?) #?\d+|(?<![\w&/])#\d+\b", re.I)


def test_the_readme_is_a_front_door() -> None:
    assert len(README.encode()) <= 12_000, f"README.md is {len(README.encode())} bytes"
    for pattern, what in ((DATE, "a date"), (TRACKER, "a tracker number")):
        found = [m.group(0) for m in pattern.finditer(README)]
        assert not found, f"README.md holds {what}: {found}"


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("10:26 of pytest on 2026-11-27", DATE),
        ("keys under hsx/default/2026/11/24/", DATE),
        ("measured in November 2026", DATE),
        ("see issue 31", TRACKER),
        ("as vLLM #51328 shows", TRACKER),
        ("(PR 36308)", TRACKER),
    ],
)
def test_the_front_door_check_finds_what_it_refuses(text: str, pattern: re.Pattern[str]) -> None:
    assert pattern.search(text)


def test_the_readme_links_only_pages_that_exist() -> None:
    links = re.findall(r"\]\(((?!https?://)[^)#]+)", README)
    assert links, "the README links no page"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing
