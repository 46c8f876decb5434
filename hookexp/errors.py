"""Every error hookexp raises on purpose, in one module.

Each carries the spec name and the config key it is about, and its message is built here, in one format::

    hooks.<spec>.<field>: <what is wrong>. <how to fix it>

The classes also subclass the matching builtin (ValueError, TypeError, RuntimeError), so generic
``except ValueError`` code keeps working. Sections: shared helpers and the base class, then one section per
layer (engine, run, ...); add a layer's classes in its own section.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, candidates: Iterable[str], n: int = 3) -> str:
    """``" Did you mean 'x' or 'y'?"`` for the closest candidates, or ``""`` when none is close."""
    close = difflib.get_close_matches(str(word), sorted(set(candidates)), n=n, cutoff=0.5)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


# what a value of plain number or flag types must be, in words
_KINDS = {frozenset({bool}): "true or false", frozenset({int}): "a whole number", frozenset({float}): "a number",
          frozenset({int, float}): "a number"}


def kind_words(allowed: Iterable[type]) -> str | None:
    """``allowed`` plain number or flag types in words (``a whole number``); None for any other types."""
    return _KINDS.get(frozenset(allowed))


def unfit(allowed: Iterable[type], value: object) -> str | None:
    """What ``value`` should be (:func:`kind_words`) when it is none of ``allowed``, plain number or flag types;
    None when it fits, is None, or ``allowed`` is anything else (nothing to check against). A bool is no number."""
    plain = frozenset(allowed)
    words = kind_words(plain)
    if words is None or value is None:
        return None
    if plain == {bool}:
        fits = isinstance(value, bool)
    elif isinstance(value, bool):
        fits = False
    else:
        fits = isinstance(value, int if plain == {int} else (int, float))
    return None if fits else words


def config_key(spec: str | None, field: str | None = None, root: str = "hooks") -> str:
    """The dotted config key a message is about, e.g. ``hooks.clamp_conv.target``."""
    parts = [root] + ([spec] if spec else []) + ([field] if field else [])
    return ".".join(parts)


class HookexpError(Exception):
    """Base class of every error hookexp raises deliberately."""

    def __init__(self, message: str, *, spec: str | None = None, field: str | None = None):
        self.spec = spec
        self.field = field
        self.key = config_key(spec, field) if spec is not None else None
        self.message = message  # without the key: for an error that re-words or re-keys this one
        super().__init__(f"{self.key}: {message}" if self.key else message)


# ----------------------------------------------------------------------------------------------------
# Engine: hook specs, targets, kinds, transforms, the handle (hookexp.engine).


class SpecError(HookexpError, ValueError):
    """A hook spec is malformed: unknown field, wrong type, unknown kind, transform or phase."""


class SpecErrors(SpecError):
    """Several static errors in one spec set, reported together (``.errors`` holds each one), so that a
    config with three mistakes needs one run to see all three, not three."""

    def __init__(self, errors: list[HookexpError]):
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"{len(self.errors)} problems in the hook specs (nothing was attached):\n{lines}")


class RegistryError(HookexpError, ValueError):
    """A registration (transform, kind, alias table entry) that would replace an existing one, or is malformed."""


class TargetError(SpecError):
    """A spec's target matches nothing, or matches objects the kind cannot attach to."""


class TransformArgsError(SpecError, TypeError):
    """A transform was given arguments it does not take, or lacks required ones."""


class HookCompatibilityError(SpecError):
    """A kind cannot work on what the target resolved to (no grad, no optimizer, no grad_fn, ...)."""


class TransformOutputError(HookexpError, RuntimeError):
    """A transform returned a tensor of another shape, dtype or device, or modified its input in place."""


class HookRuntimeError(HookexpError, RuntimeError):
    """A transform raised while training; names the spec, the target and the step."""


class HookCheckError(HookexpError):
    """The dry run (``check_on_batch``) found hooks that would fail or misbehave in training."""


class HookWarning(UserWarning):
    """A hook that does nothing where it was put (e.g. its transform saw no tensor); warned once per target."""


# ----------------------------------------------------------------------------------------------------
# Run layer and other settings.


class ConfigError(HookexpError):
    """A run configuration (outside the hooks) cannot be used; names the key and the fix."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message


# ----------------------------------------------------------------------------------------------------
# The run layer (build, loop, checkpoints, run directories, files).


class CheckpointError(ConfigError):
    """A checkpoint cannot be resumed from: missing, corrupt, incomplete, or written with another config."""


class RunDirError(ConfigError):
    """The run directory cannot be used: it holds another run's results, or it cannot be written."""


class RunFilesError(HookexpError, OSError):
    """Writing a run's files failed (disk full, read-only, permissions); names the file and the fix."""


class MissingExtraError(HookexpError, ImportError):
    """An optional feature was used without the package extra that provides it; names the extra to install."""

    def __init__(self, feature: str, package: str, extra: str, error: BaseException | str = ""):
        why = f" ({error})" if str(error) else ""
        super().__init__(f"{feature} needs {package}, which is not installed{why}. Install the extra: pip install "
                         f"'hookexp[{extra}]' (in a clone: .venv/bin/pip install -e '.[{extra}]'; ./scripts/test.sh "
                         "installs every extra).")
        self.extra = extra


class NonFiniteError(HookexpError, FloatingPointError):
    """A loss or gradient became NaN or Inf and ``guard.nan_policy`` is ``raise``."""


class RollbackLimitError(HookexpError, RuntimeError):
    """A run met one more spike or non-finite step than ``guard.rollback.max`` rollbacks allow."""
