"""Tasks: what a batch means, how the model is called, the loss, and the metrics (docs/models.md).

A task (config group ``task``) is ``classification`` (the default), ``causal_lm``, ``regression`` or a user's
class (``task._target_``). It takes batches as tuples ``(inputs..., target)`` or HF-style mappings and outputs
as tensors, tuples (logits first) or mappings with ``logits``. Metrics are sums on the device
(:meth:`Task.sums`, ``sum / count``), so a step costs no host sync. ``inputs`` maps batch entries to
``forward`` parameters and ``model_loss`` takes the model's own loss (nanoGPT's ``forward(idx, targets)``). A
user task subclasses :class:`Task` and overrides ``loss`` (and ``metric_names`` and ``sums`` for more metrics).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookexp.errors import ConfigError, did_you_mean

INPUT_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "x", "inputs", "input")


def _shapes(output: Any) -> str:
    """A model output in words: its type and tensors' shapes (``a tuple (Tensor[4, 1, 65], None)``)."""
    def one(v: Any) -> str:
        return f"Tensor{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__ if v is not None \
            else "None"

    if isinstance(output, Mapping):
        return f"a mapping {{{', '.join(f'{k}: {one(v)}' for k, v in output.items())}}}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} ({', '.join(one(v) for v in output)})"
    return f"a {one(output)}"


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


class BatchEntry:
    """``task.inputs.<param>``: a batch entry by name (a mapping's key) or position (a tuple's), optionally
    sliced as in Python: ``input_ids``, ``input_ids[:, :-1]``, ``0``."""

    _FORM = re.compile(r"^\s*([A-Za-z_]\w*|\d+)\s*(?:\[(.*)\])?\s*$")

    def __init__(self, text: Any, key: str):
        self.text, self.key = str(text), key
        found = self._FORM.match(self.text) if isinstance(text, (str, int)) and not isinstance(text, bool) else None
        if found is None:
            raise ConfigError(f"{text!r} is not a batch entry. Give an entry's name (a mapping's key, e.g. "
                              "input_ids) or position (a tuple's, e.g. 0), optionally sliced as in Python: "
                              "input_ids[:, :-1] (all but the last token), input_ids[:, 1:] (the next tokens).",
                              key=key)
        name, index = found.groups()
        self.name: str | int = int(name) if name.isdigit() else name
        self.index = None if index is None else tuple(self._part(p.strip()) for p in index.split(","))

    def _part(self, text: str) -> int | slice:
        try:
            if ":" not in text:
                return int(text)
            bounds = [int(b) if b.strip() else None for b in text.split(":")]
            if len(bounds) <= 3:
                return slice(*bounds)
        except ValueError:
            pass
        raise ConfigError(f"{self.text!r}: cannot read the index {text!r}. Use integers and slices, e.g. "
                          "input_ids[:, :-1].", key=self.key)

    def take(self, batch: Any) -> Any:
        found = (isinstance(batch, Mapping) and isinstance(self.name, str) and self.name in batch) or \
            (isinstance(batch, (tuple, list)) and isinstance(self.name, int) and self.name < len(batch))
        if not found:
            has = (f"the keys {sorted(batch)}" if isinstance(batch, Mapping) else
                   f"{len(batch)} elements (positions 0 to {len(batch) - 1})" if isinstance(batch, (tuple, list))
                   else f"a {type(batch).__name__}")
            hint = did_you_mean(self.name, [str(k) for k in batch]) if isinstance(batch, Mapping) else ""
            raise ConfigError(f"the batch has no entry {self.name!r}: it has {has}.{hint}", key=self.key)
        value = batch[self.name]
        if self.index is None:
            return value
        part = value[self.index]  # contiguous, as a data loader gives it: research code calls .view() on it
        return part.contiguous() if isinstance(part, torch.Tensor) else part


class Task:
    """The base class: how to call the model on a batch, the loss, the metrics (as on-device sums).

    ``metric_names`` are the metrics measured as sums; ``loss`` is always the first. The trainer logs
    them as ``train/<name>`` and ``val/<name>`` after :meth:`finish`. ``inputs`` and ``model_loss``: see
    the module's docstring.
    """

    name = "task"
    metric_names: tuple[str, ...] = ("loss",)

    def __init__(self, inputs: Mapping[str, Any] | None = None, model_loss: bool | int | str | None = None) -> None:
        self._accepts: dict[int, tuple[set[str], bool]] = {}
        if inputs is not None and not isinstance(inputs, Mapping):
            raise ConfigError(f"expected a mapping of forward's parameters to batch entries, e.g. "
                              f"{{idx: input_ids}}, got {inputs!r}.", key="task.inputs")
        self.entries = {str(p): BatchEntry(e, f"task.inputs.{p}") for p, e in (inputs or {}).items()}
        if model_loss is False:
            model_loss = None
        if model_loss is not None and not isinstance(model_loss, (bool, int, str)):
            raise ConfigError(f"expected true (the output's .loss, a mapping's 'loss' or a tuple's one scalar), a "
                              f"tuple position or a key, got {model_loss!r}.", key="task.model_loss")
        self.model_loss = model_loss
        if model_loss is not None:  # the model's own loss replaces the task's, and the metrics are the loss's
            self.loss = self.returned_loss  # type: ignore[method-assign]
            self.sums = self._loss_sums  # type: ignore[method-assign]
            self.metric_names = ("loss",)

    # -- calling the model ---------------------------------------------------------------------------
    def inputs(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments the model is called with: ``task.inputs``' entries, else a
        mapping's entries other than ``labels`` (those the model's forward accepts), else every element of
        a tuple but its last (the target), else the batch itself."""
        if self.entries:
            return (), {param: entry.take(batch) for param, entry in self.entries.items()}
        if isinstance(batch, Mapping):
            return (), {k: v for k, v in batch.items() if k != "labels"}
        if isinstance(batch, (tuple, list)):
            return tuple(batch[:-1]) if len(batch) > 1 else tuple(batch), {}
        return (batch,), {}

    def forward(self, model: nn.Module, batch: Any) -> Any:
        args, kwargs = self.inputs(batch)
        if self.entries:
            self._check_parameters(model)
        elif kwargs:
            kwargs = self._accepted(model, kwargs)
        return model(*args, **kwargs)

    def _signature(self, model: nn.Module) -> tuple[set[str], bool]:
        """The names ``model``'s forward takes and whether it takes ``**kwargs``; read once per model."""
        key = id(model)
        if key not in self._accepts:
            fn = getattr(model, "module", model)  # DDP / compiled wrappers forward to the module
            fn = getattr(fn, "_orig_mod", fn)
            params = inspect.signature(fn.forward).parameters.values()
            self._accepts[key] = ({p.name for p in params}, any(p.kind is p.VAR_KEYWORD for p in params))
        return self._accepts[key]

    def _accepted(self, model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Drop mapping entries the model's forward does not take (a data set's ``token_type_ids`` for a
        model without them)."""
        names, any_kw = self._signature(model)
        return kwargs if any_kw else {k: v for k, v in kwargs.items() if k in names}

    def _check_parameters(self, model: nn.Module) -> None:
        names, any_kw = self._signature(model)
        for param in self.entries:
            if param not in names and not any_kw:
                inner = getattr(getattr(model, "module", model), "_orig_mod", getattr(model, "module", model))
                raise ConfigError(f"{type(inner).__name__}.forward() has no parameter {param!r}."
                                  f"{did_you_mean(param, sorted(names))} Its parameters: {', '.join(sorted(names))}.",
                                  key=f"task.inputs.{param}")

    # -- the loss the model returns (task.model_loss) ----------------------------------------------------
    def returned_loss(self, output: Any, batch: Any) -> torch.Tensor:
        """The loss in the model's output, as ``model_loss`` says where."""
        how, loss = self.model_loss, None
        if how is True:
            loss = output.get("loss") if isinstance(output, Mapping) else None
            if loss is None:
                loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, (tuple, list)):
                scalars = [o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0]
                loss = scalars[0] if len(scalars) == 1 else None
        elif isinstance(how, int):
            if isinstance(output, (tuple, list)) and -len(output) <= how < len(output):
                loss = output[how]
        elif isinstance(output, Mapping):
            loss = output.get(how)
        else:
            loss = getattr(output, str(how), None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            where = ".loss, a mapping's 'loss' or a tuple's one scalar tensor" if how is True else repr(how)
            raise ConfigError(f"the model's output has no loss at {where}; it returned "
                              f"{_shapes(output)}. Pass the targets the model computes its loss from (task.inputs, "
                              "e.g. {idx: 'input_ids[:, :-1]', targets: 'input_ids[:, 1:]'}), or point model_loss at "
                              "the loss: a tuple position (1 for (logits, loss)) or a key.", key="task.model_loss")
        return loss.reshape(()).float()

    def _loss_sums(self, output: Any, batch: Any, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss summed over the batch's examples (the model's loss is their mean)."""
        first = next(iter(self.inputs(batch)[1].values()), None)
        n = torch.full((), float(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1.0,
                       device=loss.device)  # a fill, not a host-to-device copy: no sync on a GPU
        return (loss.float() * n).reshape(1), n

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
        items, and their number. The base counts examples and sums the loss alone. Called under
        ``torch.no_grad()`` (no ``detach`` needed), after the backward pass, on every micro-batch: each op
        here is paid on every step."""
        n = self.count(batch)
        return (loss.float() * n).reshape(1), n

    def count(self, batch: Any) -> torch.Tensor:
        target = self.target(batch)
        return torch.full((), float(target.shape[0]) if target.dim() else 1.0, device=target.device)

    def finish(self, means: dict[str, float]) -> dict[str, float]:
        """Turn the means of ``metric_names`` into the logged metrics (e.g. perplexity from the loss)."""
        return means


class Classification(Task):
    """Cross-entropy over classes; ``acc``. Sequence models (logits ``[B, T, C]`` with one label per
    example) are classified from their last position, as the grokking papers read ``x op y =``."""

    name = "classification"
    metric_names = ("loss", "acc")

    def __init__(self, label_smoothing: float = 0.0, inputs: Mapping[str, Any] | None = None,
                 model_loss: bool | int | str | None = None):
        super().__init__(inputs, model_loss)
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
        n = torch.full((), float(y.numel()), device=y.device)  # a fill, not a host-to-device copy: no sync
        correct = (logits.argmax(dim=-1) == y).sum()
        return torch.stack([loss.float() * n, correct]), n  # stack promotes the count to the loss's float


class CausalLM(Task):
    """Next-token cross-entropy: the logits at position t predict the token at t + 1. Padding is not
    counted: positions whose label is ``ignore_index`` (HF's -100) or whose ``attention_mask`` is 0.
    ``ppl`` is exp(mean token loss); ``acc`` the share of predicted tokens that are right."""

    name = "causal_lm"
    metric_names = ("loss", "acc")

    def __init__(self, ignore_index: int = -100, inputs: Mapping[str, Any] | None = None,
                 model_loss: bool | int | str | None = None):
        super().__init__(inputs, model_loss)
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
                              f"{tuple(logits.shape)}: the model predicts one vector per example, not a token per "
                              "position. Train a language model on text (model=gpt data=text_file "
                              "data.path=FILE), or use task=classification for this model and data.",
                              key="task")
        labels = self.labels(batch)
        return logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1)

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        logits, labels = self._pair(output, batch)
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index)

    def sums(self, output: Any, batch: Any, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits_of(output, self.name)
        if logits.dim() != 3:
            self._pair(output, batch)  # its error
        labels = self.labels(batch)
        # the predictions at [B, T-1] without the loss's flattened copy of the logits; an ignored position never
        # counts as right when ignore_index is negative (no prediction equals it), so no mask is needed then
        right = logits[:, :-1].argmax(dim=-1) == labels
        if self.ignore_index >= 0:
            right = right & (labels != self.ignore_index)
        n = (labels != self.ignore_index).sum()
        return torch.stack([loss.float() * n, right.sum()]), n

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
