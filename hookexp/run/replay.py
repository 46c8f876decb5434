"""Replay: re-run the steps around step N of a run with every statistic and forensics every step, into
``RUN_DIR/replay/step_N/`` (the run's own files are never touched), and say whether the replay reproduces what the
run logged (docs/rollback.md, "Replay").

    hookexp replay RUN_DIR --step N          (python -m hookexp.run.replay RUN_DIR --step N)
    hookexp.replay(run_dir, step)            -> the report (reproduced, first, batches), as a dict

It starts from the newest checkpoint at or before step N (a spike writes ``snapshot_<step>.pt``), with the run's
own config but ``stats.every=1``, ``guard.spike.action=log``, ``guard.nan_policy=warn``, no logger or checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from hookexp.errors import CheckpointError, HookexpError
from hookexp.run.checkpoint import REQUIRED_ENTRIES, Checkpointer, read_checked

PATTERN = re.compile(r"^snapshot_(\d+)\.pt$")


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Every one-file checkpoint of a run and the step it resumes at, oldest first."""
    found: list[tuple[int, Path]] = []
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return found
    for path in folder.iterdir():
        m = PATTERN.match(path.name)
        if m:
            found.append((int(m.group(1)), path))
        elif path.name in ("last.pt", "previous.pt"):
            try:
                loop = torch.load(path, map_location="cpu", weights_only=True)["loop"]
                found.append((int(loop["step"]), path))
            except Exception:  # a torn file: not a starting point
                continue
    return sorted(found)


@dataclass
class ReplayOptions:
    """How :func:`replay` re-runs: ``after`` steps past the asked one; ``every``: the replay's ``stats.every``
    (None: the run's own, so that its multi-step log lines are compared too); ``device`` (None: the run's);
    ``out``: the folder (None: ``RUN_DIR/replay/step_<N>/``); ``quiet``: print no summary."""

    after: int = 2
    every: int | None = 1
    device: str | None = None
    out: str | Path | None = None
    quiet: bool = False


def last_logged_step(metrics: Path) -> int | None:
    """The highest ``trainer/step`` of a run's ``metrics.jsonl`` (a torn last line skipped); None when it has none."""
    steps = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row.get("trainer/step"), int):
            steps.append(row["trainer/step"])
    return max(steps, default=None)


def replay(run_dir: str | Path, step: int, options: ReplayOptions | None = None) -> dict[str, Any]:
    """Replay the steps of ``run_dir`` from the newest checkpoint at or before ``step`` to ``step + after`` into
    ``run_dir/replay/step_<step>/`` (or ``options.out``); returns the report (module docstring) and prints its
    summary."""
    options = options if options is not None else ReplayOptions()
    after, every, device, out, quiet = options.after, options.every, options.device, options.out, options.quiet
    from hookexp.run import distributed
    from hookexp.run.build import build, pick_device
    from hookexp.run.checkpoint import require_writable
    from hookexp.run.trainer import Trainer

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise CheckpointError(f"{run_dir} is not a hookexp run directory (no metrics.jsonl). Give the directory a "
                              "run wrote (hydra.run.dir).", key="RUN_DIR")
    last = last_logged_step(run_dir / "metrics.jsonl")
    if last is not None and step > last:
        raise CheckpointError(f"step {step} is past the run's last step: {run_dir} logged steps up to {last}. Give a "
                              f"step the run took (0 to {last}).", key="--step")
    usable = [(s, p) for s, p in checkpoints(run_dir) if s <= step]
    if not usable:
        have = ", ".join(f"{p.name} (step {s})" for s, p in checkpoints(run_dir)) or "none"
        raise CheckpointError(f"no checkpoint of {run_dir} is at or before step {step} (the run has: {have}). A "
                              "spike writes the snapshot before it (guard.spike.metric); trainer.checkpoint_every=N "
                              "keeps more starting points.", key="--step")
    start, source = usable[-1]
    data = read_checked(source, REQUIRED_ENTRIES)
    config = _replay_config(data["config"], device, every)
    same_cadence = config["stats"]["every"] == data["config"]["stats"]["every"]
    cfg = OmegaConf.create(config)
    target = Path(out) if out is not None else run_dir / "replay" / f"step_{step}"
    if target.exists():
        shutil.rmtree(target)
    require_writable(target)
    resumed = {k: v for k, v in data.items() if k not in ("rollback", "sinks", "event")}
    resumed.update(config=config, files={"lines": {}, "source": str(target)}, records={"counts": {}})
    ranks = distributed.Dist()
    parts = build(cfg, ranks, pick_device(cfg.trainer.device), None)
    ckpt = Checkpointer(target, config, None, ranks=ranks)
    ckpt.track(model=parts.model, optimizer=parts.optimizer)
    ckpt.restore_weights(resumed)
    total = parts.total_steps
    parts.total_steps = min(step + after + 1, total)  # the schedule was built for the original length
    parts.limit = f"replay to step {parts.total_steps - 1}"
    trainer = Trainer(cfg, parts, ckpt, resumed)
    batches: list[dict[str, Any]] = []
    real_step = trainer.train_step

    def recorded(*args: Any, **kwargs: Any) -> Any:
        loop = trainer.loop
        at, epoch, first = loop.step, loop.epoch, loop.batch
        result = real_step(*args, **kwargs)
        if loop.step > at:
            batches.append({"step": at, "epoch": epoch, "batches": list(range(first, loop.batch))})
        return result

    trainer.train_step = recorded  # type: ignore[method-assign]
    summary = trainer.fit()
    report = _report(_Replayed(run_dir, target, step, start, source, batches, summary, str(parts.device), same_cadence))
    (target / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (target / "report.md").write_text(_markdown(report), encoding="utf-8")
    if not quiet:
        print(_text(report), flush=True)
    return report


def _replay_config(config: dict[str, Any], device: str | None, every: int | None = 1) -> dict[str, Any]:
    config = json.loads(json.dumps(config))  # a deep copy of plain values
    if every is not None:
        config["stats"]["every"] = every
    guard = config["guard"]
    guard["spike"].update(action="log", checkpoint=False)
    if guard.get("nan_policy") in ("raise", "rollback"):
        guard["nan_policy"] = "warn"
    guard.setdefault("forensics", {})
    if not guard["forensics"].get("window"):
        guard["forensics"]["window"] = 32
    trainer = config["trainer"]
    trainer.update(progress=False, checkpoint_every=None, save_records=False)
    if device is not None:
        trainer["device"] = device
    config["logger"]["_target_"] = None
    config["resume"] = None
    _relink_data(config["data"])
    return config


def _relink_data(data: dict[str, Any]) -> None:
    """A checkpoint keeps the config resolved: the data option's own keys (``data.p``) are no longer interpolated
    by ``data.dataset`` (``${..p}``), which the data check reads as unused. Link them again by value."""
    from hookexp.run.loaders import COMMON_KEYS

    dataset = data.get("dataset")
    if not isinstance(dataset, dict):
        return
    for key, value in data.items():
        if key in COMMON_KEYS or isinstance(value, (dict, list)):
            continue
        for name, given in dataset.items():
            if name == key and given == value:
                dataset[name] = "${.." + key + "}"


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@dataclass
class _Replayed:
    """What a replay ran: from ``source`` (step ``start``) into ``target``, the batches of each step, its summary."""

    run_dir: Path
    target: Path
    step: int
    start: int
    source: Path
    batches: list[dict[str, Any]]
    summary: dict[str, Any]
    device: str
    same_cadence: bool


def _report(r: _Replayed) -> dict[str, Any]:
    run_dir, target, step, start, source = r.run_dir, r.target, r.step, r.start, r.source
    batches, summary, device, same_cadence = r.batches, r.summary, r.device, r.same_cadence
    logged = [r for r in _read(run_dir / "metrics.jsonl") if any(k.startswith("train/") for k in r)]
    replayed = {r["trainer/step"]: r for r in _read(target / "metrics.jsonl") if any(k.startswith("train/") for k in r)}
    last = max(replayed) if replayed else start - 1
    # a rollback at step E: the run's lines after E are the re-done steps (other batches), not this trajectory's
    rolled = [r["trainer/step"] for r in _read(run_dir / "spikes.jsonl") if r.get("rolled_back")
              and start <= r["trainer/step"]]
    comparable = min([last, *rolled])
    compared, periods, first_diff = [], [], None
    previous = None
    for row in logged:
        s = row["trainer/step"]
        period_start = (previous + 1) if previous is not None else 0
        previous = s
        if s < start or s > comparable:
            continue
        if not same_cadence and (period_start != s or period_start < start):
            periods.append({"step": s, "steps": s - period_start + 1})
            continue
        mine = replayed.get(s, {})
        for key, value in row.items():
            if key in ("trainer/step", "epoch") or key.startswith("perf/") or not isinstance(value, (int, float)):
                continue
            if key not in mine:
                continue
            equal = _same(value, mine[key])
            compared.append({"step": s, "key": key, "logged": value, "replayed": mine[key], "equal": equal})
            if not equal and first_diff is None:
                first_diff = compared[-1]
    reproduced = bool(compared) and first_diff is None
    if not compared:
        verdict = ("nothing to compare: the run logged no single step in the replayed range (log steps every "
                   "stats.every steps describe several steps each)")
    elif reproduced:
        verdict = f"reproduced exactly: {len(compared)} logged values, bitwise equal"
    else:
        verdict = (f"NOT reproduced: {first_diff['key']} at step {first_diff['step']} was {first_diff['logged']!r}, "
                   f"the replay gives {first_diff['replayed']!r}. A nondeterministic op (set "
                   "repro.deterministic=true; on a GPU: atomics, cuBLAS workspaces) or the hardware (another device "
                   "than the run's, or silent data corruption)")
    spikes = _read(target / "spikes.jsonl")
    near = sorted(spikes, key=lambda r: abs(r["trainer/step"] - step))
    first = near[0].get("first", []) if near else []
    first_from = "replay"
    if not first:  # too little history before the spike in the replay: what the run's forensics said
        logged_spikes = [r for r in _read(run_dir / "spikes.jsonl") if r.get("trainer/step") == step]
        first = logged_spikes[0].get("first", []) if logged_spikes else []
        first_from = "run" if first else "none"
    return {
        "run_dir": str(run_dir), "step": step, "checkpoint": str(source), "checkpoint_step": start,
        "replayed_steps": [start, last], "device": device, "replay_dir": str(target),
        "reproduced": reproduced, "verdict": verdict, "compared_through": comparable, "compared": len(compared),
        "first_difference": first_diff, "periods_not_compared": periods,
        "spikes": [{k: r.get(k) for k in ("trainer/step", "metric", "value", "median")} for r in spikes],
        "first": first, "first_from": first_from,
        "first_layer": first[0]["target"] if first else summary.get("guard/first_nonfinite_module"),
        "batches": batches, "values": [c for c in compared if c["key"] == "train/loss"],
    }


def _text(report: dict[str, Any]) -> str:
    lines = [f"replay of {report['run_dir']} steps {report['replayed_steps'][0]}..{report['replayed_steps'][1]} "
             f"from {Path(report['checkpoint']).name} on {report['device']} -> {report['replay_dir']}",
             f"  {report['verdict']}"
             + (f" (through step {report['compared_through']}: the run rolled back after it)"
                if report["compared_through"] < report["replayed_steps"][1] else "")]
    if report["first"]:
        lines.append(f"  first out of range ({report['first_from']}'s forensics): " + ", ".join(
            f"{e['target']} ({e['family']}, step {e['step']})" for e in report["first"][:5]))
    for b in report["batches"]:
        lines.append(f"  step {b['step']}: epoch {b['epoch']}, batches {b['batches']}")
    return "\n".join(lines)


def _markdown(report: dict[str, Any]) -> str:
    rows = "\n".join(f"| {c['step']} | {c['logged']!r} | {c['replayed']!r} | {'yes' if c['equal'] else 'NO'} |"
                     for c in report["values"])
    firsts = "\n".join(f"| {i + 1} | {e['target']} | {e['family']} | {e['step']} | {e.get('score')} |"
                       for i, e in enumerate(report["first"]))
    batches = "\n".join(f"| {b['step']} | {b['epoch']} | {b['batches']} |" for b in report["batches"])
    return (f"# Replay of step {report['step']}\n\nRun: `{report['run_dir']}`; from `{report['checkpoint']}` "
            f"(step {report['checkpoint_step']}) on {report['device']}, steps {report['replayed_steps'][0]}.."
            f"{report['replayed_steps'][1]}.\n\n**{report['verdict']}.**\n\n"
            f"## train/loss, logged and replayed\n\n| step | logged | replayed | equal |\n|---|---|---|---|\n{rows}\n\n"
            f"## First out of range\n\n| # | target | family | step | score |\n|---|---|---|---|---|\n{firsts}\n\n"
            f"## Batches\n\n| step | epoch | batches |\n|---|---|---|\n{batches}\n")


def main(argv: list[str] | None = None) -> int:
    """``hookexp replay RUN_DIR --step N``: 0 when the replay reproduces the logged values, 1 when it does not,
    2 on an error (printed as one paragraph)."""
    parser = argparse.ArgumentParser(prog="hookexp replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (hydra.run.dir of the run)")
    parser.add_argument("--step", type=int, required=True, help="the step to replay (e.g. a spike's trainer/step)")
    parser.add_argument("--after", type=int, default=2, help="steps replayed after it (default 2)")
    parser.add_argument("--device", default=None, help="cpu | cuda | ...: where to replay (default: the run's)")
    parser.add_argument("--every", default="1", help="the replay's stats.every (default 1: every step); run: the "
                        "run's own, so that its multi-step log lines are compared too")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.every != "run" and not (args.every.isdigit() and int(args.every) >= 1):
        parser.error(f"--every: a whole number of at least 1, or run; got {args.every!r}")
    try:
        report = replay(args.run_dir, args.step, ReplayOptions(
            after=args.after, every=None if args.every == "run" else int(args.every), device=args.device))
    except HookexpError as e:
        print(f"hookexp replay: {e}", file=sys.stderr)
        return 2
    return 0 if report["reproduced"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
