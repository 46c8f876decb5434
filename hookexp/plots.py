"""Plots written at the end of a run (matplotlib, headless)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def plot_grad_norms(metrics_path: Path, out_path: Path, max_lines: int = 40) -> Path | None:
    """Per-parameter gradient norm over steps (log scale) from ``metrics.jsonl``; None if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, tuple[list[int], list[float]]] = {}
    for line in metrics_path.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            numeric = isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
            if key.startswith("grad/") and key.endswith("/norm") and numeric:
                steps, values = series.setdefault(key[len("grad/"):-len("/norm")], ([], []))
                steps.append(row["trainer/step"])
                values.append(value)
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    for name, (steps, values) in list(series.items())[:max_lines]:
        ax.plot(steps, values, label=name, linewidth=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("trainer/step")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title("Per-parameter gradient norm")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(series) > 8 else 1, loc="best")
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
