"""The trainer's observers (:mod:`hookexp.telemetry.observer`), built from the run's config, in the order a
log step lists their values: the task's metrics, what the hooks did, the guard, the statistics probes, the
gradient noise scale (``stats.gns``), the forensics ring buffer, the gradient clip's norm, and the spike recorder.

Nothing runs, and nothing syncs, on steps that do not log (the guard aside, see
:mod:`hookexp.telemetry.guard`). On a log step every observer hands over a device tensor and a decoder, and
:meth:`~hookexp.telemetry.observer.Observers.read` reads them back in one transfer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from hookexp.config import ForensicsConfig, SpikeConfig
from hookexp.engine import HookHandle
from hookexp.errors import ConfigError
from hookexp.telemetry.forensics import Forensics
from hookexp.telemetry.gns import GradientNoiseScale
from hookexp.telemetry.guard import NonFiniteGuard
from hookexp.telemetry.meter import TrainMeter
from hookexp.telemetry.observer import Observer, Observers
from hookexp.telemetry.probes import HookEffects, Probes
from hookexp.telemetry.readback import Pending
from hookexp.telemetry.spike import SpikeRecorder


class GradClip(Observer):
    """``trainer.clip_grad_norm``, right before the update and after the statistics (they describe the gradients
    before the clip); its log steps give ``grad/pre_clip_norm`` and ``grad/clipped``. The global norm also over
    FSDP's sharded gradients: ``clip_grad_norm_`` reduces their norms over the ranks."""

    def __init__(self, model: torch.nn.Module, max_norm: float):
        if not max_norm > 0:
            raise ConfigError(f"must be a positive norm (or null: no clipping), got {max_norm}.",
                              key="trainer.clip_grad_norm")
        self.max_norm = max_norm
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


def hooks_touching(hooks: HookHandle) -> Any:
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


def noise_scale(cfg: DictConfig, parts: Any, scaler: Any) -> GradientNoiseScale | None:
    """``stats.gns``: the gradient noise scale, or None when it is off; refused without small batches."""
    if not cfg.stats.get("gns"):
        return None
    if parts.ranks.sharded:
        raise ConfigError("the gradient noise scale needs each rank's own micro-batch gradients, and FSDP2 never "
                          "holds them (every micro-batch's gradient is reduce-scattered over the ranks at once). "
                          "Train with trainer.strategy=ddp, or set stats.gns=false.", key="stats.gns")
    if parts.accumulate < 2 and not parts.ranks.enabled:
        raise ConfigError(f"the gradient noise scale compares small batches with the big batch they make up, and "
                          f"this run has one batch per optimizer step (trainer.accumulate={parts.accumulate}, one "
                          f"process). Set trainer.accumulate=2 or more (the same samples per step: divide "
                          f"data.batch_size by it), or train several DDP ranks under torchrun; or set "
                          f"stats.gns=false.", key="stats.gns")
    scale = (lambda: scaler._scale) if scaler is not None else None  # the loss scale of the step's backward passes
    return GradientNoiseScale(parts.model, group_by=cfg.stats.get("group_by"), ema=cfg.stats.get("gns_ema", 0.95),
                              grad_scale=scale)


def trainer_observers(cfg: DictConfig, parts: Any, hooks: HookHandle, grads_scaled: bool,
                      scaler: Any = None) -> Observers:
    """The observers of a hookexp run (``parts``: :class:`hookexp.run.build.Parts`), attached after the hook
    specs so that the statistics see the gradients after the ``pre_step`` specs; ``grads_scaled``: fp16's
    GradScaler skips overflowing steps itself, so the guard looks at the loss alone; ``scaler``: that GradScaler
    (the noise scale divides its scale out of the micro-batches' gradients)."""
    stats, guard, ranks = cfg.stats, cfg.guard, parts.ranks
    if stats.every < 1:
        raise ConfigError(f"must be at least 1, got {stats.every}.", key="stats.every")
    model = parts.model
    meter = TrainMeter(parts.task, parts.device, ranks)
    probes = Probes(model, parts.optimizer, grads=stats.grads, activations=stats.activations,
                    params=stats.get("params"), updates=stats.get("updates"), optimizer_state=stats.get("optimizer"),
                    group_by=stats.get("group_by"), hist_bins=stats.hist_bins, hist_sample=stats.hist_sample,
                    activations_sharded=ranks.enabled)
    gns = None
    try:
        gns = noise_scale(cfg, parts, scaler)
        agree = ranks.all_true if ranks.sharded and ranks.enabled else None
        nonfinite = NonFiniteGuard(guard.nan_policy, model, hooks_touching(hooks), parts.device,
                                   check_grads=not grads_scaled, agree=agree)
        clip = cfg.trainer.clip_grad_norm
        named: dict[str, Observer] = {"meter": meter, "hooks": HookEffects(hooks), "guard": nonfinite,
                                      "stats": probes, **({"gns": gns} if gns is not None else {})}
        rows = hooks.table()
        watchable = [*meter.keys(), *(["grad/global_norm"] if probes.grads else []),
                     *(["grad/pre_clip_norm"] if clip is not None else [])]
        per_step = not ranks.enabled  # under DDP/FSDP the ranks' step values differ: judged on the log steps
        recorder = SpikeRecorder(
            SpikeConfig(**_plain(guard.get("spike"))), model if per_step else None, meter if per_step else None,
            metrics=watchable, record_specs=[r["spec"] for r in rows if r["transform"] == "record" and r["enabled"]],
            specs=[r["spec"] for r in rows])
        forensics = ForensicsConfig(**_plain(guard.get("forensics")))
        if forensics.window and (guard.nan_policy != "off" or recorder.enabled):
            named["forensics"] = recorder.forensics = nonfinite.forensics = Forensics(model, parts.optimizer,
                                                                                      forensics)
        named["spike"] = recorder  # before the clip: it judges the gradients' norm before the clip
        if clip is not None:
            named["clip"] = GradClip(model, clip)  # after the statistics and forensics: they see unclipped gradients
    except BaseException:
        probes.close()
        if gns is not None:
            gns.close()
        raise
    recorder.pause_records(hooks)
    return Observers(named, parts.optimizer)


def _plain(node: Any) -> dict[str, Any]:
    """A config group (DictConfig, mapping or None) as keyword arguments of its dataclass."""
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    return dict(node or {})
