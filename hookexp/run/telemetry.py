"""What the loop observes and logs, behind one small interface: the task's metrics, the statistics
probes, what the hooks did, the clip, the non-finite guard and the spike recorder.

Nothing runs, and nothing syncs, on steps that do not log (the guard aside, see
:mod:`hookexp.telemetry.guard`). On a log step every producer hands over a device tensor and a decoder,
and :func:`hookexp.telemetry.readback.read` reads them back in one transfer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from hookexp.errors import ConfigError
from hookexp.telemetry.guard import NonFiniteGuard
from hookexp.telemetry.meter import TrainMeter
from hookexp.telemetry.probes import Probes, hook_effects
from hookexp.telemetry.readback import Pending, read, split_histograms
from hookexp.telemetry.spike import Spike, SpikeRecorder


class Telemetry:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, hooks: Any, task: Any,
                 stats: DictConfig, guard: DictConfig, device: torch.device, ranks: Any, *,
                 grads_scaled: bool = False, clip_grad_norm: float | None = None):
        if stats.every < 1:
            raise ConfigError(f"must be at least 1, got {stats.every}.", key="stats.every")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ConfigError(f"must be a positive norm (or null: no clipping), got {clip_grad_norm}.",
                              key="trainer.clip_grad_norm")
        self.every = stats.every
        self.hooks = hooks
        self.meter = TrainMeter(task, device, ranks)
        # after the hooks' own optimizer pre-hook: the probes see the gradient after the pre_step specs; the clip
        # (registered below) comes last
        self.probes = Probes(model, optimizer, grads=stats.grads, activations=stats.activations,
                             params=stats.get("params"), updates=stats.get("updates"),
                             optimizer_state=stats.get("optimizer"), group_by=stats.get("group_by"),
                             hist_bins=stats.hist_bins, hist_sample=stats.hist_sample,
                             activations_sharded=ranks.enabled)
        agree = ranks.all_true if ranks.sharded and ranks.enabled else None
        self.guard = NonFiniteGuard(guard.nan_policy, model, self.hooks_touching, device,
                                    check_grads=not grads_scaled, agree=agree)
        rows = hooks.table()
        spike = guard.get("spike")
        watchable = [*self.meter.keys(), *(["grad/global_norm"] if self.probes.grads else []),
                     *(["grad/pre_clip_norm"] if clip_grad_norm is not None else [])]
        self.spike = SpikeRecorder.from_config(
            OmegaConf.to_container(spike, resolve=True) if isinstance(spike, DictConfig) else spike,
            [r["spec"] for r in rows if r["transform"] == "record" and r["enabled"]], [r["spec"] for r in rows],
            watchable)
        if self.spike.record:
            hooks.pause(self.spike.record)  # until a spike
        self.logging = False
        self._clip = clip_grad_norm
        self._clip_norm: torch.Tensor | None = None
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._handles = [] if clip_grad_norm is None else [optimizer.register_step_pre_hook(self._clip_grads)]

    # -- the loop's calls ------------------------------------------------------------------------------
    def log_step(self, step: int, last: int) -> bool:
        """Whether step ``step`` logs: every ``stats.every``-th, the last, and every step of a spike's window."""
        return step % self.every == 0 or step == last or self.spike.logging_every_step(step)

    def start_step(self, log: bool) -> None:
        self.logging = log
        self.hooks.measuring = log
        self.probes.active = log

    def add(self, sums: torch.Tensor, count: torch.Tensor) -> None:
        self.meter.add(sums, count)

    def before_update(self, loss: torch.Tensor, step: int) -> bool:
        return self.guard.before_update(loss, step)

    def set_step(self, step: int) -> None:
        """The step the hooks' schedules look at next (also after a skipped update)."""
        self.hooks.set_step(step)

    def _clip_grads(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The global norm also over FSDP's sharded gradients: clip_grad_norm_ reduces their norms over the ranks."""
        norm = torch.nn.utils.clip_grad_norm_(self._params, self._clip)
        if self.logging:
            self._clip_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach()

    def read(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The log step: every producer's values in one read-back; returns (metrics, histograms)."""
        producers: list[Pending] = [self.meter.pending(), hook_effects(self.hooks), self.guard.pending(),
                                    self.probes.pending()]
        if self._clip_norm is not None:
            norm, self._clip_norm = self._clip_norm, None
            producers.append((torch.stack([norm.float(), (norm > self._clip).float()]), _clip_decode))
        return split_histograms(read(producers))

    def spiked(self, metrics: dict[str, Any], step: int) -> Spike | None:
        """After a log step: a spike of ``guard.spike.metric`` starts a window of every-step logging and turns the
        ``record`` specs on; the step that ends a window turns them off again."""
        spike = self.spike.observe(metrics, step)
        if spike is not None and self.spike.record:
            self.hooks.pause(self.spike.record, paused=False)
        return spike

    def end_step(self, step: int) -> None:
        if self.spike.record and self.spike.window_ended(step):
            self.hooks.pause(self.spike.record)

    def hooks_touching(self, params: list[str]) -> list[str]:
        """Specs whose targets are these parameters or modules that own them (for the guard's message)."""
        out = []
        for row in self.hooks.table():
            if not row["enabled"]:
                continue
            for t in row["targets"]:
                if any(p == t or t == "" or p.startswith(t + ".") for p in params):
                    out.append(f"{row['spec']} ({row['kind']} {row['transform']} on {t})")
                    break
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"meter": self.meter.state_dict(), "guard": self.guard.summary(), "spike": self.spike.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.meter.load_state_dict(state["meter"])
        self.guard.skipped = int(state["guard"]["guard/skipped_steps"])
        self.guard.warned = int(state["guard"]["guard/nonfinite_warnings"])
        if "spike" in state:
            self.spike.load_state_dict(state["spike"])
            if self.spike.record and self.hooks.step < self.spike.until:  # resumed inside a spike's window
                self.hooks.pause(self.spike.record, paused=False)

    def summary(self) -> dict[str, Any]:
        return {**self.guard.summary(), **({"guard/spikes": self.spike.found} if self.spike.enabled else {})}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.probes.remove()


def _clip_decode(values: np.ndarray) -> dict[str, float]:
    return {"grad/pre_clip_norm": float(values[0]), "grad/clipped": float(values[1])}
