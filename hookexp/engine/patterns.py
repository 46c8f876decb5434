"""One pattern of the target grammar as a predicate on names: an exact name, a glob, or ``re:`` a regex.

Aliases (``@attn``) are expanded before a pattern gets here (:mod:`hookexp.engine.aliases`); the grammar
as a whole is described in :mod:`hookexp.engine.targets`. This module imports nothing of the engine, so
that both of those can use it.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable

from hookexp.errors import SpecError


def compile_pattern(pattern: str, *, spec: str | None = None, field: str = "target") -> Callable[[str], bool]:
    """A predicate on names for one pattern of the grammar (aliases expanded first: see ``targets.resolve``)."""
    if pattern.startswith("re:"):
        try:
            rx = re.compile(pattern[3:])
        except re.error as e:
            raise SpecError(
                f"invalid regular expression {pattern[3:]!r}: {e}. Patterns with 're:' use Python's re "
                "syntax; escape dots as '\\.'.",
                spec=spec,
                field=field,
            ) from None
        return lambda name: rx.search(name) is not None
    if any(c in pattern for c in "*?["):
        return lambda name: fnmatch.fnmatchcase(name, pattern)
    return lambda name: name == pattern
