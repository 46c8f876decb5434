"""SIGTERM and SIGINT as a flag the loop checks after each step (:class:`StopSignals`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class StopSignals:
    """Turns SIGTERM/SIGINT into a flag: inside :meth:`catching`, the first signal sets :attr:`signum`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous_handlers: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    @property
    def requested(self) -> bool:
        """Whether a stop signal came."""
        return self.signum is not None

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        """SIGTERM and SIGINT set a flag for the whole block — the loop and the shutdown after it — so that a
        signal during shutdown cannot cut the summary or the W&B finish short (main thread only)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            yield
        finally:
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
            self._previous_handlers.clear()
