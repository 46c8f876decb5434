"""The run layer: build a job from its config, train it, checkpoint it, keep its directory.

From Python::

    from hookexp.run import compose, train
    cfg = compose("model._target_=mynet.Net", "trainer.max_steps=100")
    summary = train(cfg, "outputs/mine")

Names are imported on first use: the CLI imports :mod:`hookexp.run.rundir` before composing the config,
and ``python -m hookexp --help`` must not import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def compose(*overrides: str, config_dir: str | Path | None = None) -> Any:
    """The config ``python -m hookexp OVERRIDES`` would run (``config_dir``: a folder of your own yaml files, as
    ``--config-dir``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from hookexp.cli import check_hook_files

    extra = [] if config_dir is None else [f"hydra.searchpath=[file://{Path(config_dir).absolute()}]"]
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        check_hook_files("config", [*overrides, *extra])  # two files defining one spec: refused, as on the CLI
        return hydra_compose("config", overrides=[*overrides, *extra])


def train(cfg: Any, run_dir: str | Path) -> dict[str, Any]:
    """Run the job ``cfg`` describes into ``run_dir`` (refused if it holds another run's results); returns the
    summary."""
    from hookexp.run.loop import train as train_job
    from hookexp.run.rundir import claim

    run_dir = Path(run_dir)
    claim(run_dir.absolute(), cfg.get("resume"), cfg.get("overwrite"))
    return train_job(cfg, run_dir)
