"""The keys where a checkpoint's config and the resuming run's config part (resuming with another config is
an error that lists them, except the few in :data:`hookexp.run.rundir.RESUMABLE_CHANGES`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hookexp.run.rundir import RESUMABLE_CHANGES


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
        elif a != b:
            out.append(f"{key}: {_short(a)} -> {_short(b)}")
    return out
