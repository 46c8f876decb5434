"""How many torch threads a CPU run should use: the quick start's loop at 1 and 2 intra-op threads, alone and
beside a competing process of the same priority (a busy loop, or a second training run, as a joblib sweep or a
test suite running beside a run would be).

    .venv/bin/python benchmarks/threads.py --repeats 3        # ~3 min on 2 cores

Prints, per case, the training loop's seconds (``perf/train_loop_s``: steps only, no start-up or validation),
median and range over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = [sys.executable, "-m", "hookexp", "hooks=clamp_conv", "logger=none", "trainer.progress=false"]
BUSY = [sys.executable, "-c", "while True: pass"]


def train_loop_seconds(threads: int, competitor: str, workdir: Path, tag: str) -> float:
    others: list[subprocess.Popen] = []
    if competitor == "busy loop":
        others.append(subprocess.Popen(BUSY))
    elif competitor == "second run":  # an identical run at the same time, at the same thread count
        others.append(subprocess.Popen([*RUN, f"trainer.num_threads={threads}", "trainer.epochs=1000",
                                        f"hydra.run.dir={workdir / (tag + '-other')}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL))
    try:
        run_dir = workdir / tag
        subprocess.run([*RUN, f"trainer.num_threads={threads}", f"hydra.run.dir={run_dir}"], check=True,
                       capture_output=True)
        return json.loads((run_dir / "summary.json").read_text())["perf/train_loop_s"]
    finally:
        for p in others:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cases = [(t, c) for c in ("alone", "busy loop", "second run") for t in (1, 2)]
    times: dict[tuple[int, str], list[float]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for threads, competitor in cases:
                tag = f"{r}-{threads}-{competitor.replace(' ', '_')}"
                times[(threads, competitor)].append(train_loop_seconds(threads, competitor, Path(tmp), tag))
    print("| competitor | threads | train loop s (median) | range |")
    print("|---|---|---|---|")
    for (threads, competitor), values in times.items():
        print(f"| {competitor} | {threads} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |")


if __name__ == "__main__":
    main()
