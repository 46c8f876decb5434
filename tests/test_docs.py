"""docs/: the MkDocs site builds with --strict, and every shell command of README.md and docs/*.md runs.

A command runs once over README.md and the pages (in the nav's order; the first place it appears runs it),
shortened to two steps (docblocks.SHORT), in a fresh directory that holds a copy of README.md (the examples'
small text corpus) and with W&B disabled. Blocks marked ``<!-- test: skip: REASON -->`` need a GPU, a cluster
or a network, or are run with their files by tests/test_readme.py; see tests/helpers/docblocks.py for the markers.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from docblocks import (
    DOCS,
    LEARN,
    LEARNED,
    README,
    ROOT,
    ShellBlock,
    key,
    python_blocks,
    run,
    section,
    shell_blocks,
    shortened,
    user_env,
)

MKDOCS = ROOT / "mkdocs.yml"


def nav_pages() -> list[str]:
    nav = yaml.safe_load(MKDOCS.read_text())["nav"]
    return [page for entry in nav for page in entry.values()]


PAGES = [README, *(DOCS / page for page in nav_pages())]


def owned() -> dict[Path, list[tuple[ShellBlock, list[str]]]]:
    """Per file, its blocks and the commands of each that this file runs: not marked skip, and not already
    run by a file before it."""
    seen: set[tuple[str, ...]] = set()
    out = {}
    for path in PAGES:
        out[path] = []
        for block in shell_blocks(path.read_text()):
            mine = [] if block.mark.startswith("skip: ") else [c for c in block.commands if key(c) not in seen]
            seen.update(key(c) for c in block.commands)
            out[path].append((block, mine))
    return out


def test_the_nav_lists_every_page_and_the_site_builds_strict(tmp_path: Path):
    assert sorted(nav_pages()) == sorted(p.name for p in DOCS.glob("*.md"))
    assert nav_pages()[0] == "index.md"
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(MKDOCS), "-d", str(site)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    for page in nav_pages():
        assert (site / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")).is_file(), page
    # the README's links into docs/ reach a page and, with a #fragment, a heading of it
    links = re.findall(r"\]\(docs/([\w-]+)\.md(?:#([\w-]+))?\)", README.read_text())
    assert len(links) >= 15
    for page, anchor in links:
        html = site / ("index.html" if page == "index" else f"{page}/index.html")
        assert html.is_file(), page
        assert not anchor or f'id="{anchor}"' in html.read_text(), (page, anchor)


def test_the_commands_marked_for_test_readme_are_the_ones_it_runs():
    """A block skipped here because tests/test_readme.py runs it must be one of the blocks that test reads
    (the README's quick start, docs/models.md's two recipes), so that no command is left to neither test."""
    marked = {key(c) for path in PAGES for b in shell_blocks(path.read_text()) if "test_readme" in b.mark
              for c in b.commands}
    recipes = ("Your own model, data and loss", "A model that computes its own loss")
    read = section(README, "Quick start") + "".join(section(DOCS / "models.md", title) for title in recipes)
    assert marked == {key(c) for b in shell_blocks(read) for c in b.commands}
    assert len(marked) == 6  # the quick start's two, the recipes' four


def test_each_command_is_run_once():
    runs = [key(c) for blocks in owned().values() for _, mine in blocks for c in mine]
    assert len(runs) == len(set(runs)) and len(runs) >= 30


# sweeps and full runs: the slow set (./scripts/test.sh -m slow)
HEAVY = {"sweeps.md", "training.md", "README.md", "runs.md", "models.md"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.slow] if p.name in HEAVY else [])
                                  for p, blocks in owned().items() if any(mine for _, mine in blocks)],
                         ids=lambda p: p.name)
def test_every_shell_command_of_the_page_runs(path: Path, tmp_path: Path):
    shutil.copy(README, tmp_path / "README.md")
    env = user_env(WANDB_MODE="disabled")
    for block, mine in owned()[path]:
        for command in mine:
            before = set(tmp_path.glob("**/summary.json"))
            done = run(command if block.mark == "as written" else
                       shortened(command, LEARN) if block.mark == "learns" else shortened(command), tmp_path, env)
            out = done.stdout + done.stderr
            if block.mark == "fails":
                assert done.returncode != 0, (command, out[-3000:])
                for line in block.expected.splitlines():
                    assert line.rstrip(". ") in out, (command, line, out[-3000:])
            else:
                assert done.returncode == 0, (command, out[-3000:])
            if block.mark == "learns":  # a recipe that trains to chance is a broken recipe, whatever its exit code
                for summary in sorted(set(tmp_path.glob("**/summary.json")) - before):
                    result = json.loads(summary.read_text())
                    assert result["status"] == "finished" and result["val/acc"] > LEARNED, (command, summary,
                                                                                            result["val/acc"])


LIBRARY = [DOCS / "library.md", DOCS / "statistics.md"]  # the pages of Python examples for one's own loop


def test_the_library_examples_are_complete_scripts_or_say_why_not():
    """Each python block of the library pages is run as pasted (``runs``) or names why it cannot be (``skip:``),
    so that no example leans on names defined elsewhere (``model``, ``opt``, ``loader``) unnoticed."""
    for path in LIBRARY:
        marks = [mark for mark, _ in python_blocks(path.read_text())]
        assert marks and all(m == "runs" or m.startswith("skip: ") for m in marks), (path.name, marks)
        assert "runs" in marks, path.name


@pytest.mark.parametrize("path", [p for p in PAGES if any(m == "runs" for m, _ in python_blocks(p.read_text()))],
                         ids=lambda p: p.name)
def test_every_python_example_marked_runs_runs_as_pasted(path: Path, tmp_path: Path):
    for i, (mark, body) in enumerate(python_blocks(path.read_text())):
        if mark != "runs":
            continue
        (tmp_path / f"example{i}.py").write_text(body)
        done = run(f"python example{i}.py", tmp_path, user_env(WANDB_MODE="disabled"))
        assert done.returncode == 0, (path.name, i, done.stderr[-3000:])
        assert "Traceback" not in done.stderr, done.stderr[-3000:]


# rows of docs/configuration.md's group table whose options are not a folder's files: the hook sets are listed on
# their own page, and the launchers beside slurm are the plugins' (conf/hydra/help is the --help text, no option)
NOT_FILES = {"hooks": "docs/hooks.md lists the hook sets", "hydra/launcher": "joblib and submitit_local: plugins"}


def test_the_configuration_pages_group_table_lists_every_option_of_every_group():
    rows = re.findall(r"^\| `([\w/]+)` \| (.+?) \|", section(DOCS / "configuration.md", "Groups"), re.MULTILINE)
    conf = ROOT / "conf"
    groups = {str(p.parent.relative_to(conf)) for p in conf.rglob("*.yaml") if p.parent != conf} - {"hydra/help"}
    assert sorted(g for g, _ in rows) == sorted(groups)
    for group, options in rows:
        if group not in NOT_FILES:
            files = sorted(p.stem for p in (conf / group).glob("*.yaml"))
            assert sorted(re.findall(r"`(\w+)`", options)) == files, group


def listed_arguments(text: str, name: str) -> str:
    """What follows ``name (`` in ``text`` up to its closing parenthesis (nested ones included), or ''."""
    found = re.search(rf"\b{name}\**\s+\(", text)  # add (`value`), **reverse** (`lambda`)
    if not found:
        return ""
    depth, start = 1, found.end()
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return ""


def test_the_transforms_page_lists_every_argument_of_every_transform():
    import inspect

    from hookexp.engine import TRANSFORMS

    registry = (DOCS / "transforms.md").read_text().split("\n\n")[1]  # the paragraph after the title
    for name, info in TRANSFORMS.items():
        if info.alias_of is not None and info.translate is None:
            continue  # zero_ablate: zero's arguments (none)
        fn = info.translate or info.fn
        params = list(inspect.signature(fn).parameters)[0 if info.translate else 2:]
        shown = {v: k for k, v in info.arg_aliases.items()}
        listed = listed_arguments(registry, name)
        missing = [shown.get(p, p) for p in params if f"`{shown.get(p, p)}`" not in listed]
        assert not missing, (name, missing, listed)
