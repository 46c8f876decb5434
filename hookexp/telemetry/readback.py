"""The one read-back of a log step: every producer hands over a device tensor and a decoder.

A producer (gradient statistics, the train meter, hook effects, the guard) implements :class:`Producer`:
``pending()`` returns ``(values, decode)``, where ``values`` is a tensor of any shape on the training
device (or None: nothing to read) computed without a host sync, and ``decode(host)`` turns that tensor's
host copy, a flat float64 numpy array (float32 on MPS, which has no float64), into ``{key: value}``:
floats for metrics, ``(counts, edges)`` numpy pairs for histograms (keys ending in ``/hist``).
:func:`read` joins every producer's values into one tensor and copies it to the host once: one sync a
log step, whatever the number of producers, and no producer reads another's values by position; a
:class:`Flight` is the same copy landed later (the trainer's log step on CUDA: a step later, no sync).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import numpy as np
import torch

Decode = Callable[[np.ndarray], dict[str, Any]]
Pending = tuple["torch.Tensor | None", Decode]


class Producer(Protocol):
    def pending(self) -> Pending:
        """This log step's values (no host sync) and the decoder of their host copy."""
        ...


def wide_dtype(device: torch.device) -> torch.dtype:
    """What sums and read-backs are kept in: float64, except on MPS (which has none)."""
    return torch.float32 if device.type == "mps" else torch.float64


def profiler_range(name: str) -> AbstractContextManager[Any]:
    """``torch.profiler.record_function(name)`` while a profiler records, else nothing: a range dispatches two ops
    and costs microseconds. The log step's ranges (``hookexp/...``) are what benchmarks/profile_step.py reads."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else nullcontext()


def read(pending: Iterable[Pending]) -> dict[str, Any]:
    """Every producer's values, read back in one device-to-host copy and decoded into one dict."""
    return Flight(pending).land()


class Flight:
    """Every producer's values on their way to the host: joined on the device and, on CUDA, copied into pinned
    memory behind the work queued so far, without a host sync; :meth:`land` waits for the copy (if it is not
    done yet) and decodes. Landed a step later, the copy waits for nothing: the GPU is busy with that step."""

    def __init__(self, pending: Iterable[Pending]):
        self.pending = list(pending)
        parts = [t for t, _ in self.pending if t is not None]
        self.host: torch.Tensor | None = None
        self.event: Any = None
        if not parts:
            return
        with profiler_range("hookexp/read"):
            device = next((t.device for t in parts if t.device.type != "cpu"), parts[0].device)
            joined = torch.cat([t.detach().reshape(-1).to(device, wide_dtype(device)) for t in parts])
            if joined.is_cuda:
                self.host = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=True)
                self.host.copy_(joined, non_blocking=True)  # the one transfer
                self.event = torch.cuda.Event()
                self.event.record()
            else:
                self.host = joined.cpu()  # on the CPU a view: nothing moves

    def land(self) -> dict[str, Any]:
        """The decoded values (key -> float, ``.../hist`` keys -> (counts, edges))."""
        if self.event is not None:
            with profiler_range("hookexp/read"):
                self.event.synchronize()
        host = self.host.numpy() if self.host is not None else np.empty(0)
        out: dict[str, Any] = {}
        start = 0
        with profiler_range("hookexp/decode"):
            for values, decode in self.pending:
                n = 0 if values is None else values.numel()
                out.update(decode(host[start:start + n]))
                start += n
        return out


def split_histograms(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(scalars, histograms) of what :func:`read` gave: the ``.../hist`` keys hold ``(counts, edges)`` pairs."""
    scalars: dict[str, Any] = {}
    hists: dict[str, Any] = {}
    for k, v in values.items():
        (hists if k.endswith("/hist") else scalars)[k] = v
    return scalars, hists
