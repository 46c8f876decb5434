"""``python -m hookexp.report DIR [DIR ...]``: the table and plot of a sweep or a set of runs.

Finds every job directory under the given directories (one with ``manifest.json`` or, for a job that
failed before it wrote one, ``failure.json``), groups
jobs by their command-line overrides minus the seed, and prints and writes (``report.md``) a markdown
table of mean ± std (and n) of the final and best metrics per group, and a plot (``report.png``) of
the training curves: the mean with a ± std band per group. Jobs that failed or did not finish are
listed with their reason, never averaged.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

METRICS = ("val/acc", "val/acc_best", "val/loss", "train/loss", "train/acc")
CURVES = ("train/loss", "val/acc")
IGNORED_OVERRIDES = ("seed=", "hydra.", "logger.group=", "logger.name=", "trainer.progress=")


@dataclass
class Job:
    path: Path
    overrides: list[str]
    summary: dict[str, Any] | None
    error: str | None = None

    def value(self, metric: str) -> Any:
        """The metric from summary.json, else its last logged value in metrics.jsonl."""
        if self.summary and metric in self.summary:
            return self.summary[metric]
        last = _curve(self, metric)
        return last[max(last)] if last else None

    @property
    def kept(self) -> list[str]:
        """The overrides that define the job's group: all but the seed and run bookkeeping."""
        return sorted(o for o in self.overrides if not o.startswith(IGNORED_OVERRIDES))

    def group(self, common: set[str]) -> str:
        return " ".join(o for o in self.kept if o not in common) or "(common overrides only)"

    @property
    def seed(self) -> str:
        return next((o.split("=", 1)[1] for o in self.overrides if o.startswith("seed=")), "0")

    @property
    def finished(self) -> bool:
        return self.summary is not None and self.summary.get("status") == "finished"


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


def _overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if path.exists():
        return [str(o) for o in (yaml.safe_load(path.read_text()) or [])]
    if (job_dir / "failure.json").exists():
        return list(json.loads((job_dir / "failure.json").read_text())["overrides"])
    manifest = json.loads((job_dir / "manifest.json").read_text())
    return [a for a in manifest.get("command", [])[1:] if "=" in a and not a.startswith("-")]


def find_jobs(roots: list[Path]) -> list[Job]:
    jobs = []
    for root in roots:
        if not root.exists():
            raise SystemExit(f"hookexp.report: error: {root} does not exist.")
        markers = [*root.rglob("manifest.json"), *root.rglob("failure.json")]
        for job_dir in sorted({m.parent for m in markers}, key=lambda p: (len(p.parts), str(p))):
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
            jobs.append(Job(job_dir, _overrides(job_dir), summary, error))
    return jobs


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def table(groups: list[Group], metrics: tuple[str, ...] = METRICS) -> str:
    lines = ["| group | n | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    for g in groups:
        lines.append(f"| {g.name} | {len(g.jobs)} | " + " | ".join(mean_std(g.values(m)) for m in metrics) + " |")
    return "\n".join(lines)


def _curve(job: Job, metric: str) -> dict[int, float]:
    out: dict[int, float] = {}
    path = job.path / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        if isinstance(row.get(metric), (int, float)):
            out[row["trainer/step"]] = row[metric]
    return out


def plot(groups: list[Group], out: Path, curves: tuple[str, ...] = CURVES) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), dpi=100, squeeze=False)
    for ax, metric in zip(axes[0], curves, strict=True):
        for g in groups:
            curves = [_curve(j, metric) for j in g.jobs]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            mean = [statistics.mean(c[s] for c in curves) for s in steps]
            std = [statistics.stdev(c[s] for c in curves) if len(curves) > 1 else 0.0 for s in steps]
            (line,) = ax.plot(steps, mean, label=f"{g.name} (n={len(g.jobs)})")
            ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                            [m + s for m, s in zip(mean, std, strict=True)], color=line.get_color(), alpha=0.2)
        ax.set_xlabel("trainer/step")
        ax.set_ylabel(metric)
        if metric.endswith("loss"):
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("mean ± std over seeds")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def report(roots: list[Path], out_dir: Path | None = None, metrics: tuple[str, ...] = METRICS,
           curves: tuple[str, ...] = CURVES) -> tuple[str, list[Group], list[Job]]:
    """Build the report; returns the markdown, the groups (finished jobs) and the jobs left out."""
    jobs = find_jobs(roots)
    if not jobs:
        raise SystemExit(f"hookexp.report: error: no job directories (with manifest.json) under "
                         f"{', '.join(map(str, roots))}.")
    common = set.intersection(*(set(j.kept) for j in jobs)) if len(jobs) > 1 else set()
    by_name: dict[str, Group] = {}
    for job in jobs:
        if job.finished:
            name = job.group(common)
            by_name.setdefault(name, Group(name)).jobs.append(job)
    groups = sorted(by_name.values(), key=lambda g: g.name)
    left_out = [j for j in jobs if not j.finished]
    text = [f"# hookexp report: {', '.join(map(str, roots))}", "",
            f"{sum(len(g.jobs) for g in groups)} finished jobs in {len(groups)} groups (overrides minus the seed); "
            "final and best metrics, mean ± std over the group's jobs."]
    if common:
        text += ["", "Common to every job: `" + " ".join(sorted(common)) + "`"]
    text += ["", table(groups, metrics)]
    if left_out:
        text += ["", f"Left out ({len(left_out)} failed or incomplete):", ""]
        text += [f"- `{j.path}` ({j.group(common)}, seed {j.seed}): {j.error}" for j in left_out]
    markdown = "\n".join(text) + "\n"
    out_dir = out_dir or roots[0]
    (out_dir / "report.md").write_text(markdown)
    if groups:
        plot(groups, out_dir / "report.png", curves)
    return markdown, groups, left_out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hookexp.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="a multirun directory, or run directories")
    parser.add_argument("--out", type=Path, default=None, help="where report.md and report.png go (default: "
                        "the first directory)")
    parser.add_argument("--metrics", default=",".join(METRICS), help="table columns (final values), comma-separated")
    parser.add_argument("--curves", default=",".join(CURVES), help="plotted metrics, comma-separated")
    args = parser.parse_args(argv)
    markdown, _, _ = report(args.dirs, args.out, tuple(args.metrics.split(",")), tuple(args.curves.split(",")))
    print(markdown)
    print(f"wrote {(args.out or args.dirs[0]) / 'report.md'} and report.png", file=sys.stderr)


if __name__ == "__main__":
    main()
