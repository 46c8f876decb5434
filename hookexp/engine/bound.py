"""A transform bound to a spec: looked up, imported or wrapped, its arguments checked once before any hook fires.

:class:`Transform` wraps a Python callable (with an optional batched in-place version); :func:`bind_transform`
returns the :class:`BoundTransform` the hooks call.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hookexp.engine.context import HookContext
from hookexp.engine.transforms import TRANSFORMS, BatchedFn, TransformFn
from hookexp.errors import HookexpError, SpecError, TransformArgsError, did_you_mean, kind_words, unfit

# ----------------------------------------------------------------------------------------------------
# Binding a transform to a spec: arguments checked once, before any hook fires.


class Transform:
    """A Python callable as a transform, with an optional batched in-place version for ``pre_step``::

        attach(model, {"c": {"target": "*", "kind": "pre_step",
                             "transform": Transform(my_clip, batched=my_clip_)}}, optimizer)

    ``fn(x[, ctx], **args) -> Tensor`` works out of place; ``batched(xs, ctx, **args)`` modifies the list
    of tensors in place and must give the same bits as ``fn`` on each.
    """

    def __init__(self, fn: TransformFn, *, batched: BatchedFn | None = None, name: str | None = None,
                 structured: bool = False, value_dependent: bool = False):
        if not callable(fn):
            raise TypeError(f"Transform needs a callable, got {fn!r}")
        self.fn, self.batched, self.structured, self.value_dependent = fn, batched, structured, value_dependent
        self.name = name or getattr(fn, "__qualname__", None) or repr(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Transform({self.name})"


class NotImportable(ImportError):
    """What :func:`import_object` raises: the path names nothing importable; the message says which part."""


def import_object(path: str) -> Any:
    """The object a dotted path names (``torch.optim.SGD``, ``my_pkg.mod.fn``; submodules are imported on the way),
    as Hydra finds a ``_target_`` but without its log line. A :class:`NotImportable` says which part is missing
    (``module 'torch.optim' has no attribute 'SDG'. Did you mean 'SGD'?``) or what importing a module raised;
    hookexp's own errors (a missing extra) pass unchanged."""
    parts = path.split(".")
    if not all(part.isidentifier() for part in parts):
        raise NotImportable(f"{path!r} is not a dotted path (pkg.module.name).")
    obj = _import_module(parts[0])
    if obj is None:
        raise NotImportable(f"no module named {parts[0]!r}.")
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
            continue
        except AttributeError:
            pass
        module = _import_module(".".join(parts[:i + 1])) if inspect.ismodule(obj) else None
        if module is None:
            what = "module" if inspect.ismodule(obj) else type(obj).__name__
            public = [n for n in dir(obj) if not n.startswith("_")]
            raise NotImportable(f"{what} {'.'.join(parts[:i])!r} has no attribute {part!r}."
                              f"{did_you_mean(part, public)}")
        obj = module
    return obj


def _import_module(name: str) -> Any:
    """The module ``name``, or None when there is no such module; an error raised while importing it (a missing
    import inside the user's file, a syntax error) is an :class:`ImportError` naming the module and the cause."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name or name.startswith(f"{e.name}."):
            return None
        cause: Exception = e
    except HookexpError:  # a module of hookexp's that names the extra it needs
        raise
    except Exception as e:  # whatever the module's own code raised
        cause = e
    raise NotImportable(f"importing {name!r} raised {type(cause).__name__}: "
                      f"{str(cause).splitlines()[0].rstrip('.') if str(cause) else '(no message)'}.") from cause


def _locate(path: str, spec: str) -> Callable[..., Any]:
    try:
        obj = import_object(path)
    except NotImportable as e:
        raise SpecError(
            f"cannot import the user transform {path!r}: {e} Give the full dotted path of a function importable "
            "from the run's Python path, e.g. my_pkg.transforms.my_fn.",
            spec=spec,
            field="transform",
        ) from None
    if not callable(obj):
        raise SpecError(f"the user transform {path!r} is not callable.", spec=spec, field="transform")
    return obj


@dataclass
class BoundTransform:
    """A transform with its checked arguments and the per-spec state it keeps across calls.

    ``call`` is the function with its arguments bound (``call(x, ctx)``, or ``call(x)`` when
    ``wants_ctx`` is false); ``needs_ctx`` says whether the context must be filled in (else None is
    passed, and the engine builds nothing on that call).
    """

    name: str
    fn: TransformFn
    args: dict[str, Any]
    batched: BatchedFn | None = None
    structured: bool = False
    value_dependent: bool = False
    wants_ctx: bool = True
    needs_ctx: bool = True
    stateful: bool = False
    alias_of: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    batched_args: dict[str, Any] | None = None  # what ``batched`` gets: the args with fn's defaults filled in

    def __post_init__(self) -> None:
        self.call: Callable[..., Any] = functools.partial(self.fn, **self.args) if self.args else self.fn
        if self.batched_args is None:
            self.batched_args = self.args

    def __call__(self, x: Any, ctx: HookContext | None) -> Any:
        return self.call(x, ctx) if self.wants_ctx else self.call(x)

    def batch_key(self) -> tuple[Any, ...] | None:
        """Transforms with equal keys can run as one batched call over all their tensors. Stateful ones keep
        their state per spec, so they batch within their own spec only."""
        if self.batched is None:
            return None
        key = (self.name, tuple(sorted((k, repr(v)) for k, v in self.args.items())))
        return (*key, id(self)) if self.stateful else key


def _defaults(fn: TransformFn) -> dict[str, Any]:
    """The keyword defaults of a built-in's signature ``fn(x, ctx, ...)``: the one place they are written; its
    check and its batched version get them from here."""
    return {p.name: p.default for p in list(inspect.signature(fn).parameters.values())[2:]
            if p.default is not p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_args(fn: TransformFn, args: dict[str, Any], name: str, spec: str, skip: int, *,
                shown: Mapping[str, str] | None = None) -> None:
    """Refuse arguments ``fn`` does not take, missing ones and values of another type than its hints say.
    ``shown``: the user's spelling of a parameter in messages (``lambda`` for reverse's ``lambd``)."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    user = {**{p.name: p.name for p in params}, **(shown or {})}
    allowed = [user[p.name] for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in args:
        if user.get(key, key) not in allowed:
            listing = ", ".join(allowed) if allowed else "none"
            raise TransformArgsError(
                f"transform {name!r} has no argument {key!r}.{did_you_mean(key, allowed)} "
                f"Its arguments: {listing}.",
                spec=spec,
                field=f"args.{key}",
            )
    missing = [user[p.name] for p in params if p.default is p.empty and p.kind is not p.VAR_POSITIONAL
               and p.name not in args]
    if missing:
        raise TransformArgsError(
            f"transform {name!r} needs the argument(s) {', '.join(missing)}: add them under args, "
            f"e.g. args: {{{missing[0]}: ...}}.",
            spec=spec,
            field="args",
        )
    defaults = {p.name: p.default for p in params}
    for key, value in args.items():
        wrong = _wrong_type(fn, key, value, defaults.get(key))
        if wrong:
            raise TransformArgsError(f"transform {name!r} takes {wrong} for {user.get(key, key)!r}, got {value!r}.",
                                     spec=spec, field=f"args.{user.get(key, key)}")


def _wrong_type(fn: TransformFn, key: str, value: Any, default: Any) -> str | None:
    """What an argument its signature types as a plain number or flag (``min: float | None``, ``aux: bool``) must
    be, when ``value`` is not that (:func:`~hookexp.errors.unfit`): ``args.min=abc`` or ``args.straight_through=no``
    from the command line is an error here, not a TypeError inside the first hook call or a string taken as true.
    None is allowed where the hint or the default allows it."""
    try:
        hint = typing.get_type_hints(fn).get(key)
    except Exception:  # annotations a user wrote that do not evaluate: nothing to check against
        return None
    allowed = set(typing.get_args(hint)) or {hint}
    plain = allowed - {type(None)}
    if value is None and type(None) not in allowed and default is not None:
        return kind_words(plain)
    return unfit(plain, value)


def _bind_callable(fn: Callable[..., Any], args: dict[str, Any], name: str, spec: str, **extra: Any) -> BoundTransform:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    wants_ctx = any(p.name == "ctx" for p in params) or len(positional) - len(
        [p for p in positional if p.name in args]) >= 2
    if params:
        _check_args(fn, args, name, spec, skip=2 if wants_ctx else 1)
    return BoundTransform(name, fn, args, wants_ctx=wants_ctx, needs_ctx=wants_ctx, **extra)


def bind_transform(transform: Any, args: Mapping[str, Any], spec: str) -> BoundTransform:
    """Look up (or import, or wrap) the transform and check its arguments against its signature."""
    args = dict(args)
    if isinstance(transform, Mapping):
        extra = {k: v for k, v in transform.items() if k != "_target_"}
        path = str(transform["_target_"])
        return _bind_callable(_locate(path, spec), {**extra, **args}, path, spec)
    if isinstance(transform, Transform):
        return _bind_callable(transform.fn, args, transform.name, spec, batched=transform.batched,
                              structured=transform.structured, value_dependent=transform.value_dependent)
    if callable(transform):
        name = getattr(transform, "__qualname__", None) or repr(transform)
        return _bind_callable(transform, args, name, spec)
    info = TRANSFORMS.get(transform)
    if info is None:  # parse_specs catches this first; kept for direct callers
        raise SpecError(f"unknown transform {transform!r}.", spec=spec, field="transform")
    args = {info.arg_aliases.get(k, k): v for k, v in args.items()}
    if info.alias_of is not None:
        if info.translate is not None:
            _check_args(info.translate, args, info.name, spec, skip=0,
                        shown={v: k for k, v in info.arg_aliases.items()})
            args = info.translate(**args)
        target = TRANSFORMS[info.alias_of]
    else:
        target = info
    _check_args(target.fn, args, info.name, spec, skip=2)
    full = {**_defaults(target.fn), **args}
    if target.check is not None:
        try:
            target.check(**full)
        except TransformArgsError as e:
            raise TransformArgsError(f"transform {info.name!r} {e}", spec=spec, field="args") from None
    return BoundTransform(info.name, target.fn, args, target.batched, target.structured, target.value_dependent,
                          True, target.needs_ctx, target.stateful, info.alias_of, batched_args=full)
