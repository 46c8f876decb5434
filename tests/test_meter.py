"""TrainMeter: the loss and accuracy a log step reads, against hand-computed values, for one batch since the
last log step, several, more than FOLD (folded on the device), a non-finite loss, and a resumed carry.

Every test runs both readings: the device's (one float64 tensor for the log step's single transfer) and
the CPU's (host values straight away); both must give the same numbers."""

from __future__ import annotations

import math

import pytest
import torch

from hookexp.meter import TrainMeter

# (loss, logits, labels) per batch; the argmax of each logits row is its class
BATCHES = [
    (0.5, [[2.0, 0.0], [0.0, 2.0], [1.0, 0.0]], [0, 1, 1]),  # 2 of 3 correct
    (0.25, [[0.0, 3.0], [0.0, 1.0]], [1, 1]),  # 2 of 2
    (1.125, [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], [1, 1, 1, 1]),  # 2 of 4
    (0.75, [[0.0, 1.0]], [0]),  # 0 of 1
    (0.375, [[5.0, 1.0], [0.0, 1.0]], [0, 1]),  # 2 of 2
]
CORRECT = [2, 2, 2, 0, 2]


@pytest.fixture(autouse=True, params=["device", "host"])
def reading(request, monkeypatch):
    """Which reading :meth:`TrainMeter.pending` gives: the device tensor (what a GPU takes), or host values."""
    init = TrainMeter.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        assert self.host  # the CPU without DDP reads on the host by itself
        self.host = request.param == "host"

    monkeypatch.setattr(TrainMeter, "__init__", patched)
    return request.param


def period(meter: TrainMeter, batches: list, first_step: int) -> tuple[float, float, int | None]:
    """Add ``batches`` as the steps from ``first_step`` on, then read them as a log step does."""
    for i, (loss, logits, labels) in enumerate(batches):
        meter.add(first_step + i, torch.tensor(loss), torch.tensor(logits), torch.tensor(labels))
    pending = meter.pending()
    if meter.host:
        assert isinstance(pending, list) and all(type(v) is float for v in pending)
    else:
        assert pending.dtype == torch.float64
        pending = pending.tolist()
    return meter.read(pending)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_loss_and_accuracy_of_one_or_several_batches(n):
    meter = TrainMeter(torch.device("cpu"))
    loss, acc, first_bad = period(meter, BATCHES[:n], first_step=7)
    assert loss == sum(b[0] for b in BATCHES[:n]) / n  # exact: every loss is a dyadic fraction
    assert acc == sum(CORRECT[:n]) / sum(len(b[2]) for b in BATCHES[:n])
    assert first_bad is None
    # the next period starts afresh
    assert period(meter, BATCHES[3:4], first_step=7 + n) == (0.75, 0.0, None)


def test_folding_on_the_device_changes_nothing(monkeypatch):
    monkeypatch.setattr(TrainMeter, "FOLD", 2)  # 5 batches: folded twice, one kept
    folded = period(TrainMeter(torch.device("cpu")), BATCHES, first_step=0)
    monkeypatch.setattr(TrainMeter, "FOLD", 256)
    assert folded == period(TrainMeter(torch.device("cpu")), BATCHES, first_step=0)
    assert folded == (sum(b[0] for b in BATCHES) / 5, 8 / 12, None)


@pytest.mark.parametrize("fold", [2, 256])
def test_the_first_non_finite_loss_is_named_by_its_step(monkeypatch, fold):
    monkeypatch.setattr(TrainMeter, "FOLD", fold)
    batches = [BATCHES[0], BATCHES[1], (math.nan, *BATCHES[2][1:]), (math.inf, *BATCHES[3][1:]), BATCHES[4]]
    loss, acc, first_bad = period(TrainMeter(torch.device("cpu")), batches, first_step=40)
    assert first_bad == 42 and math.isnan(loss) and acc == 8 / 12


def test_a_resumed_carry_is_part_of_the_first_period():
    meter = TrainMeter(torch.device("cpu"), loss_sum=1.5, correct=3, seen=4, batches=2, first_step=10)
    loss, acc, first_bad = period(meter, BATCHES[:1], first_step=12)
    assert (loss, acc, first_bad) == ((1.5 + 0.5) / 3, (3 + 2) / (4 + 3), None)
