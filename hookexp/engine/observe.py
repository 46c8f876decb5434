"""Plain forward hooks for instruments that only read module outputs (telemetry's activation statistics).

A hook spec is for changing what a model computes: it is counted, measured, scheduled and listed in the
hooks table. An instrument needs none of that, so it takes :func:`output_hooks`: the modules a pattern of
the target grammar matches (:func:`~hookexp.engine.targets.match`, aliases included, errors naming the
caller's setting), one torch forward hook each, called with the module's name and output while the
returned :class:`OutputHooks` is ``on`` and the module is in the chosen mode. Attached before
``torch.compile``, they are traced into its graph, which hands the output to ``fn`` through an operator
(:mod:`hookexp.engine.traced`): no graph break, and switching them on and off costs no recompilation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from hookexp.engine import traced
from hookexp.engine.kinds import compiled, refuse_compiled
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

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.on and (training is None or module.training is training):
                fn(name, output)

        def seen(xs: list[torch.Tensor], form: int) -> None:
            if self.on:
                fn(name, xs[0] if form == 0 else (tuple, list)[form - 1](xs))

        token = traced.Token(seen)

        def trace(disabled: Callable[..., Any], module: nn.Module, args: Any, output: Any) -> None:
            """The output (a tensor, or a tuple or list of tensors) handed to ``fn`` when the graph runs."""
            if training is not None and module.training is not training:
                return
            if isinstance(output, torch.Tensor):
                traced.observe([output], token, 0)
            elif type(output) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in output):
                traced.observe(list(output), token, 1 if type(output) is tuple else 2)
            else:
                disabled(module, args, output)

        self._torch_handles += [module.register_forward_hook(compiled(hook, trace)), token]
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
    not change ``output`` (its return value is ignored), and must copy what it keeps (under torch.compile it
    sees detached tensors whose memory the graph reuses). A pattern that matches nothing raises a
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
