"""The house rules a reader relies on, read from the source: a short top level, no issue numbers in code or
tests, and module docstrings that state the contract in a few lines (narrative goes to docs/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "hookexp"
# report: only runs `python -m hookexp.report`, the design's spelling of `hookexp report`
TOP_LEVEL = {"__init__", "__main__", "cli", "config", "errors", "goals", "report"}
# an issue's number, as "issue 27.3", "issue-12" or "#26" (not "&#38;" nor a hex colour): history belongs in git;
# this file quotes them on purpose and is left out of the search
ISSUE = re.compile(r"\bissues?[ -]?#?\d|(?<![\w&])#\d{2,}\b|\bissue \"", re.IGNORECASE)
DOCSTRING_LINES = 10


def sources(*folders: Path) -> list[Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.py"))


def test_the_top_level_keeps_only_its_named_modules():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules <= TOP_LEVEL, sorted(modules - TOP_LEVEL)


def test_no_issue_numbers_in_the_package_or_the_tests():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in sources(PACKAGE, ROOT / "tests")
             if p != Path(__file__) for n, line in enumerate(p.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert found == []


def test_the_issue_pattern_finds_what_it_is_for():
    assert all(ISSUE.search(s) for s in ("Issue 27.3: x", "issues 20.4 and 20.6", "(issue-12)", "see #26",
                                         'the issue "Nothing lost"'))
    assert not any(ISSUE.search(s) for s in ("an issue with the data", "color='#1f77b4'", "&#38;", "x[#]"))


@pytest.mark.parametrize("path", sources(PACKAGE), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_docstring_is_at_most_ten_lines(path: Path):
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    assert len(doc.strip().splitlines()) <= DOCSTRING_LINES, "narrative goes to docs/"
