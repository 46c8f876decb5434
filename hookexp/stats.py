"""Gradient and activation statistics, computed batched and only on log steps.

:class:`StepStats` packs the gradients and the activations of one log step into one float32 buffer
(:class:`Packed`) and describes it in a few passes, read back in one transfer together with whatever
else the log step reads. On a GPU (and on a CPU without numba) the buffer is laid out as ``[rows,
width]``: each tensor fills whole rows, the tail of its last row is padding, and every statistic is a
row-wise reduction over the whole buffer on the device and a combine of rows into tensors on the host:
about thirty kernels whatever the number of tensors (on CUDA one replay of a CUDA graph of them). On
a CPU with numba the tensors lie back to back and :mod:`hookexp.fused` describes each in one compiled
pass, which costs a fraction of thirty torch ops there; and on the CPU, where nothing moves, what a log
step reads is read where it lies (:func:`_read`), with no joining copy.

Gradients are copied in right before ``optimizer.step()``; activations by a forward hook that
exists only during log steps (``begin`` attaches, ``finish`` removes). Nothing here runs, and
nothing syncs, on steps that do not log.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Any

import numpy as np
import torch
from torch import nn

from hookexp import fused
from hookexp.engine import match
from hookexp.errors import ConfigError

GRAD_STATS = ("norm", "mean", "std", "min", "max", "frac_zero", "frac_neg")
ACT_STATS = ("mean", "std", "frac_zero")
_COL = {s: i for i, s in enumerate(GRAD_STATS)}  # the columns of Packed.decode
_ACT_COLS = [_COL[s] for s in ACT_STATS]
log = logging.getLogger("hookexp.stats")
WIDTHS = tuple(2 ** k for k in range(6, 14))  # candidate row widths, 64 .. 8192


def _match(model: nn.Module, pattern: str, what: str, key: str) -> list[tuple[str, Any]]:
    """Resolve a ``stats.*`` pattern with the hook target grammar; errors name the stats key."""
    return match(model, pattern, on=what, key=key)  # type: ignore[arg-type]


def wide_dtype(device: torch.device) -> torch.dtype:
    """What sums are read back in: float64, except on MPS (which has none)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _pick_width(sizes: list[int]) -> int:
    """The row width with the least padding plus a per-row cost (wide rows for a few big tensors,
    narrow ones for many small tensors)."""
    def cost(w: int) -> int:
        rows = sum(-(-n // w) for n in sizes)
        return rows * w + 64 * rows
    return min(reversed(WIDTHS), key=cost)


class Packed:
    """A fixed list of tensor shapes packed into one ``[rows, width]`` float32 buffer on ``device``.

    ``slots[i]`` is a view of the buffer shaped like tensor ``i``: copy a tensor in, then
    :meth:`reduce` (on the device) and :meth:`decode` (on the host). Built once per set of shapes
    and reused, so a log step allocates nothing but the results. ``hist_sample`` bounds the
    elements a histogram counts per tensor (see decode).
    """

    GRAPH_MAX_ELEMENTS = 1 << 22  # buffers up to 16 MB replay their reductions as a CUDA graph

    def __init__(self, shapes: list[torch.Size], device: torch.device, hist_sample: int | None = None):
        sizes = [math.prod(s) for s in shapes]
        if min(sizes, default=0) == 0:
            raise ValueError("cannot describe an empty tensor")
        self.n = len(sizes)
        self._sizes = np.asarray(sizes, dtype=np.float64)
        # Histogram positions: every element of a tensor up to hist_sample of them, else a fixed
        # uniform subset (drawn once, from its own generator: the training RNG is not touched).
        gen = torch.Generator().manual_seed(0)
        picks = [None if not hist_sample or n <= hist_sample
                 else torch.randperm(n, generator=gen)[:hist_sample].sort().values for n in sizes]
        taken = np.asarray([n if p is None else len(p) for n, p in zip(sizes, picks, strict=True)], dtype=np.float64)
        self._hist_scale = self._sizes / taken
        self._fused = None
        if fused.usable(device.type):  # one compiled pass per tensor: no rows, no pads
            starts = np.cumsum([0, *sizes[:-1]]).tolist()
            self.width, self.n_rows = 1, sum(sizes)
            self.buffer = torch.empty(self.n_rows, device=device)
            self._host = self.buffer.numpy()  # the kernels' view of it
            self._starts = starts
            self._fused = fused.FusedLayout(starts, sizes, [None if p is None else p.numpy() for p in picks],
                                            self._hist_scale)
        else:
            self._init_rows(sizes, device, picks)
        self.slots = [self.buffer[s:s + n].view(shape) for s, n, shape in zip(self._starts, sizes, shapes, strict=True)]

    def _init_rows(self, sizes: list[int], device: torch.device, picks: list[torch.Tensor | None]) -> None:
        """The layout the torch ops describe: rows of ``width`` elements, each tensor in whole rows."""
        self.width = w = _pick_width(sizes)
        rows = [-(-n // w) for n in sizes]
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + r * w)
        starts.pop()
        self._starts = starts
        self.n_rows = sum(rows)
        self.buffer = torch.empty(self.n_rows * w, device=device)
        long = dict(device=device, dtype=torch.long)
        pads = [(s + n, s + r * w, s) for s, n, r in zip(starts, sizes, rows, strict=True) if r * w > n]
        self._pad_dst = torch.cat([torch.arange(a, b, **long) for a, b, _ in pads]) if pads else None
        self._pad_src = torch.cat([torch.full((b - a,), s, **long) for a, b, s in pads]) if pads else None
        self._row_seg = torch.repeat_interleave(torch.arange(self.n, **long), torch.tensor(rows, **long))
        self._row_first = torch.tensor(starts, **long)[self._row_seg]  # where the row's tensor starts
        self._seg_rows = np.cumsum([0, *rows[:-1]])  # the first row of each tensor
        self._hist_pos = self._hist_seg = None
        if any(p is not None for p in picks):
            picks = [torch.arange(n) if p is None else p for n, p in zip(sizes, picks, strict=True)]
            self._hist_pos = torch.cat([s + p for s, p in zip(starts, picks, strict=True)]).to(device)
            taken = torch.tensor([len(p) for p in picks])
            self._hist_seg = torch.repeat_interleave(torch.arange(self.n), taken).to(device)
        self._seg_first_row = torch.tensor(self._seg_rows, **long)
        self._wide = wide_dtype(device)
        self._pads_dev = torch.tensor([r * w - n for n, r in zip(sizes, rows, strict=True)], device=device,
                                      dtype=self._wide)
        # A graph keeps its temporaries (about three buffers' worth) for good, where the kernels would hand
        # them back to the allocator: worth it only while launches, not the work, are what a log step costs.
        small = self.buffer.numel() <= self.GRAPH_MAX_ELEMENTS
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] | None = {} if small else None

    @torch.no_grad()
    def reduce(self, hist_bins: int = 0) -> torch.Tensor | np.ndarray:
        """The device half of describing what the slots hold: a flat float64 tensor of per-row sums
        (and histogram counts) for :meth:`decode`; on a CPU with numba, the kernels' statistics themselves, as
        the host array they wrote (no torch round trip). Row-wise float reductions only: on the CPU they are
        vectorised and threaded, while scatters over segments and reductions of bool masks are not.

        On CUDA, for buffers up to ``GRAPH_MAX_ELEMENTS``, the thirty-odd kernels are captured once per
        layout into a CUDA graph and replayed as one launch: there the host's launch cost, not the GPU's
        work, is what a log step pays for. The result then lives in the graph's memory and is overwritten
        by the next replay.
        """
        if self._fused is not None:
            return self._fused.describe(self._host, hist_bins)
        if self.buffer.device.type != "cuda" or self._graphs is None:
            return self._reduce(hist_bins)
        if hist_bins not in self._graphs:
            try:
                self._graphs[hist_bins] = self._capture(hist_bins)
            except RuntimeError as e:  # some setups cannot capture: compute kernel by kernel instead
                log.warning("statistics: could not capture a CUDA graph (%s: %s); launching their kernels one by "
                            "one instead", type(e).__name__, str(e).splitlines()[0])
                self._graphs = None
                return self._reduce(hist_bins)
        graph, out = self._graphs[hist_bins]
        graph.replay()
        return out

    def _capture(self, hist_bins: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.buffer.device
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # a first run outside the capture, as torch.cuda.graph asks
                self._reduce(hist_bins)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # W&B's thread may use CUDA
                out = self._reduce(hist_bins)
        return graph, out

    def _reduce(self, hist_bins: int) -> torch.Tensor:
        flat = self.buffer
        x = flat.view(self.n_rows, self.width)
        if self._pad_dst is not None:  # zero pads add nothing to the sums of squares and signs
            flat.index_fill_(0, self._pad_dst, 0.0)
        # 0 for zeros, -1 for negatives; NaN counts as +1, so it is nonzero and (in decode) not negative.
        # (torch.sign(NaN) is 0 on the CPU: the NaN must be replaced before, not after.)
        sign = torch.sign(torch.nan_to_num(x, 1.0))
        norm_x = torch.linalg.vector_norm(x, dim=1)
        if self._pad_dst is not None:  # pads that repeat the first element keep min and max exact
            flat.index_put_((self._pad_dst,), flat[self._pad_src])
        row_ref = flat[self._row_first]
        # Shifted by its tensor's first element, the sums of d and d^2 give an exact variance even
        # when |mean| >> std, and the pads add nothing to them.
        d = x - row_ref.nan_to_num(0.0, 0.0, 0.0)[:, None]
        lo, hi = x.amin(1), x.amax(1)
        rows = torch.stack([d.sum(1), torch.linalg.vector_norm(d, dim=1), norm_x,
                            torch.linalg.vector_norm(sign, dim=1), sign.sum(1), lo, hi, row_ref], dim=1)
        if hist_bins <= 0:
            return rows.view(-1).to(self._wide)
        if self.n_rows == self.n:
            mins, maxs = lo, hi
        else:
            mins = torch.full((self.n,), math.inf, device=x.device).scatter_reduce_(0, self._row_seg, lo, "amin")
            maxs = torch.full((self.n,), -math.inf, device=x.device).scatter_reduce_(0, self._row_seg, hi, "amax")
        width = (maxs - mins).clamp_min(1e-30)
        if self._hist_pos is None:  # every element, in place in the rows; the pads are taken out after
            seg = self._row_seg
            counts = _count(_bin_index(x, mins[seg, None], width[seg, None], hist_bins, seg[:, None]).view(-1),
                            self.n * hist_bins, self._wide)
            if self._pad_dst is not None:
                tensors = torch.arange(self.n, device=x.device)
                first = row_ref[self._seg_first_row]
                counts.index_add_(0, _bin_index(first, mins, width, hist_bins, tensors), -self._pads_dev)
        else:  # a fixed subset of the elements of the tensors larger than hist_sample
            seg = self._hist_seg
            values = flat.index_select(0, self._hist_pos)
            counts = _count(_bin_index(values, mins.index_select(0, seg), width.index_select(0, seg), hist_bins, seg),
                            self.n * hist_bins, self._wide)
        return torch.cat([rows.view(-1).to(self._wide), counts])

    def decode(self, host: np.ndarray, hist_bins: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
        """The host half: ``[tensors, len(GRAD_STATS)]`` statistics over every element, and
        ``[tensors, hist_bins]`` counts over each tensor's [min, max] (as ``torch.histc``; a tensor
        larger than ``hist_sample`` has its counts taken from its fixed subset, scaled to its size)."""
        if self._fused is not None:  # the kernels wrote the statistics themselves
            return fused.FusedLayout.split(host, self.n, hist_bins)[:2]
        rows = host[:self.n_rows * 8].reshape(self.n_rows, 8)
        starts = self._seg_rows
        sums = rows[:, :5].copy()
        sums[:, 1:3] **= 2  # the row norms of d and x, squared: sums of squares
        sums[:, 3] = np.rint(sums[:, 3] ** 2)  # the row norm of the signs, squared: a count
        s_d, ss_d, ss_x, nonzero, pos_minus_neg = np.add.reduceat(sums, starts, axis=0).T
        mins, maxs = np.minimum.reduceat(rows[:, 5], starts), np.maximum.reduceat(rows[:, 6], starts)
        first, count = rows[starts, 7], self._sizes
        with np.errstate(all="ignore"):
            mean = np.where(np.isfinite(first), first, 0.0) + s_d / count
            std = np.sqrt(np.maximum((ss_d - s_d * s_d / count) / (count - 1), 0.0))
            norm = np.sqrt(ss_x)
            zeros = count - nonzero
            negs = (nonzero - pos_minus_neg) / 2
            table = np.stack([norm, mean, std, mins, maxs, zeros / count, negs / count], axis=1)
        if hist_bins <= 0:
            return table, None
        counts = host[self.n_rows * 8:].reshape(self.n, hist_bins)
        return table, counts if self._hist_pos is None else counts * self._hist_scale[:, None]

    def kernel_edges(self, host: np.ndarray, hist_bins: int) -> np.ndarray | None:
        """``[tensors, hist_bins + 1]`` bin edges as the kernels wrote them (rows of ranges that are not finite:
        NaN); None where the torch ops described the buffer (:func:`bin_edges` makes them from the table)."""
        return fused.FusedLayout.split(host, self.n, hist_bins)[2] if self._fused is not None else None


def _global_norm(norms: list[float]) -> float:
    """The norm of all the gradients together, from each one's norm (an exactly rounded sum of squares)."""
    return math.sqrt(math.fsum(v * v for v in norms))


def bin_edges(lo: np.ndarray, hi: np.ndarray, bins: int) -> np.ndarray:
    """``[len(lo), bins + 1]`` edges of equal bins over each [lo, hi], the first exactly ``lo`` and the
    last exactly ``hi`` (as ``np.linspace``); a range of one value gets a unit-wide one around it."""
    flat = hi <= lo
    if flat.any():
        lo, hi = np.where(flat, lo - 0.5, lo), np.where(flat, lo + 0.5, hi)
    edges = np.multiply.outer((hi - lo) / bins, np.arange(bins + 1.0))
    edges += lo[:, None]
    edges[:, -1] = hi
    return edges


def _bin_index(x: torch.Tensor, lo: torch.Tensor, width: torch.Tensor, bins: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor * bins`` plus the bin of every value among ``bins`` equal bins over [lo, lo + width]
    (``torch.histc``'s arithmetic: the maximum goes to the last bin; NaN goes to the first)."""
    return ((x - lo) / width * bins).nan_to_num_(0).long().clamp_(0, bins - 1).add_(tensor * bins)


def _count(index: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """How often each of ``range(size)`` occurs in ``index``, as ``dtype``: bincount on the CPU (fast),
    index_add_ elsewhere (bincount would sync to size its output)."""
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=size).to(dtype)
    ones = torch.ones(index.shape, device=index.device, dtype=dtype)
    return torch.zeros(size, device=index.device, dtype=dtype).index_add_(0, index, ones)


def _read(reduced: torch.Tensor | np.ndarray | None, extra: tuple[torch.Tensor | list[float] | None, ...],
          join: bool | None = None) -> tuple[np.ndarray | None, list[list[float]]]:
    """``reduced`` and every ``extra`` tensor read back to the host, as floats: joined into one tensor and
    moved in one transfer from a device; on the CPU, where nothing moves, each read as it lies (joining them
    would cost a copy and a conversion per tensor, for nothing). What is on the host already (``reduced`` as
    an array, ``extra`` lists) passes as it is. ``join`` forces one way or the other (tests compare them); by
    default only a device joins."""
    stats_host = reduced if isinstance(reduced, np.ndarray) else None
    on_device = reduced if isinstance(reduced, torch.Tensor) else None
    given = [t for t in extra if isinstance(t, torch.Tensor)]
    parts = ([on_device] if on_device is not None else []) + given
    if join is None:
        join = any(p.device.type != "cpu" for p in parts)
    if join and parts:
        device = parts[0].device
        joined = torch.cat([p.detach().reshape(-1).to(device, wide_dtype(device)) for p in parts])
        chunks = np.split(joined.cpu().numpy(), list(accumulate(p.numel() for p in parts[:-1])))  # the one transfer
        if on_device is not None:
            stats_host = chunks.pop(0)
        host = iter(c.tolist() for c in chunks)
    else:
        if on_device is not None:
            stats_host = on_device.numpy()
        host = iter(t.reshape(-1).tolist() if t.is_floating_point() else [float(v) for v in t.reshape(-1).tolist()]
                    for t in given)
    return stats_host, [[] if t is None else t if isinstance(t, list) else next(host) for t in extra]


class _Layouts:
    """A few :class:`Packed` layouts by shape key (a smaller last batch is a second layout)."""

    def __init__(self, hist_sample: int | None, keep: int = 4):
        self.hist_sample, self.keep = hist_sample, keep
        self._cache: OrderedDict[Any, Packed] = OrderedDict()
        self._last: tuple[Any, list[torch.Size], Packed] | None = None

    def get(self, keys: Any, shapes: list[torch.Size], device: torch.device) -> Packed:
        last = self._last  # the usual log step: the layout of the last one, found without hashing its key
        if last is not None and keys == last[0] and shapes == last[1] and last[2].buffer.device == device:
            return last[2]
        key = (keys, tuple(shapes))
        packed = self._cache.get(key)
        if packed is None or packed.buffer.device != device:
            packed = self._cache[key] = Packed(shapes, device, self.hist_sample)
            if len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        self._last = (keys, shapes, packed)
        return packed


@dataclass
class GradStatsResult:
    """Gradient statistics of one log step, on the host."""

    names: list[str]
    values: list[list[float]]  # [P][len(GRAD_STATS)]
    global_norm: float
    keys: list[list[str]]  # [P][len(GRAD_STATS)]: grad/<name>/<stat>
    hist: list[list[float]] | None = None  # [P][bins], over each parameter's [min, max]

    @property
    def hist_range(self) -> list[tuple[float, float]]:
        return [(row[_COL["min"]], row[_COL["max"]]) for row in self.values]

    def metrics(self) -> dict[str, float]:
        out = {k: v for ks, row in zip(self.keys, self.values, strict=True) for k, v in zip(ks, row, strict=True)}
        out["grad/global_norm"] = self.global_norm
        return out


class StepStatsResult:
    """Everything :class:`StepStats` read back on one log step: the statistics table and histogram counts
    as the description left them, and the ``extra`` values given to :meth:`StepStats.finish`.

    The trainer asks for :meth:`metrics` and :meth:`histograms` alone, each built in a few calls from the
    table; the per-tensor views (:attr:`grads`, :attr:`activations`, :attr:`act_hists`) are built the first
    time they are asked for: on a CPU log step of a small model every list and dict built here counts.
    """

    def __init__(self, extra: list[list[float]], table: np.ndarray | None = None, hist: np.ndarray | None = None,
                 names: _Names | None = None, edges: np.ndarray | None = None):
        self.extra = extra  # the values of each ``extra`` given to finish (None: [])
        self._table, self._hist, self._names = table, hist, names
        self._edges = edges  # the kernels' bin edges (None: made from the table when asked)

    @cached_property
    def grads(self) -> GradStatsResult | None:
        names = self._names
        if names is None or not names.grads:
            return None
        values = self._table[names.grad_rows].tolist()
        hist = self._hist[names.grad_rows].tolist() if self._hist is not None else None
        return GradStatsResult(list(names.grads), values, _global_norm([row[_COL["norm"]] for row in values]),
                               names.grad_keys, hist)

    @cached_property
    def activations(self) -> dict[str, float]:
        """``act/<module>/<stat>`` -> value."""
        names = self._names
        if names is None or not names.acts:
            return {}
        values = self._table.take(names.flat_index[:len(names.flat_act_keys)]).tolist()  # metrics' first keys
        return dict(zip(names.flat_act_keys, values, strict=True))

    @cached_property
    def act_hists(self) -> dict[str, tuple[list[float], float, float]]:
        """module -> (counts, lo, hi)."""
        names = self._names
        if names is None or not names.acts or self._hist is None:
            return {}
        a = self._table[names.act_rows]
        return {n: (h, lo, hi) for n, h, lo, hi in zip(names.acts, self._hist[names.act_rows].tolist(),
                                                       a[:, _COL["min"]].tolist(), a[:, _COL["max"]].tolist(),
                                                       strict=True)}

    def metrics(self) -> dict[str, float]:
        """Every statistic under its metric key (``act/...``, ``grad/...``, ``grad/global_norm``): the table's
        values taken in one call and zipped with the layout's keys, made once."""
        names = self._names
        if names is None:
            return {}
        values = self._table.take(names.flat_index).tolist()
        out = dict(zip(names.flat_keys, values, strict=True))
        if names.grads:
            out["grad/global_norm"] = _global_norm(values[names.norms])
        return out

    def histograms(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``act/<module>/hist`` and ``grad/<name>/hist`` -> (counts, bin edges) as float64 arrays, as every
        sink logs them (numpy rows, not lists: orjson and W&B take them as they are, and a log step of a deep
        model has thousands of counts and edges).

        A tensor holding NaN or Inf has no finite range to bin: it has no histogram on that step (its
        ``min``/``max`` statistics say why), rather than one with NaN edges."""
        if self._hist is None:
            return {}
        ranges = self._table[:, _COL["min"]:_COL["max"] + 1]
        finite = np.isfinite(ranges)
        all_finite = bool(finite.all())
        edges = self._edges
        if edges is None:
            # (inf - inf for the ranges that are then left out; np.errstate costs more than the edges, so only then)
            with nullcontext() if all_finite else np.errstate(invalid="ignore"):
                edges = bin_edges(ranges[:, 0], ranges[:, 1], self._hist.shape[1])
        rows = zip(self._names.hist_keys, self._hist, edges, strict=True)
        if all_finite:
            return {k: (c, e) for k, c, e in rows}
        return {k: (c, e) for (k, c, e), ok in zip(rows, finite.all(axis=1).tolist(), strict=True) if ok}


class StepStats:
    """The statistics of one log step: gradients of the parameters ``grads`` matches and outputs of
    the modules ``activations`` matches, packed into one buffer, described by one :meth:`Packed.reduce`
    and read back in one device-to-host transfer (with whatever else the caller wants read).

    The trainer calls :meth:`begin` before the forward of a log step (activation hooks exist only
    from then until :meth:`finish`), :meth:`capture_grads` right before ``optimizer.step()``, and
    :meth:`finish` after it. A module called twice in one forward is described by its last call.
    Each output is copied into its slot when the hook runs, so an in-place op later in the forward
    cannot change what is described.
    """

    def __init__(self, model: nn.Module, grads: str | None = "*", activations: str | None = None,
                 hist_bins: int = 0, hist_sample: int | None = None):
        if hist_sample is not None and hist_sample < 1:
            raise ConfigError(f"must be at least 1 (or null: count every element), got {hist_sample}.",
                              key="stats.hist_sample")
        matched = _match(model, grads, "parameter", "stats.grads") if grads else []
        self.params = [(n, p) for n, p in matched if p.requires_grad]
        self.modules = _match(model, activations, "module", "stats.activations") if activations else []
        self.hist_bins = hist_bins
        self._layouts = _Layouts(hist_sample)
        self._packed: Packed | None = None
        self._slots: dict[tuple[str, str], torch.Tensor] = {}
        self._seen: dict[tuple[str, str], torch.Tensor] = {}  # what this log step copied, by (kind, name)
        self._handles: list[Any] = []
        # (slots, params, seen) when every matched parameter has a slot: capture_grads without a loop
        self._fast: tuple[list[torch.Tensor], list[nn.Parameter], dict[tuple[str, str], torch.Tensor]] | None = None
        self._keys: dict[tuple[tuple[str, str], ...], _Names] = {}

    def prepare(self, device: torch.device) -> None:
        """Load now what describing on ``device`` takes, rather than in the first log step: on a CPU that is
        numba's compiled kernels (about a second, once per process, even from numba's on-disk cache), which
        the first log step's ``perf/step_time`` and the run's ``perf/train_loop_s`` would otherwise count."""
        if self.params or self.modules:
            fused.usable(device.type)

    # -- collecting --------------------------------------------------------------------------------
    def begin(self) -> None:
        """Attach the activation hooks for one log step."""
        for name, module in self.modules:
            self._handles.append(module.register_forward_hook(self._hook(("act", name))))

    def _hook(self, key: tuple[str, str]) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel():
                with torch.no_grad():
                    self._keep(key, output.detach())
        return hook

    def _slot(self, key: tuple[str, str], t: torch.Tensor) -> torch.Tensor | None:
        """The slot of the current layout that ``t`` fits, if any."""
        slot = self._slots.get(key)
        return slot if slot is not None and slot.shape == t.shape and slot.device == t.device else None

    def _keep(self, key: tuple[str, str], t: torch.Tensor) -> None:
        slot = self._slot(key, t)
        # a new shape: kept aside, packed by finish
        self._seen[key] = slot.copy_(t) if slot is not None else t.float().clone()

    @torch.no_grad()
    def capture_grads(self) -> None:
        """Copy every matched parameter's ``.grad`` (skipping absent or empty ones): one foreach call."""
        fast = self._fast
        if fast is not None:  # the usual step: the same gradients as last time, all in their slots
            slots, params, seen = fast
            grads = [p.grad for p in params]
            if all(g is not None and g.shape == s.shape for g, s in zip(grads, slots, strict=True)):
                torch._foreach_copy_(slots, grads)
                self._seen.update(seen)
                return
        fit_slots, fit_grads = [], []
        for name, p in self.params:
            g = p.grad
            if g is None or not g.numel():
                continue
            key = ("grad", name)
            slot = self._slot(key, g)
            if slot is not None:
                fit_slots.append(slot)
                fit_grads.append(g.detach())
                self._seen[key] = slot
            else:
                self._keep(key, g.detach())
        if fit_slots:
            torch._foreach_copy_(fit_slots, fit_grads)

    def _remember_fast_path(self) -> None:
        """After a step in which every matched parameter had a gradient in its slot."""
        keys = [("grad", n) for n, _ in self.params]
        if self.params and all(k in self._slots for k in keys):
            slots = [self._slots[k] for k in keys]
            self._fast = (slots, [p for _, p in self.params], dict(zip(keys, slots, strict=True)))
        else:
            self._fast = None

    # -- describing --------------------------------------------------------------------------------
    @torch.no_grad()
    def finish(self, *extra: torch.Tensor | list[float] | None) -> StepStatsResult:
        """Remove the activation hooks, describe what was collected, and read it back together with
        the ``extra`` values (tensors of any shape, flattened; host values as they are; None reads as [])
        in one transfer."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        seen, self._seen = self._seen, {}
        keys = tuple(seen)
        packed = None
        if keys:
            tensors = [seen[k] for k in keys]
            shapes = [t.shape for t in tensors]
            packed = self._layouts.get(keys, shapes, tensors[0].device)
            if packed is not self._packed:
                self._packed, self._slots = packed, dict(zip(keys, packed.slots, strict=True))
                self._remember_fast_path()
            stale = [(slot, t) for slot, t in zip(packed.slots, tensors, strict=True) if slot is not t]
            if stale:
                torch._foreach_copy_([s for s, _ in stale], [t for _, t in stale])
        stats_host, values = _read(packed.reduce(self.hist_bins) if packed is not None else None, extra)
        if packed is None:
            return StepStatsResult(values)
        table, hist = packed.decode(stats_host, self.hist_bins)
        return StepStatsResult(values, table, hist, self._names(keys), packed.kernel_edges(stats_host, self.hist_bins))

    def _names(self, keys: tuple[tuple[str, str], ...]) -> _Names:
        names = self._keys.get(keys)
        if names is None:
            names = self._keys[keys] = _Names(keys)
        return names


class _Names:
    """What a layout's keys mean on the host: which rows are gradients, their names and metric keys
    (built once per layout, not on every log step)."""

    def __init__(self, keys: tuple[tuple[str, str], ...]):
        grads = [i for i, (kind, _) in enumerate(keys) if kind == "grad"]
        acts = [i for i, (kind, _) in enumerate(keys) if kind == "act"]
        self.grad_rows, self.act_rows = np.asarray(grads, dtype=np.int64), np.asarray(acts, dtype=np.int64)
        self.grads = [n for kind, n in keys if kind == "grad"]
        self.acts = [n for kind, n in keys if kind == "act"]
        self.grad_keys = [[f"grad/{n}/{s}" for s in GRAD_STATS] for n in self.grads]
        # StepStatsResult.metrics: every metric's position in the [tensors, GRAD_STATS] table, and its key
        width = len(GRAD_STATS)
        self.flat_index = np.asarray([i * width + c for i in acts for c in _ACT_COLS] +
                                     [i * width + c for i in grads for c in range(width)], dtype=np.int64)
        self.flat_act_keys = [f"act/{n}/{s}" for n in self.acts for s in ACT_STATS]
        self.flat_keys = self.flat_act_keys + [k for ks in self.grad_keys for k in ks]
        self.norms = slice(len(self.flat_act_keys) + _COL["norm"], None, width)  # the gradient norms among them
        self.hist_keys = [f"{kind}/{n}/hist" for kind, n in keys]  # in the table's row order


class GradStats:
    """Gradient statistics alone: ``compute()`` describes the current ``.grad`` of every parameter
    ``pattern`` matches (target grammar) that has one."""

    def __init__(self, model: nn.Module, pattern: str | None = "*", hist_bins: int = 0,
                 hist_sample: int | None = None):
        self._stats = StepStats(model, pattern, None, hist_bins, hist_sample)
        self.named = self._stats.params

    def compute(self) -> GradStatsResult | None:
        self._stats.capture_grads()
        return self._stats.finish().grads


class ActivationStats:
    """Activation statistics alone: ``begin()`` before a forward, ``end()`` after it returns
    ``act/<module>/<stat>``; ``hists`` holds the histograms of the last ``end()``."""

    def __init__(self, model: nn.Module, pattern: str | None, hist_bins: int = 0, hist_sample: int | None = None):
        self._stats = StepStats(model, None, pattern, hist_bins, hist_sample)
        self.named = self._stats.modules
        self.hists: dict[str, tuple[list[float], float, float]] = {}

    def begin(self) -> None:
        self._stats.begin()

    def end(self) -> dict[str, float]:
        result = self._stats.finish()
        self.hists = result.act_hists
        return result.activations
