"""What describing a model's gradients costs on a log step, timed inside a hand training loop.

    .venv/bin/python benchmarks/describe.py                       # small CNN, 32-bin histograms and without
    .venv/bin/python benchmarks/describe.py --models deep_mlp --steps 300

Every step runs forward, backward and ``optimizer.step()``; between backward and the step the gradients
are described and read back (a log step every step), and only that is timed. Standalone, on a warm cache,
the same call costs several times less: what a log step pays is the cold cache after a training step, so
this is the number that compares with the trainer's. One variant is left, ``telemetry``
(hookexp.telemetry.stats, the one statistics path, in torch ops; ``variants`` is where another would go,
to run in alternating rounds with it in one process). numba's kernels and the old torch rows
(``hookexp.stats``, ``hookexp.fused``) that it was compared with are gone;
their figures are in benchmarks/README.md's git history.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hookexp.telemetry.readback import read
from hookexp.telemetry.stats import TensorStats
from hookexp.workloads.models import MLP, SmallCNN

MODELS = {"small_cnn": lambda: SmallCNN(), "deep_mlp": lambda: MLP(depth=32, width=64, norm="layer")}


def variants(model: torch.nn.Module, bins: int, sample: int | None) -> dict[str, Callable[[], object]]:
    named = [(f"grad/{n}", p) for n, p in model.named_parameters()]
    describer = TensorStats(hist_bins=bins, hist_sample=sample)
    return {"telemetry": lambda: read([describer.describe({k: p.grad for k, p in named})])}


def measure(name: str, bins: int, sample: int | None, steps: int, rounds: int) -> dict[str, float]:
    """Median us of each variant's description, and of a training step without one (``step``)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    runs = variants(model, bins, sample)
    times: dict[str, list[float]] = {k: [] for k in ("step", *runs)}
    for r in range(rounds + 1):  # round 0: warm-up (torch's lazy set-up, the allocator)
        for label, describe in runs.items():
            for _ in range(steps):
                begin = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                start = time.perf_counter()
                describe()
                end = time.perf_counter()
                opt.step()
                if r:
                    times[label].append(end - start)
                    times["step"].append(time.perf_counter() - begin - (end - start))
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small_cnn", help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=200, help="steps per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}; median us over {args.steps * args.rounds} steps: a training "
          "step (batch 64) without statistics, then each variant's description")
    for name in args.models.split(","):
        for bins, sample in ((0, None), (32, 4096)):
            got = measure(name, bins, sample, args.steps, args.rounds)
            cells = " | ".join(f"{k} {v:.0f}" for k, v in got.items())
            print(f"| {name} | hist_bins={bins} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
