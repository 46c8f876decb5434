"""TrainMeter: the task's metrics of a log period, summed on the device, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from hookexp.telemetry.meter import TrainMeter
from hookexp.workloads.tasks import CausalLM, Classification

# (logits, labels) per batch; the argmax of each logits row is its class
BATCHES = [
    ([[2.0, 0.0], [0.0, 2.0], [1.0, 0.0]], [0, 1, 1]),  # 2 of 3 correct
    ([[0.0, 3.0], [0.0, 1.0]], [1, 1]),  # 2 of 2
    ([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], [1, 1, 1, 1]),  # 2 of 4
]


def add(meter: TrainMeter, task, batches):
    losses = []
    for logits, labels in batches:
        batch = (None, torch.tensor(labels))
        loss = task.loss(torch.tensor(logits), batch)
        losses.append((loss.item(), len(labels)))
        meter.add(*task.sums(torch.tensor(logits), batch, loss))
    return losses


def read(meter: TrainMeter) -> dict:
    values, decode = meter.pending()
    assert values.dtype == torch.float64
    return decode(values.tolist())


def test_a_period_reads_example_weighted_loss_and_accuracy_then_starts_again():
    task = Classification()
    meter = TrainMeter(task, torch.device("cpu"))
    losses = add(meter, task, BATCHES)
    got = read(meter)
    assert got["train/loss"] == pytest.approx(sum(v * n for v, n in losses) / 9, rel=1e-12)
    assert got["train/acc"] == 6 / 9
    add(meter, task, BATCHES[1:2])
    assert read(meter)["train/acc"] == 1.0  # the new period holds batch 2 alone


def test_a_checkpoint_carries_the_period_so_far():
    task = Classification()
    meter = TrainMeter(task, torch.device("cpu"))
    add(meter, task, BATCHES[:2])
    resumed = TrainMeter(task, torch.device("cpu"))
    resumed.load_state_dict(meter.state_dict())
    add(meter, task, BATCHES[2:])
    add(resumed, task, BATCHES[2:])
    assert read(meter) == read(resumed)


def test_causal_lm_reads_token_weighted_loss_accuracy_and_perplexity():
    task = CausalLM()
    meter = TrainMeter(task, torch.device("cpu"))
    torch.manual_seed(0)
    logits, tokens = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    loss = task.loss(logits, tokens)
    meter.add(*task.sums(logits, tokens, loss))
    got = read(meter)
    assert got["train/loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert got["train/ppl"] == pytest.approx(torch.exp(loss).item(), rel=1e-6)
    right = (logits[:, :-1].argmax(-1) == tokens[:, 1:]).float().mean().item()
    assert got["train/acc"] == pytest.approx(right)
