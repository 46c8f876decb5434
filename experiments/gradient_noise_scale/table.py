"""The study's table: train/loss and B_simple (global and per layer) at chosen steps, mean ± std over the seeds.

    python experiments/gradient_noise_scale/table.py multirun/<date>/<time> > experiments/gradient_noise_scale/table.md

A shorter run (``trainer.epochs=5``) gets the rows of the steps that every run logged; the steps left out are
named on stderr.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

STEPS = (0, 20, 40, 60, 100, 150, 200, 250, 299)
COLUMNS = ("train/loss", "gns/grad_sq", "gns/trace", "gns/b_simple", "gns/conv1/b_simple", "gns/conv2/b_simple",
           "gns/fc1/b_simple", "gns/fc2/b_simple")


def rows(run: Path) -> dict[int, dict]:
    lines = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {r["trainer/step"]: r for r in lines if "train/loss" in r}


def cell(values: list[float]) -> str:
    mean, std = statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3g} ± {std:.2g}"


def main(root: str) -> None:
    runs = [rows(p.parent) for p in sorted(Path(root).glob("*/metrics.jsonl"))]
    if not runs:
        sys.exit(f"table.py: no run under {root} (looked for {root}/*/metrics.jsonl: a multirun directory)")
    steps = [s for s in STEPS if all(s in r for r in runs)]
    missing = [s for s in STEPS if s not in steps]
    if missing:
        print(f"table.py: steps {', '.join(map(str, missing))} are not logged in every run (a shorter run?); "
              f"the table has {', '.join(map(str, steps)) or 'no step'}", file=sys.stderr)
    print(f"| step | {' | '.join(COLUMNS)} |")
    print(f"|---|{'---|' * len(COLUMNS)}")
    for step in steps:
        print(f"| {step} | {' | '.join(cell([r[step][c] for r in runs]) for c in COLUMNS)} |")
    print(f"\n{len(runs)} seeds, mean ± std; B_simple in samples (the big batch: 128).")


if __name__ == "__main__":
    main(sys.argv[1])
