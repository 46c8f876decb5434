"""The gradient noise scale per parameter group (``stats.gns``), from the micro-batches a step already computes:
McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", App. A.1). Each step's unbiased estimates
of |G|^2 and tr(S), from the micro-batches' gradient norms (tensor hooks, no extra backward) and the final
``.grad``'s, are smoothed by debiased moving averages; ``B_simple = tr(S) / |G|^2``. The estimates, the
contract on ``.grad``, the costs and DDP/FSDP: docs/statistics.md, "The gradient noise scale".
Keys (log steps): ``gns/{grad_sq,trace,b_simple}`` and ``gns/<group>/{grad_sq,trace,b_simple}`` per ``group_by`` group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hookexp.config import StatsConfig
from hookexp.errors import ConfigError
from hookexp.telemetry.observer import Observer
from hookexp.telemetry.probes import grouper, stats_key
from hookexp.telemetry.readback import Pending, wide_dtype

FSDP_REFUSED = ("the gradient noise scale needs each rank's own micro-batch gradients, and FSDP2 never holds them "
                "(every micro-batch's gradient is reduce-scattered over the ranks at once). Train with "
                "trainer.strategy=ddp, or set stats.gns=false.")


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _batch_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A forward's first argument with a batch dimension (its leading dimension counts the samples)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value
    return None


class GradientNoiseScale(Observer):
    """``stats.gns``: the gradient noise scale of ``model``'s trainable parameters (module docstring), an
    :class:`~hookexp.telemetry.observer.Observer` whose :meth:`before_update` runs on the final gradients of
    every step. ``stats``: ``group_by`` (the groups) and ``gns_ema`` (the smoothing); ``batch_size``: samples
    per micro-batch on each rank (None: measured); ``grad_scale``: the loss scale the backward passes ran under
    (fp16's GradScaler; a tensor, a number or None), asked for right before the update; ``key`` names the
    settings in errors (the trainer's ``stats.*`` keys by default)."""

    optional_state: ClassVar[bool] = True  # checkpoints written before stats.gns have no state for it

    def __init__(self, model: nn.Module, stats: StatsConfig | None = None, batch_size: int | None = None,
                 grad_scale: Callable[[], Any] | None = None, key: Callable[[str], str] = stats_key):
        stats = stats if stats is not None else StatsConfig()
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ConfigError(f"must be a positive number of samples per micro-batch (or None: measured), got "
                              f"{batch_size!r}.", key=key("gns_batch_size"))
        self.key, self.ema, self.batch_size, self.grad_scale = key, float(stats.gns_ema), batch_size, grad_scale
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if any(hasattr(p, "placements") for _, p in named):
            raise ConfigError(FSDP_REFUSED, key=key("gns"))
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        group = grouper(stats.group_by, key("group_by"))
        member = [group(n) for n in self.names]
        self.groups = list(dict.fromkeys(g for g in member if g is not None))
        rows = [[1.0] * len(named)] + [[float(m == g) for m in member] for g in self.groups]
        self._member = torch.tensor(rows)  # (1 + groups) x params: the global row, then each group's
        self._norms: list[torch.Tensor] = []  # this step: each backward's gradient norm per parameter ...
        self._which: list[int] = []  # ... and the parameter's index
        self._hits = [0] * len(named)  # backward passes that reached each parameter this step
        self._sizes: list[int] = []  # samples of each training forward this step
        self._index: dict[tuple[int, ...], torch.Tensor] = {}
        self._ema: torch.Tensor | None = None  # 2 x (1 + groups): the averages of |G|^2 and tr(S)
        self._weight: torch.Tensor | None = None  # 2 x (1 + groups): 1 - ema^t (where every step was finite)
        self._valid = False  # whether a step has had two small batches or more
        self._handles = [p.register_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self._counting = model.register_forward_pre_hook(self._count, with_kwargs=True) if batch_size is None \
            else None

    def count_calls_of(self, forward: Any) -> None:
        """Measure the batch sizes on ``forward`` (the DDP or compiled wrapper of the model) instead of the model:
        a hook outside the compiled graph, where appending to a list makes Dynamo guard on its length and
        recompile for each micro-batch."""
        if self._counting is not None and isinstance(forward, nn.Module):
            self._counting.remove()
            self._counting = forward.register_forward_pre_hook(self._count, with_kwargs=True)

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            g = grad.detach()
            self._norms.append(torch.linalg.vector_norm(
                g, dtype=torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None))
            self._which.append(i)
            self._hits[i] += 1
        return hook

    def _count(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module.training and torch.is_grad_enabled():
            x = _batch_input(args, kwargs)
            if x is not None:
                self._sizes.append(int(x.shape[0]))

    def start(self, step: int, log: bool) -> None:
        """A new step: what the previous one kept goes (also when its update was skipped)."""
        self._norms, self._which, self._hits, self._sizes = [], [], [0] * len(self.params), []

    def _at(self, index: list[int], device: torch.device) -> torch.Tensor:
        key = (*index, str(device))
        at = self._index.get(key)
        if at is None:
            if len(self._index) > 16:
                self._index.clear()
            at = self._index[key] = torch.tensor(index, device=device)
        return at

    @torch.no_grad()
    def before_update(self) -> None:
        """This step's estimates (on the device), into the moving averages; nothing is read back."""
        k, ranks = max(self._hits, default=0), _world()
        norms, which, sizes = self._norms, self._which, self._sizes
        self._norms, self._which = [], []
        n = k * ranks
        if n < 2:
            if k and not self._valid:
                raise ConfigError(f"the gradient noise scale needs two small batches or more per optimizer step, and "
                                  f"this step had {k} backward pass(es) on {ranks} rank(s). Accumulate gradients "
                                  f"(trainer.accumulate=2 or more; in your own loop, several backward passes "
                                  f"before optimizer.step(), each loss divided by their number), or train DDP "
                                  f"ranks under torchrun; or turn it off.", key=self.key("gns"))
            return  # an epoch's last step with one micro-batch: no estimate
        if self.batch_size is not None:
            inverse = 1.0 / self.batch_size
        elif sizes:
            inverse = float(np.mean([1.0 / b for b in sizes]))
        else:
            raise ConfigError("no training forward of the watched model was seen this step, so the micro-batches' "
                              "sizes are unknown. Call the model itself in the training step, or give the samples "
                              "per micro-batch.", key=self.key("gns_batch_size"))
        present = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not present:
            return
        device = self.params[present[0]].grad.device
        wide = wide_dtype(device)
        if self._member.device != device or self._member.dtype != wide:
            self._member = self._member.to(device, wide)
        if self._ema is None:
            self._ema = torch.zeros(2, len(self._member), dtype=wide, device=device)
            self._weight = torch.zeros_like(self._ema)
        elif self._ema.device != device:  # restored from a checkpoint
            self._ema, self._weight = self._ema.to(device, wide), self._weight.to(device, wide)
        big = torch.zeros(len(self.params), dtype=wide, device=device)
        finals = torch._foreach_norm([self.params[i].grad.detach() for i in present])
        big.index_copy_(0, self._at(present, device), torch.stack(finals).to(wide).square())
        small = torch.zeros_like(big)
        if norms:
            small.index_add_(0, self._at(which, device), torch.stack(norms).to(device, wide).square())
        scale = self.grad_scale() if self.grad_scale is not None else None
        # the small batches' mean |G_i|^2 on this rank: G_i = k g_i / scale, averaged over the k micro-batches
        small = small * k if scale is None else small * k / torch.as_tensor(scale, device=device).to(wide).square()
        big, small = self._member @ big, self._member @ small  # the global row, then each group's
        grad_sq = (n * big - small) / (n - 1)
        trace = (small - big) * n / ((n - 1) * inverse)
        x = torch.stack([grad_sq, trace])
        ok = torch.isfinite(x)
        self._ema = torch.where(ok, self.ema * self._ema + (1 - self.ema) * x, self._ema)
        self._weight = torch.where(ok, self.ema * self._weight + (1 - self.ema), self._weight)
        self._valid = True

    def _averaged(self) -> torch.Tensor | None:
        """The averages and their weights (4 x (1 + groups)), summed over the ranks (one all_reduce)."""
        if self._ema is None:
            return None
        both = torch.cat([self._ema, self._weight])
        if _world() > 1:
            both = both.clone()
            dist.all_reduce(both)
        return both

    def pending(self) -> Pending:
        both = self._averaged()
        if both is None:
            return None, lambda host: {}
        values = both[:2] / both[2:]  # debiased (on one rank: the weights are alike on every rank)
        groups = self.groups

        def decode(host: np.ndarray) -> dict[str, float]:
            rows = np.asarray(host, dtype=np.float64).reshape(2, -1)
            out: dict[str, float] = {}
            for j, name in enumerate([None, *groups]):
                prefix = "gns" if name is None else f"gns/{name}"
                grad_sq, trace = float(rows[0, j]), float(rows[1, j])
                out[f"{prefix}/b_simple"] = trace / grad_sq if grad_sq else float("nan")
                out[f"{prefix}/grad_sq"], out[f"{prefix}/trace"] = grad_sq, trace
            return out
        return values.reshape(-1), decode

    def state_dict(self) -> dict[str, Any]:
        """The moving averages, those of every rank averaged (on every rank: one all_reduce under DDP)."""
        both = self._averaged()
        if both is None:
            return {}
        both = both / _world()
        # left on the device: a rollback snapshot copies them without a host sync (a checkpoint loads them to the CPU)
        return {"ema": both[:2], "weight": both[2:], "groups": list(self.groups)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if list(state["groups"]) != self.groups:
            raise ConfigError(f"the checkpoint's gradient noise scale has the groups {state['groups']}, this run "
                              f"{self.groups}. Resume with the same stats.group_by.", key=self.key("group_by"))
        self._ema, self._weight = state["ema"].clone(), state["weight"].clone()
        self._valid = True

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._counting is not None:
            self._counting.remove()
            self._counting = None
        self.start(0, False)
