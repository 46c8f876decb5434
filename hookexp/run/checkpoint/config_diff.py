"""The keys where a checkpoint's config and the resuming run's config part (resuming with another config is
an error that lists them, except the few in :data:`hookexp.run.rundir.RESUMABLE_CHANGES`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hookexp.run.rundir import RESUMABLE_CHANGES

# the import paths issue 26.5 moved: a checkpoint written before the move names the old ones in its _target_s,
# which still import (the modules at the old paths are the moved ones), so they are no difference
MOVED = {"hookexp.tasks.": "hookexp.workloads.tasks.", "hookexp.models.": "hookexp.workloads.models.",
         "hookexp.data.": "hookexp.workloads.data.", "hookexp.schedules.": "hookexp.workloads.schedules.",
         "hookexp.sinks.": "hookexp.run.sinks.", "hookexp.plots.": "hookexp.analysis.plots.",
         "hookexp.report.": "hookexp.analysis.report.", "hookexp.ablate.": "hookexp.analysis.ablate."}


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def moved(value: Any) -> Any:
    """A dotted path as it reads since the move (``hookexp.models.GPT`` -> ``hookexp.workloads.models.GPT``);
    any other value as it is."""
    if isinstance(value, str):
        for old, new in MOVED.items():
            if value.startswith(old):
                return new + value[len(old):]
    return value


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``key: saved -> current`` for every key where the two configs part (a whole spec that one lacks is one
    line), except the resumable ones and keys the saved config lacks inside a group both have (added to the
    schema since: a resume composes them at their defaults, and only resumable keys may be overridden)."""
    out: list[str] = []
    for k in sorted(set(saved) | set(current), key=str):
        key = f"{prefix}{k}"
        if key.startswith(RESUMABLE_CHANGES):
            continue
        if k not in saved and prefix and prefix != "hooks.":
            continue  # a key added to the schema since the run started: the resume composed it at its default
        a, b = saved.get(k, "<unset>"), current.get(k, "<unset>")
        if isinstance(a, Mapping) and isinstance(b, Mapping) and a and b:
            out += config_changes(a, b, key + ".")
        elif moved(a) != moved(b):
            out.append(f"{key}: {_short(a)} -> {_short(b)}")
    return out
