"""Plain forward hooks for instruments that only read module outputs (telemetry's activation statistics).

A hook spec is for changing what a model computes: it is counted, measured, scheduled and listed in the
hooks table. An instrument needs none of that, so it takes :func:`output_hooks`: the modules a pattern of
the target grammar matches (:func:`~hookexp.engine.targets.match`, aliases included, errors naming the
caller's setting), one torch forward hook each, called with the module's name and output while the
returned :class:`OutputHooks` is ``on`` and the module is in the chosen mode. Attached before
``torch.compile``, the hooks run eagerly under it (:func:`~hookexp.engine.kinds.eager`), so switching them
on and off costs no recompilation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from torch import nn

from hookexp.engine.kinds import eager, refuse_compiled
from hookexp.engine.schema import HookSpec
from hookexp.engine.targets import match


class OutputHooks:
    """The forward hooks :func:`output_hooks` registered; ``on`` switches them (off: they return at once)."""

    def __init__(self, on: bool):
        self.on = on
        self.names: list[str] = []
        self._torch_handles: list[Any] = []

    def add(self, name: str, module: nn.Module, fn: Callable[[str, Any], None], phase: Literal["train", "eval", "both"]
            ) -> None:
        """Hook ``module``: ``fn(name, output)`` after each forward in ``phase``'s mode, while ``on``."""
        training = {"train": True, "eval": False, "both": None}[phase]

        @eager
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.on and (training is None or module.training is training):
                fn(name, output)

        self._torch_handles.append(module.register_forward_hook(hook))
        self.names.append(name)

    def remove(self) -> None:
        """Remove every hook (safe to call more than once)."""
        for h in self._torch_handles:
            h.remove()
        self._torch_handles.clear()


def output_hooks(model: nn.Module, pattern: str, fn: Callable[[str, Any], None], *, key: str,
                 phase: Literal["train", "eval", "both"] = HookSpec.phase, on: bool = True) -> OutputHooks:
    """Call ``fn(name, output)`` after every forward of each module of ``model`` that ``pattern`` matches,
    in training mode (``phase``: ``"eval"``, ``"both"``), while the returned hooks are ``on``. ``fn`` must
    not change ``output`` (its return value is ignored). A pattern that matches nothing raises a
    :class:`~hookexp.errors.ConfigError` naming ``key``; a compiled model is refused, as by ``attach``."""
    refuse_compiled(model)
    hooks = OutputHooks(on)
    try:
        for name, module in match(model, pattern, on="module", key=key):
            hooks.add(name, module, fn, phase)
    except BaseException:
        hooks.remove()
        raise
    return hooks
