"""First-divergence forensics (``guard.forensics``): which layer went wrong first?

A ring buffer on the device keeps, for each of the last ``window`` steps, one norm per target: every module's
output and input (root mean squares), every parameter's gradient, optimizer state, weight (and update). A few
multi-tensor kernels a step, no host sync, no graph break under ``torch.compile``; read back only when something
went wrong. :meth:`Forensics.report` ranks the targets by the first step each left its own range (the rule, the
order within a step and the costs: docs/statistics.md, "Which layer went first: forensics").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from hookexp.config import ForensicsConfig
from hookexp.engine.shards import local_part
from hookexp.telemetry.observer import Observer

MISSING = -1.0  # a norm not recorded at that step (norms are >= 0; NaN and Inf mean non-finite)
GAP = 0  # normal steps inside one abnormal run (see _onset): none, an early-training trend is no part of it
FLOOR = 0.05  # the least spread of log(norm) a z-score divides by: a change under ~5% a step is never abnormal


@dataclass(frozen=True)
class Series:
    name: str  # a module or parameter name, as named_modules() / named_parameters() give it
    family: str  # output | grad | <optimizer state key, e.g. exp_avg> | update | weight


@dataclass
class Report:
    """What :meth:`Forensics.report` found: ``first`` (earliest first, at most ``top``: one dict per target with
    ``target``, ``family``, ``step``, ``score`` and, for module outputs, ``input``), the z-scores (steps x
    targets) and the targets, for the figure. ``onset``: the step ``first[0]`` left its range (None: nothing did)."""

    step: int
    reason: str
    first: list[dict[str, Any]]
    ranked: list[dict[str, Any]] = field(default_factory=list)  # every target that left its range, first first
    steps: list[int] = field(default_factory=list)
    targets: list[Series] = field(default_factory=list)
    z: np.ndarray | None = None

    @property
    def onset(self) -> int | None:
        return self.ranked[0]["step"] if self.ranked else None

    def nonfinite_outputs(self) -> list[dict[str, Any]]:
        """The module outputs that went non-finite, first first."""
        return [e for e in self.ranked if e["family"] == "output" and e.get("nonfinite")]


def _first_float_tensor(x: Any) -> torch.Tensor | None:
    """The first floating-point tensor of a module's input or output (a tensor, a tuple, a dict, a ModelOutput)."""
    if isinstance(x, torch.Tensor):
        return x if x.is_floating_point() else None
    items: Iterable[Any] = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            return item
    return None



def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One float32 norm per tensor: one multi-tensor kernel per dtype (see :func:`_foreach_norms`)."""
    if not tensors:
        return []
    with torch.no_grad():
        return _foreach_norms([local_part(t) for t in tensors])


def _foreach_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``torch._foreach_norm`` of ``tensors`` in float32, called once per (dtype, contiguous) group: on CUDA a list
    that mixes dtypes (bf16 autocast: a LayerNorm's float32 output beside a Linear's bf16 one) or holds a strided
    view takes the slow path, a kernel per tensor, for the whole list."""
    groups: dict[tuple[torch.dtype, bool], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.is_contiguous()), []).append(i)
    if len(groups) == 1:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    out: list[torch.Tensor] = [tensors[0]] * len(tensors)
    for members in groups.values():
        for i, norm in zip(members, torch._foreach_norm([tensors[i] for i in members], 2, dtype=torch.float32),
                           strict=True):
            out[i] = norm
    return out


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync (a CUDA copy from pinned memory is asynchronous)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


class Forensics(Observer):
    """The ring buffer and its reading (module docstring), configured by ``config`` (``guard.forensics``). Its rows
    go into checkpoints and rollback snapshots: a resumed or rolled-back run ranks a spike against the steps before
    it, as the uninterrupted run does."""

    optional_state: ClassVar[bool] = True  # checkpoints written before the buffer was kept have none

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 config: ForensicsConfig | None = None):
        config = config if config is not None else ForensicsConfig()
        if not config.window:
            raise ValueError("guard.forensics.window=0 means no forensics: build none")
        self.model, self.optimizer = model, optimizer
        self.window, self.z, self.top = config.window, float(config.z), config.top
        self.track_updates = config.updates
        self.modules = [(name, m) for name, m in model.named_modules() if name]
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        # this step: the norms and, per module call, (module index, position of its output's norm, of its input's
        # or -1). The hooks record into lists of their own (the tensors waiting for the forward's end, their norms,
        # the calls), merged into the step's before the update (_merge); with count_calls_of, anew at each forward
        # and merged at its end, outside the compiled graph
        self._normed: list[torch.Tensor] = []
        self.calls: list[tuple[int, int, int]] = []
        self._forward_begin()
        self.handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(self.modules)]
        # an in-place module (ReLU(inplace=True)) overwrites its input: norm what is pending before it runs
        self.handles += [m.register_forward_pre_hook(self._flush) for _, m in self.modules
                         if getattr(m, "inplace", False) is True]
        self.handles.append(model.register_forward_hook(self._forward_end))  # one kernel for all its tensors
        self._bracket: list[Any] = []  # count_calls_of: the wrapper's hooks that begin and end each forward
        self.layout: list[Series] | None = None  # the buffer's columns, fixed at the first recorded step
        self.out_modules: list[int] = []  # module indices in column order
        self.state_keys: list[str] = []
        self.families: list[str] = []
        self.buf: torch.Tensor | None = None
        self.steps: list[int] = [-1] * self.window  # the step each slot holds (host side: no sync)
        self.pos = 0
        self.step = -1
        self.committed = True
        self._grads: list[torch.Tensor] | None = None
        self._after: list[torch.Tensor] | None = None
        self._before: list[torch.Tensor] | None = None
        self._missing: torch.Tensor | None = None
        self._plans: dict[tuple[tuple[int, int, int], ...], Any] = {}
        self.reports: list[Report] = []
        self._saved: dict[str, Any] | None = None  # a checkpoint's rows, taken in once this run's columns are known

    # -- recording -----------------------------------------------------------------------------------------
    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.model.training or not torch.is_grad_enabled():
                return  # validation, or a forward under no_grad: not a training step
            out = _first_float_tensor(output)
            if out is None:
                return
            inp = _first_float_tensor(args)
            at = -1
            if inp is not None and inp is self._last:
                at = self._last_at  # the input is the output normed last: no second kernel
            elif inp is not None:
                self._pending.append(inp)
                at, self._count = self._count, self._count + 1
            if out is self._last and inp is not out:  # a container returning its last child's output: that norm
                self._calls.append((index, self._last_at, at))  # (an in-place module's output is its input: anew)
                return
            self._pending.append(out)
            self._calls.append((index, self._count, at))
            self._last, self._last_at = out, self._count
            self._count += 1
        return hook

    def _flush(self, *args: Any) -> None:
        """The pending tensors' root mean squares, in one multi-tensor kernel (a forward's end, before an
        in-place module, and before the update for a forward whose root never ran)."""
        if self._pending:
            pending, self._pending = self._pending, []
            with torch.no_grad():
                norms = _foreach_norms(pending)
                self._fwd_normed.extend(torch._foreach_div(norms, [math.sqrt(max(t.numel(), 1)) for t in pending]))

    def _forward_end(self, *args: Any) -> None:
        self._flush()
        self._last = None  # the next forward's first input is no output of this one

    def _forward_begin(self, *args: Any) -> None:
        """The hooks' lists, new (count_calls_of: a forward begins; what one that never reached its end left is
        dropped)."""
        self._pending: list[torch.Tensor] = []  # tensors waiting for the forward's end (or an in-place module)
        self._fwd_normed: list[torch.Tensor] = []  # their norms
        self._calls: list[tuple[int, int, int]] = []  # the module calls, positions among the forward's norms
        self._count = 0  # tensors pended in this forward
        self._last: torch.Tensor | None = None  # the output of the module whose forward ended last
        self._last_at = -1  # where its norm is among the forward's

    def _merge(self, *args: Any) -> None:
        """What the hooks recorded into the step's norms and calls (before the update or a report; count_calls_of: at
        each forward's end)."""
        self._flush()
        if self._calls or self._fwd_normed:
            offset = len(self._normed)
            self.calls.extend((i, out + offset, inp + offset if inp >= 0 else -1) for i, out, inp in self._calls)
            self._normed.extend(self._fwd_normed)
        self._forward_begin()

    def count_calls_of(self, forward: Any) -> None:
        """Begin and end each forward on ``forward`` (the DDP or compiled wrapper of the model), outside the compiled
        graph: each forward's hooks then start from new, empty lists, so that Dynamo's guards on them hold at every
        micro-batch (recording into the step's lists, a compiled model recompiled for each micro-batch of
        trainer.accumulate, and past torch's recompile limit ran eagerly)."""
        if isinstance(forward, nn.Module) and forward is not self.model and not self._bracket:
            self._bracket = [forward.register_forward_pre_hook(self._forward_begin),
                             forward.register_forward_hook(self._merge)]

    def missing(self, device: torch.device) -> torch.Tensor:
        if self._missing is None or self._missing.device != device:
            self._missing = torch.full((), MISSING, device=device)
        return self._missing

    def start(self, step: int, log: bool) -> None:
        if not self.committed:
            self._commit()  # the previous step ran no update (skipped): keep what it recorded
        self.calls, self._normed = [], []
        self._forward_begin()
        self.step, self.committed, self._grads, self._after = step, False, None, None

    def _grad_norms(self) -> None:
        grads = [p.grad for _, p in self.params]
        present = _norms([g for g in grads if g is not None])
        if len(present) < len(grads):
            it = iter(present)
            missing = self.missing(present[0].device if present else self.params[0][1].device)
            present = [next(it) if g is not None else missing for g in grads]
        self._grads = present

    def before_update(self) -> None:
        self._merge()
        if not self.params:
            return
        self._grad_norms()
        if self.track_updates:
            weights = [local_part(p.detach()) for _, p in self.params]
            if self._before is None:
                self._before = [torch.empty_like(w) for w in weights]
            torch._foreach_copy_(self._before, weights)

    def after_update(self) -> None:
        if not self.params:
            return
        params = [p for _, p in self.params]
        tensors: list[torch.Tensor] = list(params)  # normed under no_grad: no detach (an op each)
        families = ["weight"]
        if self.track_updates and self._before is not None:
            torch._foreach_sub_(self._before, [local_part(p.detach()) for p in params])  # before - after: the update
            tensors += self._before
            families.append("update")
        states = [self.optimizer.state.get(p, {}) for p in params] if self.optimizer is not None else []
        if self.layout is None and states:
            self.state_keys = sorted({k for s, p in zip(states, params, strict=True) for k, v in s.items()
                                      if isinstance(v, torch.Tensor) and v.shape == p.shape and k != "step"})
        slots: list[tuple[str, int]] = []  # (family, parameter) of each norm after the weights and updates
        for key in self.state_keys:
            for k, s in enumerate(states):
                if isinstance(s.get(key), torch.Tensor):
                    tensors.append(s[key])
                    slots.append((key, k))
        norms = _norms(tensors)
        p = len(params)
        self._after = norms[:p * len(families)]
        self._after_families = families
        self._state_slots = {slot: norms[p * len(families) + i] for i, slot in enumerate(slots)}
        self._commit()

    def end(self, step: int) -> None:
        if not self.committed:
            self._commit()

    def _make_layout(self) -> None:
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
        self.families = [*self.state_keys, *(["update"] if "update" in self._after_families else []), "weight"]
        layout = [Series(self.modules[i][0], "output") for i in order]
        layout += [Series(self.params[k][0], "grad") for k in self.grad_order]
        for family in self.families:
            layout += [Series(name, family) for name, _ in self.params]
        self.layout = layout

    def _commit(self) -> None:
        """This step's row into the ring buffer (before the update, or without one: the after-update families
        are MISSING)."""
        self.committed = True
        self._merge()
        if not self.params and not self.calls:
            return
        if self.layout is None:
            if self._after is None:
                return  # the first step took no update: the optimizer state is not known yet
            self._make_layout()
        row = self._row()
        if self._saved is not None:
            self._take_saved(row.device)
        if self.buf is None:
            self.buf = torch.full((self.window, row.numel()), MISSING, device=row.device)
        last = (self.pos - 1) % self.window
        if self.steps[last] == self.step:  # the guard recorded this step before its update: complete that row
            self.buf[last].copy_(row)
        else:
            self.buf[self.pos].copy_(row)
            self.steps[self.pos] = self.step
            self.pos = (self.pos + 1) % self.window

    def _row(self) -> torch.Tensor:
        """The step's norms in column order: outputs, gradients, the after-update families, then the inputs. One
        stack when every module ran once; a module called several times (micro-batches) gets the root mean
        square of its calls' (a few kernels more)."""
        assert self.layout is not None
        device = self._grads[0].device if self._grads else self._normed[0].device if self._normed else \
            self.params[0][1].device
        missing = self.missing(device)
        entries: list[torch.Tensor] = list(self._normed)
        n_calls = len(entries)
        p = len(self.params)
        entries += [self._grads[k] for k in self.grad_order] if self._grads is not None else [missing] * p
        for family in self.families:
            if self._after is None:
                entries += [missing] * p
            elif family in self._after_families:
                at = self._after_families.index(family) * p
                entries += self._after[at:at + p]
            else:
                entries += [self._state_slots.get((family, k), missing) for k in range(p)]
        plan = self._plans.get(tuple(self.calls))
        if plan is None:
            plan = self._plans[tuple(self.calls)] = self._plan(n_calls, device)
        outs, ins, repeated = plan
        rest = entries[n_calls:]
        if repeated is None:
            return torch.stack([entries[k] if k >= 0 else missing for k in outs] + rest +
                               [entries[k] if k >= 0 else missing for k in ins])
        positions, columns, counts, absent = repeated  # squares summed per column, over the calls
        calls = torch.stack(entries[:n_calls]).double().square().index_select(0, positions)
        sums = torch.zeros(2 * len(self.out_modules), dtype=torch.float64, device=device).index_add_(0, columns, calls)
        rms = torch.where(absent, MISSING, (sums / counts).sqrt()).float()
        n = len(self.out_modules)
        return torch.cat([rms[:n], torch.stack(rest) if rest else rms[:0], rms[n:]])

    def _plan(self, n_calls: int, device: torch.device) -> Any:
        """Where each column's value is among the step's norms (by the pattern of calls): positions, or for
        repeated calls the index and counts of a sum of squares."""
        column = {m: c for c, m in enumerate(self.out_modules)}
        n = len(self.out_modules)
        outs, ins = [-1] * n, [-1] * n
        per_column: dict[int, list[int]] = {}
        for i, out, inp in self.calls:
            c = column.get(i)
            if c is None:
                continue
            per_column.setdefault(c, []).append(out)
            if inp >= 0:
                per_column.setdefault(n + c, []).append(inp)
            outs[c], ins[c] = out, inp
        if all(len(v) == 1 for v in per_column.values()):
            return outs, ins, None
        pairs = [(pos, col) for col, positions in sorted(per_column.items()) for pos in positions]
        counts = torch.zeros(2 * n, dtype=torch.float64)
        for col, positions in per_column.items():
            counts[col] = len(positions)
        positions = torch.tensor([pos for pos, _ in pairs], dtype=torch.long)
        columns = torch.tensor([col for _, col in pairs], dtype=torch.long)
        absent = counts == 0
        return outs, ins, (_to(positions, device), _to(columns, device), _to(counts.clamp(min=1), device),
                           _to(absent, device))

    # -- reading -------------------------------------------------------------------------------------------
    def current_row(self) -> None:
        """Record the step in progress as it stands (the guard, before the update: outputs and gradients)."""
        if self.committed or self.layout is None:
            return
        if self.params and self._grads is None:
            self._grad_norms()
        self._commit()

    def history(self) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The buffer on the host, oldest step first: (steps, norms [steps x targets], input norms)."""
        if self.buf is None or self.layout is None:
            return [], np.zeros((0, 0)), np.zeros((0, 0))
        host = self.buf.detach().double().cpu().numpy()
        slots = sorted((s, k) for k, s in enumerate(self.steps) if s >= 0)
        rows = host[[k for _, k in slots]]
        n = len(self.layout)
        return [s for s, _ in slots], rows[:, :n], rows[:, n:]

    def report(self, step: int, reason: str = "spike", since: int | None = None) -> Report:
        """Rank the targets by the first step each left its range, up to ``step`` (docs/statistics.md). ``since``:
        the earliest step the cause can be (default: the step before ``step``): a target that left its range far
        (twice ``z``) from then on counts even if it came back (a cause of a step or two whose effect lasts); one
        that left before and came back is noise."""
        if self.layout is None:
            return self._first_step(step, reason)
        self.current_row()
        steps, norms, ins = self.history()
        keep = [k for k, s in enumerate(steps) if s <= step]
        steps, norms, ins = [steps[k] for k in keep], norms[keep], ins[keep]
        since = step - 1 if since is None else since
        recent = sum(1 for s in steps if s < since)  # the first row the cause can be in
        targets = list(self.layout)
        z, bad = _scores(norms, self.z)
        _, in_bad = _scores(ins, self.z)
        first: list[tuple[int, int, dict[str, Any]]] = []
        for j, target in enumerate(targets):
            t = _onset(bad[:, j], recent, np.abs(z[:, j]) > 2 * self.z)
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
            first.append((t, j, entry))
        first.sort(key=lambda e: (e[0], e[1]))
        ranked = [e[2] for e in first]
        report = Report(step, reason, ranked[:self.top], ranked, steps, targets, z)
        self.reports.append(report)
        return report

    def _first_step(self, step: int, reason: str) -> Report:
        """Nothing recorded yet (the first step went wrong): this step's non-finite module outputs alone."""
        self._merge()
        ranked: list[dict[str, Any]] = []
        seen: set[int] = set()
        for i, out, inp in self.calls:
            if i in seen or bool(torch.isfinite(self._normed[out])):
                continue
            seen.add(i)
            entry = {"target": self.modules[i][0], "family": "output", "step": self.step, "score": None,
                     "nonfinite": True}
            if inp >= 0:
                entry["input"] = "normal" if bool(torch.isfinite(self._normed[inp])) else "non-finite"
            ranked.append(entry)
        report = Report(step, reason, ranked[:self.top], ranked)
        self.reports.append(report)
        return report

    def take_reports(self) -> list[Report]:
        """The reports made since the last call (the trainer draws each once)."""
        reports, self.reports = self.reports, []
        return reports

    def reset_after_rollback(self, step: int) -> None:
        """The run went back to ``step``: the rows of the steps from it on describe steps that are undone."""
        self.steps = [s if s < step else -1 for s in self.steps]
        self.committed = True

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rows and the steps they hold, and their columns (left on the device: a rollback snapshot copies
        them without a host sync; a checkpoint loads them to the CPU)."""
        if self.buf is None or self.layout is None:
            return {}
        return {"buf": self.buf, "steps": list(self.steps), "columns": [[t.name, t.family] for t in self.layout]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's or snapshot's rows, taken in at once if the columns are known, else at the first recorded
        step (a resumed run's)."""
        self.committed = True
        if not state:
            return
        self._saved = dict(state)
        if self.buf is not None:
            self._take_saved(self.buf.device)

    def _take_saved(self, device: torch.device) -> None:
        """The saved rows, oldest step first, as this run's ring (the last ``window`` of them), if their columns are
        this run's (a checkpoint of another model or optimizer: the ring starts empty)."""
        saved, self._saved = self._saved, None
        if saved is None or [Series(n, f) for n, f in saved["columns"]] != self.layout:
            return
        order = sorted((s, k) for k, s in enumerate(saved["steps"]) if s >= 0)[-self.window:]
        buf = torch.full((self.window, saved["buf"].shape[1]), MISSING, device=device)
        if order:
            rows = torch.tensor([k for _, k in order])
            buf[:len(order)] = saved["buf"].index_select(0, rows.to(saved["buf"].device)).to(device)
        self.buf = buf
        self.steps = [s for s, _ in order] + [-1] * (self.window - len(order))
        self.pos = len(order) % self.window

    def close(self) -> None:
        for h in [*self.handles, *self._bracket]:
            h.remove()
        self.handles.clear()
        self._bracket.clear()
        self._before = None


def _onset(bad: np.ndarray, since: int, far: np.ndarray | None = None, gap: int = GAP) -> int | None:
    """The first step of the earliest run of abnormal steps (runs split by at most ``gap`` normal steps are one)
    that reaches to within ``gap`` steps of the end, or starts at row ``since`` or later and goes ``far`` (a
    cause of a step or two whose effect lasts); None if there is none: a blip before, or a small one, is noise."""
    hits = np.flatnonzero(bad)
    end = len(bad) - 1
    k = 0
    while k < len(hits):
        start = hits[k]
        while k + 1 < len(hits) and hits[k + 1] - hits[k] - 1 <= gap:
            k += 1
        if end - hits[k] <= gap or (start >= since and (far is None or far[start:hits[k] + 1].any())):
            return int(start)
        k += 1
    return None


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
