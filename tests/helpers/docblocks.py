"""The code blocks of README.md and docs/*.md, and their shell commands run as a user pastes them.

Shared by tests/test_readme.py (the recipes run with their files) and tests/test_docs.py (every other shell
command of every page). A bash block may be preceded by one marker line that says how the tests treat it:

    <!-- test: skip: REASON -->   not run here (needs a GPU, a cluster, a network; or run by another test)
    <!-- test: as written -->     run without the shortening overrides (SHORT) appended
    <!-- test: fails -->          each command must exit non-zero, printing the next ```text block's lines
    <!-- test: learns -->         a recipe: run long enough to learn (LEARN), each run it makes must beat chance

A python block marked ``<!-- test: runs -->`` is a complete script: tests/test_docs.py runs it as pasted.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
# Appended to every `python -m hookexp` / `hookexp` / `hookexp ablate` command of a page (later
# overrides win): two optimizer steps show that a command runs without training for its full length.
SHORT = ["trainer.max_steps=2", "trainer.progress=false"]
TRAINS = (["python", "-m", "hookexp"], ["hookexp"])
NO_TRAINING = ("report", "replay")  # subcommands that train nothing: run as written
# A recipe's commands (marked ``learns``): 30 steps, where digits' val/acc passes 0.5 and a hook set that stops
# learning stays at chance (0.1): every run such a command makes must reach LEARNED.
LEARN = ["trainer.max_steps=30", "trainer.progress=false"]
LEARNED = 0.3
BLOCK = re.compile(r"(?:<!-- test: ([^\n]*?) -->\n)?```(\w+)\n(.*?)```", flags=re.S)


def section(path: Path, title: str) -> str:
    """The text of ``## title`` in the markdown file ``path``, up to the next ``## `` heading."""
    text = path.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced code block of ``text`` as (language, body)."""
    return [(lang, body) for _, lang, body in BLOCK.findall(text)]


@dataclass
class ShellBlock:
    mark: str  # "" or the marker's text: "skip: REASON", "as written", "fails"
    commands: list[str]
    expected: str = ""  # for "fails": the body of the ```text block that follows


def commands(body: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, blank and comment-only lines left out."""
    joined = re.sub(r"\\\n\s*", "", body)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def shell_blocks(text: str) -> list[ShellBlock]:
    found = BLOCK.findall(text)
    out = []
    for i, (mark, lang, body) in enumerate(found):
        if lang != "bash":
            continue
        expected = found[i + 1][2] if mark == "fails" and i + 1 < len(found) and found[i + 1][1] == "text" else ""
        assert mark in ("", "as written", "fails", "learns") or mark.startswith("skip: "), f"unknown marker {mark!r}"
        assert mark != "fails" or expected, "a 'fails' block must be followed by a ```text block of its output"
        out.append(ShellBlock(mark, commands(body), expected))
    return out


def python_blocks(text: str) -> list[tuple[str, str]]:
    """The python blocks of ``text`` as (marker, body): ``runs``, ``skip: REASON`` or ""."""
    return [(mark, body) for mark, lang, body in BLOCK.findall(text) if lang == "python"]


def strip_comment(command: str) -> str:
    """The command without a trailing ``# comment`` (a ``#`` after a blank, outside quotes, as bash reads it)."""
    quote = ""
    for i, ch in enumerate(command):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command.rstrip()


def key(command: str) -> tuple[str, ...]:
    """What makes two commands the same command: their words, comments and spacing aside."""
    return tuple(shlex.split(strip_comment(command)))


def shortened(command: str, overrides: list[str] = SHORT) -> str:
    words = list(key(command))
    head = next((len(t) for t in TRAINS if words[:len(t)] == t), None)
    subcommand = words[head] if head is not None and head < len(words) else ""
    if head is not None and subcommand not in NO_TRAINING and not {"--help", "--cfg"} & set(words):
        return f"{strip_comment(command)} {shlex.join(overrides)}"
    return command


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell in a fresh directory: the venv's ``python`` and ``hookexp`` first on
    PATH, no PYTHONPATH (user modules are found from the cwd), W&B quiet."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WANDB_MODE")}
    env.update(WANDB_SILENT="true", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", **extra)
    return env


def run(command: str, cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    """``command`` run by bash, as a user pastes it (an unquoted {a,b} argument is split by brace expansion)."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
