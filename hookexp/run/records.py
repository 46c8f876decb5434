"""``records/<spec>.pt``: what ``record`` transforms kept, saved at every checkpoint and at the end.

The files are written atomically with every record so far, and a checkpoint stores how many records each
spec had: a resumed run reads the files back, keeps exactly those (the ones a killed run made after its
checkpoint are made again), and goes on appending. Each file is a list of ``{target, step, value, aux}``
(detached CPU or device tensors), read with ``torch.load(path, weights_only=True)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hookexp.engine import Record
from hookexp.run.checkpoint import atomic_save


def _file_name(spec: str) -> str:
    return spec.replace("/", "_").replace(":", "_") + ".pt"


class Records:
    def __init__(self, hooks: Any, run_dir: Path, enabled: bool = True):
        self.hooks = hooks
        self.dir = run_dir / "records"
        self.enabled = enabled
        self._saved: dict[str, int] = {}

    def save(self) -> dict[str, int]:
        """Write every spec's records that changed since the last save; returns the counts on the disk."""
        if not self.enabled:
            return {}
        for name, recs in self.hooks.records.items():
            if recs and self._saved.get(name) != len(recs):
                rows = [{"target": r.target, "step": r.step, "value": r.value, "aux": r.aux} for r in recs]
                atomic_save(rows, self.dir / _file_name(name))
                self._saved[name] = len(recs)
        return dict(self._saved)

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.save()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.enabled:
            return
        kept = self.hooks.records
        for name, count in state["counts"].items():
            path = self.dir / _file_name(name)
            if name not in kept or not count or not path.exists():
                continue
            rows = torch.load(path, map_location="cpu", weights_only=True)[:count]
            kept[name].extend(Record(name, r["target"], r["step"], r["value"], r["aux"]) for r in rows)
            self._saved[name] = len(rows)
