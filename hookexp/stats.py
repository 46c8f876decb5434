"""Gradient and activation statistics, computed batched and only on log steps.

Gradients: every matched parameter's ``.grad`` is flattened into one buffer once, and each statistic
is one segment reduction over it (``index_add_`` / ``scatter_reduce_``), so the cost is a handful of
kernels whatever the number of parameters, and the result is one ``[P, S]`` tensor that crosses to
the host in a single transfer. Nothing here runs, and nothing syncs, on steps that do not log.

Activations: forward hooks that exist only during log steps (``begin`` attaches, ``end`` removes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookexp.specs import HookSpec
from hookexp.targets import resolve

GRAD_STATS = ("norm", "mean", "std", "min", "max", "frac_zero", "frac_neg")
ACT_STATS = ("mean", "std", "frac_zero")


def _match(model: nn.Module, pattern: str, what: str, key: str) -> list[tuple[str, Any]]:
    """Resolve a ``stats.*`` pattern with the hook target grammar; errors name the stats key."""
    spec = HookSpec(name=key, target=pattern, kind="grad" if what == "parameter" else "forward")
    return [(t.name, t.obj) for t in resolve(model, spec, what, config_key=key)]  # type: ignore[arg-type]


@dataclass
class GradStatsResult:
    """Statistics of one log step, on the host."""

    names: list[str]
    values: list[list[float]]  # [P][len(GRAD_STATS)]
    global_norm: float
    hist: list[list[float]] | None = None  # [P][bins], over each parameter's [min, max]

    @property
    def hist_range(self) -> list[tuple[float, float]]:
        return [(row[GRAD_STATS.index("min")], row[GRAD_STATS.index("max")]) for row in self.values]

    def metrics(self) -> dict[str, float]:
        out = {f"grad/{n}/{s}": v for n, row in zip(self.names, self.values, strict=True)
               for s, v in zip(GRAD_STATS, row, strict=True)}
        out["grad/global_norm"] = self.global_norm
        return out


class GradStats:
    """Statistics of the gradients of the parameters ``pattern`` matches (target grammar)."""

    def __init__(self, model: nn.Module, pattern: str | None = "*", hist_bins: int = 0):
        matched = _match(model, pattern, "parameter", "stats.grads") if pattern else []
        self.named = [(n, p) for n, p in matched if p.requires_grad]
        self.hist_bins = hist_bins
        self._seg_cache: dict[tuple[Any, ...], torch.Tensor] = {}

    def _layout(self, sizes: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment ids (element -> parameter) and lengths, cached per set of present gradients."""
        key = (tuple(sizes), str(device))
        cached = self._seg_cache.get(key)
        if cached is None:
            lengths = torch.tensor(sizes, device=device)
            cached = (torch.repeat_interleave(torch.arange(len(sizes), device=device), lengths), lengths)
            self._seg_cache[key] = cached
        return cached

    @torch.no_grad()
    def compute(self) -> GradStatsResult | None:
        """Describe the current ``.grad`` of every matched parameter (parameters without one are skipped)."""
        present = [(n, p.grad) for n, p in self.named if p.grad is not None]
        if not present:
            return None
        names = [n for n, _ in present]
        grads = [g for _, g in present]
        device = grads[0].device
        flat = torch.cat([g.detach().reshape(-1).to(device=device, dtype=torch.float32) for g in grads])
        seg, lengths = self._layout([g.numel() for g in grads], device)
        n_params = len(grads)
        # One segmented sum over [sum, sum of squares, zeros, negatives], in float64 so that the
        # variance from sums stays exact enough; min/max by scatter_reduce.
        wide = flat.double() if device.type != "mps" else flat
        columns = torch.stack([wide, wide * wide, (flat == 0).to(wide.dtype), (flat < 0).to(wide.dtype)], dim=1)
        sums = torch.segment_reduce(columns, "sum", lengths=lengths, axis=0)
        count = lengths.to(wide.dtype)
        total, sumsq, zeros, negs = sums.unbind(dim=1)
        mean = total / count
        std = ((sumsq - total * mean) / (count - 1)).clamp_min(0).sqrt()  # unbiased, as Tensor.std()
        mins = torch.full((n_params,), float("inf"), device=device).scatter_reduce_(0, seg, flat, "amin")
        maxs = torch.full((n_params,), float("-inf"), device=device).scatter_reduce_(0, seg, flat, "amax")
        table = torch.stack([sumsq.sqrt(), mean, std, mins.to(wide.dtype), maxs.to(wide.dtype),
                             zeros / count, negs / count], dim=1)
        parts = [table.reshape(-1), sumsq.sum().sqrt().reshape(1)]
        if self.hist_bins > 0:
            bins = self.hist_bins
            idx = _bin_index(flat, mins[seg], maxs[seg], bins)
            parts.append(_count(seg * bins + idx, n_params * bins).to(wide.dtype))
        host = torch.cat(parts).tolist()  # the one device-to-host transfer of this log step
        n_stats = len(GRAD_STATS)
        values = [host[i * n_stats:(i + 1) * n_stats] for i in range(n_params)]
        global_norm = host[n_params * n_stats]
        result = GradStatsResult(names, values, global_norm)
        if self.hist_bins > 0:
            start = n_params * n_stats + 1
            result.hist = [host[start + i * self.hist_bins:start + (i + 1) * self.hist_bins]
                           for i in range(n_params)]
        return result


def _bin_index(flat: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """The bin of every value among ``bins`` equal bins over [lo, hi] (per element: lo/hi broadcast)."""
    return ((flat - lo) / (hi - lo).clamp_min(1e-30) * bins).floor().clamp(0, bins - 1).nan_to_num(0).long()


def _count(index: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of ``range(size)`` occurs in ``index``: bincount on the CPU (fast), index_add_
    elsewhere (bincount would sync to size its output)."""
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=size).float()
    return torch.zeros(size, device=index.device).index_add_(0, index, torch.ones(index.shape, device=index.device))


def _histogram(flat: torch.Tensor, bins: int) -> torch.Tensor:
    """``[lo, hi, count_1 .. count_bins]`` over [min, max], on device and without a host sync."""
    lo, hi = flat.min(), flat.max()
    return torch.cat([lo.reshape(1), hi.reshape(1), _count(_bin_index(flat, lo, hi, bins), bins)])


class ActivationStats:
    """Mean, std and fraction of zeros of the outputs of matched modules, on log steps only."""

    def __init__(self, model: nn.Module, pattern: str | None, hist_bins: int = 0):
        self.named = _match(model, pattern, "module", "stats.activations") if pattern else []
        self.hist_bins = hist_bins
        self._handles: list[Any] = []
        self._rows: dict[str, torch.Tensor] = {}
        self.hists: dict[str, tuple[list[float], float, float]] = {}  # of the last log step

    def begin(self) -> None:
        """Attach the forward hooks for one log step."""
        for name, module in self.named:
            self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                with torch.no_grad():
                    x = output.detach().float()
                    # (measured on CPU: faster than torch.std_mean + count_nonzero)
                    row = torch.stack([x.mean(), x.std(), (x == 0).float().mean()])
                    if self.hist_bins > 0:
                        row = torch.cat([row, _histogram(x.reshape(-1), self.hist_bins)])
                    self._rows[name] = row
        return hook

    def end(self) -> dict[str, float]:
        """Remove the hooks and return ``act/<module>/<stat>`` (one transfer)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if not self._rows:
            return {}
        names = list(self._rows)
        host = torch.stack([self._rows[n] for n in names]).tolist()
        self._rows.clear()
        self.hists = {n: (row[5:], row[3], row[4]) for n, row in zip(names, host, strict=True) if len(row) > 5}
        return {f"act/{n}/{s}": v for n, row in zip(names, host, strict=True)
                for s, v in zip(ACT_STATS, row[:len(ACT_STATS)], strict=True)}
