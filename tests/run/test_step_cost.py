"""The trainer's own price, counted: the aten ops a training step dispatches beyond the hand-written loop's
(``benchmarks/opcount.py``'s count: a ``TorchDispatchMode``, marginal over a number of steps, so building,
validation and the first and last log steps cancel). Counts do not depend on the machine: exact."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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
