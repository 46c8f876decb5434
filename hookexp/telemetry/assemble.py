"""The one place observers are built from ``stats`` and ``guard``: for the trainer, :func:`hookexp.watch` and the
Lightning and HF callbacks alike (:func:`build_observers`).

The order is the order a log step lists their values: the task's metrics, what the hooks did, the non-finite
guard, the statistics probes, the gradient noise scale, the forensics ring buffer, the spike recorder and the
gradient clip's norm. What a driver adds to the config (its hooks, meter, ranks, loss scale) is a :class:`Wiring`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hookexp.config import GuardConfig, StatsConfig
from hookexp.errors import ConfigError
from hookexp.telemetry.forensics import Forensics
from hookexp.telemetry.gns import FSDP_REFUSED, GradientNoiseScale
from hookexp.telemetry.guard import NonFiniteGuard
from hookexp.telemetry.observer import Observer, Observers
from hookexp.telemetry.probes import HookEffects, Probes, stats_key
from hookexp.telemetry.readback import Pending
from hookexp.telemetry.spike import SpikeRecorder


@dataclass
class Wiring:
    """What a driver adds to ``stats`` and ``guard``. ``hooks``: the attached specs (a HookHandle); ``meter``: the
    task's metrics (the trainer's); ``device``: with one, the non-finite guard (``guard.nan_policy``) on it;
    ``grads_scaled``: fp16's GradScaler skips overflowing steps itself, so the guard looks at the loss alone;
    ``ranks``: the trainer's :class:`hookexp.run.distributed.Dist` (None: torch.distributed as it is);
    ``accumulate``: micro-batches per step when known (the noise scale needs two small batches);
    ``clip``: ``trainer.clip_grad_norm``; ``grad_scale``: the loss scale the noise scale divides out;
    ``gns_batch_size``: samples per micro-batch (None: measured); ``forensics``: on or off (None: with the guard
    or a spike recorder); ``key`` names a stats setting in errors; ``before_hook``: see :class:`Observers`."""

    hooks: Any = None
    meter: Observer | None = None
    device: torch.device | None = None
    grads_scaled: bool = False
    ranks: Any = None
    accumulate: int | None = None
    clip: float | None = None
    grad_scale: Callable[[], Any] | None = None
    gns_batch_size: int | None = None
    forensics: bool | None = None
    key: Callable[[str], str] = stats_key
    before_hook: bool = True


class GradClip(Observer):
    """``trainer.clip_grad_norm``, right before the update and after the statistics (they describe the gradients
    before the clip); its log steps give ``grad/pre_clip_norm`` and ``grad/clipped``. The global norm also over
    FSDP's sharded gradients: ``clip_grad_norm_`` reduces their norms over the ranks."""

    def __init__(self, model: torch.nn.Module, max_norm: float):
        self.max_norm = max_norm  # checked by TrainerConfig
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.logging = False
        self.norm: torch.Tensor | None = None

    def start(self, step: int, log: bool) -> None:
        self.logging = log

    def before_update(self) -> None:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        if self.logging:
            self.norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach()

    def pending(self) -> Pending:
        if self.norm is None:
            return None, lambda host: {}
        norm, self.norm = self.norm, None
        return torch.stack([norm.float(), (norm > self.max_norm).float()]), _clip_decode


def _clip_decode(values: np.ndarray) -> dict[str, float]:
    return {"grad/pre_clip_norm": float(values[0]), "grad/clipped": float(values[1])}


def hooks_touching(hooks: Any) -> Callable[[list[str]], list[str]]:
    """The guard's question: the specs whose targets are these parameters or modules that own them."""
    def touching(params: list[str]) -> list[str]:
        out = []
        for row in hooks.table():
            if not row["enabled"]:
                continue
            for t in row["targets"]:
                if any(p == t or t == "" or p.startswith(t + ".") for p in params):
                    out.append(f"{row['spec']} ({row['kind']} {row['transform']} on {t})")
                    break
        return out
    return touching


def check_noise_scale(stats: StatsConfig, wiring: Wiring) -> None:
    """``stats.gns`` needs small batches: refused under FSDP, and with one micro-batch on one process."""
    ranks = wiring.ranks
    if not stats.gns or ranks is None:
        return
    if ranks.sharded:
        raise ConfigError(FSDP_REFUSED, key=wiring.key("gns"))
    if wiring.accumulate is not None and wiring.accumulate < 2 and not ranks.enabled:
        raise ConfigError(f"the gradient noise scale compares small batches with the big batch they make up, and "
                          f"this run has one batch per optimizer step (trainer.accumulate={wiring.accumulate}, one "
                          f"process). Set trainer.accumulate=2 or more (the same samples per step: divide "
                          f"data.batch_size by it), or train several DDP ranks under torchrun; or set "
                          f"stats.gns=false.", key=wiring.key("gns"))


def _spike_recorder(model: torch.nn.Module, guard: GuardConfig, wiring: Wiring, watchable: list[str]) -> SpikeRecorder:
    """``guard.spike``: the one call of :class:`SpikeRecorder`."""
    rows = wiring.hooks.table() if wiring.hooks is not None else []
    per_step = wiring.ranks is None or not wiring.ranks.enabled  # the ranks' step values differ: judged on log steps
    return SpikeRecorder(guard.spike, model if per_step else None, wiring.meter if per_step else None,
                         metrics=watchable, specs=rows)


def _forensics(model: torch.nn.Module, optimizer: Any, guard: GuardConfig) -> Forensics:
    """``guard.forensics``: the one call of :class:`Forensics`."""
    return Forensics(model, optimizer, guard.forensics)


def _nonfinite(model: torch.nn.Module, guard: GuardConfig, wiring: Wiring) -> NonFiniteGuard:
    """``guard.nan_policy``: the one call of :class:`NonFiniteGuard`."""
    ranks = wiring.ranks
    nonfinite = NonFiniteGuard(guard.nan_policy, model, wiring.device, check_grads=not wiring.grads_scaled)
    if wiring.hooks is not None:
        nonfinite.touching = hooks_touching(wiring.hooks)
    if ranks is not None and ranks.sharded and ranks.enabled:
        nonfinite.agree = ranks.all_true
    return nonfinite


def build_observers(model: torch.nn.Module, optimizer: torch.optim.Optimizer, stats: StatsConfig,
                    guard: GuardConfig, wiring: Wiring) -> Observers:
    """The observers ``stats`` and ``guard`` describe, in log order (module docstring), driven from ``optimizer``'s
    hooks; attach the hook specs first, so that the statistics see the gradients after the ``pre_step`` specs.
    A failure closes what was built."""
    check_noise_scale(stats, wiring)
    named: dict[str, Observer] = {}
    with contextlib.ExitStack() as built:
        def add(name: str, observer: Any) -> Any:
            built.callback(observer.close)
            named[name] = observer
            return observer

        if wiring.meter is not None:
            add("meter", wiring.meter)
        if wiring.hooks is not None:
            add("hooks", HookEffects(wiring.hooks))
        nonfinite = add("guard", _nonfinite(model, guard, wiring)) if wiring.device is not None else None
        sharded = wiring.ranks.enabled if wiring.ranks is not None else None
        probes = add("stats", Probes(model, optimizer, stats, sharded, wiring.key))
        if stats.gns:
            add("gns", GradientNoiseScale(model, stats, wiring.gns_batch_size, wiring.grad_scale, wiring.key))
        keys = wiring.meter.keys() if wiring.meter is not None else []  # type: ignore[attr-defined]
        watchable = [*keys, *(["grad/global_norm"] if probes.grads else []),
                     *(["grad/pre_clip_norm"] if wiring.clip is not None else [])]
        recorder = _spike_recorder(model, guard, wiring, watchable)
        on = wiring.forensics
        if on is None:
            on = (nonfinite is not None and guard.nan_policy != "off") or recorder.enabled
        if on and guard.forensics.window:
            recorder.forensics = add("forensics", _forensics(model, optimizer, guard))
            if nonfinite is not None:
                nonfinite.forensics = recorder.forensics
        add("spike", recorder)  # before the clip: it judges the gradients' norm before the clip
        if wiring.clip is not None:
            add("clip", GradClip(model, wiring.clip))  # after the statistics and forensics: unclipped gradients
        if wiring.hooks is not None:
            recorder.pause_records(wiring.hooks)
        observers = Observers(named, optimizer, before_hook=wiring.before_hook)
        built.pop_all()
    return observers
