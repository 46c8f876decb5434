"""``hookexp report DIR [DIR ...]``: the table (``report.md``) and plot (``report.png``) of a sweep or a set
of runs, with steps to reach a target (``--reach``) and the coordinate check of a width sweep (``--coord``).
``HELP`` is the full description ``--help`` prints; docs/sweeps.md has the recipes."""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from hookexp.analysis.plots import Metrics, coord_figure, curves_figure, read_metrics, save, short_labels
from hookexp.errors import ConfigError, did_you_mean
from hookexp.goals import Reach

HELP = """``hookexp report DIR [DIR ...]``: the table and plot of a sweep or a set of runs.

Finds every job directory under the given directories (one with ``manifest.json`` or, for a job that
failed before it wrote one, ``failure.json``), groups jobs by their command-line overrides minus the
seed, and prints and writes (``report.md``) a markdown table of mean ± std (and n) of the final and
best metrics per group, and a plot (``report.png``) of the curves of each group. Jobs that failed or
did not finish are listed with their reason, never averaged.

Steps to reach (``--reach val/acc=0.95``, repeatable or comma-separated): per job, the first
``trainer/step`` whose logged value is at or past the target: ``>=`` for metrics that grow, ``<=`` for
metrics whose name ends in loss, ppl, perplexity or mse; write ``--reach val/loss<=0.1`` or
``--reach train/acc>=0.9`` to say the direction yourself. Its resolution is how often the metric is
logged (``trainer.eval_every`` for val/ metrics). Per group: mean ± sample std (n - 1) over the jobs
that reached it, with "k of n reached"; a job that never reached it is counted in n and shown with the
best value it got, never averaged in.

Plot: one panel per metric (``--curves``, plus each ``--reach`` metric with its target dashed); y on a
log axis for loss-like metrics and norms, where the band is the geometric mean ×/÷ the geometric std
(it never falls to the bottom of the axis); elsewhere mean ± std clipped to the jobs' range; a group of
one job draws no band. ``--logx`` puts steps on a log axis (step 0 is not drawn).

Coordinate check (``--coord``; Yang et al. 2021, the ``mup`` README): the jobs are a width sweep (the width is
the override of the first ``--width`` key a job has: ``model.width`` or ``model.d_model``), grouped by their
overrides minus the width and the seed. Per group, layer, step and width: the mean over seeds of each layer's
mean |x| (``act/<layer>/abs_mean``, logged with ``stats.activations`` and ``stats.every=1``); the plot draws it
against the width, log-log, one panel per step and one row per group; the table gives per layer the slope of
the least-squares line through log(mean |x|) against log(width) at the group's last step (0: flat, as under
µP; 1: growing like the width). ``--max-slope X`` exits with status 1 and a one-line message naming the layer
when a slope is above X or cannot be computed (a value NaN, Inf or 0): the check a model's CI can run.

Examples:
  hookexp report multirun/2026-11-22/10-00-00
  hookexp report multirun/2026-11-22/10-00-00 --reach val/acc=0.95 --logx --out reports/grokfast
  hookexp report multirun/2026-11-22/10-00-00 --coord --max-slope 0.2
"""

METRICS = ("val/acc", "val/acc_best", "val/loss", "train/loss", "train/acc")
SPIKES = "spikes"  # a column of the table: the lines of a job's spikes.jsonl (the spikes guard.spike found)
CURVES = ("train/loss", "val/acc")
# what does not change a job's training: the seed, where it ran and logged, and how it was started (a resumed job,
# resume=true or resume=PATH, and +overwrite=true, belong with their sweep's group)
IGNORED_OVERRIDES = ("seed=", "hydra.", "logger.group=", "logger.name=", "trainer.progress=", "resume=", "overwrite=")
WIDTH_KEYS = ("model.width", "model.d_model")


def many(n: int, noun: str) -> str:
    """``1 group``, ``3 groups``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def parse_reach(texts: Iterable[str | Reach]) -> list[Reach]:
    """``--reach`` values, each one target or a comma-separated list of them."""
    out: list[Reach] = []
    for text in texts:
        out += [text] if isinstance(text, Reach) else [Reach.parse(t) for t in text.split(",") if t.strip()]
    return list(dict.fromkeys(out))


@dataclass
class Job:
    path: Path
    overrides: list[str]
    summary: dict[str, Any] | None
    error: str | None = None
    root: Path | None = None
    width: int | None = None  # --coord: the job's width override
    ignored: tuple[str, ...] = ()  # override prefixes that do not define its group, besides IGNORED_OVERRIDES
    _metrics: Metrics | None = field(default=None, repr=False)

    @property
    def metrics(self) -> Metrics:
        """metrics.jsonl's rows, read once; a torn last line (a killed job) is skipped and counted."""
        if self._metrics is None:
            self._metrics = read_metrics(self.path / "metrics.jsonl")
        return self._metrics

    def curve(self, metric: str) -> dict[int, float]:
        return self.metrics.series(metric)

    def value(self, metric: str) -> Any:
        """The metric from summary.json, else its last logged value in metrics.jsonl (``spikes``: the number of
        spikes in spikes.jsonl)."""
        if metric == SPIKES:
            return self.spikes
        if self.summary and metric in self.summary:
            return self.summary[metric]
        last = self.curve(metric)
        return last[max(last)] if last else None

    def first_step(self, target: Reach) -> int | None:
        """The first trainer/step at which the target holds; None if it never does."""
        return min((s for s, v in self.curve(target.metric).items() if target.holds(v)), default=None)

    def best(self, target: Reach) -> float | None:
        """The best finite value logged (max for >=, min for <=): what a job that never reached got to."""
        values = [v for v in self.curve(target.metric).values() if math.isfinite(v)]
        return (max if target.op == ">=" else min)(values) if values else None

    @property
    def spikes(self) -> int | None:
        """The spikes the job's spike recorder found (lines of spikes.jsonl); None without a spike recorder."""
        path = self.path / "spikes.jsonl"
        if not path.exists():
            return 0 if self.summary and "guard/spikes" in self.summary else None
        return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())

    @property
    def kept(self) -> list[str]:
        """The overrides that define the job's group: all but the seed and run bookkeeping."""
        return sorted(o for o in self.overrides if not o.lstrip("+").startswith((*IGNORED_OVERRIDES, *self.ignored)))

    def group(self, common: set[str]) -> str:
        """The group's name: the kept overrides that not every job shares, in the order they were given."""
        kept = set(self.kept) - common
        return " ".join(dict.fromkeys(o for o in self.overrides if o in kept)) or "(common overrides only)"

    @property
    def seed(self) -> str:
        return next((o.split("=", 1)[1] for o in self.overrides if o.startswith("seed=")), "0")

    @property
    def finished(self) -> bool:
        return self.summary is not None and self.summary.get("status") == "finished"

    @property
    def shown_path(self) -> str:
        try:
            return str(self.path.relative_to(self.root)) if self.root else str(self.path)
        except ValueError:
            return str(self.path)


@dataclass
class Group:
    name: str
    jobs: list[Job] = field(default_factory=list)

    def values(self, metric: str) -> list[float]:
        out = []
        for job in self.jobs:
            v = job.value(metric)
            if isinstance(v, (int, float)) and math.isfinite(v):
                out.append(float(v))
        return out

    def steps_to(self, target: Reach) -> list[int | None]:
        """Per job, the first step at which the target holds (None: never)."""
        return [job.first_step(target) for job in self.jobs]


def _overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if path.exists():
        return [str(o) for o in (yaml.safe_load(path.read_text()) or [])]
    if (job_dir / "failure.json").exists():
        return list(json.loads((job_dir / "failure.json").read_text())["overrides"])
    manifest = json.loads((job_dir / "manifest.json").read_text())
    return [a for a in manifest.get("command", [])[1:] if "=" in a and not a.startswith("-")]


def find_jobs(roots: list[Path]) -> list[Job]:
    """Every job directory under the roots, each once (a sweep and one of its jobs both given count it once)."""
    jobs, seen = [], set()
    for root in roots:
        if not root.is_dir():
            raise ConfigError(f"{root} is not a directory. Pass a multirun directory (multirun/DATE/TIME) or run "
                              "directories.", key="DIR")
        markers = [*root.rglob("manifest.json"), *root.rglob("failure.json")]
        for job_dir in sorted({m.parent for m in markers}, key=lambda p: (len(p.parts), _natural(str(p)))):
            if job_dir.resolve() in seen or _is_replay(job_dir):
                continue
            seen.add(job_dir.resolve())
            summary_path = job_dir / "summary.json"
            summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
            error = None
            failure = job_dir / "failure.json"
            if failure.exists():
                error = json.loads(failure.read_text()).get("error")
            elif summary is None:
                error = "no summary.json: the job did not finish (killed, or still running)"
            elif summary.get("status") != "finished":
                error = f"status {summary.get('status')!r}"
            jobs.append(Job(job_dir, _overrides(job_dir), summary, error, root))
    return jobs


def _is_replay(job_dir: Path) -> bool:
    """A replay's directory inside a run (``RUN/replay/step_N``, :mod:`hookexp.run.replay`): not a job."""
    return job_dir.parent.name == "replay" and (job_dir.parent.parent / "manifest.json").exists()


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def reach_cell(steps: Sequence[int | None]) -> str:
    """``mean ± std (k of n reached)`` over the jobs that reached the target; the others only counted."""
    reached = [s for s in steps if s is not None]
    counted = f"({len(reached)} of {len(steps)} reached)"
    if not reached:
        return f"never {counted}"
    if len(reached) == 1:
        return f"{reached[0]} {counted}"
    return f"{statistics.mean(reached):.1f} ± {statistics.stdev(reached):.1f} {counted}"


def table(groups: list[Group], metrics: tuple[str, ...] = METRICS, reach: Sequence[Reach] = ()) -> str:
    header = [*metrics, *(f"steps to {t}" for t in reach)]
    lines = ["| group | n | " + " | ".join(header) + " |", "|---|---|" + "---|" * len(header)]
    for g in groups:
        cells = [mean_std(g.values(m)) for m in metrics] + [reach_cell(g.steps_to(t)) for t in reach]
        lines.append(f"| {g.name} | {len(g.jobs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reach_table(groups: list[Group], reach: Sequence[Reach]) -> str:
    """Per job: the step each target was reached at, or never (with the best value the job got)."""
    lines = ["| group | seed | job | " + " | ".join(str(t) for t in reach) + " |",
             "|---|---|---|" + "---|" * len(reach)]
    for g in groups:
        for job in g.jobs:
            cells = []
            for t in reach:
                step, best = job.first_step(t), job.best(t)
                cells.append(str(step) if step is not None else
                             f"never (best {best:.4g})" if best is not None else "never (not logged)")
            lines.append(f"| {g.name} | {job.seed} | `{job.shown_path}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _natural(text: str) -> list[Any]:
    """Sort ``n_layer=16`` after ``n_layer=4`` and ``lr=0.01`` before ``lr=0.1``: numbers compare as numbers
    (re.split with a group alternates text and numbers, so like compares with like)."""
    parts = re.split(r"(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", text)
    return [(float(t), t) if i % 2 else t for i, t in enumerate(parts)]


def _check_names(wanted: Iterable[str], logged: set[str], optional: set[str], key: str) -> None:
    """A metric a user asked for that no job logged is a typo until shown otherwise: say so, with the
    closest names. The default columns and curves may be absent (another task logs other metrics)."""
    for name in dict.fromkeys(wanted):
        if name not in logged and name not in optional:
            known = sorted(k for k in logged if not k.startswith(("grad/", "act/", "param/", "update/", "opt/",
                                                                   "hook/", "perf/")))
            raise ConfigError(f"no job under the given directories logged a metric named {name!r}."
                              f"{did_you_mean(name, logged)} The jobs logged: {', '.join(known[:12])}"
                              f"{', ...' if len(known) > 12 else ''}.", key=key)


def _prepare_out(out_dir: Path) -> Path:
    """Create the output folder (and its parents); one paragraph, not a traceback, when that cannot be."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".hookexp-report-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write the report to {str(out_dir)!r}: {e.strerror or e}. Pass a folder you can "
                          "write to (it is created if missing), e.g. --out reports/my_sweep.", key="--out") from e
    return out_dir


def group_jobs(jobs: list[Job], members: list[Job]) -> tuple[list[Group], set[str]]:
    """``members`` grouped by their kept overrides minus those every one of ``jobs`` shares (the same overrides in
    another order are the same group), in natural order of their names; and those common overrides."""
    common = set.intersection(*(set(j.kept) for j in jobs)) if len(jobs) > 1 else set()
    by_key: dict[frozenset[str], Group] = {}
    for job in members:
        by_key.setdefault(frozenset(job.kept) - common, Group(job.group(common))).jobs.append(job)
    return sorted(by_key.values(), key=lambda g: _natural(g.name)), common


def report(roots: list[Path], out_dir: Path | None = None, metrics: tuple[str, ...] = METRICS,
           curves: tuple[str, ...] = CURVES, reach: Sequence[str | Reach] = (),
           logx: bool = False) -> tuple[str, list[Group], list[Job]]:
    """Build the report; returns the markdown, the groups (finished jobs) and the jobs left out.
    Bad input (no jobs, a metric no job logged, an output folder that cannot be written) raises ConfigError."""
    roots = [Path(r) for r in roots]
    targets = parse_reach(reach)
    jobs = find_jobs(roots)
    if not jobs:
        raise ConfigError(f"no job directories under {', '.join(map(str, roots))}: a job directory holds "
                          "manifest.json (or failure.json for a job that failed). Pass a multirun directory "
                          "(multirun/DATE/TIME) or the run directories themselves.", key="DIR")
    groups, common = group_jobs(jobs, [j for j in jobs if j.finished])
    left_out = [j for j in jobs if not j.finished]
    finished = [j for g in groups for j in g.jobs]
    logged = {k for j in finished for k in j.metrics.names()}
    if finished:
        _check_names([t.metric for t in targets], logged, set(), "--reach")
        _check_names(curves, logged, set(CURVES), "--curves")
        _check_names(metrics, logged | {k for j in finished for k in j.summary or {}} | {SPIKES},
                     set(METRICS), "--metrics")
        metrics = tuple(m for m in metrics if m not in METRICS or any(g.values(m) for g in groups))
        if SPIKES not in metrics and any(j.spikes is not None for j in finished):
            metrics = (*metrics, SPIKES)  # runs with the spike recorder: how many spikes each found
    out_dir = _prepare_out(Path(out_dir) if out_dir is not None else roots[0])

    text = [f"# hookexp report: {', '.join(map(str, roots))}", "",
            f"{many(len(finished), 'finished job')} in {many(len(groups), 'group')} (overrides minus the seed); "
            "final and best metrics, mean ± std over the group's jobs."]
    if common:
        text += ["", "Common to every job: `" + " ".join(sorted(common)) + "`"]
    text += ["", table(groups, metrics, targets)]
    if targets:
        text += ["", "Steps to reach: the first `trainer/step` at which the logged metric is at or past the target "
                 "(resolution: how often it is logged); mean ± sample std over the jobs that reached it, and "
                 "how many of the group's jobs did. Jobs that never reached it are counted, never averaged in.",
                 "", reach_table(groups, targets)]
    torn = [j for j in jobs if j.metrics.skipped]
    if torn:
        text += ["", "Unreadable lines skipped (a job killed while writing leaves a torn last line):", ""]
        text += [f"- `{j.shown_path}/metrics.jsonl`: {j.metrics.skipped} line(s)" for j in torn]
    if left_out:
        text += ["", f"Left out ({len(left_out)} failed or incomplete):", ""]
        for j in left_out:
            steps = [r["trainer/step"] for r in j.metrics.rows if isinstance(r.get("trainer/step"), int)]
            last = f" (last logged trainer/step {max(steps)})" if steps else ""
            group = j.group(common) + ", " if set(j.kept) - common else ""
            text.append(f"- `{j.shown_path}` ({group}seed {j.seed}): {j.error}{last}")
    markdown = "\n".join(text) + "\n"
    (out_dir / "report.md").write_text(markdown)
    if groups:
        plot(groups, out_dir / "report.png", tuple(dict.fromkeys([*curves, *(t.metric for t in targets)])),
             logx=logx, reach=targets)
    return markdown, groups, left_out


def plot(groups: list[Group], out: Path, curves: tuple[str, ...] = CURVES, logx: bool = False,
         reach: Sequence[Reach] = ()):
    """Write report.png; returns the :class:`hookexp.analysis.plots.Panel` s as drawn (what tests check)."""
    labels = short_labels([g.name for g in groups])
    data = {m: [(f"{label} (n={len(g.jobs)})", [j.curve(m) for j in g.jobs]) for label, g in
                zip(labels, groups, strict=True)] for m in curves}
    n = {len(g.jobs) for g in groups}
    spread = "one job per group" if n == {1} else "band: spread over each group's jobs (seeds)"
    fig, panels = curves_figure(data, logx=logx, thresholds={t.metric: t.value for t in reach},
                                title=f"{many(sum(map(len, (g.jobs for g in groups))), 'job')} in "
                                f"{many(len(groups), 'group')}; "
                                f"{spread}")
    save(fig, out)
    return panels


# ------------------------------------------------------------------------------------ coordinate check


@dataclass
class Coord:
    """One group of a coordinate check: ``values[layer][step][width]``, the mean over the group's seeds of the
    layer's mean |x|; ``slopes[layer]``, the log-log slope against width at ``step``, the last step logged."""

    name: str
    jobs: list[Job]
    values: dict[str, dict[int, dict[int, float]]]
    step: int
    slopes: dict[str, float]


def log_slope(widths: Sequence[float], values: Sequence[float]) -> float:
    """The least-squares slope of log(value) against log(width); NaN with fewer than two widths or any value
    that is not positive and finite."""
    if len(widths) < 2 or not all(math.isfinite(v) and v > 0 for v in values):
        return math.nan
    return float(np.polyfit(np.log(np.asarray(widths, dtype=float)), np.log(np.asarray(values, dtype=float)), 1)[0])


def _width(job: Job, keys: Sequence[str]) -> int | None:
    """The job's width: the integer value of its override of the first of ``keys`` it has."""
    given = dict(o.lstrip("+").split("=", 1) for o in job.overrides if "=" in o)
    for key in keys:
        if key in given:
            try:
                return int(given[key])
            except ValueError:
                return None
    return None


def _coord_values(jobs: list[Job], stat: str = "abs_mean") -> tuple[dict[str, dict[int, dict[int, float]]], int]:
    """``{layer: {step: {width: mean over the jobs of that width}}}`` and the last step every job logged."""
    per: dict[str, dict[int, dict[int, list[float]]]] = {}
    last = []
    for job in jobs:
        layers = [k[4:-len(stat) - 1] for k in dict.fromkeys(k for r in job.metrics.rows for k in r)
                  if k.startswith("act/") and k.endswith(f"/{stat}")]
        steps = set()
        for layer in layers:
            for step, value in job.curve(f"act/{layer}/{stat}").items():
                per.setdefault(layer, {}).setdefault(step, {}).setdefault(job.width, []).append(value)
                steps.add(step)
        last.append(max(steps, default=-1))
    values = {layer: {step: {w: float(np.mean(v)) for w, v in sorted(by_w.items())} for step, by_w in
                      sorted(by_step.items())} for layer, by_step in per.items()}
    return values, min(last, default=-1)


def coord_check(roots: list[Path], out_dir: Path | None = None, width_keys: Sequence[str] = WIDTH_KEYS,
                max_slope: float | None = None) -> tuple[str, list[Coord], list[tuple[Coord, str, float]]]:
    """The coordinate check of a width sweep (module docstring): writes report.md and report.png; returns the
    markdown, the groups and the layers over ``max_slope`` as ``(group, layer, slope)``, steepest first (a slope
    that could not be computed, NaN, counts as over). Bad input raises ConfigError."""
    roots = [Path(r) for r in roots]
    jobs = find_jobs(roots)
    for job in jobs:
        job.width, job.ignored = _width(job, width_keys), tuple(f"{k}=" for k in width_keys)
    used = [j for j in jobs if j.finished and j.width is not None]
    if not used:
        raise ConfigError(f"no finished job under {', '.join(map(str, roots))} has a width override "
                          f"({' or '.join(width_keys)}=N). Pass the directory of a width sweep, e.g. "
                          "python -m hookexp -m experiment=coord_check model.width=64,128,256, or name the width's "
                          "key with --width.", key="--width")
    if not any(k.startswith("act/") and k.endswith("/abs_mean") for j in used for k in j.metrics.names()):
        raise ConfigError("no job logged act/<layer>/abs_mean: run the sweep with stats.activations set to the "
                          "layers to check (and stats.every=1), as experiment=coord_check does.", key="DIR")
    by_overrides, common = group_jobs(used, used)  # minus the width and the seed
    groups = []
    for group in by_overrides:
        values, step = _coord_values(group.jobs)
        slopes = {}
        for layer, by_step in values.items():
            at = by_step.get(step, {})
            slopes[layer] = log_slope(list(at), list(at.values()))
        groups.append(Coord(group.name, group.jobs, values, step, slopes))
    over = [(g, layer, v) for g in groups for layer, v in g.slopes.items()
            if max_slope is not None and not v <= max_slope]
    over.sort(key=lambda t: -t[2] if math.isfinite(t[2]) else -math.inf)
    left_out = [j for j in jobs if j not in used]
    out_dir = _prepare_out(Path(out_dir) if out_dir is not None else roots[0])

    text = [f"# hookexp coordinate check: {', '.join(map(str, roots))}", "",
            f"{many(len(used), 'finished job')} in {many(len(groups), 'group')} (overrides minus the width and the "
            "seed). Mean |x| "
            "of each layer's output (`act/<layer>/abs_mean`), averaged over the group's seeds; slope: least squares "
            "of log(mean |x|) on log(width) at the group's last step (0: flat, as under µP; 1: grows like the "
            "width)."]
    if common:
        text += ["", "Common to every job: `" + " ".join(sorted(common)) + "`"]
    text += ["", r"| group | layer | seeds | widths | step | slope | mean \|x\| at the smallest → largest width |",
             "|---|---|---|---|---|---|---|"]
    for g in groups:
        seeds = len({j.seed for j in g.jobs})
        for layer, value in g.slopes.items():
            at = g.values[layer].get(g.step, {})
            widths = ", ".join(map(str, at))
            ends = f"{at[min(at)]:.4g} → {at[max(at)]:.4g}" if at else "-"
            text.append(f"| {g.name} | {layer} | {seeds} | {widths} | {g.step} | {value:.3f} | {ends} |")
    if max_slope is not None:
        text += ["", f"`--max-slope {max_slope:g}`: " + (
            "passed." if not over else f"{len(over)} layer(s) over: " +
            ", ".join(f"{layer} ({g.name}: {v:.3f})" for g, layer, v in over) + ".")]
    if left_out:
        text += ["", f"Left out ({len(left_out)}: failed, incomplete, or without a width override):", ""]
        text += [f"- `{j.shown_path}`: {j.error or 'no width override (' + ' or '.join(width_keys) + ')'}"
                 for j in left_out]
    markdown = "\n".join(text) + "\n"
    (out_dir / "report.md").write_text(markdown)
    figure = coord_figure([(g.name, g.values) for g in groups],
                          title="mean |x| of each layer's output against width (mean over seeds), per step")
    save(figure, out_dir / "report.png")
    return markdown, groups, over


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hookexp report", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="a multirun directory, or run directories")
    parser.add_argument("--out", type=Path, default=None, help="where report.md and report.png go, created if "
                        "missing (default: the first DIR)")
    parser.add_argument("--metrics", default=",".join(METRICS), help="table columns (final values), comma-separated")
    parser.add_argument("--curves", default=",".join(CURVES), help="plotted metrics, comma-separated")
    parser.add_argument("--reach", action="append", default=[], metavar="METRIC=VALUE",
                        help="steps to reach a value, per job and per group; repeatable or comma-separated; "
                        "METRIC>=VALUE or METRIC<=VALUE gives the direction")
    parser.add_argument("--logx", action="store_true", help="steps on a log axis")
    parser.add_argument("--coord", action="store_true", help="coordinate check of a width sweep: mean |x| per "
                        "layer against width, and each layer's log-log slope")
    parser.add_argument("--width", default=",".join(WIDTH_KEYS), help="--coord: the override keys that give a "
                        "job's width, first found wins, comma-separated")
    parser.add_argument("--max-slope", type=float, default=None, metavar="X", help="--coord: exit 1 when a "
                        "layer's slope is above X")
    args = parser.parse_args(argv)
    split = (lambda s: tuple(x.strip() for x in s.split(",") if x.strip()))  # noqa: E731
    if args.max_slope is not None and not args.coord:
        parser.error("--max-slope is a bound of the coordinate check: add --coord.")
    if args.coord:
        try:
            markdown, _, over = coord_check(args.dirs, args.out, split(args.width), args.max_slope)
        except ConfigError as e:
            parser.error(str(e))
        print(markdown)
        print(f"wrote {(args.out or args.dirs[0]) / 'report.md'} and report.png", file=sys.stderr)
        if over:
            group, layer, value = over[0]
            more = f" (and {len(over) - 1} more layers)" if len(over) > 1 else ""
            sys.exit(f"coordinate check failed: layer {layer} of group {group.name!r} has slope {value:.3f} above "
                     f"--max-slope {args.max_slope:g}{more}")
        return
    try:
        markdown, groups, left_out = report(args.dirs, args.out, split(args.metrics), split(args.curves), args.reach,
                                            args.logx)
    except ConfigError as e:
        parser.error(str(e))
    print(markdown)
    print(f"wrote {(args.out or args.dirs[0]) / 'report.md'} and report.png", file=sys.stderr)
    if not groups:  # a script running a sweep and its report learns that nothing finished
        sys.exit(f"hookexp report: no job finished ({many(len(left_out), 'job')} failed or unfinished, listed in "
                 "report.md with their errors): nothing to compare.")


if __name__ == "__main__":
    main()
