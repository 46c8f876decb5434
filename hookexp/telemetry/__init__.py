"""hookexp's telemetry: what a training run measures and how a log step reads it back.

``stats`` describes tensors (the one statistics path, shard-aware); ``readback`` is the protocol every
producer follows and the one device-to-host copy of a log step; ``probes`` keeps what a log step describes
(gradients, activations, weights, updates, optimizer state); ``meter`` sums the task's metrics between log
steps; ``guard`` is the non-finite guard and ``spike`` the spike recorder; ``assemble`` builds them all from
the ``stats`` and ``guard`` configs, for the trainer and ``watch``, which puts them into any training loop
(:func:`hookexp.watch`).
"""

from hookexp.telemetry.readback import Decode, Pending, Producer, read, wide_dtype
from hookexp.telemetry.stats import STATS, TensorStats, bin_edges

__all__ = ["STATS", "Decode", "Pending", "Producer", "TensorStats", "bin_edges", "read", "wide_dtype"]
