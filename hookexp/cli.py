"""``hookexp`` / ``python -m hookexp``: the Hydra training command, and the subcommands ``report``, ``ablate``
and ``replay`` (:data:`SUBCOMMANDS`).

Hydra composes ``conf/`` (shipped as ``hookexp.conf``) with the command line; this module checks the composed
config, claims the run directory and hands the config to the run layer. A mistake hookexp detects is one
paragraph and exit status 2; a launch that fails before training leaves no run directory. Nothing here imports
torch until a run starts. In a multirun a failing job writes ``failure.json`` and the sweep goes on;
:class:`SweepSummary` lists the failures at the end and exits 1 (docs/sweeps.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
import threading
import traceback
import typing
from pathlib import Path
from typing import Any, ClassVar

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationKeyError

from hookexp.config import EXTRA_KEYS, TYPED_GROUPS, HookexpConfig
from hookexp.errors import ConfigError, HookexpError, did_you_mean
from hookexp.goals import objective, objective_value
from hookexp.run import launchers, rundir
from hookexp.run.hydra_api import (
    HYDRA_PRIVATE,
    check_hook_files,
    hook_files_defining,
    hydra_errors_as_ours,
    hydra_private,
    unknown_keys_as_additions,
)

log = logging.getLogger("hookexp")


def check_config(cfg: DictConfig, defined_in: typing.Callable[[str], list[str]] | None = None,
                 sets: typing.Sequence[str] = ()) -> None:
    """Keys added with ``+key=value`` must be ones hookexp reads: at the top level and inside the typed groups
    (``+trainer.epoch=3`` is a typo, not a new setting). ``defined_in(name)``: the hook files that define a spec
    the run has not loaded (``hooks.clamp_conv.args.min=-1`` without ``hooks=clamp_conv``); ``sets``: the hook
    files chosen (``hooks=[a,b]``)."""
    known = set(HookexpConfig.__dataclass_fields__) | set(EXTRA_KEYS)
    for key in cfg:
        if key not in known:
            extras = ", ".join(f"+{k}=... ({v})" for k, v in EXTRA_KEYS.items())
            raise ConfigError(f"unknown top-level key.{did_you_mean(str(key), known)} Keys you may add: {extras}.",
                              key=str(key))
    for group, schema in TYPED_GROUPS.items():
        _check_fields(cfg.get(group), schema, group)
    specs = [str(name) for name in cfg.get("hooks") or {}]
    for name in specs:  # hooks.clmap_conv.args.min=1: a misspelled spec name, not a new spec
        if isinstance(cfg.hooks[name], DictConfig) and not {"target", "kind"} & set(cfg.hooks[name]):
            if files := (defined_in(name) if defined_in else []):
                chosen = [s for s in sets if s not in ("none", files[0])]
                add = f"hooks=[{','.join([*chosen, files[0]])}]" if chosen else f"hooks={files[0]}"
                raise ConfigError(f"no hook spec named {name!r} in this run: conf/hooks/{files[0]}.yaml defines it, "
                                  f"and this run does not load that file: select it with {add}.",
                                  key=f"hooks.{name}")
            raise ConfigError(f"no hook spec named {name!r}.{did_you_mean(name, set(specs) - {name})} The specs are: "
                              f"{', '.join(s for s in specs if s != name) or '(none)'}; a new spec needs a target and "
                              f"a kind (+hooks.{name}={{target: fc1, kind: forward, ...}}).", key=f"hooks.{name}")
    _check_interpolations(cfg)


def _check_interpolations(cfg: DictConfig) -> None:
    """An interpolation that names a key the config lacks (a model's ``num_classes: ${data.num_classes}``):
    one paragraph naming the key that holds it and what it names, not OmegaConf's traceback."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationKeyError as e:
        key = str(e.full_key)
        parent, _, last = key.rpartition(".")
        raw = OmegaConf.to_container(OmegaConf.select(cfg, parent) if parent else cfg)
        written = raw.get(last, "its interpolation") if isinstance(raw, dict) else "its interpolation"
        missing = str(e.msg).split("'")[1] if str(e.msg).count("'") >= 2 else "?"
        owner, _, name = missing.rpartition(".")
        there = OmegaConf.select(cfg, owner) if owner else cfg
        has = (f"{did_you_mean(name, [str(k) for k in there])} {owner or 'The config'} has: "
               f"{', '.join(str(k) for k in there)}." if isinstance(there, DictConfig) else "")
        raise ConfigError(f"{written} names {missing}, a key the config does not have.{has} Set {key} to a value, "
                          "or make the interpolation name a key that exists.", key=key) from None


def _check_fields(node: Any, schema: Any, where: str) -> None:
    """The keys of ``node`` against the dataclass ``schema``, and of its nested dataclasses (``trainer.fsdp``)."""
    hints = typing.get_type_hints(schema)
    fields = list(schema.__dataclass_fields__)
    for key in node or {}:
        if key not in fields:
            raise ConfigError(f"unknown key.{did_you_mean(str(key), fields)} {where} has: {', '.join(fields)}.",
                              key=f"{where}.{key}")
        if dataclasses.is_dataclass(hints[key]):
            _check_fields(node[key], hints[key], f"{where}.{key}")


def apply_ablation(cfg: DictConfig) -> None:
    """``+ablate=NAME``: disable spec NAME; ``none`` keeps every spec, ``all`` disables every spec."""
    target = cfg.get("ablate")
    if target is None or str(target) == "none":
        return
    names = list(cfg.hooks)
    if str(target) == "all":
        for name in names:
            cfg.hooks[name].enabled = False
        return
    if str(target) not in names:
        raise ConfigError(f"no hook spec named {target!r} to ablate.{did_you_mean(str(target), names)} "
                          f"The specs are: {', '.join(names) or '(none)'}; or use none or all.", key="ablate")
    cfg.hooks[str(target)].enabled = False


def _sweep_defaults(cfg: DictConfig) -> None:
    """In a multirun: W&B group = the sweep directory, name = the job's overrides (unless set)."""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    with open_dict(cfg):
        if cfg.logger.group is None:
            cfg.logger.group = "_".join(Path(hc.sweep.dir).parts[-2:])  # e.g. 2026-11-22_10-00-00
        if cfg.logger.name is None:
            overrides = [o for o in hc.overrides.task if not o.startswith("hydra.")]
            cfg.logger.name = " ".join(overrides) or f"job{hc.job.num}"


def run(cfg: DictConfig) -> Any:
    """Run (or dry-run) one job; returns ``optimized_metric`` for sweepers (null: val/acc, else val/loss), negated
    when lower is better (:func:`hookexp.goals.objective_value`)."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    chosen = next((o.split("=", 1)[1] for o in overrides if o.startswith("hooks=")), "none")  # a list: no choice
    sets = chosen.strip("[]").replace(" ", "").split(",")
    check_config(cfg, lambda name: hook_files_defining(name, hc.job.config_name, [*hc.overrides.hydra, *overrides]),
                 sets)
    check_hook_files(hc.job.config_name, [*hc.overrides.hydra, *overrides])  # hydra.searchpath adds config dirs
    apply_ablation(cfg)
    _sweep_defaults(cfg)
    # torch is imported only once the config is checked
    from hookexp.run.build import build_task, check_targets, logged_metrics
    from hookexp.run.loop import dry_run, run_job

    # the sweep objective: a name the task does not log is refused before anything trains
    metric = objective(cfg.get("optimized_metric"), logged_metrics(build_task(cfg, overrides, quiet=True)))

    check_targets(cfg, overrides)  # the model's and optimizer's keys, before the data is loaded
    kept = finished_job(run_dir) if hc.mode == RunMode.MULTIRUN and rundir.truthy(cfg.get("resume")) else None
    if kept is not None:  # a resumed sweep: this job finished before (without a checkpoint to extend from)
        return objective_value(metric, kept)
    if cfg.get("dry_run"):
        dry_run(cfg, run_dir, overrides)
        log.info("run directory: %s", run_dir)
        return None
    summary = run_job(cfg, run_dir, overrides)
    if summary.get("nothing_to_do"):  # resumed at its finished end: said so, nothing written
        return objective_value(metric, summary)
    rank = int(os.environ.get("RANK", "0"))
    if rank > 0 and Path(summary["run_dir"]) != run_dir and RunDirPolicy.created.get(str(run_dir)):
        rundir.remove_unstarted(run_dir)  # torchrun: this rank's Hydra named its own directory; the run is rank 0's
    if summary["status"] == "interrupted":
        if rank == 0 and hc.mode == RunMode.MULTIRUN:
            print(f"hookexp: interrupted by signal {summary['signal']} after step {summary['trainer/steps']} of job "
                  f"{hc.job.num} of the sweep in {hc.sweep.dir}; continue the sweep (finished jobs are kept, this one "
                  f"continues, the others start) with: {sweep_resume_command(Path(hc.sweep.dir))}", file=sys.stderr)
        elif rank == 0:
            print(f"hookexp: interrupted by signal {summary['signal']} after step {summary['trainer/steps']}; "
                  f"continue with: {resume_command(Path(summary['run_dir']))}", file=sys.stderr)
        sys.exit(128 + int(summary["signal"]))
    if hc.mode == RunMode.RUN:  # finished: a stop signal now has nothing to stop, and a finished run exits 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    shown = ", ".join(f"{k}={v:.4g}" for k, v in summary.items()
                      if k.startswith(("train/", "val/")) and isinstance(v, float))
    log.info("finished %d steps (%s reached) in %.1f s: %s; run directory: %s", summary["trainer/steps"],
             summary.get("trainer/stopped_by", "the last step"), summary["runtime_s"], shown, run_dir)
    return objective_value(metric, summary)


SOURCE_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")


def config_sources(args: list[str]) -> list[str]:
    """The arguments that say where the run's configs came from (``--config-dir DIR`` and the other config
    flags, ``hydra.searchpath=...``): a resume re-composes the run's own overrides, which may name the user's
    config files."""
    out: list[str] = []
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in SOURCE_FLAGS:
            out += [arg] if "=" in arg or i + 1 == len(args) else [arg, args[i + 1]]
        elif arg.startswith("hydra.searchpath="):
            out.append(arg)
    return out


def finished_job(run_dir: Path) -> dict[str, Any] | None:
    """A resumed sweep's job that finished before and has no checkpoint (one with a checkpoint is resumed, and says
    "nothing to do" itself): its summary, after saying so; None for any other job."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if summary.get("status") != "finished" or (run_dir / "checkpoints").exists():
        return None
    log.info("nothing to do: job %s finished at step %s (kept as it is; it has no checkpoint to continue from)",
             run_dir, summary.get("trainer/steps"))
    return summary


def sweep_resume_command(sweep_dir: Path) -> str:
    """The multirun command that was run, into the same sweep directory, with ``resume=true``."""
    args = [a for a in sys.argv[1:] if rundir.override_key(a) not in ("resume", "hydra.sweep.dir")]
    return shlex.join([*launch_head(), *args, f"hydra.sweep.dir={os.path.abspath(sweep_dir)}", "resume=true"])


def resume_command(run_dir: Path) -> str:
    """The command that continues ``run_dir``, runnable where the user stands: the interpreter that is running (or
    the ``hookexp`` script that was run), under torchrun the torchrun command with its node and process counts."""
    return shlex.join([*launch_head(), *config_sources(sys.argv[1:]), "resume=true", f"hydra.run.dir={run_dir}"])


def launch_head() -> list[str]:
    """How this command was launched, before its arguments: the interpreter (or the ``hookexp`` console script),
    under torchrun the torchrun command with its node and process counts."""
    if "LOCAL_WORLD_SIZE" in os.environ:  # set by torchrun
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        torchrun = Path(sys.executable).with_name("torchrun")
        head = [str(torchrun)] if torchrun.is_file() else [sys.executable, "-m", "torch.distributed.run"]
        head += [f"--nnodes={int(os.environ.get('WORLD_SIZE', per_node)) // per_node}",
                 f"--nproc_per_node={per_node}", "-m", "hookexp"]
    elif Path(sys.argv[0]).name == "hookexp" and Path(sys.argv[0]).is_file():  # the console script
        head = [os.path.abspath(sys.argv[0])]
    else:
        head = [sys.executable, "-m", "hookexp"]
    return head


class StoppedDuringStartUp(BaseException):
    """SIGTERM/SIGINT before the trainer took the signals over (start-up: composing, building, loading data)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_start_up(signum: int, frame: Any) -> None:
    raise StoppedDuringStartUp(signum)


@contextlib.contextmanager
def _start_up_signals() -> typing.Iterator[None]:
    """SIGTERM/SIGINT during start-up end the job with one line and 128 + the signal (a job scheduler's preemption,
    Ctrl-C), not with Python's default handler (rc -15, no message) or a KeyboardInterrupt traceback. The trainer
    installs its own handlers (checkpoint, then stop) for the steps, and restores these after them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _stop_start_up) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is _stop_start_up:  # a finished run set SIG_IGN: keep that
                signal.signal(sig, handler)


@hydra.main(version_base="1.3", config_path="pkg://hookexp.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> Any:
    hc = HydraConfig.get()
    run_dir = Path(os.path.abspath(hc.runtime.output_dir))
    try:
        with _start_up_signals():
            return run(cfg)
    except StoppedDuringStartUp as e:
        if RunDirPolicy.created.get(str(run_dir)):
            logging.shutdown()
            rundir.remove_unstarted(run_dir, RunDirPolicy.parents.get(str(run_dir)))
        print(f"\nhookexp: stopped by signal {e.signum} during start-up, before the first step: nothing was trained. "
              f"Run the same command again (with resume=true hydra.run.dir={run_dir} it starts from step 0 if there "
              "is no checkpoint yet).", file=sys.stderr)
        sys.exit(128 + e.signum)
    except Exception as e:
        if hc.mode == RunMode.MULTIRUN:
            _record_failure(run_dir, list(hc.overrides.task), e)
            return float("nan")
        if RunDirPolicy.created.get(str(run_dir)):
            logging.shutdown()
            rundir.remove_unstarted(run_dir, RunDirPolicy.parents.get(str(run_dir)))
        if isinstance(e, HookexpError):
            print(f"\nhookexp: error: {e}", file=sys.stderr)
            sys.exit(2)
        raise


def _record_failure(job_dir: Path, overrides: list[str], error: BaseException) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    text = str(error) if isinstance(error, HookexpError) else f"{type(error).__name__}: {error}"
    (job_dir / "failure.json").write_text(json.dumps({
        "overrides": overrides, "error": text, "type": type(error).__name__,
        "traceback": "".join(traceback.format_exception(error)),
    }, indent=2) + "\n")
    print(f"hookexp: job {' '.join(overrides)} failed: {text}", file=sys.stderr)


class RunDirPolicy(Callback):
    """Before Hydra writes anything into the run (or sweep) directory: refuse one that holds results."""

    created: ClassVar[dict[str, bool]] = {}  # run dir -> whether this launch creates it
    parents: ClassVar[dict[str, list[Path]]] = {}  # run dir -> the folders above it this launch creates

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        launchers.check_launcher(config.hydra.get("launcher"), multirun=False)
        try:
            run_dir = Path(os.path.abspath(str(config.hydra.run.dir)))
        except Exception:  # an interpolation only the job can resolve: the run layer checks it then
            return
        self.parents[str(run_dir)] = rundir.new_parents(run_dir)
        _exit_on_error(lambda: self.created.__setitem__(
            str(run_dir), rundir.claim(run_dir, config.get("resume"), config.get("overwrite"))))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _exit_on_error(lambda: launchers.check_launcher(config.hydra.get("launcher"), multirun=True))
        _exit_on_error(lambda: rundir.claim_sweep(Path(str(config.hydra.sweep.dir)), config.get("overwrite"),
                                                      config.get("resume")))


def _exit_on_error(fn: Any) -> None:
    try:
        fn()
    except HookexpError as e:
        print(f"hookexp: error: {e}", file=sys.stderr)
        sys.exit(2)


class SweepSummary(Callback):
    """At the end of a multirun: list the jobs that failed (from their failure.json) and exit 1."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        failures = sorted(sweep_dir.glob("**/failure.json"))
        if not failures:
            return
        total = len(list(sweep_dir.glob("**/.hydra/overrides.yaml")))
        print(f"\nhookexp: {len(failures)} of {max(total, len(failures))} jobs failed "
              f"(the others' results are in {sweep_dir}):", file=sys.stderr)
        for path in failures:
            info = json.loads(path.read_text())
            print(f"  {path.parent.name}: {' '.join(info['overrides'])}: {info['error']}", file=sys.stderr)
        sys.exit(1)


# `hookexp NAME ...` with NAME one of these runs the module's main(argv) -> exit status; every other first word is
# the training command. Imported only when named, so that a missing one (replay) leaves the others working.
SUBCOMMANDS = {
    "report": "hookexp.analysis.report",  # hookexp report DIR [DIR ...]: the table and plot of a sweep
    "ablate": "hookexp.analysis.ablate",  # hookexp ablate hooks=[a,b] seed=0,1: a leave-one-out ablation
    "replay": "hookexp.run.replay",  # hookexp replay RUN_DIR --step N: one step of a run again
}


def subcommand(name: str, argv: list[str]) -> int:
    """Run ``hookexp NAME ARGV``; returns its exit status."""
    import importlib

    try:
        module = importlib.import_module(SUBCOMMANDS[name])
    except ModuleNotFoundError as e:
        if e.name != SUBCOMMANDS[name]:
            raise
        print(f"hookexp: error: {name} is not available in this version of hookexp.", file=sys.stderr)
        return 2
    return int(module.main(argv) or 0)


def versions() -> str:
    """``hookexp 0.1.0 (torch ..., hydra-core ..., ...; Python ...)``: the installed versions a bug report needs,
    read from the packages' metadata (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    found = [f"{name} {v}" for name in ("torch", "hydra-core", "omegaconf", "wandb", "transformers", "lightning")
             if (v := of(name)) is not None]
    return f"hookexp {of('hookexp') or 'unknown'} ({', '.join(found)}; Python {sys.version.split()[0]})"


def main() -> None:
    # The console script `hookexp` finds the user's own modules in the current directory, as `python -m` does.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
        sys.exit(subcommand(sys.argv[1], sys.argv[2:]))
    if {"--version", "-V"} & set(sys.argv[1:]):  # hookexp's version, not Hydra's (its flag), and without torch
        print(versions())
        sys.exit(0)
    if len(sys.argv) > 1 and not sys.argv[1].startswith(("-", "~")) and "=" not in sys.argv[1]:
        word = sys.argv[1]  # `hookexp reprot DIR`: not Hydra's "Error parsing override 'reprot' missing EQUAL"
        print(f"hookexp: error: {word!r} is neither a subcommand nor an override (KEY=VALUE, GROUP=OPTION)."
              f"{did_you_mean(word, SUBCOMMANDS)} Subcommands: {', '.join(SUBCOMMANDS)}; python -m hookexp --help "
              "lists the config groups and keys.", file=sys.stderr)
        sys.exit(2)
    args = sys.argv[1:]
    others = [a for a in args if a.startswith("-") or "=" not in a]  # Hydra's flags and their values
    overrides = [a for a in args if not a.startswith("-") and "=" in a]
    try:
        for name in HYDRA_PRIVATE:  # a Hydra outside the supported versions: one paragraph, before anything runs
            hydra_private(name)
        overrides = rundir.resume_overrides(overrides)
        launchers.check_plugins(overrides)
    except HookexpError as e:
        print(f"hookexp: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [sys.argv[0], *others, *overrides]
    if int(os.environ.get("RANK", "0")) > 0:  # under torchrun only rank 0 writes: Hydra's files too
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    # A log file that cannot be written (a full disk: cli.log, W&B's debug log) drops the record instead of printing
    # logging's "--- Logging error ---" traceback (which W&B's console capture then fails on): the run's own error
    # says what went wrong, in one paragraph.
    logging.raiseExceptions = False
    logging.getLogger("alembic").setLevel(logging.WARNING)  # optuna's storage: "setup plugin alembic..." lines
    if not sys.stderr.isatty():  # optuna's colorlog writes ANSI codes into files and pipes otherwise
        os.environ.setdefault("NO_COLOR", "1")
    with unknown_keys_as_additions(), hydra_errors_as_ours():
        _hydra_main()


if __name__ == "__main__":
    main()
