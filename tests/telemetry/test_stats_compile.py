"""``stats.compile``: a log step's tensors described by torch.compile's fused kernels (CUDA's default), forced on
the CPU here (inductor's C++ kernels): the same logged values as the eager rows, the eager rows when the compiler
fails, and the setting's default and checks."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from conftest import config, read_jsonl

from hookexp.errors import ConfigError
from hookexp.run.loop import run_job as train
from hookexp.telemetry import stats
from hookexp.telemetry.readback import read
from hookexp.telemetry.stats import TensorStats

RUN = ("trainer.max_steps=6", "stats.every=3", "stats.activations=*relu*", "stats.hist_bins=8", "data.batch_size=32")


def logged(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if any(k.startswith("grad/") for k in r)]


def test_a_run_with_compiled_statistics_logs_what_the_eager_rows_log(tmp_path):
    """Every gradient and activation statistic (kurtosis too) of a digits run, compiled against eager, to float64's
    rounding; the losses bit for bit (the statistics do not touch training)."""
    before = stats.ROW_KERNEL.calls
    train(config(*RUN, "stats.compile=true"), tmp_path / "compiled")
    assert stats.ROW_KERNEL.failed is None and stats.ROW_KERNEL.calls > before
    train(config(*RUN, "stats.compile=false"), tmp_path / "eager")
    compiled, eager = logged(tmp_path / "compiled"), logged(tmp_path / "eager")
    assert [r["trainer/step"] for r in compiled] == [r["trainer/step"] for r in eager] == [0, 3, 5]
    for got, want in zip(compiled, eager, strict=True):
        assert got.keys() == want.keys()
        assert any(k.endswith("/kurtosis") for k in got) and any(k.startswith("act/") for k in got)
        for key, value in want.items():
            if key == "train/loss":
                assert got[key] == value
            elif key.startswith(("grad/", "act/")) and isinstance(value, float) and math.isfinite(value):
                assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_a_compiler_that_fails_leaves_the_eager_rows_with_one_warning(monkeypatch, caplog):
    """A compile error (no C++ compiler, an inductor bug) is said once, naming stats.compile; every call then gives
    what the eager rows give."""
    def broken(*args, **kwargs):
        raise RuntimeError("no working C++ compiler found\nmore detail")

    monkeypatch.setattr(stats, "ROW_KERNEL", stats._RowKernel())
    monkeypatch.setattr(torch, "compile", broken)
    torch.manual_seed(0)
    tensors = {"a": torch.randn(300), "b": torch.randn(7, 5)}
    want = read([TensorStats(compile=False).describe(tensors)])
    with caplog.at_level(logging.WARNING, logger="hookexp.stats"):
        first = read([TensorStats(compile=True).describe(tensors)])
        second = read([TensorStats(compile=True).describe(tensors)])
    warned = [r.getMessage() for r in caplog.records if r.name == "hookexp.stats"]
    assert warned == ["stats.compile: the statistics' fused kernel did not compile (RuntimeError: no working C++ "
                      "compiler found); tensors are described eagerly from now on, with the same values. Set "
                      "stats.compile=false to skip the attempt."]
    for got in (first, second):
        assert got.keys() == want.keys()
        assert all(got[k] == pytest.approx(want[k], rel=1e-12, nan_ok=True) for k in want)


def test_out_of_memory_in_the_compiled_rows_is_no_compile_failure(monkeypatch, caplog):
    """The device running out of memory in the compiled call is not the compiler failing: no stats.compile warning,
    those rows eagerly (which raise it if it lasts), and the next call compiled again."""
    failures = [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")]

    def fake_compile(fn, **kwargs):  # the kernel's call, eager here; the first one runs out of memory
        def call(*args, **kw):
            if failures:
                raise failures.pop()
            return fn(*args, **kw)
        return call

    monkeypatch.setattr(stats, "ROW_KERNEL", stats._RowKernel())
    monkeypatch.setattr(torch, "compile", fake_compile)
    torch.manual_seed(0)
    tensors = {"a": torch.randn(300), "b": torch.randn(7, 5)}
    want = read([TensorStats(compile=False).describe(tensors)])
    describer = TensorStats(compile=True)
    with caplog.at_level(logging.WARNING, logger="hookexp.stats"):
        first = read([describer.describe(tensors)])
        second = read([describer.describe(tensors)])
    assert [r.getMessage() for r in caplog.records if r.name == "hookexp.stats"] == []
    assert stats.ROW_KERNEL.failed is None and stats.ROW_KERNEL.calls == 1  # the second call, compiled
    assert [layout.compiled for layout in describer._layouts.values()] == [True]
    for got in (first, second):
        assert got.keys() == want.keys()
        assert all(got[k] == pytest.approx(want[k], rel=1e-12, nan_ok=True) for k in want)


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch.compiler.set_stance: torch >= 2.6")
def test_the_kernel_run_uncompiled_describes_as_the_eager_rows(monkeypatch):
    """Dynamo told to run everything eagerly (a user debugging their own compile): the kernel's call gives the
    eager single passes bit for bit, not the compiled rows' math run uncompiled (a float64 copy of the deviations
    and one of their squares on top of the widened rows)."""
    monkeypatch.setattr(stats, "ROW_KERNEL", stats._RowKernel())
    monkeypatch.setattr(stats, "FUSED", frozenset({"cpu"}))
    torch.manual_seed(0)
    tensors = {"act/a": torch.randn(64, 300) * 3 + 1, "grad/b": torch.randn(700, 33)}
    want = read([TensorStats(compile=False).describe(tensors, higher=["act/a"])])
    with torch.compiler.set_stance("force_eager"):
        got = read([TensorStats(compile=True).describe(tensors, higher=["act/a"])])
    assert stats.ROW_KERNEL.failed is None and stats.ROW_KERNEL.calls == 1
    assert {k: str(v) for k, v in got.items()} == {k: str(v) for k, v in want.items()}

    graphs = []  # traced by Dynamo, the same call is the compiled rows' math: no var_mean in its graph

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward
    narrow, w = torch.randn(5, 16), 16
    ones = torch.ones(5, dtype=torch.float64)
    args = (narrow, (ones * w, ones * 0, ones * 0), w, 2)
    traced = torch.compile(stats._rows, backend=backend, fullgraph=True, dynamic=True)(*args, compiled=True)
    assert len(graphs) == 1 and "var_mean" not in graphs[0] and "sum" in graphs[0]
    assert torch.allclose(traced, stats._rows(*args), rtol=1e-12)


def test_the_default_compiles_on_cuda_only_and_the_setting_is_checked():
    """stats.compile=null: compiled where COMPILED names the device (CUDA), eager on this CPU; a value that is not a
    flag is refused naming the key."""
    assert {"cuda"} == set(stats.COMPILED)
    plain = TensorStats()
    plain.describe({"a": torch.randn(10)})
    forced = TensorStats(compile=True)
    forced.describe({"a": torch.randn(10)})
    assert [layout.compiled for layout in plain._layouts.values()] == [False]
    assert [layout.compiled for layout in forced._layouts.values()] == [True]
    from hookexp.run import compose

    with pytest.raises(ConfigError) as e:
        compose("stats.compile=sometimes")
    assert str(e.value).startswith("stats.compile: "), str(e.value)


def test_every_variant_of_the_kernel_compiles_past_dynamos_default_limit(monkeypatch):
    """Dtypes x one row or more x none, one or more rows with 3rd and 4th powers: ten variants, over Dynamo's
    recompile limit of 8 per function, which stopped the kernel at the 9th. All compile (Dynamo's own traces, the
    eager backend, to keep it quick) and none turns the kernel off; Dynamo's limit is as it was afterwards."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    monkeypatch.setattr(stats, "ROW_KERNEL", stats._RowKernel())
    torch._dynamo.reset()
    counters.clear()
    limit = torch._dynamo.config.recompile_limit
    torch.manual_seed(0)
    layouts = (({"one": torch.randn(10)}, []), ({"one": torch.randn(10)}, ["one"]),
               ({"one": torch.randn(3, 512), "two": torch.randn(7)}, []),
               ({"one": torch.randn(7), "two": torch.randn(3, 512)}, ["one"]),
               ({"one": torch.randn(3, 512), "two": torch.randn(7)}, ["one", "two"]))
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for tensors, higher in layouts:
            tensors = {k: v.to(dtype) for k, v in tensors.items()}
            want = read([TensorStats(compile=False).describe(tensors, higher=higher)])
            got = read([TensorStats(compile=True).describe(tensors, higher=higher)])
            assert stats.ROW_KERNEL.failed is None, (dtype, higher, stats.ROW_KERNEL.failed)
            assert got.keys() == want.keys()
            assert all(got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12, nan_ok=True) for k in want)
    assert stats.ROW_KERNEL.calls == 4 * len(layouts) and counters["stats"]["unique_graphs"] > limit
    assert torch._dynamo.config.recompile_limit == limit


def test_auto_leaves_the_kernel_eager_where_algorithms_must_be_deterministic(monkeypatch):
    """repro.deterministic=true: the default describes eagerly (an inductor timing reduction configs may pick
    another summation order in another run); stats.compile=true still compiles. Checked with the CPU counted as
    a device that compiles by default."""
    monkeypatch.setattr(stats, "COMPILED", frozenset({"cpu"}))
    x = {"a": torch.randn(10)}

    def compiled(describer: TensorStats) -> bool:
        describer.describe(x)
        return [layout.compiled for layout in describer._layouts.values()] == [True]
    assert compiled(TensorStats())
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not compiled(TensorStats()) and compiled(TensorStats(compile=True))


def test_the_kernel_compiles_in_process_with_room_for_its_variants():
    """Within the kernel's calls only: inductor compiles in this process (no pool of workers per rank) and
    Dynamo allows 64 compiles of the function; outside, the user's settings."""
    import torch._dynamo
    import torch._inductor.config as inductor

    threads, limit = inductor.compile_threads, torch._dynamo.config.recompile_limit
    with stats._own_limits():
        assert inductor.compile_threads == 1 and torch._dynamo.config.recompile_limit == max(64, limit)
    assert (inductor.compile_threads, torch._dynamo.config.recompile_limit) == (threads, limit)
