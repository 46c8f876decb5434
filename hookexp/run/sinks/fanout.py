"""The trainer's one sink: :class:`Sinks` hands the local files and the backend the same values;
:class:`NullSinks` is what ranks other than 0 log to (nothing)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hookexp.run.sinks.base import Histograms, Sink
from hookexp.run.sinks.files import LocalFiles


class NullSinks:
    """What ranks other than 0 log to: nothing."""

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Histograms | None = None) -> None:
        pass

    def log_histograms(self, histograms: Histograms, step: int) -> None:
        pass

    def spike(self, row: Mapping[str, Any]) -> None:
        pass

    def image(self, key: str, path: Path, step: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        pass


class Sinks:
    """Fan-out to the local files and the backends (by their ``logger._target_``), in that order. ``log`` also
    takes the step's histograms (each sink gets them first, through ``log_histograms``). A sink that fails to
    finish does not stop the others; the first failure is raised once all have finished. :meth:`state_dict` is
    what a checkpoint keeps of the backends: their :meth:`Sink.resume_state` by ``_target_``."""

    def __init__(self, local: LocalFiles, backends: Mapping[str, Sink] | None = None):
        self.local = local
        self.backends = dict(backends or {})
        self.sinks: list[Sink] = [local, *self.backends.values()]

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Histograms | None = None) -> None:
        if histograms:
            self.log_histograms(histograms, step)
        for sink in self.sinks:
            sink.log(metrics, step)

    def log_histograms(self, histograms: Histograms, step: int) -> None:
        for sink in self.sinks:
            sink.log_histograms(histograms, step)

    def spike(self, row: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.spike(row)

    def image(self, key: str, path: Path, step: int) -> None:
        for sink in self.sinks:
            sink.image(key, path, step)

    def state_dict(self) -> dict[str, Any]:
        return {target: getattr(sink, "resume_state", dict)() for target, sink in self.backends.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing: a backend is given its kept state when it is made (:class:`RunInfo`, ``resume``)."""

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        errors: list[BaseException] = []
        for sink in self.sinks:
            try:
                sink.finish(summary, failed)
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]
