"""Structured hook values, kept as they are: tuples, lists, namedtuples, dicts, ``OrderedDict`` subclasses
such as transformers' ``ModelOutput``, and dataclasses come back as the same type with the same fields.

A hook sees a bare tensor or one of these. The engine transforms the tensors at its top level (or, with
``index``, one element picked by position or key) and rebuilds the value only where something changed,
so a module returning a ``ModelOutput`` still returns one, with its attributes, to the code after it.
``select`` (:class:`Selector`) narrows a tensor to a slice: neurons/positions along a dim, or heads of
the last dimension.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

from hookexp.errors import did_you_mean

Key = int | str


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def is_structured(value: Any) -> bool:
    return isinstance(value, (tuple, list, Mapping)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type))


def elements(value: Any) -> Iterator[tuple[Key, Any]]:
    """``(key, element)`` at the top level: positions of sequences, keys of mappings, fields of dataclasses."""
    if isinstance(value, (tuple, list)):
        yield from enumerate(value)
    elif isinstance(value, Mapping):
        yield from value.items()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield f.name, getattr(value, f.name)


def keys_of(value: Any) -> list[Key]:
    if _is_namedtuple(value):
        return list(type(value)._fields)
    return [k for k, _ in elements(value)]


def locate(value: Any, index: Key) -> Key | None:
    """The key of element ``index`` in ``value`` (None: the value is one tensor and index 0 picks it).

    Positions work on every structure (a mapping's keys in order: for a ``ModelOutput`` that is its
    tuple view); names work on mappings, dataclasses and namedtuples. Raises ``LookupError`` saying
    what the value holds.
    """
    if isinstance(value, torch.Tensor):
        if index in (0, -1):
            return None
        raise LookupError(f"index {index!r} picks from a structured value, and this one is a single tensor")
    if not is_structured(value):
        raise LookupError(f"index {index!r} picks from a structured value, and this one is {type(value).__name__}")
    keys = keys_of(value)
    what = type(value).__name__
    if isinstance(index, int):
        if not -len(keys) <= index < len(keys):
            raise LookupError(f"index {index} is out of range: the value is a {what} of {len(keys)} elements")
        if isinstance(value, (tuple, list)):
            return index % len(keys)
        return keys[index]
    if isinstance(value, (tuple, list)) and not _is_namedtuple(value):
        raise LookupError(f"index {index!r} is a name, and the value is a {what}, indexed by position")
    if index not in keys:
        raise LookupError(f"the {what} has no element {index!r}.{did_you_mean(index, [str(k) for k in keys])} "
                          f"Its elements: {', '.join(map(str, keys))}")
    return keys.index(index) if _is_namedtuple(value) else index


def get(value: Any, key: Key | None) -> Any:
    if key is None:
        return value
    if isinstance(value, (tuple, list, Mapping)):
        return value[key]
    return getattr(value, key)  # type: ignore[arg-type]


def rebuild(value: Any, changes: Mapping[Key, Any]) -> Any:
    """``value`` with the elements in ``changes`` replaced, as the same type with the same fields."""
    if not changes:
        return value
    if isinstance(value, (tuple, list)):
        out = list(value)
        for k, v in changes.items():
            out[k] = v  # type: ignore[index]
        if _is_namedtuple(value):
            return type(value)(*out)
        return type(value)(out)
    if isinstance(value, Mapping):
        if type(value) is dict:
            return {**value, **changes}
        if isinstance(value, MutableMapping):
            new = copy.copy(value)  # keeps the class (ModelOutput: its attributes follow __setitem__)
            for k, v in changes.items():
                new[k] = v
            return new
        return type(value)({**value, **changes})  # type: ignore[call-arg]
    new = copy.copy(value)  # a dataclass, frozen or not
    for k, v in changes.items():
        object.__setattr__(new, k, v)  # type: ignore[arg-type]
    return new


def map_tensors(value: Any, fn: Callable[[torch.Tensor, Key | None], torch.Tensor]) -> tuple[Any, bool]:
    """Apply ``fn(tensor, key)`` to a bare tensor or to the tensors at the top level of a structure.

    Returns the new value (the same object when nothing changed) and whether any tensor was seen.
    """
    if isinstance(value, torch.Tensor):
        return fn(value, None), True
    changes: dict[Key, Any] = {}
    seen = False
    for k, v in elements(value):
        if isinstance(v, torch.Tensor):
            seen = True
            new = fn(v, k)
            if new is not v:
                changes[k] = new
    return rebuild(value, changes), seen


def has_tensor(value: Any, depth: int = 3) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return depth > 0 and is_structured(value) and any(has_tensor(v, depth - 1) for _, v in elements(value))


def detach_copy(value: Any, to_cpu: bool = False) -> Any:
    """Detached copies of every tensor in a value, structure kept (tensors, sequences, mappings, dataclasses)."""
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        return out.cpu() if to_cpu else out
    if not is_structured(value):
        return value
    return rebuild(value, {k: detach_copy(v, to_cpu) for k, v in elements(value)
                           if isinstance(v, torch.Tensor) or is_structured(v)})


# ----------------------------------------------------------------------------------------------------
# select: the transform sees a slice; the rest of the tensor passes unchanged.


class Selector:
    """``select: {dim, index}`` or ``{heads, num_heads}``: take the slice, and put a new slice back out of place.

    Heads split the last dimension into ``num_heads`` equal parts (``[..., num_heads * head_dim]``, as an
    attention output or the input of its output projection is laid out) and pick some of them.
    """

    def __init__(self, select: Mapping[str, Any]):
        if "heads" in select:
            heads = select["heads"]
            self.heads: int | None = int(select["num_heads"])
            self.picks = [heads] if isinstance(heads, int) else list(heads)
            self.dim = -2
        else:
            self.heads = None
            index = select["index"]
            self.picks = [index] if isinstance(index, int) else list(index)
            self.dim = int(select["dim"])
        self._index: dict[torch.device, torch.Tensor] = {}  # the picks as a tensor, per device, made once

    def describe(self) -> str:
        if self.heads is not None:
            return f"heads {self.picks} of {self.heads}"
        return f"index {self.picks} along dim {self.dim}"

    def _view(self, x: torch.Tensor) -> torch.Tensor:
        if self.heads is None:
            return x
        if x.dim() == 0 or x.shape[-1] % self.heads:
            raise LookupError(f"select heads needs the last dimension to split into num_heads={self.heads} equal "
                              f"parts; the tensor has shape {tuple(x.shape)}")
        return x.unflatten(-1, (self.heads, x.shape[-1] // self.heads))

    def _picks(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[self.dim] if -x.dim() <= self.dim < x.dim() else None
        if size is None:
            raise LookupError(f"select dim {self.dim} does not exist in a tensor of shape {tuple(x.shape)}")
        bad = [i for i in self.picks if not -size <= i < size]
        if bad:
            raise LookupError(f"select index {bad} is out of range for dim {self.dim} of size {size} "
                              f"(shape {tuple(x.shape)})")
        idx = self._index.get(x.device)
        if idx is None:
            idx = self._index[x.device] = torch.tensor([i % size for i in self.picks], device=x.device)
        return idx

    def take(self, x: torch.Tensor) -> torch.Tensor:
        v = self._view(x)
        return v.index_select(self.dim, self._picks(v))

    def put(self, x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        v = self._view(x)
        return v.index_copy(self.dim, self._picks(v), part).reshape(x.shape)
