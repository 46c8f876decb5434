"""The transform registry: :data:`TRANSFORMS`, :func:`register_transform`, :func:`register_transform_alias`.

A transform is ``fn(x, ctx, **args) -> Tensor``: out of place, keeping shape, dtype and device (checked on every
call). ``batched``: an in-place version over a list of tensors for ``pre_step`` (one ``torch._foreach_*`` call)
that gives the same bits; ``structured``: sees the whole hook value; ``needs_ctx=False``: ignores ``ctx`` (None is
passed). The built-ins register in :mod:`hookexp.engine.transforms`: import these names from there or from
:mod:`hookexp.engine`, so that the built-ins are registered first. docs/transforms.md has the rest.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hookexp.errors import RegistryError

TransformFn = Callable[..., Any]
BatchedFn = Callable[..., None]


@dataclass(frozen=True)
class TransformInfo:
    """A registry entry. An alias has ``alias_of`` (the transform it runs) and ``translate`` (its own
    arguments -> the target's arguments)."""

    name: str
    fn: TransformFn
    batched: BatchedFn | None = None
    structured: bool = False
    arg_aliases: Mapping[str, str] = field(default_factory=dict)
    check: Callable[..., None] | None = None
    value_dependent: bool = False  # acts on magnitudes: a scaled gradient (fp16) changes what it does
    needs_ctx: bool = True
    stateful: bool = False  # keeps per-target state in ctx.state (saved by HookHandle.state_dict)
    doc: str = ""
    alias_of: str | None = None
    translate: Callable[..., dict[str, Any]] | None = None


TRANSFORMS: dict[str, TransformInfo] = {}


def register_transform(
    name: str,
    *,
    batched: BatchedFn | None = None,
    structured: bool = False,
    arg_aliases: Mapping[str, str] | None = None,
    check: Callable[..., None] | None = None,
    value_dependent: bool = False,
    needs_ctx: bool = True,
    stateful: bool = False,
) -> Callable[[TransformFn], TransformFn]:
    """Decorator that adds ``fn`` to the registry under ``name`` (a name already taken is refused).

    ``check(**args)`` validates argument values when a spec is bound, before any hook fires; it raises
    :class:`TransformArgsError` with the fix. ``value_dependent``: the result depends on magnitudes
    (clamp, add, ...), so the trainer warns when such a transform sees fp16-scaled gradients.
    ``arg_aliases``: other spellings of arguments (``{"lambda": "lambd"}``: a YAML key that is a Python
    keyword). ``stateful``: the transform keeps per-target state in ``ctx.state``.
    """

    def deco(fn: TransformFn) -> TransformFn:
        if name in TRANSFORMS:
            raise RegistryError(f"transform {name!r} is already registered; pick another name.")
        TRANSFORMS[name] = TransformInfo(name, fn, batched, structured, dict(arg_aliases or {}), check,
                                         value_dependent, needs_ctx, stateful, inspect.getdoc(fn) or "")
        return fn

    return deco


def register_transform_alias(name: str, *, of: str, translate: Callable[..., dict[str, Any]] | None = None,
                             arg_aliases: Mapping[str, str] | None = None, doc: str = "") -> None:
    """Register ``name`` as another name of transform ``of``. ``translate(**args)`` maps the alias's own
    arguments to ``of``'s (its signature is what the alias accepts); without it the alias takes ``of``'s."""
    if name in TRANSFORMS:
        raise RegistryError(f"transform {name!r} is already registered; pick another name.")
    target = TRANSFORMS.get(of)
    if target is None or target.alias_of is not None:
        raise RegistryError(f"transform alias {name!r}: {of!r} is not a registered transform (aliases of aliases "
                            "are not allowed).")
    TRANSFORMS[name] = TransformInfo(name, target.fn, target.batched, target.structured,
                                     dict(arg_aliases or target.arg_aliases), target.check, target.value_dependent,
                                     target.needs_ctx, target.stateful, doc or f"Alias of {of}.", of, translate)
