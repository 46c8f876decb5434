"""Shared helpers: run ``python -m hookexp`` as a user would, and read a W&B offline run back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
HELPERS = TESTS / "helpers"  # modules the tests import (user transforms, models) and scripts they run
sys.path.insert(0, str(HELPERS))


def options(group: str) -> list[str]:
    """The shipped options of a config group (conf/<group>/*.yaml), by name."""
    from importlib import resources

    folder = resources.files("hookexp.conf") / group
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


@pytest.fixture(scope="module")
def hydra_conf():
    """Hydra initialised on the package's configs, for a module's compose() calls."""
    from hydra import initialize_config_module

    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        yield


# The first-divergence forensics buffer (guard.forensics, on by default) costs a few norms a step: about a fifth of
# the in-process tests' training time on this CPU. Tests that are not about it train without it; those that are
# (tests/telemetry/test_forensics.py, tests/run/test_cuda.py, the CLI tests) name it or keep the default.
FORENSICS_ON = "guard.forensics.window=32"


@pytest.fixture(autouse=True)
def _no_grad_norm_plot(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process runs draw no gradient-norm plot unless the test is marked ``grad_norm_plot``: matplotlib's
    figure is most of a short run's time on this CPU, and only the marked tests read it. Child processes (every CLI
    test, the docs pages) always draw it; tests/analysis/test_report.py draws it directly. The stand-in is the
    plot's own answer for a run that logged no gradient norm (None: no file, no image logged)."""
    if request.node.get_closest_marker("grad_norm_plot") is None:
        import hookexp.run.trainer

        monkeypatch.setattr(hookexp.run.trainer, "plot_grad_norms", lambda metrics_path, out_path: None)


def config(*overrides: str):
    """The config ``python -m hookexp OVERRIDES`` composes, with W&B off, no progress bar and no forensics buffer
    (``FORENSICS_ON`` turns it back on): what the tests train in process with :func:`hookexp.run.loop.run_job`."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        return compose("config", overrides=["logger=none", "trainer.progress=false", "guard.forensics.window=0",
                                            *overrides])


def helpers_path() -> str:
    """PYTHONPATH for a child process: tests/helpers first, then what the environment had (a machine whose
    packages live on PYTHONPATH keeps them)."""
    return os.pathsep.join([str(HELPERS), *filter(None, [os.environ.get("PYTHONPATH")])])


def run_cli(args: list[str], cwd: Path, timeout: int = 300, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """``python -m hookexp ARGS`` in ``cwd``; tests/helpers is on PYTHONPATH for the user transforms."""
    base = {**os.environ, "PYTHONPATH": helpers_path(), "WANDB_SILENT": "true"}
    base.pop("WANDB_MODE", None)
    env = {**base, **(env or {})}
    flags = [a for a in args if a.startswith("-")]  # -m and friends go before the overrides
    overrides = [a for a in args if not a.startswith("-")]
    return subprocess.run([sys.executable, "-m", "hookexp", *flags, "trainer.progress=false", *overrides], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)


def wandb_run_dir(run_dir: Path) -> Path:
    (found,) = (run_dir / "wandb").glob("offline-run-*")
    return found


def wandb_summary(run_dir: Path) -> dict:
    """The run's state, summary and config as ``wandb leet inspect --summary --json`` prints them."""
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--summary", "--json",
                          str(wandb_run_dir(run_dir))], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def wandb_history(run_dir: Path) -> list[dict]:
    """Every history row of the run's .wandb log, in order."""
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json",
                          str(wandb_run_dir(run_dir))], capture_output=True, text=True, timeout=120, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return [r["history"]["item"] for r in rows if r.get("type") == "history"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(scope="session")
def quick_start(tmp_path_factory) -> Path:
    """The README's quick start, command 1 (``python -m hookexp hooks=clamp_conv``), run once as it stands there in
    a fresh directory, as a user pastes it: its run directory, read by tests/test_readme.py (the figure the README
    quotes) and tests/run/test_cli.py (the files and the W&B run of the main job)."""
    import re

    from docblocks import README, run, section, user_env

    command = re.search(r"Command 1 is `(python -m hookexp [^`]*)`", section(README, "Quick start")).group(1)
    cwd = tmp_path_factory.mktemp("quick_start")
    done = run(f"{command} trainer.progress=false", cwd, user_env())  # python: the venv's
    assert done.returncode == 0, done.stderr[-3000:]
    (summary,) = cwd.glob("outputs/**/summary.json")
    return summary.parent


def has_module(name: str) -> bool:
    """Whether ``name`` imports; False also when a parent package is missing (``hydra_plugins`` is a namespace
    package that exists only once some Hydra plugin is installed)."""
    from importlib.util import find_spec

    try:
        return find_spec(name) is not None
    except ModuleNotFoundError:
        return False


# Tests that take ``device`` run on the CPU everywhere and again on a CUDA GPU where there is one (CI has
# none: run ``pytest -k cuda`` on a GPU machine).
DEVICES = ["cpu",
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)
