"""Objects from ``_target_`` config nodes, with hookexp's errors: a missing or misspelt argument, a value the
constructor refuses, ``auto`` values filled from the data, and arguments a default config gives that the
user's own ``_target_`` does not take."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hydra.utils import instantiate as hydra_instantiate
from omegaconf import DictConfig, OmegaConf

from hookexp.engine.bound import NotImportable, import_object
from hookexp.errors import ConfigError, did_you_mean, unfit

log = logging.getLogger("hookexp.build")

# torch's optimizer messages name their argument in words: which config key they are about
_MESSAGE_KEYS = {"learning rate": "lr", "beta parameter": "betas", "epsilon": "eps", "momentum": "momentum",
                 "weight_decay": "weight_decay", "dampening": "dampening"}


def target_of(node: Mapping[str, Any], key: str) -> Callable[..., Any]:
    path = node.get("_target_")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"needs a '_target_': the dotted path of a class or function to build, e.g. "
                          f"{key}._target_=my_pkg.MyThing.", key=key)
    try:
        return import_object(path)
    except NotImportable as e:
        raise ConfigError(f"cannot import {path!r}: {e} Give the full dotted path of something importable; your "
                          "own modules are found from the current directory or PYTHONPATH.", key=f"{key}._target_"
                          ) from None


def parameters_of(fn: Callable[..., Any]) -> tuple[dict[str, inspect.Parameter], bool]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}, True
    named = {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params.values())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_arguments(fn: Callable[..., Any], args: Mapping[str, Any], key: str, given: Iterable[str] = ()) -> None:
    """Refuse keys ``fn`` does not take (did you mean) and text where its default is a number or a flag."""
    params, any_kw = parameters_of(fn)
    names = [n for n in params if n not in given and n != "self"]
    for name, value in args.items():
        if name not in params:
            if not any_kw:
                raise ConfigError(f"{_name(fn)} has no parameter {name!r}.{did_you_mean(name, names)} Its parameters: "
                                  f"{', '.join(names) or 'none'}.", key=f"{key}.{name}")
            continue
        default = params[name].default  # a number (int or float alike: lr=0 takes 0.1) or a flag
        wanted = unfit({int, float} if _is_number(default) else {type(default)}, value)
        if wanted:
            raise ConfigError(f"expected {wanted}, got {value!r}.", key=f"{key}.{name}")


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _blame(message: str, keys: Iterable[str]) -> str | None:
    """The argument an error message is about: one whose name it starts with or mentions."""
    text = message.lower()
    for words, name in _MESSAGE_KEYS.items():
        if words in text and name in keys:
            return name
    for name in sorted(keys, key=len, reverse=True):
        if re.search(rf"(^|[^\w.]){re.escape(name.lower())}([^\w]|$)", text):
            return name
    return None


def _refused(error: BaseException, fn: Callable[..., Any], args: Mapping[str, Any], key: str) -> ConfigError:
    """What a target raised, as one paragraph naming the argument it is about (or the group)."""
    cause = error.__cause__ if error.__cause__ is not None and type(error).__name__ == "InstantiationException" \
        else error
    if isinstance(cause, ConfigError):
        return cause
    text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    blamed = _blame(text, args)
    where = f"{key}.{blamed}" if blamed else key
    return ConfigError(f"{_name(fn)} refused its arguments: {type(cause).__name__}: {text}. Fix {where} "
                       "(print the config with --cfg job).", key=where)


class _Partial:
    """A ``_partial_`` node's result: called later (the optimizer with the model's parameters), it still names
    the config key when the target refuses its arguments."""

    def __init__(self, made: Callable[..., Any], fn: Callable[..., Any], args: Mapping[str, Any], key: str):
        self.made, self.fn, self.args, self.key = made, fn, args, key

    def __call__(self, *a: Any, **kw: Any) -> Any:
        try:
            return self.made(*a, **kw)
        except ConfigError:
            raise
        except Exception as e:
            raise _refused(e, self.fn, self.args, self.key) from None


def instantiate(node: DictConfig | Mapping[str, Any], key: str, *, later: Iterable[str] = (), **given: Any) -> Any:
    """Build ``node`` (a ``_target_`` mapping) with ``given`` added, naming ``key`` in every error: an unknown
    or ill-typed argument before the call, what the target raises after it (also when a ``_partial_`` result
    is called later, with the arguments named in ``later``)."""
    fn = target_of(node, key)
    args = {str(k): v for k, v in node.items() if not str(k).startswith("_")}
    check_arguments(fn, args, key, [*given, *later])
    try:
        made = hydra_instantiate(node, **given)
    except ConfigError:
        raise
    except Exception as e:
        raise _refused(e, fn, args, key) from None
    return _Partial(made, fn, args, key) if node.get("_partial_", False) else made


def unpartial(fn: Any) -> Any:
    while hasattr(fn, "func") and hasattr(fn, "keywords"):  # functools.partial
        fn = fn.func
    return fn


def fill_auto(node: DictConfig, info: Mapping[str, Any], key: str,
              derive: Mapping[str, Callable[[], tuple[Any, str]]] | None = None) -> DictConfig:
    """A copy of ``node`` with every ``auto`` value (also in nested mappings, e.g. ``model.config.vocab_size``)
    taken from the data's ``info``. ``derive``: for a name the data does not give, a function returning
    ``(value, how it was found)``, logged, or ``(None, why it cannot be known)``, called once and only when a value
    asks for it."""
    known = dict(info)
    why: dict[str, str] = {}

    def lookup(name: str, where: str) -> Any:
        if name not in known and name not in why and derive and name in derive:
            value, how = derive[name]()
            if value is None:
                why[name] = how
            else:
                known[name] = value
                log.info("%s.%s=auto: %s, %s", where, name, value, how)
        if name not in known:
            given = ", ".join(f"{k}={v}" for k, v in info.items() if not isinstance(v, (list, dict))) or "nothing"
            reason = f" {why[name]}" if why.get(name) else ""
            raise ConfigError(f"is 'auto', but the data does not say it (the data gives: {given}).{reason} "
                              f"Set it: {where}.{name}=<value>.", key=f"{where}.{name}")
        return known[name]

    def fill(values: dict[str, Any], where: str) -> None:
        for name, value in values.items():
            if isinstance(value, dict):
                fill(value, f"{where}.{name}")
            elif value == "auto":
                values[name] = lookup(name, where)

    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict)
    fill(values, key)
    return OmegaConf.create(values)


def drop_inherited(node: DictConfig, key: str, overrides: Iterable[str] | None, *, only_written: bool = False,
                   quiet: bool = False) -> DictConfig:
    """When the command line replaced a node's ``_target_`` (``model._target_=mynet.Net``,
    ``data.dataset._target_=mynet.make``), keys the new target does not take that came from the group's config
    file are dropped (logged); keys the user set stay and are checked. ``only_written`` (the model): every key
    from the config file is dropped, taken or not, but ``auto`` ones (filled from the data): a user's model never
    gets another model's value (small_cnn's ``hidden: 64``). Without a command line, nothing is dropped. ``quiet``:
    log nothing (a check before the build, which logs it)."""
    if overrides is None:
        return node
    set_here = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    if f"{key}._target_" not in set_here:
        return node
    fn = unpartial(target_of(node, key))
    params, any_kw = parameters_of(fn)
    if any_kw and not only_written:
        return node
    inherited = [k for k in node if not str(k).startswith("_") and f"{key}.{k}" not in set_here]
    untaken = [k for k in inherited if k not in params and not any_kw]
    taken = [k for k in inherited if k not in untaken and only_written and node._get_node(k)._value() != "auto"]
    if untaken and not quiet:
        log.info("%s: %s does not take %s (from the default %s config): not passed", key, node.get("_target_"),
                 ", ".join(map(str, untaken)), key)
    if taken and not quiet:
        log.info("%s: %s gets only the keys set for it: %s of the default %s config not passed (set one with "
                 "++%s.%s=...)", key, node.get("_target_"), ", ".join(f"{k}={node._get_node(k)._value()}"
                                                                    for k in taken), key, key, taken[0])
    if not untaken and not taken:
        return node
    out = OmegaConf.create(OmegaConf.to_container(node, resolve=False))
    for k in [*untaken, *taken]:
        del out[k]
    return out
