"""First-divergence forensics (``guard.forensics``): which layer went wrong first?

While training, a ring buffer on the device keeps one cheap norm per target for each of the last ``window``
steps: every module's output (and its input, to tell a producer from a propagator), every parameter's
gradient, update and weight, and the optimizer's per-parameter state (Adam's moments). Recording costs a few
small kernels a step (one norm per distinct tensor a module returns or takes, one fused norm per parameter
family; with ``updates``, one copy of the weights) and no host sync; the buffer is read back only when something
went wrong.

When the spike recorder fires, or the non-finite guard, :meth:`Forensics.report` ranks the targets by the
first step at which each left its own recent range: the robust z-score of the step's change of log(norm)
against the median and the MAD of its earlier changes in the buffer (a steady drift is in range, a jump is
not; a non-finite norm counts at once), the start of the run of
abnormal steps that lasts to (within two steps of) the event; a blip long before it that went back to normal
is noise and not listed. Module outputs and inputs are root mean squares, so that a smaller last batch of
an epoch is no outlier. Ties go to what happens
first within a step: module outputs in the order their forwards end, then the gradients in backward order,
then the optimizer state, the updates and the weights. A module whose output left its range while its input
did not is the *producer*; one whose input had left too *propagates*.

Under FSDP each rank records the norms of its own shards (a shard of an abnormal tensor is abnormal too);
rank 0's view is the one written.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hookexp.errors import ConfigError
from hookexp.telemetry.observer import Observer

MISSING = -1.0  # a norm not recorded at that step (norms are >= 0; NaN and Inf mean non-finite)
GAP = 1  # normal steps that end an abnormal run (see _onset)
FLOOR = 0.05  # the least spread of log(norm) a z-score divides by: a change under ~5% a step is never abnormal


@dataclass(frozen=True)
class Target:
    name: str  # a module or parameter name, as named_modules() / named_parameters() give it
    family: str  # output | grad | <optimizer state key, e.g. exp_avg> | update | weight


@dataclass
class Report:
    """What :meth:`Forensics.report` found: ``first`` (earliest first, at most ``top``: one dict per target with
    ``target``, ``family``, ``step``, ``score`` and, for module outputs, ``input``), the z-scores (steps x
    targets) and the targets, for the figure."""

    step: int
    reason: str
    first: list[dict[str, Any]]
    ranked: list[dict[str, Any]] = field(default_factory=list)  # every target that left its range, first first
    steps: list[int] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    z: np.ndarray | None = None

    def nonfinite_outputs(self) -> list[dict[str, Any]]:
        """The module outputs that went non-finite, first first."""
        return [e for e in self.ranked if e["family"] == "output" and e.get("nonfinite")]


def _first_tensor(x: Any) -> torch.Tensor | None:
    """The first floating-point tensor of a module's input or output (a tensor, a tuple, a dict, a ModelOutput)."""
    if isinstance(x, torch.Tensor):
        return x if x.is_floating_point() else None
    items: Iterable[Any] = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            return item
    return None


def _norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync (a CUDA copy from pinned memory is asynchronous)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard


def _norms(tensors: list[torch.Tensor | None], missing: torch.Tensor) -> torch.Tensor:
    """One float32 norm per tensor (``missing`` for None), as a 1-d device tensor: one fused kernel."""
    present = [_local(t) for t in tensors if t is not None]
    norms = [n.float() for n in torch._foreach_norm(present)] if present else []
    if len(norms) == len(tensors):
        return torch.stack(norms) if norms else missing.new_empty(0)
    it = iter(norms)
    return torch.stack([next(it) if t is not None else missing for t in tensors])


class Forensics(Observer):
    """The ring buffer and its reading (module docstring). ``window``: steps kept; ``z``: the robust z-score that
    counts as leaving the range; ``top``: entries of a report; ``updates``: also the update norms (costs one copy
    of the weights)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, window: int = 32, z: float = 8.0,
                 top: int = 10, updates: bool = False):
        for key, value, least in (("window", window, 4), ("top", top, 1)):  # window 0 (off): not built at all
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"must be a whole number of at least {least}, got {value!r}.",
                                  key=f"guard.forensics.{key}")
        if not z > 0:
            raise ConfigError(f"must be a positive z-score, got {z!r}.", key="guard.forensics.z")
        self.model, self.optimizer = model, optimizer
        self.window, self.z, self.top, self.track_updates = window, float(z), top, updates
        self.modules = [(name, m) for name, m in model.named_modules() if name]
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        # this step's calls: (module, output norm, input norm or None, their sizes)
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor | None, int, int]] = []
        self._seen: dict[int, tuple[Any, int, torch.Tensor]] = {}  # id -> (weak reference, version, norm)
        self.handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(self.modules)]
        self.layout: list[Target] | None = None  # the buffer's columns, fixed at the first recorded step
        self.out_modules: list[int] = []  # module indices in column order
        self.state_keys: list[str] = []
        self.buf: torch.Tensor | None = None
        self.steps: list[int] = [-1] * window  # the step each slot holds (host side: no sync)
        self.pos = 0
        self.step = -1
        self.committed = True
        self._cache: dict[tuple[tuple[int, int, int], ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._grads: torch.Tensor | None = None
        self._before: list[torch.Tensor] | None = None
        self._missing: torch.Tensor | None = None
        self.reports: list[Report] = []

    # -- recording -----------------------------------------------------------------------------------------
    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.model.training or not torch.is_grad_enabled():
                return  # validation, or a forward under no_grad: not a training step
            out = _first_tensor(output)
            if out is None:
                return
            inp = _first_tensor(args)
            self.calls.append((index, self._norm(out), None if inp is None else self._norm(inp), out.numel(),
                               0 if inp is None else inp.numel()))
        return hook

    def _norm(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s norm, computed once a step: a module's input is mostly another's output (and a container's
        output its last child's), so most inputs cost no kernel. Tensors are known by a weak reference (a freed
        tensor's reused ``id`` is never taken for it) and their version (an in-place op since, ``ReLU(inplace=True)``,
        makes a new norm)."""
        known = self._seen.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            return known[2]
        norm = _norm(t)
        self._seen[id(t)] = (weakref.ref(t), t._version, norm)
        return norm

    def missing(self, device: torch.device) -> torch.Tensor:
        if self._missing is None or self._missing.device != device:
            self._missing = torch.full((), MISSING, device=device)
        return self._missing

    def start(self, step: int, log: bool) -> None:
        if not self.committed:
            self._commit(None)  # the previous step ran no update (skipped): keep what it recorded
        self.calls.clear()
        self._seen.clear()
        self.step, self.committed, self._grads = step, False, None

    def before_update(self) -> None:
        params = [p for _, p in self.params]
        if not params:
            return
        self._grads = _norms([p.grad for p in params], self.missing(params[0].device))
        if self.track_updates:
            weights = [_local(p.detach()) for p in params]
            if self._before is None:
                self._before = [torch.empty_like(w) for w in weights]
            torch._foreach_copy_(self._before, weights)

    def after_update(self) -> None:
        params = [p for _, p in self.params]
        if not params:
            return
        missing = self.missing(params[0].device)
        weights = [_local(p.detach()) for p in params]
        parts: dict[str, torch.Tensor] = {"weight": _norms(weights, missing)}
        if self.track_updates and self._before is not None:
            torch._foreach_sub_(self._before, weights)  # before - after: this step's update
            parts["update"] = _norms(self._before, missing)
        if self.optimizer is not None:
            states = [self.optimizer.state.get(p, {}) for p in params]
            if self.layout is None:
                self.state_keys = sorted({k for s, p in zip(states, params, strict=True) for k, v in s.items()
                                          if isinstance(v, torch.Tensor) and v.shape == p.shape and k != "step"})
            for key in self.state_keys:
                parts[key] = _norms([s.get(key) for s in states], missing)
        self._commit(parts)

    def end(self, step: int) -> None:
        if not self.committed:
            self._commit(None)

    def _outputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's output and input root mean square per module in column order (over all its calls: a
        smaller last batch of an epoch is no outlier), MISSING for a module not called. A few kernels a step: the
        index and the sizes are cached by the pattern of calls."""
        n = len(self.out_modules)
        missing = self.missing(device)
        if not self.calls:
            return missing.expand(n), missing.expand(n)
        key = tuple((i, o, k) for i, _, _, o, k in self.calls)
        if key not in self._cache:
            column = {m: c for c, m in enumerate(self.out_modules)}
            cols = [column.get(i, n) for i, _, _ in key]
            sizes = torch.zeros(n + 1, 2, dtype=torch.float64)
            for c, (_, o, k) in zip(cols, key, strict=True):
                sizes[c] += torch.tensor([o, k], dtype=torch.float64)
            absent = sizes[:n] == 0
            self._cache[key] = _to(torch.tensor(cols), device), _to(absent, device), \
                _to(sizes[:n].clamp(min=1).float(), device)
        idx, absent, sizes = self._cache[key]
        vals = torch.stack([torch.stack([c[1] for c in self.calls]),
                            torch.stack([missing if c[2] is None else c[2] for c in self.calls])], 1)
        sums = torch.zeros(n + 1, 2, device=device).index_add_(0, idx, vals.square())[:n]
        rms = torch.where(absent, missing, (sums / sizes).sqrt())
        return rms[:, 0], rms[:, 1]

    def _make_layout(self, families: list[str]) -> None:
        order: list[int] = []
        for i, *_ in self.calls:
            if i not in order:
                order.append(i)
        self.out_modules = order
        module_pos = {name: k for k, (name, _) in enumerate(self.modules[i] for i in order)}

        def forward_pos(param: str) -> int:
            owner = param.rpartition(".")[0]
            while owner and owner not in module_pos:
                owner = owner.rpartition(".")[0]
            return module_pos.get(owner, -1)

        # gradients arrive in backward order: the parameters of the modules that ran last first
        self.grad_order = sorted(range(len(self.params)), key=lambda k: -forward_pos(self.params[k][0]))
        self._grad_index: torch.Tensor | None = None
        layout = [Target(self.modules[i][0], "output") for i in order]
        layout += [Target(self.params[k][0], "grad") for k in self.grad_order]
        for family in families:
            layout += [Target(name, family) for name, _ in self.params]
        self.layout = layout
        self.families = families

    def _commit(self, parts: dict[str, torch.Tensor] | None) -> None:
        """This step's row into the ring buffer (``parts``: the after-update families; None: no update ran)."""
        self.committed = True
        if not self.params and not self.calls:
            return
        if self.layout is None:
            if parts is None:
                return  # the first step took no update: the optimizer state is not known yet
            self._make_layout([*self.state_keys, *(["update"] if "update" in parts else []), "weight"])
        row = self._row(parts)
        if self.buf is None:
            self.buf = torch.full((self.window, row.numel()), MISSING, device=row.device)
        last = (self.pos - 1) % self.window
        if self.steps[last] == self.step:  # the guard recorded this step before its update: complete that row
            self.buf[last].copy_(row)
        else:
            self.buf[self.pos].copy_(row)
            self.steps[self.pos] = self.step
            self.pos = (self.pos + 1) % self.window

    def _row(self, parts: dict[str, torch.Tensor] | None) -> torch.Tensor:
        assert self.layout is not None
        device = self._grads.device if self._grads is not None else \
            self.calls[0][1].device if self.calls else self.params[0][1].device
        missing = self.missing(device)
        outs, ins = self._outputs(device)
        p = len(self.params)
        if self._grads is not None:
            if self._grad_index is None or self._grad_index.device != device:
                self._grad_index = _to(torch.tensor(self.grad_order), device)
            grads = self._grads[self._grad_index]
        else:
            grads = missing.expand(p)
        rest = [parts[f] if parts is not None and f in parts else missing.expand(p) for f in self.families]
        return torch.cat([outs, grads, *rest, ins])

    # -- reading -------------------------------------------------------------------------------------------
    def current_row(self) -> None:
        """Record the step in progress as it stands (the guard, before the update: outputs and gradients)."""
        if self.committed or self.layout is None:
            return
        params = [p for _, p in self.params]
        if params and self._grads is None:
            self._grads = _norms([p.grad for p in params], self.missing(params[0].device))
        self._commit(None)

    def history(self) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The buffer on the host, oldest step first: (steps, norms [steps x targets], input norms)."""
        if self.buf is None or self.layout is None:
            return [], np.zeros((0, 0)), np.zeros((0, 0))
        host = self.buf.detach().double().cpu().numpy()
        slots = sorted((s, k) for k, s in enumerate(self.steps) if s >= 0)
        rows = host[[k for _, k in slots]]
        n = len(self.layout)
        return [s for s, _ in slots], rows[:, :n], rows[:, n:]

    def report(self, step: int, reason: str = "spike") -> Report:
        """Rank the targets by the first step each left its range, up to ``step`` (module docstring)."""
        if self.layout is None:
            return self._first_step(step, reason)
        self.current_row()
        steps, norms, ins = self.history()
        keep = [k for k, s in enumerate(steps) if s <= step]
        steps, norms, ins = [steps[k] for k in keep], norms[keep], ins[keep]
        targets = list(self.layout)
        z, bad = _scores(norms, self.z)
        _, in_bad = _scores(ins, self.z)
        first: list[tuple[int, int, float, dict[str, Any]]] = []
        for j, target in enumerate(targets):
            t = _onset(bad[:, j])
            if t is None:
                continue
            value = norms[t, j]
            entry: dict[str, Any] = {"target": target.name, "family": target.family, "step": steps[t],
                                     "score": _round(z[t, j])}
            if not math.isfinite(value):
                entry["nonfinite"] = True
            if target.family == "output" and j < ins.shape[1] and ins[t, j] != MISSING:
                entry["input"] = "non-finite" if not math.isfinite(ins[t, j]) else \
                    "abnormal" if in_bad[t, j] else "normal"
            first.append((t, j, abs(z[t, j]), entry))
        first.sort(key=lambda e: (e[0], e[1]))
        ranked = [e[3] for e in first]
        report = Report(step, reason, ranked[:self.top], ranked, steps, targets, z)
        self.reports.append(report)
        return report

    def _first_step(self, step: int, reason: str) -> Report:
        """Nothing recorded yet (the first step went wrong): this step's non-finite module outputs alone."""
        ranked: list[dict[str, Any]] = []
        seen: set[int] = set()
        for i, out, inp, *_ in self.calls:
            if i in seen or bool(torch.isfinite(out)):
                continue
            seen.add(i)
            entry = {"target": self.modules[i][0], "family": "output", "step": self.step, "score": None,
                     "nonfinite": True}
            if inp is not None:
                entry["input"] = "normal" if bool(torch.isfinite(inp)) else "non-finite"
            ranked.append(entry)
        report = Report(step, reason, ranked[:self.top], ranked)
        self.reports.append(report)
        return report

    def take_reports(self) -> list[Report]:
        """The reports made since the last call (the trainer draws each once)."""
        reports, self.reports = self.reports, []
        return reports

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._before = None


def _onset(bad: np.ndarray, gap: int = GAP) -> int | None:
    """The first step of the last run of abnormal steps (runs split by at most ``gap`` normal steps are one),
    if that run reaches to within ``gap`` steps of the end; else None: a blip long before, then normal again,
    is noise, not the onset of what went wrong."""
    hits = np.flatnonzero(bad)
    if not hits.size or len(bad) - 1 - hits[-1] > gap:
        return None
    k = len(hits) - 1
    while k > 0 and hits[k] - hits[k - 1] - 1 <= gap:
        k -= 1
    return int(hits[k])


def _round(x: float) -> float | None:
    return None if not math.isfinite(x) else round(float(x), 2)


def _scores(norms: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Robust z-scores of each step's change of log(norm) against the changes before it (at least 3 of them:
    their median is the trend, their MAD the noise), and whether each left its range (above ``threshold``, or
    non-finite). A steady drift (weights early in training) is its own range; a jump is not. MISSING entries
    are never abnormal."""
    steps, n = norms.shape
    present = norms != MISSING
    finite = np.isfinite(norms)
    logs = np.where(present & finite, np.log(np.maximum(np.where(finite, norms, 1.0), 1e-30)), np.nan)
    change = np.full((steps, n), np.nan)
    change[1:] = logs[1:] - logs[:-1]
    z = np.zeros((steps, n))
    for t in range(4, steps):
        hist = change[:t]
        enough = np.sum(~np.isnan(hist), axis=0) >= 3
        with warnings.catch_warnings():  # a column with no value yet: nanmedian warns and gives NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            med = np.nanmedian(hist, axis=0)
            mad = np.nanmedian(np.abs(hist - med), axis=0)
        scale = np.maximum(1.4826 * np.nan_to_num(mad), FLOOR)
        z[t] = np.where(enough & ~np.isnan(change[t]), (change[t] - med) / scale, 0.0)
    z = np.nan_to_num(z)
    nonfinite = present & ~finite
    z[nonfinite] = np.inf
    return z, (np.abs(z) > threshold) | nonfinite


def draw(report: Report, path: Path, rows: int = 40) -> Path:
    """A heatmap of ``report``'s z-scores (targets x steps), the targets it ranks first on top, then those that
    moved most; written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = {(t.name, t.family): j for j, t in enumerate(report.targets)}
    chosen = [index[(e["target"], e["family"])] for e in report.first]
    z = report.z if report.z is not None else np.zeros((0, len(report.targets)))
    if z.size:
        moved = np.argsort(-np.abs(np.nan_to_num(z, posinf=1e9, neginf=-1e9)).max(axis=0))
        chosen += [int(j) for j in moved if j not in chosen][: max(rows - len(chosen), 0)]
    chosen = chosen[:rows]
    data = np.clip(np.nan_to_num(z[:, chosen], posinf=20, neginf=-20), -20, 20).T if chosen else np.zeros((1, 1))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(report.steps) + 3), 0.28 * max(len(chosen), 4) + 1.5))
    image = ax.imshow(data, aspect="auto", cmap="RdBu_r", vmin=-20, vmax=20, interpolation="nearest")
    ax.set_yticks(range(len(chosen)), [f"{report.targets[j].family} {report.targets[j].name}" for j in chosen],
                  fontsize=7)
    ticks = list(range(0, len(report.steps), max(1, len(report.steps) // 10)))
    ax.set_xticks(ticks, [str(report.steps[k]) for k in ticks], fontsize=7)
    ax.set_xlabel("step")
    ax.set_title(f"forensics at step {report.step} ({report.reason}): robust z of the change of log norm, "
                 "first to leave on top", fontsize=9)
    fig.colorbar(image, ax=ax, label="z")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
