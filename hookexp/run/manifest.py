"""``manifest.json``: everything needed to know what a run was and to run it again."""

from __future__ import annotations

import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("hookexp", "torch", "hydra-core", "omegaconf", "wandb", "numpy", "scikit-learn", "tqdm", "matplotlib",
            "transformers", "datasets", "accelerate", "lightning", "torchvision")  # None: not installed


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_state(cwd: Path) -> dict[str, Any]:
    """The commit and dirty flag of the git checkout the run was started from, if any."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def build_manifest(config: dict[str, Any], hooks_table: list[dict[str, Any]], seed: int,
                   cwd: Path) -> dict[str, Any]:
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv],
        "cwd": str(cwd),
        "host": socket.gethostname(),
        "seed": seed,
        "git": git_state(cwd),
        "versions": package_versions(),
        "hooks": hooks_table,
        "config": config,
    }
