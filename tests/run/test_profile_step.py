"""benchmarks/profile_step.py: a trainer step's time by where it was launched, read from torch.profiler. Its main path
runs here on the CPU (the ops' self time; no GPU columns); the GPU columns' arithmetic is checked on a timeline
written by hand, as the profiler gives it on a GPU (kernels linked to the ops that launched them)."""

from __future__ import annotations

import gzip
import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MS = 1_000_000  # ns


@pytest.fixture(scope="module")
def ps():
    sys.path.insert(0, str(BENCHMARKS))  # profile_step imports overhead.py from its folder
    return importlib.import_module("profile_step")


def cells(text: str, first: str) -> tuple[list[str], dict[str, list[str]]]:
    """The markdown table whose header row starts with ``first``: its header and its rows by label."""
    lines = text[text.index(f"| {first} |"):].split("\n\n")[0].splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if not line.startswith("|---")]
    return rows[0], {r[0]: r[1:] for r in rows[1:]}


def test_the_cpu_profile_of_the_small_cnn_finds_the_log_step_and_the_statistics(ps, capsys, tmp_path):
    ps.main(["--models", "small_cnn", "--cases", "b,c", "--steps", "3", "--warmup-steps", "3", "--trace",
             str(tmp_path)])
    out = capsys.readouterr().out
    header, rows = cells(out, "ms per step (median)")
    assert header == ["ms per step (median)", "b", "c", "c - b"]
    b, c = ({k: v[i] for k, v in rows.items()} for i in (0, 1))
    assert set(rows) >= {"wall (profiled)", "GPU busy (union of kernels)", "ops (CPU self time): statistics",
                         "ops (CPU self time): read-back", "ops (CPU self time): rest", "host: log step",
                         "host: after the read-back (decode, sinks, observe)", "host: describe (launching the "
                         "statistics)", "host: activation probe hooks (forward)"}
    assert c["GPU idle"] == b["GPU idle"] == "-"  # no device: no GPU columns
    # c logs every step, b never in the profiled steps: the log step's ranges are found in c's steps only
    for label in ("host: log step", "host: describe (launching the statistics)",
                  "host: activation probe hooks (forward)", "ops (CPU self time): statistics"):
        assert float(c[label]) > 0 and float(b[label]) == 0, label
    assert float(c["host: log step"]) >= float(c["host: after the read-back (decode, sinks, observe)"]) > 0
    # every op the statistics add is inside a range: the rest of the step dispatches the same ops in b and c
    assert int(c["ops (CPU self time) launched (count): statistics"]) > 0
    assert c["ops (CPU self time) launched (count): rest"] == b["ops (CPU self time) launched (count): rest"]
    _, top = cells(out, "op (self time)")
    assert len(top) == 15 and "statistics" in {v[0] for v in top.values()}  # case c's ops, by where they ran
    saved = json.loads((tmp_path / "profile_small_cnn.json").read_text())
    assert [len(saved["cases"][k]["steps"]) for k in ("b", "c")] == [3, 3]
    assert (tmp_path / "profile_small_cnn.md").read_text() in out
    trace = gzip.decompress((tmp_path / "small_cnn_c.json.gz").read_bytes()).decode()
    assert all(f'"hookexp/{r}"' in trace for r in ("log_step", "land", "describe", "read", "decode", "sinks",
                                                   "probe_hook"))


def test_a_hand_loop_case_is_refused_by_name(ps, capsys):
    with pytest.raises(SystemExit):
        ps.main(["--models", "small_cnn", "--cases", "a", "--steps", "1", "--warmup-steps", "1"])
    assert "not the hand loops" in capsys.readouterr().err


def test_the_gpu_columns_of_a_step_written_by_hand(ps):
    E = ps.Event
    step = E("ProfilerStep#1", "range", 0, 100 * MS)
    ranges = [E("hookexp/describe", "range", 40 * MS, 50 * MS, corr=10), E("hookexp/log_step", "range", 70 * MS,
              95 * MS, corr=11), E("hookexp/read", "range", 72 * MS, 80 * MS, corr=12),
              E("hookexp/land", "range", 72 * MS, 95 * MS, corr=13)]  # read at once: the log step lands its record
    ops = [E("aten::mm", "op", 10 * MS, 11 * MS, corr=1), E("aten::norm", "op", 45 * MS, 46 * MS, corr=2),
           E("aten::copy_", "op", 75 * MS, 76 * MS, corr=3), E("aten::add", "op", 97 * MS, 98 * MS, corr=4)]
    kernels = [E("gemm", "kernel", 12 * MS, 30 * MS, linked=1), E("norm", "kernel", 46 * MS, 60 * MS, linked=2),
               E("Memcpy DtoH", "kernel", 74 * MS, 79 * MS, linked=3),
               E("add", "kernel", 101 * MS, 110 * MS, linked=4),  # launched in this step, runs after it
               E("fill", "kernel", 20 * MS, 25 * MS, corr=99)]  # no linked op: its runtime call says when
    runtime = [E("cudaLaunchKernel", "runtime", 5 * MS, 6 * MS, corr=99)]
    rows, work = ps.analyse([step, *ranges, *ops, *kernels, *runtime], device=True)
    assert len(rows) == 1 and len(work) == 5
    got = {k: round(v, 6) for k, v in rows[0].items()}
    # busy: [12, 30] (fill inside gemm), [46, 60], [74, 79]; idle: after the read [80, 100], before [0, 12]
    assert {k: got[k] for k in ps.GPU_ROWS} == dict(zip(ps.GPU_ROWS, [37, 63, 20, 12, 31], strict=True))
    assert [got[f"device: {c}"] for c in ps.CATEGORIES] == [14, 5, 0, 18 + 9 + 5]
    assert [got[f"count: {c}"] for c in ps.CATEGORIES] == [1, 1, 0, 3]
    assert got["host: log step"] == 25 and got[ps.AFTER_READ] == 15 and got["host: read-back (incl. waiting " \
        "for the GPU)"] == 8 and got["host: describe (launching the statistics)"] == 10


def test_a_record_landed_a_step_late_is_measured_from_its_own_read_back(ps):
    """CUDA's late log step: step N+1's log step lands N's record (waits on its copy, decodes, writes the sinks),
    then sends N+1's (the join and the copy: a second read-back range, which waits for nothing)."""
    E = ps.Event
    step = E("ProfilerStep#2", "range", 0, 100 * MS)
    ranges = [E("hookexp/log_step", "range", 60 * MS, 95 * MS), E("hookexp/land", "range", 60 * MS, 85 * MS),
              E("hookexp/read", "range", 60 * MS, 62 * MS), E("hookexp/decode", "range", 62 * MS, 70 * MS),
              E("hookexp/sinks", "range", 70 * MS, 80 * MS), E("hookexp/read", "range", 90 * MS, 93 * MS, corr=5)]
    ops = [E("aten::mm", "op", 5 * MS, 6 * MS, corr=1), E("aten::copy_", "op", 91 * MS, 92 * MS, corr=2)]
    kernels = [E("gemm", "kernel", 10 * MS, 70 * MS, linked=1), E("Memcpy DtoH", "kernel", 92 * MS, 94 * MS, linked=2)]
    rows, _ = ps.analyse([step, *ranges, *ops, *kernels], device=True)
    got = {k: round(v, 6) for k, v in rows[0].items()}
    assert got[ps.AFTER_READ] == 23  # 62 -> 85: decode, sinks, observe; not 93 -> 95 after the send
    assert got["host: read-back (incl. waiting for the GPU)"] == 5 and got["host: log step"] == 35
    # idle after the landing's read-back (62): [70, 92] and [94, 100]; before the first kernel: [0, 10]
    assert {k: got[k] for k in ps.GPU_ROWS} == dict(zip(ps.GPU_ROWS, [62, 38, 28, 10, 0], strict=True))


def test_an_ops_self_time_leaves_out_its_childrens(ps):
    E = ps.Event
    events = [E("hookexp/describe", "range", 0, 100), E("aten::norm", "op", 10, 50), E("aten::abs", "op", 20, 30),
              E("aten::sum", "op", 60, 70)]
    assert {(w.name, w.ns) for w in ps.self_times(events)} == {("aten::norm", 30), ("aten::abs", 10),
                                                              ("aten::sum", 10)}


def test_the_packages_ranges_dispatch_nothing_unless_a_profiler_records():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hookexp.telemetry.readback import profiler_range

    seen: list[str] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen(), profiler_range("hookexp/read"):
        torch.ones(1).add_(1)
    assert seen == ["aten.ones.default", "aten.add_.Tensor"]
    # no record_function op: the op counts (benchmarks/opcount.py) do not see the ranges
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            profiler_range("hookexp/read"):
        pass
    assert [e.name for e in prof.events()] == ["hookexp/read"]
