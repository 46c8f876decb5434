"""Probes: what the statistics describe (``stats.grads``, ``activations``, ``params``, ``updates``,
``optimizer``, ``group_by``), captured by hooks attached once and acting on log steps only.

A log step's gradients and activations are described in ONE :class:`~hookexp.telemetry.stats.TensorStats` call
and the weight, update and optimizer-state norms with one ``torch._foreach_norm``; nothing is read back here.
Keys: ``grad/<param>/<stat>``, ``grad/global_norm``, ``act/<module>/<stat>``, ``param/<param>/norm``,
``update/<param>/{norm,ratio}``, ``opt/<param>/<state>_norm``, ``{grad,param,update}/group/<group>/norm``,
``.../hist``. When each is captured, and the costs: docs/internals.md, "Probes".
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hookexp.config import StatsConfig
from hookexp.engine import match, output_hooks
from hookexp.errors import ConfigError
from hookexp.telemetry.observer import Observer
from hookexp.telemetry.readback import Pending, profiler_range
from hookexp.telemetry.stats import ACTIVATION_STATS, GRADIENT_STATS, STATS, TensorStats, norms

_ACT_DROPPED = tuple(f"/{s}" for s in STATS if s not in ACTIVATION_STATS)  # what activations do not log
_GRAD_DROPPED = tuple(f"/{s}" for s in STATS if s not in GRADIENT_STATS)  # what gradients do not log


def stats_key(setting: str) -> str:
    """The trainer's config key of a ``stats`` setting (errors name it); the trainer always measures the noise
    scale's batch size, so ``gns_batch_size`` is ``stats.gns`` there."""
    return "stats.gns" if setting == "gns_batch_size" else f"stats.{setting}"


def _params(model: nn.Module, pattern: str | None, key: str, trainable: bool = True) -> list[tuple[str, nn.Parameter]]:
    if not pattern:
        return []
    return [(n, p) for n, p in match(model, pattern, on="parameter", key=key) if p.requires_grad or not trainable]


def grouper(pattern: str | None, key: str) -> Callable[[str], str | None]:
    """``stats.group_by``: the group of a parameter name (None: in no group)."""
    if not pattern:
        return lambda name: None
    if not isinstance(pattern, str) or not pattern.startswith("re:"):
        raise ConfigError(f"expected a 're:' regular expression matched from the start of each parameter name, "
                          f"e.g. 're:^blocks\\.\\d+' (one group per block), got {pattern!r}.", key=key)
    try:
        rx = re.compile(pattern[3:])
    except re.error as e:
        raise ConfigError(f"{pattern!r} is not a valid regular expression ({e}).", key=key) from None

    def group(name: str) -> str | None:
        m = rx.match(name)
        return m.group(0).rstrip(".") or None if m else None
    return group


class Probes(Observer):
    """The statistics probes of one model and optimizer, an :class:`~hookexp.telemetry.observer.Observer`
    (driven by :class:`~hookexp.telemetry.observer.Observers`, whose optimizer hooks call
    :meth:`before_update` and :meth:`after_update`); see the module docstring. ``stats``: what to describe (the
    trainer's ``stats`` config; None: its defaults). ``activations_sharded``: whether activations are one rank's
    part of a batch spread over the default process group (DDP/FSDP; by default: whenever torch.distributed is
    initialized with several ranks). ``key`` names a setting in errors (the trainer's ``stats.*`` keys by
    default; ``watch`` names its own arguments)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, stats: StatsConfig | None = None,
                 activations_sharded: bool | None = None, key: Callable[[str], str] = stats_key):
        stats = stats if stats is not None else StatsConfig()
        self.grads = [(f"grad/{n}", p) for n, p in _params(model, stats.grads, key("grads"))]  # (metric key, param)
        self.params = _params(model, stats.params, key("params"), trainable=False)
        self.updates = _params(model, stats.updates, key("updates"))
        self.opt_params = _params(model, stats.optimizer, key("optimizer"))
        if optimizer is None and (self.grads or self.updates or self.opt_params):
            raise ConfigError("gradient, update and optimizer statistics are taken around optimizer.step(): pass "
                              "the optimizer.", key="Probes(optimizer=...)")
        self._group = grouper(stats.group_by, key("group_by"))
        self.describer = TensorStats(STATS, stats.hist_bins, stats.hist_sample, compile=stats.compile)
        if activations_sharded is None:
            activations_sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._acts_sharded = activations_sharded
        self._acts_kept: dict[str, torch.Tensor] = {}  # act/<module> -> a copy of its output, this log step
        self._described: Pending | None = None  # gradients and activations, described right before the update
        self._normed: dict[str, torch.Tensor] = {}  # param/, update/, weight/, opt/ tensors: norms only
        self._before: list[torch.Tensor] = []
        self._active = False
        self._acts = None
        if stats.activations:
            self._acts = output_hooks(model, stats.activations, self._keep_activation, key=key("activations"), on=False)
        self._optimizer = optimizer

    @property
    def active(self) -> bool:
        return self._active

    @active.setter
    def active(self, on: bool) -> None:
        """On for a log step (set before its forward), off otherwise."""
        self._active = on
        if self._acts is not None:
            self._acts.on = on

    def start(self, step: int, log: bool) -> None:
        self.active = log

    # -- capture ----------------------------------------------------------------------------------------
    def _keep_activation(self, name: str, output: Any) -> None:
        """A matched module's output (its first element when a tuple or list), kept for this log step."""
        x = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            self._acts_kept[f"act/{name}"] = x.detach().clone()  # a later in-place op must not change it

    def _describe(self, grads: dict[str, torch.Tensor]) -> None:
        """Gradients and the activations kept so far, described at once (no copy of the gradients: the clip
        after this works on them in place); nothing is read back."""
        acts, self._acts_kept = self._acts_kept, {}
        tensors = {**acts, **grads}
        if tensors:
            with profiler_range("hookexp/describe"):
                values, decode = self.describer.describe(tensors, sharded=list(acts) if self._acts_sharded else (),
                                                         higher=acts)  # gradients log no kurtosis
            self._described = (values, decode)

    @torch.no_grad()
    def before_update(self) -> None:
        """Right before the update, on final gradients."""
        if not self._active:
            return
        self._describe({key: p.grad for key, p in self.grads if p.grad is not None and p.grad.numel()})
        self._before = [p.detach().clone() for _, p in self.updates]

    @torch.no_grad()
    def after_update(self) -> None:
        """Right after the update."""
        if not self._active:
            return
        for (name, p), before in zip(self.updates, self._before, strict=True):
            self._normed[f"update/{name}"] = p.detach() - before
            self._normed[f"weight/{name}"] = before
        self._before = []
        for name, p in self.params:
            self._normed[f"param/{name}"] = p.detach()  # its norm is taken in pending(), before the next update
        for name, p in self.opt_params:
            for state, value in self._optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.is_floating_point():
                    self._normed[f"opt/{name}/{state}"] = value.detach()

    # -- the log step -----------------------------------------------------------------------------------
    def pending(self) -> Pending:
        """What this log step kept, described (no host sync) with the decoder of its host copy; starts over."""
        if self._described is None:  # activations alone (no optimizer step since they were kept)
            self._describe({})
        (described, describe), self._described = self._described or (None, None), None
        normed, norm = norms(self._normed)
        self._normed = {}
        parts = [t for t in (described, normed) if t is not None]
        if not parts:
            return None, lambda host: {}
        cut = 0 if described is None else described.numel()

        def decode(host: np.ndarray) -> dict[str, Any]:
            return self._metrics(describe(host[:cut]) if describe is not None else {}, norm(host[cut:]))
        return torch.cat([t.reshape(-1).to(parts[0].dtype) for t in parts]), decode

    def _metrics(self, out: dict[str, Any], normed: dict[str, float]) -> dict[str, Any]:
        """The describer's ``<key>/<stat>`` values (``out``, completed in place) and the norms as the documented
        metric keys: activations keep mean, std, mean |x|, kurtosis and fraction zero, gradients all but the last
        two; the global and group norms are added."""
        for key in [k for k in out if (k.startswith("act/") and k.endswith(_ACT_DROPPED))
                    or (k.startswith("grad/") and k.endswith(_GRAD_DROPPED))]:
            del out[key]
        grad_norms = {key[5:]: out[f"{key}/norm"] for key, _ in self.grads if f"{key}/norm" in out}
        found: dict[str, dict[str, float]] = {"grad": grad_norms, "param": {}, "update": {}, "weight": {}}
        for key, value in normed.items():  # <family>/<name>/norm
            family, rest = key.split("/", 1)
            if family == "opt":  # opt/<name>/<state>/norm -> opt/<name>/<state>_norm
                out[f"opt/{rest.removesuffix('/norm')}_norm"] = value
            else:
                found[family][rest.removesuffix("/norm")] = value
                if family != "weight":  # (the weights before the update: for update/<name>/ratio only)
                    out[key] = value
        for name, weight in found["weight"].items():
            update = found["update"].get(name)
            if update is not None:
                out[f"update/{name}/ratio"] = update / weight if weight else math.nan
        if grad_norms:
            out["grad/global_norm"] = _total(grad_norms.values())
        for family in ("grad", "param", "update"):
            groups: dict[str, list[float]] = {}
            for name, norm in found[family].items():
                g = self._group(name)
                if g is not None:
                    groups.setdefault(g, []).append(norm)
            out.update({f"{family}/group/{g}/norm": _total(v) for g, v in groups.items()})
        return out

    def close(self) -> None:
        if self._acts is not None:
            self._acts.remove()
        self._acts_kept.clear()
        self._normed.clear()
        self._described = None
        self._before = []


class HookEffects(Observer):
    """What the specs of ``hooks`` (a HookHandle) did on log steps, as ``hook/<spec>/<stat>``: they are
    measured on log steps only."""

    def __init__(self, hooks: Any):
        self.hooks = hooks

    def start(self, step: int, log: bool) -> None:
        self.hooks.measuring = log

    def pending(self) -> Pending:
        """What the specs did since the last read; resets."""
        values, decode = self.hooks.pending_stats(reset=True)
        return values, lambda host: {f"hook/{spec}/{k}": v for spec, row in decode(host.tolist()).items()
                                     for k, v in row.items() if k != "targets"}


def _total(norms: Any) -> float:
    """The norm of several tensors together, from each one's norm (an exactly rounded sum of squares)."""
    values = np.asarray(list(norms), dtype=np.float64)
    return math.sqrt(math.fsum((values * values).tolist()))

