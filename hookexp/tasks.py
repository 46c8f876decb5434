"""Tasks: what a batch means, how the model is called, the loss, and the metrics.

A task is the objective of a run (config group ``task``): ``classification`` (the default),
``causal_lm``, ``regression``, or a user's own class given as ``task._target_: my_pkg.MyTask``.
It sees batches as the data gives them — a tuple/list ``(inputs..., target)`` or a mapping in the
style of HuggingFace (``input_ids``, ``attention_mask``, ``labels``) — and model outputs as they
come: a tensor, a tuple (the first element holds the logits), or a mapping / ``ModelOutput`` with
``logits`` (and ``loss``).

Metrics are kept as sums on the device (:meth:`Task.sums`), so a training step costs no host sync:
the trainer adds them up between log steps and reads them back with the statistics. A metric is
``sum / count``: for classification the count is examples, for ``causal_lm`` predicted tokens.

A user task subclasses :class:`Task` and overrides ``loss`` (and, for more metrics, ``metric_names``
and ``sums``)::

    class Hinge(hookexp.tasks.Task):
        def loss(self, output, batch):
            y = self.target(batch).float() * 2 - 1
            return torch.clamp(1 - y * output.squeeze(-1), min=0).mean()
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookexp.errors import ConfigError

INPUT_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "x", "inputs", "input")


def logits_of(output: Any, task: str = "task") -> torch.Tensor:
    """The logits of a model output: the tensor itself, ``output.logits`` / ``output["logits"]``, or the
    first tensor of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) or hasattr(output, "logits"):
        logits = output.get("logits") if isinstance(output, Mapping) else output.logits
        if isinstance(logits, torch.Tensor):
            return logits
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    fields = list(output.keys()) if isinstance(output, Mapping) else type(output).__name__
    raise ConfigError(f"the model's output has no logits for task {task!r} (got {fields}). Return a tensor, a tuple "
                      "whose first element is the logits, or a mapping/ModelOutput with a 'logits' field; or give "
                      "a task of your own (task._target_: my_pkg.MyTask).", key="task")


class Task:
    """The base class: how to call the model on a batch, the loss, the metrics (as on-device sums).

    ``metric_names`` are the metrics measured as sums; ``loss`` is always the first. The trainer logs
    them as ``train/<name>`` and ``val/<name>`` after :meth:`finish`.
    """

    name = "task"
    metric_names: tuple[str, ...] = ("loss",)

    def __init__(self) -> None:
        self._accepts: dict[int, tuple[set[str], bool]] = {}

    # -- calling the model ---------------------------------------------------------------------------
    def inputs(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments the model is called with: a mapping's entries other
        than ``labels`` (those the model's forward accepts), else every element of a tuple but its last
        (the target), else the batch itself."""
        if isinstance(batch, Mapping):
            return (), {k: v for k, v in batch.items() if k != "labels"}
        if isinstance(batch, (tuple, list)):
            return tuple(batch[:-1]) if len(batch) > 1 else tuple(batch), {}
        return (batch,), {}

    def forward(self, model: nn.Module, batch: Any) -> Any:
        args, kwargs = self.inputs(batch)
        if kwargs:
            kwargs = self._accepted(model, kwargs)
        return model(*args, **kwargs)

    def _accepted(self, model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Drop mapping entries the model's forward does not take (a data set's ``token_type_ids`` for a
        model without them); the signature is read once per model."""
        key = id(model)
        if key not in self._accepts:
            fn = getattr(model, "module", model)  # DDP / compiled wrappers forward to the module
            fn = getattr(fn, "_orig_mod", fn)
            params = inspect.signature(fn.forward).parameters.values()
            self._accepts[key] = ({p.name for p in params}, any(p.kind is p.VAR_KEYWORD for p in params))
        names, any_kw = self._accepts[key]
        return kwargs if any_kw else {k: v for k, v in kwargs.items() if k in names}

    def target(self, batch: Any) -> torch.Tensor:
        """What the model should predict: ``labels`` of a mapping, or the last element of a tuple."""
        if isinstance(batch, Mapping):
            if "labels" not in batch:
                raise ConfigError(f"task {self.name!r} needs the batch's 'labels', but the batch has only "
                                  f"{sorted(batch)}. Use data whose batches carry labels, or another task.",
                                  key="task")
            return batch["labels"]
        if isinstance(batch, (tuple, list)) and len(batch) > 1:
            return batch[-1]
        raise ConfigError(f"task {self.name!r} needs (inputs, target) batches, got "
                          f"{type(batch).__name__ if not isinstance(batch, Sequence) else f'a {len(batch)}-tuple'}. "
                          "Use data whose batches are (x, y) pairs or mappings with 'labels'.", key="task")

    # -- the objective ---------------------------------------------------------------------------------
    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def sums(self, output: Any, batch: Any, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sums, count)``: one on-device value per ``metric_names`` summed over the batch's counted
        items, and their number. The base counts examples and sums the loss alone."""
        n = self.count(batch)
        return (loss.detach().float() * n).reshape(1), n

    def count(self, batch: Any) -> torch.Tensor:
        target = self.target(batch)
        return torch.tensor(float(target.shape[0]) if target.dim() else 1.0, device=target.device)

    def finish(self, means: dict[str, float]) -> dict[str, float]:
        """Turn the means of ``metric_names`` into the logged metrics (e.g. perplexity from the loss)."""
        return means


class Classification(Task):
    """Cross-entropy over classes; ``acc``. Sequence models (logits ``[B, T, C]`` with one label per
    example) are classified from their last position, as the grokking papers read ``x op y =``."""

    name = "classification"
    metric_names = ("loss", "acc")

    def __init__(self, label_smoothing: float = 0.0):
        super().__init__()
        if not 0.0 <= label_smoothing < 1.0:
            raise ConfigError(f"needs 0 <= label_smoothing < 1, got {label_smoothing}.", key="task.label_smoothing")
        self.label_smoothing = label_smoothing

    def _logits(self, output: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits, y = logits_of(output, self.name), self.target(batch)
        if logits.dim() == 3 and y.dim() == 1:
            logits = logits[:, -1]
        return logits, y

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        logits, y = self._logits(output, batch)
        return F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)

    def sums(self, output: Any, batch: Any, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, y = self._logits(output, batch)
        n = torch.tensor(float(y.numel()), device=y.device)
        correct = (logits.detach().argmax(dim=-1) == y).sum()
        return torch.stack([loss.detach().float() * n, correct.float()]), n


class CausalLM(Task):
    """Next-token cross-entropy: the logits at position t predict the token at t + 1. Padding is not
    counted: positions whose label is ``ignore_index`` (HF's -100) or whose ``attention_mask`` is 0.
    ``ppl`` is exp(mean token loss); ``acc`` the share of predicted tokens that are right."""

    name = "causal_lm"
    metric_names = ("loss", "acc")

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = ignore_index

    def labels(self, batch: Any) -> torch.Tensor:
        """The next-token targets ``[B, T-1]``: the batch's ``labels`` (or its tokens) shifted by one,
        with masked positions set to ``ignore_index``."""
        if isinstance(batch, Mapping):
            tokens = batch.get("labels", batch.get("input_ids"))
            if tokens is None:
                raise ConfigError(f"task 'causal_lm' needs 'input_ids' (or 'labels') in the batch, which has only "
                                  f"{sorted(batch)}.", key="task")
            mask = batch.get("attention_mask")
        elif isinstance(batch, (tuple, list)):
            tokens, mask = batch[-1], None
        else:
            tokens, mask = batch, None
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
            raise ConfigError("task 'causal_lm' needs token batches of shape [batch, length] (integers), got "
                              f"{getattr(tokens, 'shape', type(tokens).__name__)}. Use a token data set "
                              "(data=text_file, data=hf_disk) or task=classification.", key="task")
        labels = tokens[:, 1:]
        if mask is not None:
            labels = labels.masked_fill(mask[:, 1:] == 0, self.ignore_index)
        return labels

    def _pair(self, output: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits_of(output, self.name)
        if logits.dim() != 3:
            raise ConfigError(f"task 'causal_lm' needs logits of shape [batch, length, vocab], got "
                              f"{tuple(logits.shape)}.", key="task")
        labels = self.labels(batch)
        return logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1)

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        logits, labels = self._pair(output, batch)
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index)

    def sums(self, output: Any, batch: Any, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, labels = self._pair(output, batch)
        counted = labels != self.ignore_index
        n = counted.sum().float()
        correct = ((logits.detach().argmax(dim=-1) == labels) & counted).sum()
        return torch.stack([loss.detach().float() * n, correct.float()]), n

    def finish(self, means: dict[str, float]) -> dict[str, float]:
        loss = means["loss"]
        return {**means, "ppl": math.exp(loss) if loss < 700 else math.inf}


class Regression(Task):
    """Mean squared error against float targets; ``mse`` (= the loss)."""

    name = "regression"

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        pred, y = logits_of(output, self.name), self.target(batch)
        if pred.shape != y.shape and pred.numel() == y.numel():
            pred = pred.reshape(y.shape)
        if pred.shape != y.shape:
            raise ConfigError(f"task 'regression' needs predictions shaped like the targets; got {tuple(pred.shape)} "
                              f"for targets {tuple(y.shape)}.", key="task")
        return F.mse_loss(pred.float(), y.float())

    def finish(self, means: dict[str, float]) -> dict[str, float]:
        return {**means, "mse": means["loss"]}
