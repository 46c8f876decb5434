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
    ``--config-dir``). As on the command line, a misspelt key is kept for :func:`train`'s checks to name with a
    did-you-mean, and Hydra's own errors (an unknown option of a group, a value of the wrong type) are a
    :class:`~hookexp.errors.ConfigError` naming the key."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from hookexp.run.hydra_api import check_hook_files, explain_hydra_error, unknown_keys_as_additions

    extra = [] if config_dir is None else [f"hydra.searchpath=[file://{Path(config_dir).absolute()}]"]
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"), unknown_keys_as_additions():
        try:
            check_hook_files("config", [*overrides, *extra])  # two files defining one spec: refused, as on the CLI
            return hydra_compose("config", overrides=[*overrides, *extra])
        except Exception as e:
            ours = explain_hydra_error(e)
            if ours is None:
                raise
            raise ours from None


def train(cfg: Any, run_dir: str | Path, *, resume: bool | str | Path | None = None,
          overwrite: bool = False) -> dict[str, Any]:
    """Run the job ``cfg`` describes into ``run_dir``; returns the summary. A ``run_dir`` that holds another run's
    results is refused, unless ``resume=True`` (continue that run from its checkpoint; ``resume=PATH``: another
    run's checkpoint or run directory, into this one) or ``overwrite=True`` (delete its results and start over).
    They stand for the command line's ``resume=...`` and ``+overwrite=true`` (which ``cfg`` may hold as well)."""
    from omegaconf import open_dict

    from hookexp.run.loop import run_job
    from hookexp.run.rundir import PYTHON, claim

    run_dir = Path(run_dir)
    if resume is not None:
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.resume = resume if isinstance(resume, bool) else str(resume)
    claim(run_dir.absolute(), cfg.get("resume"), overwrite or cfg.get("overwrite"), PYTHON)
    return run_job(cfg, run_dir, launch=PYTHON)
