"""The trainer's own price, counted: the aten ops a training step dispatches beyond the hand-written loop's
(``benchmarks/opcount.py``'s count: a ``TorchDispatchMode``, marginal over a number of steps, so building,
validation and the first and last log steps cancel). Counts do not depend on the machine: exact."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
OWN_OPS = 15  # the metric sums, the guard's finiteness check and the meter's two adds (benchmarks/README.md)


def opcount():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("opcount", BENCHMARKS / "opcount.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", ["small_cnn", "gpt_small"])
def test_the_trainers_step_costs_at_most_15_ops_over_the_hand_loop(model):
    oc = opcount()
    cfg = [*oc.MODELS[model].overrides, "trainer.device=cpu"]
    # 4 -> 8 steps stay inside the first epoch of both data sets (no sampler ops at an epoch's start)
    hand = oc.per_step(None, cfg, [], 4, 8, warmup=1)
    runs, extra = oc.case_runs(oc.MODELS[model])["b_nofx"]
    trainer = oc.per_step(runs, cfg, [*extra, *oc.NO_LOG], 4, 8, warmup=1)
    assert hand - trainer == {}, "the trainer leaves out an op of the hand loop"
    own = trainer - hand
    assert sum(own.values()) <= OWN_OPS, f"the trainer's own ops per step: {dict(own)}"
    # what stays: the guard's one foreach max-norm and its read-back (on the CPU), the meter's two adds
    assert own["_foreach_norm"] == 1 and own["_local_scalar_dense"] == 1 and own["add_"] == 2


def test_the_bytes_an_op_reads_and_writes_are_its_distinct_tensors_and_a_view_moves_none():
    oc = opcount()
    x, y = torch.randn(1000), torch.randn(1000)

    def moved(f, device="cpu"):
        mode = oc.Count(device)
        with mode:
            f()
        return dict(mode.ops), dict(mode.bytes)

    # a step of one sum: the marginal count reads the tensor and writes the scalar
    ops, moved_bytes = oc.marginal(lambda model, steps, extra: [x.sum() for _ in range(steps)], [], [], 2, 5, 0)
    assert ops == {"sum": 1} and moved_bytes == {"sum": x.nbytes + x.sum().nbytes}
    # a step whose size changes: the mean of the marginal steps' (sums of 102, 103 and 104 elements)
    ops, moved_bytes = oc.marginal(lambda model, steps, extra: [x[:100 + i].sum() for i in range(steps)],
                                   [], [], 2, 5, 0)
    assert ops == {"slice": 1, "sum": 1} and moved_bytes == {"slice": 0, "sum": 103 * 4 + 4}
    # one odd step in the window (an epoch's shorter last batch): a step's bytes are a full step's
    ops, moved_bytes = oc.marginal(lambda model, steps, extra: [x[:10 if i == 4 else 1000].sum() for i in range(steps)],
                                   [], [], 2, 6, 0)
    assert ops == {"slice": 1, "sum": 1} and moved_bytes == {"slice": 0, "sum": x.nbytes + 4}
    assert moved(lambda: x.add_(y)) == ({"add_": 1}, {"add_": 3 * x.nbytes})  # x read and written, y read
    # x read once, whichever tensor object holds it
    assert moved(lambda: x.mul(x.detach())) == ({"detach": 1, "mul": 1}, {"detach": 0, "mul": 2 * x.nbytes})
    z = torch.empty(1000)
    assert moved(lambda: torch.add(x, y, out=z)) == ({"add": 1}, {"add": 3 * x.nbytes})  # out= written only
    assert moved(lambda: z.copy_(x)) == ({"copy_": 1}, {"copy_": 2 * x.nbytes})  # copy_ overwrites z unread
    assert moved(lambda: x.view(10, 100).t()) == ({"view": 1, "t": 1}, {"view": 0, "t": 0})
    assert moved(lambda: torch.empty_like(x)) == ({"empty_like": 1}, {"empty_like": 0})
    # a broadcast input counts its distinct elements, a multi-tensor op each of its tensors
    assert moved(lambda: x.expand(8, 1000).sum(0))[1] == {"expand": 0, "sum": 2 * x.nbytes}
    assert moved(lambda: torch._foreach_norm([x, y]))[1] == {"_foreach_norm": 2 * x.nbytes + 2 * x.sum().nbytes}
    # a gather reads, and an in-place scatter reads and writes, only as many elements as its index picks
    at, values = torch.tensor([3, 1, 4, 1, 5]), torch.ones(5)
    assert moved(lambda: x.take(at))[1] == {"take": 5 * 4 + at.nbytes + 5 * 4}
    assert moved(lambda: x.index_put_((at,), values))[1] == {"index_put_": at.nbytes + values.nbytes + 2 * 5 * 4}
    # only tensors on the step's device count: none here for a CUDA step
    assert moved(lambda: x.sum(), device="cuda") == ({"sum": 1}, {"sum": 0})
