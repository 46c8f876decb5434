"""What the loop observes and logs, behind one small interface: the task's metrics, the gradient and
activation statistics, what the hooks did, the clip and the non-finite guard.

Nothing runs, and nothing syncs, on steps that do not log (the guard aside, see :mod:`hookexp.guard`).
On a log step every producer hands a device tensor and a decoder, and :meth:`Telemetry.read` reads them
back in one transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig

from hookexp.errors import ConfigError
from hookexp.guard import NonFiniteGuard
from hookexp.meter import TrainMeter
from hookexp.stats import StepStats

Producer = tuple[torch.Tensor | None, Callable[[list[float]], dict[str, Any]]]

# Whether the statistics core describes FSDP's sharded gradients (DTensors) as the whole tensors they are parts of.
# hookexp/stats.py describes local tensors only; the shard-aware core (hookexp/telemetry/stats.py, issue 21) sets
# this when it is wired in here, and tests/test_fsdp.py's statistics test then runs instead of being expected to fail.
SHARD_AWARE_STATS = False


class Telemetry:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, hooks: Any, task: Any,
                 stats: DictConfig, nan_policy: str, device: torch.device, ranks: Any, *, grads_scaled: bool = False,
                 clip_grad_norm: float | None = None):
        if stats.every < 1:
            raise ConfigError(f"must be at least 1, got {stats.every}.", key="stats.every")
        if stats.hist_bins < 0:
            raise ConfigError(f"must be 0 (no histograms) or more, got {stats.hist_bins}.", key="stats.hist_bins")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ConfigError(f"must be a positive norm (or null: no clipping), got {clip_grad_norm}.",
                              key="trainer.clip_grad_norm")
        if getattr(ranks, "sharded", False) and stats.grads and not SHARD_AWARE_STATS:
            raise ConfigError("gradient statistics under trainer.strategy=fsdp must combine every rank's shard of each "
                              "gradient, which this version's statistics do not do yet (they would describe rank 0's "
                              "shards as if they were whole). Set stats.grads=null to train with FSDP now, or train "
                              "with trainer.strategy=ddp.", key="stats.grads")
        self.every = stats.every
        self.hooks = hooks
        self._agree_on_skips = getattr(ranks, "sharded", False) and ranks.enabled and nan_policy == "skip_step"
        self._ranks, self._device = ranks, device
        self.meter = TrainMeter(task, device, ranks)
        self.stats = StepStats(model, stats.grads, stats.activations, stats.hist_bins, stats.hist_sample)
        self.stats.prepare(device)
        self.guard = NonFiniteGuard(nan_policy, model, self.hooks_touching, device, check_grads=not grads_scaled)
        self.logging = False
        self._clip = clip_grad_norm
        self._clip_norm: torch.Tensor | None = None
        self._params = [p for p in model.parameters() if p.requires_grad]
        # Registered after the hooks' own: they see the gradient after the pre_step specs; the clip comes last.
        self._handles = [optimizer.register_step_pre_hook(self._capture)]
        if clip_grad_norm is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._clip_grads))

    # -- the loop's calls ------------------------------------------------------------------------------
    def start_step(self, log: bool) -> None:
        self.logging = log
        self.hooks.measuring = log
        if log:
            self.stats.begin()

    def add(self, sums: torch.Tensor, count: torch.Tensor) -> None:
        self.meter.add(sums, count)

    def before_update(self, loss: torch.Tensor, step: int) -> bool:
        take = self.guard.before_update(loss, step)
        if self._agree_on_skips:  # FSDP: each rank checked its own shards; the ranks step together or not at all
            take = not self._ranks.any(not take, self._device)
        return take

    def _capture(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.logging:
            self.stats.capture_grads()

    def _clip_grads(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The global norm also over FSDP's sharded gradients: clip_grad_norm_ reduces their norms over the ranks."""
        norm = torch.nn.utils.clip_grad_norm_(self._params, self._clip)
        if self.logging:
            self._clip_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach()

    def read(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The log step: every producer's values in one read-back; returns (metrics, histograms)."""
        hook_values, hook_decode = self.hooks.pending_stats(reset=True)
        producers: list[Producer] = [self.meter.pending(), (hook_values, lambda v: _hook_metrics(hook_decode(v))),
                                     self.guard.pending()]
        if self._clip_norm is not None:
            norm, self._clip_norm = self._clip_norm, None
            producers.append((torch.stack([norm.float(), (norm > self._clip).float()]).double(), _clip_decode))
        result = self.stats.finish(*(t for t, _ in producers))
        metrics: dict[str, Any] = {}
        for (_, decode), values in zip(producers, result.extra, strict=True):
            metrics.update(decode(values))
        metrics.update(result.metrics())
        return metrics, result.histograms()

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
        return {"meter": self.meter.state_dict(), "guard": self.guard.summary()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.meter.load_state_dict(state["meter"])
        self.guard.skipped = int(state["guard"]["guard/skipped_steps"])
        self.guard.warned = int(state["guard"]["guard/nonfinite_warnings"])

    def summary(self) -> dict[str, Any]:
        return self.guard.summary()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _hook_metrics(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"hook/{spec}/{k}": v for spec, row in stats.items() for k, v in row.items() if k != "targets"}


def _clip_decode(values: list[float]) -> dict[str, float]:
    return {"grad/pre_clip_norm": values[0], "grad/clipped": values[1]}
