"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint holds the model and optimizer states, every random generator (python, numpy, torch CPU
and CUDA, and the data order's generator as it was at the start of the current epoch), the position
in the loop (step, epoch, batches consumed in the epoch), the accumulators of the current log
interval, the hooks' state (step, counters, noise generators) and the W&B run id. Only tensors,
numbers, strings and containers of them are stored, so loading uses ``torch.load(weights_only=True)``.

Writing is atomic: the file is written next to its destination and moved over it with ``os.replace``,
so a crash while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookexp.errors import ConfigError

FORMAT = 1


def rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save({"format": FORMAT, **payload}, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path) -> dict[str, Any]:
    """Read a checkpoint; a missing, corrupt or foreign file is a :class:`ConfigError` naming it."""
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {path}. Give resume=PATH (a checkpoint file or a run directory with "
                          "checkpoints/last.pt), or run with the same hydra.run.dir as the interrupted run.",
                          key="resume")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"cannot read the checkpoint {path} ({type(e).__name__}: {str(e).splitlines()[0]}). "
                          "It is corrupt or was not written by hookexp; resume from another checkpoint.",
                          key="resume") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a hookexp checkpoint (format {FORMAT}).", key="resume")
    return data


def resolve(resume: Any, run_dir: Path) -> Path | None:
    """The checkpoint ``resume`` names: true -> this run directory's; a path -> that file or run dir."""
    if resume is None or resume is False or str(resume).lower() in ("false", "none", "null"):
        return None
    if resume is True or str(resume).lower() == "true":
        return run_dir / "checkpoints" / "last.pt"
    path = Path(str(resume))
    return path / "checkpoints" / "last.pt" if path.is_dir() else path
