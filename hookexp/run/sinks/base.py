"""What every sink implements (:class:`Sink`) and what a backend is given (:class:`RunInfo`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

STEP_KEY = "trainer/step"


Histograms = Mapping[str, tuple[Any, Any]]  # key -> (counts, bin edges): float lists or 1-d float64 arrays


class Sink(Protocol):
    """Where a run's records go. The trainer hands every sink the same values in the same order: on a log step
    ``log_histograms`` (when there are histograms) and then ``log`` for the same step; ``spike`` for each spike the
    spike recorder found (:mod:`hookexp.telemetry.spike`); ``image`` for a plot written at the end; ``finish``
    once, last. ``resume_state`` is kept in each checkpoint and handed back to the sink of a run resumed from it
    (:class:`RunInfo`, ``resume``): W&B's run id, so that the resumed run continues the same W&B run. Local files
    (:class:`LocalFiles`) are always written; ``logger._target_`` adds one backend (:func:`make_backend`)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def log_histograms(self, histograms: Histograms, step: int) -> None: ...

    def spike(self, row: Mapping[str, Any]) -> None: ...

    def image(self, key: str, path: Path, step: int) -> None: ...

    def resume_state(self) -> dict[str, Any]: ...

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None: ...


@dataclass(frozen=True)
class RunInfo:
    """What a backend is given besides its own ``logger`` keys: the run directory, the config as run (resolved,
    the model's arguments as built), the hooks table, and for a resumed run the step it resumes from and what
    this backend's :meth:`Sink.resume_state` returned when the checkpoint was written (None: a new run, or a
    checkpoint written with another backend)."""

    run_dir: Path
    config: dict[str, Any] = field(default_factory=dict)
    hooks_table: list[dict[str, Any]] = field(default_factory=list)
    resumed_step: int | None = None
    resume: dict[str, Any] | None = None
