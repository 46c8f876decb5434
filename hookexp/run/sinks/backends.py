"""The backend ``logger._target_`` names: checked before anything is built (:func:`check_logger`), then made
(:func:`make_backend`)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

from hookexp.config import LoggerConfig, typed
from hookexp.engine.bound import NotImportable, import_object
from hookexp.errors import ConfigError
from hookexp.run.sinks.base import RunInfo, Sink
from hookexp.run.sinks.wandb import WandbSink


def backend_class(cfg: Mapping[str, Any]) -> type | None:
    """The class ``logger._target_`` names (None: ``logger=none``), or a :class:`ConfigError` naming the key."""
    target = cfg.get("_target_")
    if target is None:
        return None
    fix = ("Use logger=wandb, logger=tensorboard or logger=none, or the import path of a class that implements "
           "hookexp.run.sinks.Sink (local files are always written).")
    try:
        found = import_object(str(target))
    except NotImportable as e:
        raise ConfigError(f"cannot import the logger backend {target!r}: {e} {fix}", key="logger._target_") from None
    if not isinstance(found, type):
        raise ConfigError(f"{target!r} is a {type(found).__name__}, not a class. {fix}", key="logger._target_")
    return found


def check_logger(cfg: Mapping[str, Any]) -> None:
    """Refuse an unknown backend or mode, or a backend whose package is missing, before anything is built or
    written."""
    backend = backend_class(cfg)
    if cfg.get("mode") not in ("offline", "online", "disabled"):
        raise ConfigError(f"unknown W&B mode {cfg.get('mode')!r}. Use offline, online or disabled.",
                          key="logger.mode")
    env = os.environ.get("WANDB_MODE")
    if backend is WandbSink and env is not None and env not in ("offline", "online", "disabled", "dryrun", "run"):
        raise ConfigError(f"the environment sets WANDB_MODE={env!r}, which W&B refuses (and which would override "
                          f"logger.mode={cfg.get('mode')}). Unset it (`unset WANDB_MODE`) or set it to offline, online "
                          "or disabled.", key="WANDB_MODE")
    if backend is not None and callable(getattr(backend, "check", None)):
        backend.check()


def make_backend(cfg: Mapping[str, Any], run: RunInfo) -> Sink | None:
    """The sink ``logger._target_`` names, made the way Hydra instantiates a ``_target_`` node: the class gets
    ``run`` and those ``logger`` keys its constructor names (the schema holds W&B's keys for every backend; a
    backend that does not name them does not get them), or the whole ``logger`` config as one
    :class:`~hookexp.config.LoggerConfig` when it names ``logger``. None for ``logger=none``."""
    backend = backend_class(cfg)
    if backend is None:
        return None
    params = inspect.signature(backend).parameters
    if "logger" in params:
        return backend(run, typed(LoggerConfig, cfg, lambda name: f"logger.{name}"))  # type: ignore[no-any-return]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    args = {k: v for k, v in cfg.items() if k != "_target_" and (takes_any or k in params)}
    return backend(run, **args)  # type: ignore[no-any-return]
