"""hookexp's telemetry: what a training run measures and how a log step reads it back.

``stats`` describes tensors (the one statistics path, shard-aware); ``readback`` is the protocol every
producer follows and the one device-to-host copy of a log step; ``probes`` keeps what a log step describes
(gradients, activations, weights, updates, optimizer state); ``meter`` sums the task's metrics between log
steps; ``guard`` is the non-finite guard and ``spike`` the spike recorder; ``watch`` puts the probes into any
training loop (:func:`hookexp.watch`).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"read": "readback", "wide_dtype": "readback", "Decode": "readback", "Pending": "readback",
         "Producer": "readback", "STATS": "stats", "TensorStats": "stats", "bin_edges": "stats"}

__all__ = ["STATS", "Decode", "Pending", "Producer", "TensorStats", "bin_edges", "read", "wide_dtype"]


def __getattr__(name: str) -> Any:  # lazily: hookexp.telemetry.settings (the config schema's) imports no torch
    if name in _LAZY:
        return getattr(importlib.import_module(f"hookexp.telemetry.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'hookexp.telemetry' has no attribute {name!r}")
