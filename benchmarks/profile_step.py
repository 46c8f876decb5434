"""Where a trainer step's time goes: torch.profiler over steady steps of overhead.py's trainer cases.

    .venv/bin/python benchmarks/profile_step.py --models small_cnn --steps 20          # the CPU columns
    .venv/bin/python benchmarks/profile_step.py --models gpt2_124m --set data.batch_size=1 data.block_size=32
    python benchmarks/profile_step.py --device cuda --models gpt2_124m --trace /tmp/profile   # on a GPU machine

Each case (a trainer case of benchmarks/overhead.py: b, c, d0, gns, ...; default b,c) runs once in this process:
--warmup-steps steps unprofiled, one profiler warm-up step, --steps profiled steps, and the run's last step (a log
step: left out). A step is the time between two ends of a step (``Observers.end``, as log_step.py times it). The
table gives per step, median over the profiled steps, in ms:
  wall                  the profiled step (the profiler's host cost, ~1-2 us an op, inflates it); "unprofiled":
                        the warm-up steps' median, by the clock
  GPU busy / idle       the union of the kernels' (and copies') intervals in the step, and the rest of the step;
                        idle is split into: after a record's read-back lands (the host decodes, writes the sinks
                        and observes; the GPU waits unless the next step's work is queued, as on a late log step),
                        before the step's first kernel, and elsewhere (the GPU waits for the host's launches)
  kernels: ...          kernel time by where the op that launched it ran: inside ``hookexp/describe`` (the
                        statistics of the gradients and activations) or ``hookexp/probe_hook`` (this script's range
                        around the activation probes' forward hooks): statistics; ``hookexp/read`` (the join and the
                        copy to the host): read-back; the rest of ``hookexp/log_step`` (the producers' pending
                        values, the decode, the sinks): log step; else: the rest of the step. On the CPU, where
                        nothing runs on a device, the ops' self time instead ("ops: ...")
  host: ...             the ranges' own durations: the log step; its read-back (on a GPU: waiting for the GPU);
                        after a record's read-back returns (``hookexp/land``: decode, sinks, observe);
                        the sinks; describe (launching the statistics); the probe hooks (forward)
A column "<case> - b" follows when b ran. Then the top kernels (CPU: ops) of case c (else the last case) by time.
``--trace DIR`` writes each case's chrome trace (``<model>_<case>.json.gz``), every profiled step's values
(``profile_<model>.json``) and the printed tables (``profile_<model>.md``) there. SIGUSR1 or SIGTERM
(``timeout -s USR1``) stops it and prints the cases done. The package opens its ``hookexp/...`` ranges only while
a profiler records (``hookexp.telemetry.readback.profiler_range``), at log-step granularity.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from overhead import MODELS, Interrupted, cases  # this script's folder is on sys.path when it is run

from hookexp.telemetry.observer import Observers
from hookexp.telemetry.probes import Probes
from hookexp.telemetry.readback import profiler_range

STEP = "ProfilerStep#"
CATEGORY = {"hookexp/describe": "statistics", "hookexp/probe_hook": "statistics", "hookexp/read": "read-back",
            "hookexp/log_step": "log step", "hookexp/decode": "log step", "hookexp/sinks": "log step",
            "hookexp/land": "log step"}
CATEGORIES = ("statistics", "read-back", "log step", "rest")
HOST = {"host: log step": "hookexp/log_step", "host: read-back (incl. waiting for the GPU)": "hookexp/read",
        "host: sinks": "hookexp/sinks", "host: describe (launching the statistics)": "hookexp/describe",
        "host: activation probe hooks (forward)": "hookexp/probe_hook"}
AFTER_READ = "host: after the read-back (decode, sinks, observe)"
GPU_ROWS = ("GPU busy (union of kernels)", "GPU idle", "GPU idle: after the read-back, to the step's end",
            "GPU idle: before the step's first kernel", "GPU idle: elsewhere (waiting for launches)")


@dataclass(frozen=True)
class Event:
    """One profiler event, in ns on the profiler's clock. ``kind``: range (a CPU user annotation: record_function),
    op (a CPU op), runtime (a CUDA runtime or driver call), kernel (device work: a kernel, copy or memset);
    ``corr``: its correlation id; ``linked``: a device event's launching CPU event's ``corr`` (0: none)."""

    name: str
    kind: str
    start: int
    end: int
    thread: int = 0
    corr: int = 0
    linked: int = 0


def events_of(result: Any) -> list[Event]:
    """The events of a torch profiler result (``prof.profiler.kineto_results``) that the analysis reads."""
    out = []
    for e in result.events():
        activity = str(e.activity_type())
        device = str(e.device_type()) != "DeviceType.CPU"
        if "annotation" in activity or e.is_user_annotation():
            if device:
                continue  # the GPU-side copy of a record_function range
            kind = "range"
        elif device:
            kind = "kernel"
        elif activity in ("cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver"):
            kind = "runtime"
        elif activity == "cpu_op":
            kind = "op"
        else:
            continue
        out.append(Event(e.name(), kind, e.start_ns(), e.end_ns(), e.start_thread_id(), e.correlation_id(),
                         e.linked_correlation_id()))
    return out


@dataclass
class Work:
    """A kernel (or, on the CPU, an op's self time): ``at``, when the op that launched it started (None: not
    linked), ``ns`` its duration, ``category`` where it was launched (CATEGORIES)."""

    name: str
    at: int | None
    start: int
    end: int
    ns: int
    category: str = "rest"


def self_times(cpu: list[Event]) -> list[Work]:
    """Each CPU op's self time (its duration less its children's), the events of each thread nested by time."""
    out: list[Work] = []
    by_thread: dict[int, list[Event]] = {}
    for e in cpu:
        by_thread.setdefault(e.thread, []).append(e)
    for events in by_thread.values():
        stack: list[list[Any]] = []  # [event, its children's ns], outermost first
        for e in [*sorted(events, key=lambda e: (e.start, -e.end)), None]:
            while stack and (e is None or stack[-1][0].end <= e.start):  # close what ended before e starts
                done, children = stack.pop()
                if stack:
                    stack[-1][1] += done.end - done.start
                if done.kind == "op":
                    ns = max(done.end - done.start - children, 0)
                    out.append(Work(done.name, done.start, done.start, done.end, ns))
            if e is not None:
                stack.append([e, 0])
    return out


def merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def busy_in(union: list[tuple[int, int]], lo: int, hi: int) -> int:
    """How much of [lo, hi] the disjoint sorted intervals ``union`` cover."""
    total = 0
    for start, end in union[max(bisect.bisect_right(union, (lo, lo)) - 1, 0):]:
        if start >= hi:
            break
        total += max(0, min(end, hi) - max(start, lo))
    return total


def innermost(ranges: list[Event], starts: list[int], at: int) -> Event | None:
    """The innermost of ``ranges`` (sorted by start; ``starts``: theirs) that holds ``at``."""
    for i in range(bisect.bisect_right(starts, at) - 1, -1, -1):
        if ranges[i].end >= at:
            return ranges[i]
    return None


def analyse(events: list[Event], device: bool) -> tuple[list[dict[str, float]], list[Work]]:
    """Per profiled step (a ``ProfilerStep#`` range) its values in ms (the table's rows), and the device work
    of those steps (kernels; on the CPU, ``device=False``, the ops' self time) with where each was launched."""
    windows = sorted((e for e in events if e.kind == "range" and e.name.startswith(STEP)), key=lambda e: e.start)
    ranges = sorted((e for e in events if e.kind == "range" and e.name in CATEGORY), key=lambda e: (e.start, -e.end))
    cpu = [e for e in events if e.kind in ("op", "range")]
    if device:
        launched = {e.corr: e.start for e in cpu}  # what a kernel's linked id names: the op (or range) launching it
        runtime = {e.corr: e.start for e in events if e.kind == "runtime"}
        work = [Work(e.name, launched.get(e.linked, runtime.get(e.corr)), e.start, e.end, e.end - e.start)
                for e in events if e.kind == "kernel"]
    else:
        work = self_times(cpu)
    range_starts = [r.start for r in ranges]
    for w in work:
        r = innermost(ranges, range_starts, w.at) if w.at is not None else None
        w.category = CATEGORY[r.name] if r is not None else "rest"
    starts = [w.start for w in windows]

    def window_of(t: int) -> int:
        i = bisect.bisect_right(starts, t) - 1
        return i if i >= 0 and t <= windows[i].end else -1

    per: list[list[Work]] = [[] for _ in windows]
    for w in work:
        i = window_of(w.at if w.at is not None else w.start)
        if i >= 0:
            per[i].append(w)
    union = merged([(w.start, w.end) for w in work]) if device else []
    rows = []
    for win, mine in zip(windows, per, strict=True):
        inside = [r for r in ranges if win.start <= r.start <= win.end]
        row = {"wall": (win.end - win.start) / 1e6}
        for label, name in HOST.items():
            row[label] = sum(r.end - r.start for r in inside if r.name == name) / 1e6
        reads = [r for r in inside if r.name == "hookexp/read"]
        # each record's landing (Trainer.land): from the end of its read-back (none inside on the CPU: read in the
        # send) to its end; on CUDA a log step lands the last step's record, then sends its own (a second read)
        lands = [r for r in inside if r.name == "hookexp/land"]
        landed = [max((r.end for r in reads if land.start <= r.start <= land.end), default=land.start)
                  for land in lands]
        row[AFTER_READ] = sum(land.end - at for land, at in zip(lands, landed, strict=True)) / 1e6
        for c in CATEGORIES:
            row[f"device: {c}"] = sum(w.ns for w in mine if w.category == c) / 1e6
            row[f"count: {c}"] = sum(w.category == c for w in mine)
        if device:
            busy = busy_in(union, win.start, win.end)
            read_end = max(landed, default=win.end)
            first = min((s for s, e in union if e > win.start), default=win.end)
            before = min(max(first, win.start), read_end)
            idle_after = (win.end - read_end) - busy_in(union, read_end, win.end)
            idle_before = (before - win.start) - busy_in(union, win.start, before)
            idle = (win.end - win.start) - busy
            row.update(zip(GPU_ROWS, (busy / 1e6, idle / 1e6, idle_after / 1e6, idle_before / 1e6,
                                      (idle - idle_after - idle_before) / 1e6), strict=True))
        rows.append(row)
    return rows, [w for ws in per for w in ws]


@dataclass
class Profile:
    """One case's profiled steps (``analyse``'s rows), its device work, and the clock's unprofiled step times."""

    steps: list[dict[str, float]]
    work: list[Work]
    unprofiled: list[float] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        values = [s[key] for s in self.steps if key in s]
        return statistics.median(values) if values else None


TRACK = SimpleNamespace(prof=None, ends=[])  # the running profiler, and perf_counter at each step's end
_end = Observers.end
_keep = Probes._keep_activation


def _end_step(self: Observers, step: int) -> None:
    """``Observers.end``: the trainer's last call of every step, timed; steps the profiler's schedule."""
    _end(self, step)
    TRACK.ends.append(time.perf_counter())
    if TRACK.prof is not None:
        TRACK.prof.step()


def _keep_activation(self: Probes, name: str, output: Any) -> None:
    """The activation probes' forward hook, in a range (none where torch.compile traces it: a graph break)."""
    if torch.compiler.is_compiling():
        return _keep(self, name, output)
    with profiler_range("hookexp/probe_hook"):
        return _keep(self, name, output)


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """This script's two patches (the step's end, the probe hooks' range), undone on leaving."""
    Observers.end, Probes._keep_activation = _end_step, _keep_activation
    try:
        yield
    finally:
        Observers.end, Probes._keep_activation = _end, _keep


def profile_case(run: Any, args: argparse.Namespace, cuda: bool, trace: Path | None) -> Profile:
    """Run one case (``run()``: overhead.py's case for warm-up + 1 + steps + 1 steps) under the profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    schedule = torch.profiler.schedule(wait=args.warmup_steps, warmup=1, active=args.steps, repeat=1)
    TRACK.ends = []
    with patched(), torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        TRACK.prof = prof
        try:
            run()
        finally:
            TRACK.prof = None
    if len(TRACK.ends) < args.warmup_steps + 2:
        raise RuntimeError(f"{len(TRACK.ends)} steps ended: profile_step.py profiles the trainer's cases (b, c, "
                           "d0, ...), not the hand loops")
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    rows, work = analyse(events_of(prof.profiler.kineto_results), cuda)
    clock = [(b - a) * 1e3 for a, b in zip(TRACK.ends, TRACK.ends[1:args.warmup_steps], strict=False)][1:]
    return Profile(rows, work, clock)


def table(profiles: dict[str, Profile], cuda: bool) -> str:
    """The markdown table: a row per value, a column per case (median ms per step) and ``<case> - b``."""
    names = list(profiles)
    diffs = [n for n in names if n != "b"] if "b" in profiles else []
    work = "kernels" if cuda else "ops (CPU self time)"
    rows: list[tuple[str, list[float | None]]] = []

    def add(label: str, key: str) -> None:
        rows.append((label, [profiles[n].median(key) for n in names]))

    rows.append(("wall, unprofiled (warm-up steps, by the clock)",
                 [statistics.median(p.unprofiled) if p.unprofiled else None for p in profiles.values()]))
    add("wall (profiled)", "wall")
    for label in GPU_ROWS:
        if cuda:
            add(label, label)
        else:
            rows.append((label, [None] * len(names)))
    for c in CATEGORIES:
        add(f"{work}: {c}", f"device: {c}")
    for c in CATEGORIES:
        add(f"{work} launched (count): {c}", f"count: {c}")
    for label in HOST:
        add(label, label)
        if label == "host: read-back (incl. waiting for the GPU)":
            add(AFTER_READ, AFTER_READ)

    def cell(v: float | None, count: bool) -> str:
        return "-" if v is None else f"{v:.0f}" if count else f"{v:.2f}"

    lines = ["| ms per step (median) | " + " | ".join([*names, *(f"{n} - b" for n in diffs)]) + " |",
             "|---|" + "---|" * (len(names) + len(diffs))]
    for label, values in rows:
        count = "(count)" in label
        by = dict(zip(names, values, strict=True))
        d = [None if by[n] is None or by["b"] is None else by[n] - by["b"] for n in diffs]
        lines.append("| " + " | ".join([label, *(cell(v, count) for v in [*values, *d])]) + " |")
    return "\n".join(lines)


def top(profile: Profile, n: int, cuda: bool) -> str:
    """The ``n`` kernels (CPU: ops, by self time) with the most time per step, and where they were launched."""
    steps = max(len(profile.steps), 1)
    totals: dict[str, list[Any]] = {}
    for w in profile.work:
        t = totals.setdefault(w.name, [0, 0, {}])
        t[0] += 1
        t[1] += w.ns
        t[2][w.category] = t[2].get(w.category, 0) + w.ns
    what = "kernel" if cuda else "op (self time)"
    lines = [f"| {what} | launched in | calls/step | ms/step |", "|---|---|---|---|"]
    for name, (calls, ns, where) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:n]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {max(where, key=where.get)} | {calls / steps:.1f} | "
                     f"{ns / steps / 1e6:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma-separated, of overhead.py's models (default: "
                        "gpt2_124m with a CUDA --device, else small_cnn)")
    parser.add_argument("--cases", default="b,c", help="overhead.py's trainer cases (b, c, d0, d, gns, ...)")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per case")
    parser.add_argument("--warmup-steps", type=int, default=10, help="unprofiled steps before them")
    parser.add_argument("--device", default="cpu", help="trainer.device for every case: cpu, cuda, ...")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides appended to "
                        "every model's (e.g. trainer.compile=true; data.batch_size=1 data.block_size=32)")
    parser.add_argument("--top", type=int, default=15, help="kernels (CPU: ops) listed for case c")
    parser.add_argument("--trace", type=Path, help="write the chrome traces, the steps' values and the tables there")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    models = (args.models or ("gpt2_124m" if cuda else "small_cnn")).split(",")
    quiet = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the trainer's warnings would interleave with the tables
    if args.trace:
        args.trace.mkdir(parents=True, exist_ok=True)

    def interrupted(signum: int, frame: object) -> None:
        raise Interrupted

    handlers = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    where = torch.cuda.get_device_name() if cuda else f"{os.cpu_count()} cores"
    compiled = "compiled" if "trainer.compile=true" in args.set else "eager"
    failed = False
    try:
        for m in models:
            bench = MODELS[m]
            steps = args.warmup_steps + args.steps + 2  # + the profiler's warm-up step + the run's last (log) step
            runs = cases(bench, [*bench.overrides, f"trainer.device={args.device}", *args.set], steps)
            profiles: dict[str, Profile] = {}
            try:
                for case in args.cases.split(","):
                    trace = args.trace / f"{m}_{case}.json.gz" if args.trace else None
                    started = time.perf_counter()
                    try:
                        profiles[case] = profile_case(runs[case], args, cuda, trace)
                    except Exception as e:  # one case that fails must not cost the others
                        print(f"{m} {case}: FAILED ({type(e).__name__}: {e})".splitlines()[0], file=sys.stderr)
                        failed = True
                        continue
                    print(f"{m} {case}: {len(profiles[case].steps)} steps profiled "
                          f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            except (Interrupted, KeyboardInterrupt):
                print(f"interrupted: the table holds {', '.join(profiles) or 'no case'}", file=sys.stderr)
                failed = True
            if not profiles:
                continue
            text = (f"## {m}: torch {torch.__version__}, {args.device} ({where}), {compiled}, {args.steps} steps "
                    f"profiled after {args.warmup_steps} + 1\n\n{table(profiles, cuda)}\n")
            shown = "c" if "c" in profiles else list(profiles)[-1]
            text += f"\nTop {args.top} {'kernels' if cuda else 'ops'} of case {shown}, per step:\n\n"
            text += top(profiles[shown], args.top, cuda) + "\n"
            if cuda:
                unlinked = {c: sum(w.at is None for w in p.work) for c, p in profiles.items()}
                text += "\nKernels not linked to a launching op (counted as rest): " + ", ".join(
                    f"{c} {n} of {len(profiles[c].work)}" for c, n in unlinked.items()) + "\n"
            print(text, flush=True)
            if args.trace:
                (args.trace / f"profile_{m}.md").write_text(text)
                (args.trace / f"profile_{m}.json").write_text(json.dumps(
                    {"torch": torch.__version__, "device": args.device, "where": where, "set": args.set,
                     "cases": {c: {"steps": p.steps, "unprofiled": p.unprofiled} for c, p in profiles.items()}},
                    indent=1))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        logging.disable(quiet)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
