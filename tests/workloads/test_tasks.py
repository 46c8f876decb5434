"""Tasks against the same objective written by hand with plain torch: loss, metric sums, batch forms."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookexp.errors import ConfigError
from hookexp.workloads.tasks import CausalLM, Classification, Regression, Task, logits_of


@dataclass
class Output(OrderedDict):  # what a HF ModelOutput looks like: a mapping with attributes
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None

    def __post_init__(self):
        self["logits"] = self.logits


def test_classification_loss_and_accuracy_equal_cross_entropy_by_hand():
    torch.manual_seed(0)
    logits, y = torch.randn(7, 5), torch.randint(0, 5, (7,))
    task = Classification()
    loss = task.loss(logits, (None, y))
    assert torch.equal(loss, F.cross_entropy(logits, y))
    sums, n = task.sums(logits, (None, y), loss)
    assert n.item() == 7
    assert sums[0].item() == pytest.approx(F.cross_entropy(logits, y, reduction="sum").item(), rel=1e-6)
    assert sums[1].item() == (logits.argmax(1) == y).sum().item()
    assert task.finish({"loss": 1.0, "acc": 0.5}) == {"loss": 1.0, "acc": 0.5}


def test_classification_of_a_sequence_model_reads_its_last_position():
    torch.manual_seed(1)
    logits, y = torch.randn(4, 6, 9), torch.randint(0, 9, (4,))  # [B, T, V] and one label each
    task = Classification()
    for output in (logits, (logits, torch.zeros(1)), Output(logits=logits), {"logits": logits}):
        assert torch.equal(task.loss(output, {"input_ids": None, "labels": y}), F.cross_entropy(logits[:, -1], y))


def test_causal_lm_shifts_and_ignores_padding_like_the_hand_written_loss():
    torch.manual_seed(2)
    tokens = torch.randint(0, 11, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0  # padding at the end of example 1
    logits = torch.randn(3, 8, 11)
    batch = {"input_ids": tokens, "attention_mask": mask}
    task = CausalLM()
    loss = task.loss(logits, batch)
    target = tokens[:, 1:].clone()
    target[mask[:, 1:] == 0] = -100
    by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, 11), target.reshape(-1), ignore_index=-100)
    assert torch.equal(loss, by_hand)
    sums, n = task.sums(logits, batch, loss)
    counted = target != -100
    assert n.item() == counted.sum().item() == 3 * 7 - 3  # example 1's last 3 targets are padding
    right = (logits[:, :-1].argmax(-1) == target) & counted
    assert sums[1].item() == right.sum().item()
    assert task.finish({"loss": 2.0, "acc": 0.25})["ppl"] == pytest.approx(math.exp(2.0))
    # HF-style labels with -100 are used as given; a bare token tensor is its own target
    labels = target.new_full((3, 8), -100)
    labels[:, 1:] = target
    assert torch.equal(task.loss(logits, {"input_ids": tokens, "labels": labels}), by_hand)
    assert torch.equal(task.loss(logits, tokens), F.cross_entropy(logits[:, :-1].reshape(-1, 11),
                                                                   tokens[:, 1:].reshape(-1)))


def test_regression_is_mse_and_reports_it():
    pred, y = torch.randn(5, 3), torch.randn(5, 3)
    task = Regression()
    assert torch.equal(task.loss(pred, (None, y)), F.mse_loss(pred, y))
    assert task.finish({"loss": 0.5}) == {"loss": 0.5, "mse": 0.5}
    column, targets = torch.randn(5, 1), torch.randn(5)  # a [B, 1] head against [B] targets
    assert torch.equal(task.loss(column, (None, targets)), F.mse_loss(column.reshape(5), targets))
    with pytest.raises(ConfigError, match=r"needs predictions shaped like the targets; got \(5, 2\)"):
        task.loss(torch.randn(5, 2), (None, targets))


def test_forward_passes_mapping_entries_the_model_takes_and_not_labels():
    seen = {}

    class Net(nn.Module):
        def forward(self, input_ids, attention_mask=None):
            seen.update(input_ids=input_ids, attention_mask=attention_mask)
            return input_ids.float()

    batch = {"input_ids": torch.ones(2, 3), "attention_mask": torch.zeros(2, 3), "token_type_ids": torch.ones(2, 3),
             "labels": torch.ones(2, 3)}
    CausalLM().forward(Net(), batch)
    assert seen["attention_mask"] is batch["attention_mask"]
    x = torch.randn(2, 4)
    assert torch.equal(Task().forward(nn.Identity(), (x, torch.zeros(2))), x)


def test_wrong_batches_and_outputs_are_one_paragraph_errors():
    with pytest.raises(ConfigError, match=r"^task: task 'classification' needs the batch's 'labels', but the batch "
                                          r"has only \['input_ids'\]"):
        Classification().loss(torch.randn(2, 3), {"input_ids": torch.zeros(2, 3)})
    with pytest.raises(ConfigError, match=r"^task: the model's output has no logits for task 'causal_lm' \(got "
                                          r"\['hidden'\]\)"):
        CausalLM().loss({"hidden": torch.zeros(1)}, {"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(ConfigError, match=r"needs token batches of shape \[batch, length\] \(integers\), got "
                                          r"torch.Size\(\[2, 3\]\)"):
        CausalLM().loss(torch.randn(2, 3, 4), (torch.randn(2, 3),))
    with pytest.raises(ConfigError, match=r"^task\.label_smoothing: needs 0 <= label_smoothing < 1"):
        Classification(label_smoothing=1.5)
    assert logits_of((torch.ones(1), "x")).shape == (1,)


class OwnLoss(nn.Module):
    """nanoGPT's contract: (logits, loss) with targets; (last position's logits, None) without."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 10)

    def forward(self, idx, targets=None):
        logits = self.emb(idx)
        if targets is None:
            return logits[:, [-1]], None
        return logits, F.cross_entropy(logits.reshape(-1, 10), targets.reshape(-1))


def test_task_inputs_map_shifted_batch_entries_to_forward_and_model_loss_takes_the_returned_loss():
    """The loss is the model's own, computed from the shifted next tokens, exactly."""
    torch.manual_seed(0)
    model, tokens = OwnLoss(), torch.randint(0, 10, (3, 9))
    task = CausalLM(inputs={"idx": "input_ids[:, :-1]", "targets": "input_ids[:, 1:]"}, model_loss=1)
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    output = task.forward(model, batch)
    loss = task.loss(output, batch)
    assert torch.equal(loss, F.cross_entropy(model.emb(tokens[:, :-1]).reshape(-1, 10), tokens[:, 1:].reshape(-1)))
    assert task.metric_names == ("loss",) and CausalLM.metric_names == ("loss", "acc")
    sums, n = task.sums(output, batch, loss)
    assert n.item() == 3 and sums.tolist() == [pytest.approx(3 * loss.item())]
    assert task.finish({"loss": 2.0}) == {"loss": 2.0, "ppl": math.exp(2.0)}
    # the loss found by `true` in each form a model returns it, and by position or key
    scalar = torch.tensor(1.5)
    found = Task(model_loss=True)
    for out in ((torch.zeros(2, 3), scalar), {"logits": torch.zeros(1), "loss": scalar},
                Output(logits=torch.zeros(1), loss=scalar)):
        assert found.loss(out, batch) == 1.5
    assert Task(model_loss="nll").loss({"nll": scalar}, batch) == 1.5
    assert Task(inputs={"x": 0}).inputs((torch.ones(2), torch.zeros(2)))[1]["x"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(("task", "batch", "message"), [
    (lambda: CausalLM(inputs={"idx": "input_ids"}, model_loss=1), {"input_ids": torch.zeros(2, 4).long()},
     "task.model_loss: the model's output has no loss at 1; it returned a tuple (Tensor[2, 1, 10], None). Pass the "
     "targets the model computes its loss from (task.inputs, e.g. {idx: 'input_ids[:, :-1]', targets: "
     "'input_ids[:, 1:]'}), or point model_loss at the loss: a tuple position (1 for (logits, loss)) or a key."),
    (lambda: CausalLM(inputs={"idz": "input_ids"}), {"input_ids": torch.zeros(2, 4).long()},
     "task.inputs.idz: OwnLoss.forward() has no parameter 'idz'. Did you mean 'idx'? Its parameters: idx, targets."),
    (lambda: CausalLM(inputs={"idx": "input_idz[:, :-1]"}), {"input_ids": torch.zeros(2, 4).long()},
     "task.inputs.idx: the batch has no entry 'input_idz': it has the keys ['input_ids']. Did you mean 'input_ids'?"),
    (lambda: CausalLM(inputs={"idx": "input_ids[:, a:]"}), {},
     "task.inputs.idx: 'input_ids[:, a:]': cannot read the index 'a:'. Use integers and slices, e.g. "
     "input_ids[:, :-1]."),
    (lambda: CausalLM(inputs={"idx": "input ids"}), {},
     "task.inputs.idx: 'input ids' is not a batch entry. Give an entry's name (a mapping's key, e.g. input_ids) or "
     "position (a tuple's, e.g. 0), optionally sliced as in Python: input_ids[:, :-1] (all but the last token), "
     "input_ids[:, 1:] (the next tokens)."),
])
def test_task_inputs_and_model_loss_mistakes_name_their_key(task, batch, message):
    with pytest.raises(ConfigError) as e:
        made = task()
        made.loss(made.forward(OwnLoss(), batch), batch)
    assert str(e.value) == message
