"""Run directories: one directory holds one run, and a run's results are never mixed or lost.

A fresh launch into a directory with a run's results is refused (``resume=true``, ``+overwrite=true`` or
another ``hydra.run.dir``); ``resume=true`` re-composes the run's own config; a launch that fails before
training removes the directory it created. Details: docs/internals.md, "Run directories", and docs/runs.md.

No torch here: the CLI imports this before composing, and ``--help`` must stay fast.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from hookexp.errors import RunDirError

# What a run writes: a directory holding any of these holds a run.
RESULTS = ("metrics.jsonl", "histograms.jsonl", "spikes.jsonl", "summary.json", "manifest.json", "checkpoints",
           "records", "wandb", "tensorboard", "plots", "dry_run.json", "failure.json")
# Config keys a resumed run may change: how long, where and how verbosely it runs, not what it computes.
RESUMABLE_CHANGES = ("trainer.max_steps", "trainer.epochs", "trainer.progress", "trainer.checkpoint_every",
                     "trainer.device", "trainer.num_threads", "trainer.save_records", "data.num_workers",
                     "trainer.stop_when", "hydra.searchpath", "logger.", "resume", "optimized_metric")


def resumable_changes() -> str:
    """:data:`RESUMABLE_CHANGES` as the errors (and docs/runs.md) write them: ``logger.*``, ``resume`` aside."""
    return ", ".join(k + "*" if k.endswith(".") else k for k in RESUMABLE_CHANGES if k != "resume")



@dataclass(frozen=True)
class Launch:
    """How a run was started, so that an error names its fix as the user can give it: on the command line
    (:data:`CLI`) or as the arguments of :func:`hookexp.run.train` (:data:`PYTHON`)."""

    key: str  # the setting the run-directory errors are about
    writable: str  # how to pick a writable run directory
    resume: str  # continue the run in {run_dir}
    resume_from: str  # continue from the checkpoint {path}
    overwrite: str  # start the run over
    elsewhere: str  # pick another run directory
    resume_here: str  # continue the run in the run directory given
    dir_name: str  # the run directory's name in a sentence
    give_dir: str  # how to give the interrupted run's directory
    resume_key: str  # the setting the resume errors are about


CLI = Launch("hydra.run.dir", "Choose a writable directory with hydra.run.dir=PATH",
             "resume=true hydra.run.dir={run_dir}", "resume=true hydra.run.dir=... with resume={path}",
             "+overwrite=true", "choose another directory (hydra.run.dir=PATH, or leave it out for a new timestamped "
             "one)", "resume=true", "hydra.run.dir", "give hydra.run.dir=<the interrupted run's directory>", "resume")
PYTHON = Launch("train(run_dir=...)", "Pass a writable run_dir", "train(cfg, run_dir, resume=True)",
                "train(cfg, run_dir, resume='{path}')", "train(cfg, run_dir, overwrite=True)", "pass another run_dir",
                "train(cfg, run_dir, resume=True)", "run_dir", "pass the interrupted run's directory",
                "train(resume=...)")


def results_in(run_dir: Path) -> list[str]:
    return [name for name in RESULTS if (run_dir / name).exists()]


def truthy(value: object) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


def require_creatable(run_dir: Path, launch: Launch = CLI) -> None:
    """One paragraph when the run directory cannot be made or written: a file where a folder of its path should be,
    a read-only disk, no permission. (Checked before Hydra makes it, whose error would be a traceback.)"""
    there = run_dir
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        why = f"{there} is a file, not a directory"
    elif not os.access(there, os.W_OK | os.X_OK):
        why = f"{there} is not writable (permissions, or a read-only file system)"
    else:
        return
    raise RunDirError(f"cannot write the run directory {run_dir}: {why}. {launch.writable}, or fix the path or its "
                      "permissions.", key=launch.key)


def claim(run_dir: Path, resume: object, overwrite: object, launch: Launch = CLI) -> bool:
    """Check ``run_dir`` before a run starts; returns whether this launch creates it (then a failure before
    training removes it again). The errors name their fixes as ``launch`` takes them."""
    require_creatable(run_dir, launch)
    if not run_dir.exists():
        return True
    found = results_in(run_dir)
    if not found or (resume is not None and resume is not False and str(resume).lower() not in ("false", "null")):
        return False
    if truthy(overwrite):
        for name in [*RESULTS, ".hydra"]:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        return False
    clash = (f"{run_dir} already holds a run ({', '.join(found)}); a new run there would mix its results with that "
             "one's.")
    raise RunDirError(f"{clash} Continue that run with {launch.resume.format(run_dir=run_dir)}, start it over with "
                      f"{launch.overwrite} (deletes its results), or {launch.elsewhere}.", key=launch.key)


def claim_sweep(sweep_dir: Path, overwrite: object, resume: object = None) -> None:
    """A multirun into a sweep directory whose jobs already hold results is refused the same way, unless it resumes
    that sweep (``resume=true``: each job continues from its checkpoint, or starts if it never did)."""
    if not sweep_dir.is_dir() or truthy(resume):
        return
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and results_in(p)]
    if not jobs:
        return
    if truthy(overwrite):
        for job in jobs:
            shutil.rmtree(job)
        return
    raise RunDirError(f"{sweep_dir} already holds a sweep ({len(jobs)} job directories with results); a new sweep "
                      "there would mix with it. Choose another hydra.sweep.dir, or add +overwrite=true to delete "
                      "the old jobs' results.", key="hydra.sweep.dir")


def override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def resume_overrides(overrides: list[str]) -> list[str]:
    """``resume=true hydra.run.dir=X [extra]`` -> X's own overrides, the allowed extras, resume and the run dir.
    Other command lines come back unchanged."""
    values = {override_key(o): o.split("=", 1)[1] for o in overrides if "=" in o}
    run_dir = values.get("hydra.run.dir")
    if not truthy(values.get("resume")) or run_dir is None:
        return overrides
    saved_path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not saved_path.is_file():
        return overrides  # nothing to re-compose from: the checkpointer says what is missing
    saved = [str(o) for o in (yaml.safe_load(saved_path.read_text()) or [])]
    extra = [o for o in overrides if override_key(o) not in ("resume", "hydra.run.dir")]
    refused = [o for o in extra if not override_key(o).startswith(RESUMABLE_CHANGES) and o not in saved]
    if refused:
        raise RunDirError(f"resume=true continues the run in {run_dir} with the config it was started with "
                          f"({' '.join(saved) or 'the defaults'}); {' '.join(refused)} would change what it computes. "
                          f"Only {resumable_changes()} may change on resume; start a new run for anything else.",
                          key="resume")
    changed = {override_key(o) for o in extra}
    kept = [o for o in saved if override_key(o) not in changed and override_key(o) != "resume"]
    return [*kept, *extra, "resume=true", f"hydra.run.dir={run_dir}"]


def new_parents(run_dir: Path) -> list[Path]:
    """The folders above ``run_dir`` that do not exist yet (a launch creates them: ``outputs/<date>``)."""
    return [p for p in run_dir.parents if not p.exists()]


def remove_unstarted(run_dir: Path, parents: list[Path] | None = None) -> None:
    """After a launch failed before training: remove the directory it created (nothing of a run is in it), and of
    ``parents`` (:func:`new_parents`, before the launch) those left empty (``outputs/<date>/``)."""
    if run_dir.is_dir() and not (run_dir / "manifest.json").exists() and not (run_dir / "dry_run.json").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
    for parent in parents or []:  # nearest first
        if run_dir.exists() or not parent.is_dir() or any(parent.iterdir()):
            break
        parent.rmdir()


def set_aside(run_dir: Path, launch: Launch = CLI) -> Path | None:
    """``resume=true`` where ``run_dir`` holds no checkpoint (a requeued command whose first attempt never got to
    one): the files of that attempt are moved into ``run_dir/attempt-N/`` (returned; None when there were none), and
    the run starts from step 0. A run that finished without a checkpoint is refused instead, naming
    ``trainer.checkpoint_every``: running it again is not resuming it."""
    summary = run_dir / "summary.json"
    try:
        done = json.loads(summary.read_text()) if summary.is_file() else {}
    except (OSError, ValueError):
        done = {}
    if done.get("status") == "finished":
        raise RunDirError(f"{run_dir} holds a run that finished at step {done.get('trainer/steps', '?')} without a "
                          "checkpoint to continue from (with trainer.checkpoint_every=0 a run checkpoints only when "
                          "a signal stops it). Start a new run with trainer.checkpoint_every=N (its last step is "
                          f"checkpointed too, so it can be extended later), or run this one again with "
                          f"{launch.overwrite}.", key=launch.resume_key)
    found = [name for name in results_in(run_dir) if name != "checkpoints"]
    if not found:
        return None
    n = 1
    while (run_dir / f"attempt-{n}").exists():
        n += 1
    attempt = run_dir / f"attempt-{n}"
    attempt.mkdir()
    for name in found:
        os.replace(run_dir / name, attempt / name)
    return attempt
