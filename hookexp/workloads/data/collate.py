"""Batching variable-length token sequences: :class:`PadCollate` pads each batch to its longest sequence."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class PadCollate:
    """Batches mappings of variable-length token tensors: pads on the right to the longest in the batch.

    ``input_ids`` are padded with ``pad_id``, ``labels`` with ``label_pad`` (ignored by the loss),
    ``attention_mask`` and other sequences with 0; an ``attention_mask`` (1 = token, 0 = padding) is added when
    the examples have none. Scalars are stacked, non-tensor values (strings) kept as lists. A class, not a
    closure, so that DataLoader workers can pickle it.
    """

    def __init__(self, pad_id: int = 0, label_pad: int = -100):
        self.pad_id, self.label_pad = pad_id, label_pad

    def __repr__(self) -> str:
        return f"PadCollate(pad_id={self.pad_id}, label_pad={self.label_pad})"

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, Any]:
        if not examples or not isinstance(examples[0], Mapping):
            raise TypeError(f"pad_collate batches mappings such as {{'input_ids': ...}}, got "
                            f"{type(examples[0]).__name__ if examples else 'no examples'}")
        out: dict[str, Any] = {}
        for name in examples[0]:
            values = [e[name] for e in examples]
            if isinstance(values[0], (str, bytes)):
                out[name] = values
                continue
            tensors = [torch.as_tensor(v) for v in values]
            if tensors[0].dim() == 0:
                out[name] = torch.stack(tensors)
                continue
            pad = {"input_ids": self.pad_id, "labels": self.label_pad}.get(name, 0)
            out[name] = torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=pad)
        if "attention_mask" not in out and isinstance(out.get("input_ids"), torch.Tensor):
            lengths = torch.tensor([len(e["input_ids"]) for e in examples])
            out["attention_mask"] = (torch.arange(out["input_ids"].shape[1]) < lengths[:, None]).long()
        return out


def pad_collate(pad_id: int = 0, label_pad: int = -100) -> PadCollate:
    """The collate function for variable-length token mappings (``data.collate_fn: {_target_:
    hookexp.workloads.data.pad_collate, pad_id: 0}``); see :class:`PadCollate`."""
    return PadCollate(pad_id, label_pad)
