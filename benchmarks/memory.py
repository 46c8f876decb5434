"""Resident memory of a long run with statistics on every step: does anything accumulate?

    .venv/bin/python benchmarks/memory.py                  # 10,000 steps, small CNN, W&B offline
    .venv/bin/python benchmarks/memory.py --steps 2000

Samples this process's RSS every 0.25 s while the trainer runs (hooks: clamp_conv and the
dead-ReLU probe; every statistic family every step: every gradient statistic with histograms, ReLU
activation statistics with histograms, weight, update and optimizer-state norms, and group norms of
the conv and fc layers) and prints the RSS after the first 10% of the steps, at the end, and the
growth in between.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import matplotlib
from hydra import compose, initialize_config_module

from hookexp.run.loop import run_job as train

matplotlib.use("Agg")
import matplotlib.pyplot

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--logger", default="wandb", choices=["wandb", "none"])
    parser.add_argument("overrides", nargs="*", help="more config overrides, e.g. stats.hist_bins=0")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")  # the W&B run's summary would bury the result
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.perf_counter(), rss_mb()))
            time.sleep(0.25)

    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        cfg = compose("config", overrides=[
            "trainer.progress=false", f"trainer.max_steps={args.steps}", f"logger={args.logger}",
            "trainer.epochs=100000",
            "hooks=[clamp_conv,dead_relu_probe]", "stats.every=1", "stats.hist_bins=32",
            "stats.activations=relu*", "stats.params=*", "stats.updates=*", "stats.optimizer=*",
            "stats.group_by='re:^[a-z]+'", *args.overrides])
    with tempfile.TemporaryDirectory() as tmp:
        thread = threading.Thread(target=sample, daemon=True)
        started = time.perf_counter()
        thread.start()
        summary = train(cfg, Path(tmp))
        done.set()
        thread.join()
        loop = summary["perf/train_loop_s"]
    # The window: from 10% of the run (after build, imports, first allocations) to 95% (before the
    # end-of-run plot and files, which allocate once).
    span = samples[-1][0] - started
    window = [m for t, m in samples if 0.1 * span <= t - started <= 0.95 * span]
    print(f"{args.steps} steps with statistics every step: {loop:.1f} s of training")
    print(f"RSS at 10% of the run: {window[0]:.1f} MB; at 95%: {window[-1]:.1f} MB; growth "
          f"{window[-1] - window[0]:+.1f} MB; after the end-of-run plot: {samples[-1][1]:.1f} MB")


if __name__ == "__main__":
    main()
