"""Figures from ``metrics.jsonl``: the run's gradient-norm plot and the report's group curves (matplotlib,
headless).

Readable at scale: beyond ``LINE_PLOT_MAX`` parameters the gradient norms are a layer x step heatmap on a log
colour scale (one row per block beyond ``HEATMAP_ROWS_MAX``); zeros and non-finite values are shown, never
dropped; a spread on a log axis is geometric, on a linear one mean ± std clipped to the jobs' range; a single
job draws no band; legends sit outside the data. docs/sweeps.md and docs/statistics.md show them.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from hookexp.goals import lower_is_better

STEP = "trainer/step"
LINE_PLOT_MAX = 10  # at most this many parameters: one line each (ten distinct colours, a legend that fits)
HEATMAP_ROWS_MAX = 64  # more parameters than this: one heatmap row per block (``blocks.3``), not per parameter
ZERO_COLOUR, NONFINITE_COLOUR, MISSING_COLOUR = "white", "#d62728", "0.78"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------------------------- reading


@dataclass
class Metrics:
    """The rows of one ``metrics.jsonl``, and how many lines could not be read (a torn last line when the
    job was killed mid-write)."""

    rows: list[dict[str, Any]]
    skipped: int = 0

    def names(self) -> set[str]:
        return {k for row in self.rows for k in row}

    def series(self, metric: str) -> dict[int, float]:
        """``{trainer/step: value}`` for the rows that log ``metric``; a null (orjson's NaN/Inf) is NaN."""
        out: dict[int, float] = {}
        for row in self.rows:
            if metric in row and isinstance(row.get(STEP), int):
                value = row[metric]
                if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                    out[row[STEP]] = math.nan if value is None else float(value)
        return out


def read_metrics(path: Path) -> Metrics:
    """Every line of ``metrics.jsonl`` that parses as a JSON object; the rest are counted, not fatal."""
    rows, skipped = [], 0
    path = Path(path)
    if not path.exists():
        return Metrics([])
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:  # a torn line, a line cut inside a multi-byte character, or NaN
            try:  # written by the json module (NaN, Infinity)
                row = json.loads(line)
            except ValueError:
                skipped += 1
                continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            skipped += 1
    return Metrics(rows, skipped)


def log_y(metric: str) -> bool:
    """Loss-like metrics and norms span decades: their y axis is logarithmic."""
    return lower_is_better(metric) or metric.lower().endswith(("/norm", "_norm"))


# ------------------------------------------------------------------------------------ gradient norms


@dataclass
class GradNorms:
    """Gradient norms as a (rows x steps) matrix; NaN where a row was not logged at a step, ``nonfinite``
    where it was logged as NaN/Inf (orjson writes both as null)."""

    names: list[str]
    steps: list[int]
    values: np.ndarray
    nonfinite: np.ndarray
    grouped: bool = False  # rows are blocks (L2 over their parameters), not parameters

    @property
    def missing(self) -> np.ndarray:
        return np.isnan(self.values) & ~self.nonfinite


def grad_norms(metrics: Metrics) -> GradNorms | None:
    """The ``grad/<param>/norm`` series, rows in model order (the order the statistics logged them)."""
    names: dict[str, int] = {}
    steps: dict[int, int] = {}
    cells: list[tuple[int, int, Any]] = []
    for row in metrics.rows:
        step = row.get(STEP)
        for key, value in row.items():
            if key.startswith("grad/") and key.endswith("/norm") and isinstance(step, int):
                r = names.setdefault(key[len("grad/"):-len("/norm")], len(names))
                cells.append((r, steps.setdefault(step, len(steps)), value))
    if not names:
        return None
    order = sorted(steps)
    column = {steps[s]: i for i, s in enumerate(order)}
    values = np.full((len(names), len(order)), np.nan)
    nonfinite = np.zeros_like(values, dtype=bool)
    for r, c, value in cells:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        values[r, column[c]] = float(value) if ok else np.nan
        nonfinite[r, column[c]] = not ok
    return GradNorms(list(names), order, values, nonfinite)


def block_of(name: str) -> str:
    """The block a parameter belongs to: its name up to the first numeric part (``blocks.3.attn.qkv.weight``
    -> ``blocks.3``, ``transformer.h.11.mlp.c_fc.weight`` -> ``transformer.h.11``, ``0.weight`` -> ``0``),
    else its module (``embed.weight`` -> ``embed``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def by_block(norms: GradNorms) -> GradNorms:
    """One row per block, in model order: the L2 norm of the block's whole gradient, sqrt(sum of its
    parameters' squared norms) (exact, not an approximation); non-finite if any part is, missing if any is.
    Labels say how many parameters a block has and how many had an all-zero gradient at some step."""
    blocks: dict[str, list[int]] = {}
    for i, name in enumerate(norms.names):
        blocks.setdefault(block_of(name), []).append(i)
    values = np.stack([np.sqrt(np.sum(norms.values[rows] ** 2, axis=0)) for rows in blocks.values()])
    nonfinite = np.stack([norms.nonfinite[rows].any(axis=0) for rows in blocks.values()])
    values[nonfinite] = np.nan
    labels = []
    for b, rows in blocks.items():  # a zero parameter vanishes inside its block's norm: the label keeps it
        zero = sum(bool((norms.values[r] == 0).any()) for r in rows)
        notes = ([str(len(rows))] if len(rows) > 1 else []) + ([f"{zero} zero"] if zero else [])
        labels.append(f"{b} ({', '.join(notes)})" if notes else b)
    return GradNorms(labels, norms.steps, values, nonfinite, grouped=True)


def _edges(centres: Sequence[float]) -> np.ndarray:
    """Cell edges around (possibly irregular) step positions, so the heatmap's x axis is trainer/step."""
    c = np.asarray(centres, dtype=float)
    if len(c) == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[c[0] - (mid[0] - c[0])], mid, [c[-1] + (c[-1] - mid[-1])]])


def _positive_range(values: np.ndarray) -> tuple[float, float]:
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size == 0:
        return 0.1, 1.0
    lo, hi = float(positive.min()), float(positive.max())
    return (lo / 2, hi * 2) if lo == hi else (lo, hi)


def _mark_zeros_and_nonfinite(ax, steps: np.ndarray, zero: np.ndarray, bad: np.ndarray, colour: Any = "black",
                              lane: int = 0) -> None:
    """Zeros as triangles along the bottom edge, NaN/Inf as crosses along the top (x in data units, y in axes
    units, one lane per series so they do not hide each other): a log axis cannot place them, and they are
    what one looks for."""
    import matplotlib.transforms as mtransforms

    edge = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    if zero.any():
        ax.plot(steps[zero], np.full(zero.sum(), 0.02 + 0.025 * lane), "v", color=colour, ms=5, transform=edge,
                clip_on=False)
    if bad.any():
        ax.plot(steps[bad], np.full(bad.sum(), 0.98 - 0.025 * lane), "X", color=colour, ms=6, transform=edge,
                clip_on=False)


def _draw_lines(fig, norms: GradNorms) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    ax = fig.add_subplot()
    steps = np.asarray(norms.steps)
    lane = 0
    for i, name in enumerate(norms.names):
        v = norms.values[i]
        ok = np.isfinite(v) & (v > 0)
        zero, bad = np.isfinite(v) & (v == 0), norms.nonfinite[i]
        notes = [f"{what} at {k} of {len(v)} steps" for what, k in (("0", zero.sum()), ("NaN/Inf", bad.sum())) if k]
        (line,) = ax.plot(steps[ok], v[ok], marker="." if ok.sum() < 30 else None, linewidth=1.3,
                          label=name + (f" ({'; '.join(notes)})" if notes else ""))
        if zero.any() or bad.any():
            _mark_zeros_and_nonfinite(ax, steps, zero, bad, line.get_color(), lane)
            lane += 1
    if (np.isfinite(norms.values) & (norms.values > 0)).any():
        ax.set_yscale("log")
    ax.set_xlabel(STEP)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_ylabel("gradient L2 norm")
    ax.set_title("Gradient norm per parameter")
    ax.grid(True, which="major", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if lane:
        handles += [Line2D([], [], color="0.3", marker="v", linestyle=""), Line2D([], [], color="0.3", marker="X",
                                                                                  linestyle="")]
        labels += ["zero (bottom edge)", "NaN/Inf (top edge)"]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _draw_heatmap(fig, norms: GradNorms) -> None:
    import matplotlib as mpl
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    top, ax = fig.subplots(2, 1, sharex=True, height_ratios=[1, max(3.0, len(norms.names) / 8)])
    steps = np.asarray(norms.steps, dtype=float)
    # the strip above: the whole gradient's norm (L2 over every row), so the heatmap's columns have a scale
    finite = np.where(np.isfinite(norms.values), norms.values, 0.0)
    total = np.sqrt((finite ** 2).sum(axis=0))
    bad = norms.nonfinite.any(axis=0)
    ok = (total > 0) & ~bad
    top.plot(steps[ok], total[ok], color="black", linewidth=1.2, marker="." if ok.sum() < 30 else None)
    top.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # steps are whole numbers
    _mark_zeros_and_nonfinite(top, steps, (total == 0) & ~bad, bad, NONFINITE_COLOUR)
    if ok.any():
        top.set_yscale("log")
    top.set_ylabel("all (L2)", fontsize=8)
    top.grid(True, alpha=0.3)
    what = "block (L2 over its parameters)" if norms.grouped else "parameter"
    top.set_title(f"Gradient norm per {what}: {len(norms.names)} rows in model order", fontsize=10)

    lo, hi = _positive_range(norms.values)
    cells = norms.values.copy()
    zero = np.isfinite(cells) & (cells == 0)
    cells[zero] = lo / 10  # below vmin: drawn in the colour map's "under" colour
    cells[norms.nonfinite] = hi * 10  # above vmax: the "over" colour
    cmap = mpl.colormaps["viridis"].with_extremes(under=ZERO_COLOUR, over=NONFINITE_COLOUR, bad=MISSING_COLOUR)
    mesh = ax.pcolormesh(_edges(steps), np.arange(len(norms.names) + 1), np.ma.masked_invalid(cells),
                         norm=LogNorm(vmin=lo, vmax=hi), cmap=cmap, shading="flat")
    ax.set_ylim(len(norms.names), 0)  # the first layer on top
    every = max(1, math.ceil(len(norms.names) / HEATMAP_ROWS_MAX))
    ticks = np.arange(0, len(norms.names), every)
    ax.set_yticks(ticks + 0.5, [norms.names[i] for i in ticks], fontsize=7 if len(norms.names) > 24 else 8)
    ax.set_xlabel(STEP)
    fig.colorbar(mesh, ax=[top, ax], label="gradient L2 norm (log scale)", shrink=0.8, pad=0.01)
    shown = [(zero.any(), Patch(facecolor=ZERO_COLOUR, edgecolor="black", label="zero")),
             (norms.nonfinite.any(), Patch(facecolor=NONFINITE_COLOUR, label="NaN/Inf")),
             (norms.missing.any(), Patch(facecolor=MISSING_COLOUR, label="not logged"))]
    patches = [p for present, p in shown if present]
    if patches:
        fig.legend(handles=patches, loc="outside lower center", ncol=len(patches), fontsize=8, frameon=False)


def grad_norm_figure(metrics_path: Path, line_plot_max: int = LINE_PLOT_MAX):
    """The run's gradient-norm figure, or None when nothing was logged: a line per parameter for at most
    ``line_plot_max`` parameters, else a (parameter or block) x step heatmap on a log colour scale."""
    norms = grad_norms(read_metrics(metrics_path))
    if norms is None:
        return None
    plt = _pyplot()
    if len(norms.names) <= line_plot_max:
        fig = plt.figure(figsize=(10, 5), dpi=100, layout="constrained")
        _draw_lines(fig, norms)
        return fig
    if len(norms.names) > HEATMAP_ROWS_MAX:
        norms = by_block(norms)
    fig = plt.figure(figsize=(11, min(2.5 + 0.17 * len(norms.names), 16)), dpi=100, layout="constrained")
    _draw_heatmap(fig, norms)
    return fig


def plot_grad_norms(metrics_path: Path, out_path: Path, max_lines: int = LINE_PLOT_MAX) -> Path | None:
    """Write the run's gradient-norm figure (see :func:`grad_norm_figure`) to ``out_path``; None if nothing
    was logged."""
    fig = grad_norm_figure(Path(metrics_path), max_lines)
    if fig is None:
        return None
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)
    _pyplot().close(fig)
    return out_path


# ---------------------------------------------------------------------------------------- group curves


@dataclass
class Band:
    """What one group's curve draws: the centre line and the spread (None: a single job, no band)."""

    label: str
    x: np.ndarray
    centre: np.ndarray
    low: np.ndarray | None = None
    high: np.ndarray | None = None


@dataclass
class Panel:
    """One metric's axes as drawn."""

    metric: str
    xscale: str
    yscale: str
    bands: list[Band] = field(default_factory=list)


def spread(values: np.ndarray, log: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Centre and band of a (jobs x steps) array. On a log axis: geometric mean ×/÷ geometric std, over the
    positive values (a log axis cannot place the others); on a linear axis: mean ± sample std, clipped to the
    jobs' min and max. With one job: the values, no band."""
    v = np.asarray(values, dtype=float)
    if log:
        v = np.log(np.where(np.isfinite(v) & (v > 0), v, np.nan))
    n = np.sum(np.isfinite(v), axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        centre = np.nansum(v, axis=0) / n
        std = np.sqrt(np.nansum((v - centre) ** 2, axis=0) / (n - 1))
    centre[n == 0] = np.nan
    if v.shape[0] < 2:
        return (np.exp(centre) if log else centre), None, None
    std[n < 2] = np.nan  # no spread from one value
    if log:
        return np.exp(centre), np.exp(centre - std), np.exp(centre + std)
    with np.errstate(invalid="ignore"):
        low = np.maximum(centre - std, np.nanmin(np.where(np.isfinite(v), v, np.nan), axis=0))
        high = np.minimum(centre + std, np.nanmax(np.where(np.isfinite(v), v, np.nan), axis=0))
    return centre, low, high


def short_labels(names: Sequence[str], width: int = 34, max_lines: int = 3) -> list[str]:
    """Legend labels for group names (space-separated overrides): keys cut to their last part
    (``optim.weight_decay=0.01`` -> ``weight_decay=0.01``) unless two keys of one name would then read the
    same, long values cut in the middle, wrapped to ``width`` columns and at most ``max_lines`` lines; the
    full names when the short ones would not tell the groups apart."""
    split = [[o.partition("=") for o in n.split(" ")] for n in names]
    bare = {k: k.lstrip("+~") for parts in split for k, eq, _ in parts if eq}
    tail = {k: b.rsplit(".", 1)[-1] for k, b in bare.items()}
    whole = {k for parts in split for k, eq, _ in parts if eq and
             any(j != k and tail[j] == tail[k] for j, eq2, _ in parts if eq2)}  # model.lr and optim.lr in one name
    short = {k: bare[k] if k in whole else tail[k] for k in bare}

    def value(v: str) -> str:
        return v if len(v) <= 24 else v[:11] + "…" + v[-11:]

    out = []
    for parts in split:
        text = " ".join(f"{short[k]}={value(v)}" if eq else k for k, eq, v in parts)
        lines = textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [text]
        if len(lines) > max_lines:
            lines = lines[:max_lines]
            lines[-1] = lines[-1][: width - 1] + "…"
        out.append("\n".join(lines))
    return out if len(set(out)) == len(out) else [textwrap.fill(n, width) for n in names]


def curves_figure(curves: Mapping[str, Sequence[tuple[str, Sequence[Mapping[int, float]]]]], logx: bool = False,
                  thresholds: Mapping[str, float] | None = None, title: str = ""):
    """Draw group curves: ``curves[metric] = [(group label, [one {step: value} per job]), ...]``; each group
    at the steps all its jobs logged. Returns the figure and the :class:`Panel` s as drawn. Log x drops
    step 0 (a log axis has no 0); ``thresholds[metric]`` adds a dashed line (the ``--reach`` value)."""
    plt = _pyplot()
    metrics = [m for m, groups in curves.items() if any(any(job for job in jobs) for _, jobs in groups)]
    labels = list(dict.fromkeys(label for m in metrics for label, _ in curves[m]))
    colours = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20").colors
    colour = {label: colours[i % len(colours)] for i, label in enumerate(labels)}
    ncols = min(max(len(metrics), 1), 3)
    nrows = max(1, math.ceil(len(metrics) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols + 0.4, 3.9 * nrows + 0.3 + 0.22 * len(labels) / ncols),
                             dpi=110, squeeze=False, layout="constrained")
    for ax in axes.flat[len(metrics):]:
        ax.set_axis_off()
    panels = []
    for ax, metric in zip(axes.flat, metrics, strict=False):
        log = log_y(metric)
        panel = Panel(metric, "linear", "linear")
        for label, jobs in curves[metric]:
            steps = sorted(set.intersection(*(set(j) for j in jobs))) if jobs else []
            if logx:
                steps = [s for s in steps if s > 0]
            if not steps:
                continue
            values = np.array([[job[s] for s in steps] for job in jobs], dtype=float)
            centre, low, high = spread(values, log)
            x = np.asarray(steps, dtype=float)
            if len(x) == 1:  # a value logged once per job (a short run's val/acc): a point and its spread's bar
                bar = None if low is None else np.abs(np.stack([centre - low, high - centre]))
                ax.errorbar(x, centre, yerr=bar, fmt="o", color=colour[label], capsize=3, label=label)
            else:
                ax.plot(x, centre, color=colour[label], linewidth=1.6, label=label)
            if low is not None and len(x) > 1:
                ax.fill_between(x, low, high, color=colour[label], alpha=0.2, linewidth=0)
            panel.bands.append(Band(label, x, centre, low, high))
        target = (thresholds or {}).get(metric)
        if target is not None:
            ax.axhline(target, color="0.35", linestyle="--", linewidth=1)
        if log and any(np.any(np.isfinite(b.centre) & (b.centre > 0)) for b in panel.bands):
            ax.set_yscale("log")
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(STEP + (" (log)" if logx else ""))
        ax.set_ylabel(metric)
        how = "geometric mean ×/÷ std" if ax.get_yscale() == "log" else "mean ± std"
        ax.set_title(f"{metric}  ({how}{f'; dashed: {target:g}' if target is not None else ''})", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        panel.xscale, panel.yscale = ax.get_xscale(), ax.get_yscale()
        panels.append(panel)
    if not metrics:
        axes[0][0].text(0.5, 0.5, "no curves logged", ha="center", va="center", transform=axes[0][0].transAxes)
    if labels:
        handles = [plt.Line2D([], [], color=colour[label], linewidth=2) for label in labels]
        ncol = max(1, min(len(labels), 2 * ncols))
        fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig, panels


def save(fig, out_path: Path) -> Path:
    fig.savefig(out_path)
    _pyplot().close(fig)
    return out_path



# ------------------------------------------------------------------------------------ coordinate check


def coord_figure(groups: Sequence[tuple[str, Mapping[str, Mapping[int, Mapping[int, float]]]]], title: str = ""):
    """The µP coordinate check as the ``mup`` README draws it: one row per group, one panel per step, mean |x|
    against width on log-log axes, one line per layer, every panel on the same y axis (flat reads as flat).
    ``groups = [(name, {layer: {step: {width: value}}})]``; non-positive and non-finite values are not drawn (a
    log axis cannot place them). Returns the figure."""
    plt = _pyplot()
    steps = sorted({s for _, layers in groups for by_step in layers.values() for s in by_step})
    layers = list(dict.fromkeys(layer for _, by_layer in groups for layer in by_layer))
    colours = plt.get_cmap("tab10" if len(layers) <= 10 else "tab20").colors
    colour = {layer: colours[i % len(colours)] for i, layer in enumerate(layers)}
    nrows, ncols = max(1, len(groups)), max(1, len(steps))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.3 * ncols + 0.6, 2.9 * nrows + 0.4 + 0.2 * len(layers) / 4),
                             dpi=110, squeeze=False, layout="constrained", sharey=True)
    for row, (name, by_layer) in zip(axes, groups, strict=False):
        for ax, step in zip(row, steps, strict=True):
            for layer, by_step in by_layer.items():
                points = sorted((w, v) for w, v in by_step.get(step, {}).items() if math.isfinite(v) and v > 0)
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", markersize=3, color=colour[layer], label=layer)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"step {step}", fontsize=9)
            ax.set_xlabel("width", fontsize=8)
            ax.grid(True, which="major", alpha=0.3)
        row[0].set_ylabel(f"{textwrap.fill(name, 30)}\nmean |x|", fontsize=8)
    handles = [plt.Line2D([], [], color=colour[layer], marker="o", markersize=3) for layer in layers]
    if layers:
        fig.legend(handles, layers, loc="outside lower center", ncol=min(len(layers), 6), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
