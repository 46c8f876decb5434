"""Launchers: what starts the ranks of a run (torchrun, or submitit under SLURM:
:func:`export_slurm_environment` maps SLURM's variables to torchrun's), and :func:`check_launcher`, which turns
``hydra/launcher=slurm`` on a machine without SLURM into one paragraph. Details: docs/internals.md, "Launchers".

No torch here: the CLI imports this module before a run starts.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

from hookexp.errors import ConfigError

log = logging.getLogger("hookexp.launchers")

def slurm_environment() -> dict[str, str]:
    """torchrun's variables for a task that submitit started among several SLURM tasks (read from this process's
    environment with submitit's own reader, which expands the node list); empty for anything else (one task,
    torchrun's variables already set, not started by submitit). A variable already set (MASTER_PORT=...) stays."""
    env = os.environ
    if env.get("SUBMITIT_EXECUTOR") != "slurm" or int(env.get("SLURM_NTASKS", "1")) <= 1 or "WORLD_SIZE" in env:
        return {}
    from submitit.helpers import TorchDistributedEnvironment

    found = TorchDistributedEnvironment()
    values = {"MASTER_ADDR": found.master_addr, "MASTER_PORT": str(found.master_port), "RANK": str(found.rank),
              "WORLD_SIZE": str(found.world_size), "LOCAL_RANK": str(found.local_rank),
              "LOCAL_WORLD_SIZE": str(found.local_world_size)}
    return {k: v for k, v in values.items() if k not in env}


def export_slurm_environment() -> dict[str, str]:
    """Set torchrun's variables from SLURM's when submitit started several tasks (see :func:`slurm_environment`);
    returns what was set."""
    values = slurm_environment()
    os.environ.update(values)
    if values:
        log.info("SLURM task %s of %s: rank %s, master %s:%s", os.environ.get("SLURM_PROCID"),
                 os.environ.get("SLURM_NTASKS"), os.environ["RANK"], os.environ["MASTER_ADDR"],
                 os.environ["MASTER_PORT"])
    return values


# Hydra plugins behind config options: (group, option) -> (the plugin's module, its PyPI package). All are in the
# extra .[sweeps]; the package's own options that build on one (sweep=optuna_lr, hydra/launcher=slurm) are found
# through their defaults lists.
PLUGINS = {
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper"),
    ("hydra/launcher", "joblib"): ("hydra_plugins.hydra_joblib_launcher", "hydra-joblib-launcher"),
    ("hydra/launcher", "submitit_slurm"): ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    ("hydra/launcher", "submitit_local"): ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
}


def _installed(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # hydra_plugins (a namespace package) exists only once some plugin does
        return False


def _options_behind(group: str, option: str, seen: frozenset[tuple[str, str]] = frozenset()) -> list[tuple[str, str]]:
    """``(group, option)`` and the options the package's own config file for it selects in its defaults list."""
    from importlib import resources

    import yaml

    found = [(group, option)]
    path = resources.files("hookexp.conf").joinpath(*group.split("/"), f"{option}.yaml")
    if (group, option) in seen or not path.is_file():
        return found
    for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_":  # an option of the same group (slurm: submitit_slurm)
            found += _options_behind(group, entry, seen | {(group, option)})
        elif isinstance(entry, dict):  # {"override /hydra/sweeper": "optuna"}
            for key, value in entry.items():
                found += _options_behind(key.removeprefix("override ").strip("/"), str(value), seen | {(group, option)})
    return found


def check_plugins(overrides: list[str]) -> None:
    """Before Hydra composes: an option that needs a Hydra plugin of the extra .[sweeps] that is not installed is
    one paragraph naming the extra (Hydra would say only "Could not find 'hydra/launcher/joblib'")."""
    for override in overrides:
        key, _, values = override.lstrip("+").partition("=")
        if key not in ("sweep", "hydra/launcher", "hydra/sweeper"):
            continue
        for value in (v.strip() for v in values.split(",")):  # a multirun over options: each of them
            for group, option in _options_behind(key, value):
                plugin = PLUGINS.get((group, option))
                if plugin is not None and not _installed(plugin[0]):
                    via = f" (it selects {group}={option})" if (group, option) != (key, value) else ""
                    raise ConfigError(
                        f"{key}={value} needs the Hydra plugin {plugin[1]}{via}, which is not installed. The sweep "
                        "plugins are the optional extra sweeps: pip install 'hookexp[sweeps]' (in a clone: "
                        ".venv/bin/pip install -e '.[sweeps]'; ./scripts/test.sh installs every extra).")


def _is_slurm(launcher: Mapping[str, Any] | None) -> bool:
    return "slurm" in str((launcher or {}).get("_target_", "")).lower()


def check_launcher(launcher: Mapping[str, Any] | None, multirun: bool) -> None:
    """Before a sweep starts: the launcher it names can start jobs here. A single run (no ``-m``) runs in this
    process whatever the launcher says: a SLURM launcher then gets a warning."""
    if not _is_slurm(launcher):
        return
    if not multirun:
        log.warning("hydra/launcher=slurm only launches multiruns (-m); this single run trains here, in this process. "
                    "Add -m to submit it to SLURM.")
        return
    missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(
            f"the SLURM launcher submits every job with sbatch and starts its tasks with srun, and this machine has "
            f"no {' and no '.join(missing)} on its PATH: it is not a SLURM cluster's login node. Run the command on a "
            "login node of the cluster (with the same hookexp installed, pip install -e '.[sweeps]'), or launch here "
            "without SLURM: drop hydra/launcher=slurm (the jobs run one after another), or use "
            "hydra/launcher=joblib hydra.launcher.n_jobs=N to run N jobs at once on this machine.",
            key="hydra/launcher")
