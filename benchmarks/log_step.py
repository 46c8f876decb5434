"""What one log step costs, measured inside one trainer run, where the machine's speed is steady.

    .venv/bin/python benchmarks/log_step.py                          # small CNN, all statistics, every 2nd step
    .venv/bin/python benchmarks/log_step.py --models deep_mlp --every 10 --runs 5
    .venv/bin/python benchmarks/log_step.py --models gpt2_host --fused --steps 200  # c's host part on a GPU

`overhead.py` compares separate runs; on a 2-core VM their speed differs by far more than the statistics
cost (see benchmarks/README.md). Here the trainer runs with ``stats.every=N`` and every step is timed where it ends;
a log step's extra time is the median log step less the median of the other steps of the same run. With
``--every 2`` every other step logs, so ``log / other`` approximates case c's c/b without comparing two
runs (the step after a log step, in the denominator, pays a little of the log step's cold cache too).
The same is printed with statistics off (``stats.grads=null``, loss and accuracy still logged) as the
floor that any log step costs, and with the gradient statistics alone (``grads``: no activation probes, whose
forward hooks stay on the modules between log steps).
"""

from __future__ import annotations

import argparse
import statistics
import time
from itertools import pairwise

# this script's folder is on sys.path when it is run
from overhead import MODELS, add_fused, stats_all, trainer_loop, use_fused

from hookexp.telemetry.observer import Observers

ENDS: list[float] = []  # perf_counter at the end of every step of the current run
_end_step = Observers.end


def end_step_timed(self: Observers, step: int) -> None:
    """The trainer's last call of every step (after the log step's read-back and the sinks), timed."""
    _end_step(self, step)
    ENDS.append(time.perf_counter())


def run(overrides: list[str], steps: int, every: int, skip: int) -> tuple[float, float]:
    """Median ms of the log steps and of the other steps (the first ``skip`` steps left out)."""
    ENDS.clear()
    trainer_loop(overrides, steps, [f"stats.every={every}"])
    times = [(b - a) * 1e3 for a, b in pairwise(ENDS)]  # times[i]: step i + 1
    log = [t for i, t in enumerate(times, 1) if i >= skip and i % every == 0 and i != steps - 1]
    other = [t for i, t in enumerate(times, 1) if i >= skip and i % every != 0 and i != steps - 1]
    return statistics.median(log), statistics.median(other)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small_cnn", help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--every", type=int, default=2, help="stats.every: a log step every N steps")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--runs", type=int, default=3)
    add_fused(parser)
    args = parser.parse_args()
    use_fused(args)
    Observers.end = end_step_timed  # the trainer's last call of every step, timed
    print(f"stats.every={args.every}, {args.steps} steps a run, median ms per step; extra = log step - other step")
    print("\n| model | statistics | run | other step | log step | extra | log / other |\n|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model, activations = list(MODELS[name].overrides), MODELS[name].activations
        variants = {
            "off": [*model, "stats.grads=null"],
            "grads": [*model, *stats_all(activations), "stats.activations=null"],
            "all": [*model, *stats_all(activations)],
        }
        run(variants["all"], 60, args.every, 10)  # warm-up: torch's lazy set-up, the allocator
        for r in range(args.runs):
            for label, overrides in variants.items():
                log, other = run(overrides, args.steps, args.every, 20)
                cells = [name, label, r + 1, f"{other:.2f}", f"{log:.2f}", f"{log - other:.2f}", f"{log / other:.2f}"]
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
