"""What a checkpoint restores into: anything with a ``state_dict`` (:class:`Stateful`) and the loop
position (:class:`LoopState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class LoopState:
    """Where the loop is: a new run starts at zero, a resumed one where its checkpoint stopped."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch being trained
    batch: int = 0  # batches of that epoch consumed
    last_log_step: int = 0  # the first step of the current log period
    evaluated: int = -1  # the last step after which validation ran
    train_s: float = 0.0  # seconds spent in training steps (validation and start-up aside)
    # the steps since the last log step and their batches: what a spike's row in spikes.jsonl lists
    period: list[dict[str, Any]] = field(default_factory=list)
