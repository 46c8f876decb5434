"""One paragraph when the run directory cannot be written, before anything is built."""

from __future__ import annotations

import os
from pathlib import Path

from hookexp.errors import ConfigError


def require_writable(run_dir: Path) -> None:
    """One paragraph when the run directory cannot be written (read-only disk, permissions)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to the run directory {run_dir} ({e.strerror or e}). Choose a writable "
                          "directory with hydra.run.dir=PATH, or free space/permissions there.",
                          key="hydra.run.dir") from None
