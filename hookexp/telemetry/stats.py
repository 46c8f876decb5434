"""Describe tensors: the one statistics path, in plain torch ops (single passes on CUDA, compiled by default there;
two elsewhere).

``TensorStats(stats, hist_bins, hist_sample).describe({"grad/fc1.weight": g1, ...})`` returns a
:data:`~hookexp.telemetry.readback.Pending` pair (a flat device tensor and the decoder of its host copy, no host
sync): per tensor ``norm``, ``mean``, ``std``, ``min``, ``max``, ``frac_zero``, ``frac_neg``, ``abs_mean``,
``kurtosis`` and, with ``hist_bins`` > 0, a histogram. DTensors and the keys in ``sharded`` are combined over the
ranks in one all-gather (two collectives with histograms). The exact definitions, the kernels and the sharded
path: docs/internals.md, "Describing tensors".
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hookexp.errors import ConfigError, did_you_mean
from hookexp.telemetry.readback import Pending, wide_dtype

STATS = ("norm", "mean", "std", "min", "max", "frac_zero", "frac_neg", "abs_mean", "kurtosis")
# what each family of the probes logs (hookexp.telemetry.probes): a new statistic is its column below, its line in
# _decode, and its name here — this file and its test
ACTIVATION_STATS = ("mean", "std", "abs_mean", "kurtosis", "frac_zero")
GRADIENT_STATS = ("norm", "mean", "std", "min", "max", "frac_zero", "frac_neg")
log = logging.getLogger("hookexp.stats")
FUSED = frozenset({"cuda"})  # devices whose rows are described in single passes (_row_partials)
COMPILED = frozenset({"cuda"})  # devices whose rows are compiled when stats.compile is null (auto)
COLUMNS = 10  # per row, tensor or rank: elements, sum, squared deviations, zeros, negatives, min, max, sum of |x|,
#              cubed and 4th-power deviations


def _nothing(host: np.ndarray) -> dict[str, Any]:
    return {}


class TensorStats:
    """Describes named tensors on log steps; ``group`` is the process group sharded tensors are spread
    over (None: the default group, when ``torch.distributed`` is initialized); ``compile``: rows described by
    torch.compile's fused kernels (True), eagerly (False), or compiled on the devices in :data:`COMPILED` (None)."""

    def __init__(self, stats: Collection[str] = STATS, hist_bins: int = 0, hist_sample: int | None = None,
                 group: Any = None, compile: bool | None = None):
        unknown = [s for s in stats if s not in STATS]
        if unknown:
            raise ValueError(f"unknown statistic {unknown[0]!r}; the statistics are {', '.join(STATS)}."
                             f"{did_you_mean(unknown[0], STATS)}")
        if hist_bins < 0:
            raise ConfigError(f"must be 0 (no histograms) or more, got {hist_bins}.", key="stats.hist_bins")
        if hist_sample is not None and hist_sample < 1:
            raise ConfigError(f"must be at least 1 (or null: count every element), got {hist_sample}.",
                              key="stats.hist_sample")
        self.stats = [s for s in STATS if s in stats]
        self.hist_bins, self.hist_sample, self.group = hist_bins, hist_sample, group
        self.compile = compile  # rows in torch.compile's fused kernels: True, False, None (on CUDA)
        self._layouts: OrderedDict[Any, _Layout] = OrderedDict()

    @torch.no_grad()
    def describe(self, tensors: Mapping[str, torch.Tensor], sharded: Collection[str] = (),
                 higher: Collection[str] | None = None) -> Pending:
        """``(values, decode)`` for ``tensors`` (key -> tensor; metric keys are ``<key>/<stat>`` and
        ``<key>/hist``); ``sharded``: the keys of plain tensors that are this rank's part of a tensor;
        ``higher``: the keys whose ``kurtosis`` is wanted (None: all), the only ones that pay for the 3rd and
        4th powers of their elements."""
        if not tensors:
            return None, _nothing
        wanted = "kurtosis" in self.stats
        higher = [k for k in tensors if wanted and (higher is None or k in higher)]
        keys = higher + [k for k in tensors if k not in set(higher)]  # those first: their rows are one block
        tensors = {k: tensors[k] for k in keys}
        ranks = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank(self.group) if ranks > 1 else 0
        parts = [_placed(k, t, k in sharded, rank) for k, t in tensors.items()]
        ranks = ranks if any(spread for _, spread, _ in parts) else 1
        local = [t if ranks == 1 or own else t.reshape(-1)[:0] for t, _, own in parts]  # a replica: one rank
        key = (tuple(keys), len(higher), tuple(t.numel() for t in local), local[0].device, ranks)
        layout = self._layouts.pop(key, None) or _Layout(keys, self, local, ranks, len(higher))
        self._layouts[key] = layout
        if len(self._layouts) > 8:  # e.g. activations of a smaller last batch: a few layouts, the oldest go
            self._layouts.popitem(last=False)

        narrow = torch.cat([p for t, pad in zip(local, layout.pads, strict=True) for p in (t.reshape(-1), pad)
                            if p is not None]).view(layout.rows, layout.width)
        binned = _bin_values(narrow, layout) if self.hist_bins else None
        if layout.fused:
            table = _combine(_row_partials(narrow, layout), layout.row_seg, len(keys))
        else:
            x = narrow.to(layout.wide)
            signs = _signs(narrow)
            del narrow
            table = _partials(x, signs, layout)
        if ranks > 1:
            everyone = table.new_empty(ranks * len(keys), COLUMNS)
            getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(everyone, table, group=self.group)
            table = _combine(everyone, layout.rank_seg, len(keys))
        values = table.view(-1)
        if binned is not None:
            counts = _histograms(*binned, table, layout, self.hist_bins)
            if ranks > 1:
                dist.all_reduce(counts, group=self.group)
            values = torch.cat([values, counts])
        return values, lambda host: _decode(host, layout, self.stats, self.hist_bins)


@torch.no_grad()
def norms(tensors: Mapping[str, torch.Tensor], group: Any = None) -> Pending:
    """``(values, decode)`` of each tensor's L2 norm alone (``<key>/norm``; empty tensors have none), for what needs
    no more (weights, updates, optimizer state): one ``torch._foreach_norm`` of the local tensors, no copy of them.
    DTensors' squared norms are summed over the ranks in ONE ``all_reduce`` (a replica counted on its first rank);
    none when nothing is sharded. Computed in the tensors' own dtype (float32: to about 1e-7 relative)."""
    tensors = {k: t for k, t in tensors.items() if t.numel()}
    if not tensors:
        return None, _nothing
    ranks = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(group) if ranks > 1 else 0
    parts = [_placed(k, t, False, rank) for k, t in tensors.items()]
    local = [t for t, _, _ in parts]
    squares = torch.stack(torch._foreach_norm(local)).to(wide_dtype(local[0].device)).square()
    if ranks > 1 and any(spread for _, spread, _ in parts):
        squares = squares * torch.tensor([own for _, _, own in parts], device=squares.device)
        dist.all_reduce(squares, group=group)
    keys = [f"{k}/norm" for k in tensors]
    return squares, lambda host: dict(zip(keys, np.sqrt(np.asarray(host, dtype=np.float64)).tolist(), strict=True))


def _placed(key: str, t: torch.Tensor, sharded: bool, rank: int) -> tuple[torch.Tensor, bool, bool]:
    """(local tensor, whether it is one part of a tensor spread over ranks, whether this rank counts it
    when the ranks' partials are combined)."""
    placements = getattr(t, "placements", None)
    if placements is None:  # a plain tensor
        return t, sharded, sharded or rank == 0
    if any(p.is_partial() for p in placements):
        raise ValueError(f"cannot describe {key!r}: its DTensor placement is Partial (a pending sum over ranks). "
                         "Describe it after its reduction (FSDP2's gradients are Shard after backward), or "
                         "redistribute it to Shard or Replicate first.")
    coord = t.device_mesh.get_coordinate()
    own = coord is not None and all(c == 0 for c, p in zip(coord, placements, strict=True) if not p.is_shard())
    return t.to_local(), any(p.is_shard() for p in placements), own


class _Layout:
    """How one list of local tensor sizes lies in rows, built once and reused: the pads at the end of each
    tensor's last row, which tensor each row belongs to and how many elements it holds, and the histogram
    positions."""

    def __init__(self, keys: list[str], describer: TensorStats, local: list[torch.Tensor], ranks: int,
                 higher: int = 0):
        hist_sample = describer.hist_sample
        self.keys = [[f"{k}/{s}" for s in describer.stats] for k in keys]  # the decoder's, made once
        self.flat_keys = [k for row in self.keys for k in row]
        self.hist_keys = [f"{k}/hist" for k in keys]
        sizes = [t.numel() for t in local]
        device, self.wide = local[0].device, wide_dtype(local[0].device)
        self.width = w = 2 ** min(14, max(4, round(math.log2(max(1.0, sum(sizes) / len(sizes)) ** 0.5))))
        rows = [-(-n // w) for n in sizes]
        self.rows, ends = sum(rows), np.cumsum(rows) * w
        self.higher, self.higher_rows = higher, sum(rows[:higher])  # the leading tensors (rows) with 3rd/4th powers
        pads = [r * w - n for n, r in zip(sizes, rows, strict=True)]
        zeros = torch.zeros(w, device=device)  # float32: cat then promotes nothing but bf16/fp16 (faster)
        self.pads = [zeros[:p] if p else None for p in pads]
        pad_at = torch.cat([torch.arange(int(e) - p, int(e)) for e, p in zip(ends, pads, strict=True)])
        self.pad_at, self.pad_row = pad_at.to(device), (pad_at // w).to(device)
        tensor = torch.arange(len(sizes))
        self.row_seg = tensor.repeat_interleave(torch.tensor(rows)).to(device)
        row_n = [min(w, n - i * w) for n, r in zip(sizes, rows, strict=True) for i in range(r)]
        self.row_n = torch.tensor(row_n, dtype=self.wide, device=device)
        self.sizes = torch.tensor(sizes, dtype=self.wide, device=device)
        self.count = self.sizes.clamp_min(1)  # what the sums are divided by
        self.rank_seg = tensor.repeat(ranks).to(device)
        # auto: compiled on CUDA, but not where algorithms must be deterministic (an inductor that picks among
        # reduction configs by timing them may sum in another order from one run to the next)
        compiled = describer.compile if describer.compile is not None else (
            device.type in COMPILED and not torch.are_deterministic_algorithms_enabled())
        # Welford's partials want float64; compiled, every device's rows take the single-pass math
        self.fused = (device.type in FUSED or compiled) and self.wide == torch.float64
        self.compiled = self.fused and compiled
        if self.fused:  # each padded row's pads take its first element's value, then leave its partials
            firsts = ends - w  # where each tensor's last row starts
            self.pad_src = torch.cat([torch.full((p,), int(f)) for f, p in zip(firsts, pads, strict=True)]).to(device)
            row_pad = [w - k for k in row_n]
            self.row_pad = torch.tensor(row_pad, dtype=self.wide, device=device)
            self.pad_weight = self.row_n * self.row_pad / w  # what the pads add to a row's M2, per squared offset
        self.pos = self.pos_seg = self.scale = None
        if hist_sample is not None and max(sizes) > hist_sample:  # else every element is counted, in place
            gen = [torch.Generator().manual_seed(0) for _ in sizes]
            picks = [torch.randint(n, (hist_sample,), generator=g).sort().values if n > hist_sample
                     else torch.arange(n) for n, g in zip(sizes, gen, strict=True)]
            starts = np.cumsum([0, *rows[:-1]]) * w
            self.pos = torch.cat([int(s) + p for s, p in zip(starts, picks, strict=True)]).to(device)
            taken = torch.tensor([len(p) for p in picks])
            self.pos_seg = tensor.repeat_interleave(taken).to(device)
            self.scale = (torch.tensor(sizes, dtype=torch.float64) / taken.clamp_min(1)).to(device, self.wide)
        # each binned value's first bin in the counts: its tensor's (one extra bin per tensor takes the pads)
        counted = self.row_seg[:, None] if self.pos is None else self.pos_seg
        self.bin_base = counted * (describer.hist_bins + 1) if describer.hist_bins else None


def _signs(narrow: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the joined tensors before widening (fewer bytes, the same signs): its nonzeros and its
    negatives, float32 (float64 for float64 tensors); a NaN is nonzero and not negative, a pad (0) neither. Sums
    of signs: exact in float32 (a row has at most 2^14 elements), and faster than counting booleans on a CPU."""
    sign = (narrow if narrow.element_size() >= 4 else narrow.float()).nan_to_num(1.0).sign_()  # NaN as +1; a copy
    balance = sign.sum(1)  # positives - negatives
    nonzero = sign.abs_().sum(1)
    return nonzero, (nonzero - balance) / 2  # torch.stack widens them with the other columns


def _partials(x: torch.Tensor, signs: tuple[torch.Tensor, torch.Tensor], layout: _Layout) -> torch.Tensor:
    """``[tensors, COLUMNS]`` partials of this rank's elements (count, sum, squared deviations from the mean,
    zeros, negatives, min, max, sum of |x|, cubed and 4th-power deviations), from row-wise reductions summed
    per tensor, with the rows' nonzeros and negatives (``signs``, :func:`_signs`); ``x`` is used up. The pads,
    zeros from ``torch.cat`` while the sums and |x| are counted, are then set to their tensor's mean: they keep
    min and max, and add nothing to the deviations. Two passes,
    the second's powers corrected by its sum (shifted sums): exact however large the mean is against the
    spread, in float64 and in MPS's float32. NaN is nonzero and not negative; min and max propagate it."""
    seg, n = layout.row_seg, len(layout.sizes)
    (nonzero, negatives), total = signs, x.sum(1)
    absolute = torch.linalg.vector_norm(x, 1, dim=1)  # sum of |x|, without a copy of x
    mean = x.new_zeros(n).index_add_(0, seg, total) / layout.count
    shift = mean.nan_to_num_(0.0, math.inf, -math.inf)[seg]  # a tensor with NaN or +-Inf: pads 0 or the Inf
    if len(layout.pad_at):
        x.view(-1).index_put_((layout.pad_at,), shift[layout.pad_row])
    lo, hi = torch.aminmax(x, dim=1) if x.is_cuda else (x.amin(1), x.amax(1))  # one pass where it is fused
    deviations = x.sub_(shift[:, None]).sum(1)  # what the mean's rounding leaves: taken out of the powers
    cubes, fourths = x.new_zeros(len(x)), x.new_zeros(len(x))
    if layout.higher_rows:  # only the tensors whose kurtosis is wanted (activations), not every gradient
        head = x[:layout.higher_rows]
        square = head.square()
        cubes[:layout.higher_rows] = (head * square).sum(1)
        fourths[:layout.higher_rows] = square.square_().sum(1)
        del square
    squares = x.square_().sum(1)
    rows = torch.stack([layout.row_n, total, squares, layout.row_n - nonzero, negatives, absolute,
                        cubes, fourths], 1)
    sums = x.new_zeros(n, rows.shape[1]).index_add_(0, seg, rows)
    e = x.new_zeros(n).index_add_(0, seg, deviations) / layout.count  # the mean's rounding
    s2, s3, s4 = sums[:, 2], sums[:, 6], sums[:, 7]
    out = x.new_zeros(n, COLUMNS)
    out[:, 0:2], out[:, 3:5], out[:, 7] = sums[:, 0:2], sums[:, 3:5], sums[:, 5]  # slices: a list index is a copy
    out[:, 2] = s2 - layout.sizes * e * e
    out[:, 8] = s3 - 3 * e * s2 + 2 * layout.sizes * e ** 3
    out[:, 9] = s4 - 4 * e * s3 + 6 * e * e * s2 - 3 * layout.sizes * e ** 4
    out[:, 5] = x.new_full((n,), math.inf).scatter_reduce_(0, seg, lo, "amin")
    out[:, 6] = x.new_full((n,), -math.inf).scatter_reduce_(0, seg, hi, "amax")
    return out


def _row_partials(narrow: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """``[rows, COLUMNS]`` partials of each row of the joined tensors, for :func:`_combine` (on CUDA: fewer bytes
    than :func:`_partials`, the same values to float64's rounding). A padded row's pads hold its first element (so
    they keep min and max), whose copies :func:`_rows` then takes out. ``narrow`` is changed (its pads). With
    ``layout.compiled``, :func:`_rows` runs as torch.compile's kernels (:data:`ROW_KERNEL`)."""
    if not len(narrow):  # every tensor empty (this rank's shards, say): var_mean of no rows would warn
        return narrow.new_zeros(0, COLUMNS, dtype=layout.wide)
    if len(layout.pad_at):
        flat = narrow.view(-1)
        flat.index_put_((layout.pad_at,), flat.index_select(0, layout.pad_src))
    args = (narrow, (layout.row_n, layout.row_pad, layout.pad_weight), layout.width, layout.higher_rows)
    out = ROW_KERNEL(*args) if layout.compiled else None  # None: did not compile (said once), or no memory
    return out if out is not None else _rows(*args)


def _rows(narrow: torch.Tensor, counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w: int, k: int,
          compiled: bool = False) -> torch.Tensor:
    """The rows' partials: min/max, zeros and negatives of the narrow rows, and of the widened rows the sum of
    |x|, the mean and the squared deviations from it. ``counts``: each row's elements, pads ``p`` and pads' weight
    in its squared deviations (``_Layout``'s ``row_n``, ``row_pad``, ``pad_weight``). The ``p`` copies of each row's
    first element that pad it are taken out exactly for the counts, and for the moments by Chan's formula, well
    conditioned since that element is one of the row's. Only the first ``k`` rows get 3rd and 4th powers. Rows
    with NaN or Inf give non-finite moments; the decoder reads those from min and max. Eager: one widened copy and
    single passes (Welford's ``var_mean``), 53 bytes per float32 element. ``compiled`` (inside ``torch.compile``):
    the mean as the first element plus the mean deviation from it (the pads' deviations are exactly 0, so a row of
    one value has that mean and no spread), then the deviations' powers, which the compiler fuses into two reads of
    ``narrow`` and no copy; run uncompiled (Dynamo off, or told to run eagerly), the eager rows, which need fewer
    float64 copies."""
    row_n, p, pad_weight = counts
    first = narrow[:, 0]
    wide = row_n.dtype
    v = first.to(wide, copy=True).nan_to_num_(0.0, 0.0, 0.0)  # a copy (float64: a view); non-finite: unused
    zeros = (narrow == 0).sum(1) - p * (first == 0)
    negatives = (narrow < 0).sum(1) - p * (first < 0)
    lo, hi = torch.aminmax(narrow, dim=1)
    x = narrow.to(wide)
    absolute = torch.linalg.vector_norm(x, 1, dim=1).sub_(p * v.abs())
    cubes, fourths = x.new_zeros(len(x)), x.new_zeros(len(x))
    if compiled and torch.compiler.is_compiling():  # uncompiled (Dynamo off or skipping): the leaner eager rows
        mean = v + (x - v[:, None]).sum(1) / row_n  # the real elements' mean (the pads' deviations from v: 0)
        offset = v - mean
        d = x - mean[:, None]
        square = d.square()
        m2 = square.sum(1) - p * offset.square()
        if k:
            cubes[:k] = (square[:k] * d[:k]).sum(1) - p[:k] * offset[:k] ** 3
            fourths[:k] = square[:k].square().sum(1) - p[:k] * offset[:k] ** 4
        return torch.stack([row_n, mean * row_n, m2, zeros, negatives, lo, hi, absolute, cubes, fourths], 1)
    var, mean = torch.var_mean(x, dim=1, correction=0)
    mean = mean.add_(p * (mean - v) / row_n)  # the real elements' mean
    offset = v - mean
    m2 = var.mul_(w).sub_(pad_weight * offset.square())
    if k:  # only the tensors whose kurtosis is wanted (activations), not every gradient
        d = x[:k].sub_(mean[:k, None])  # x is used up: a copy, or narrow itself (float64)
        square = d.square()
        cubes[:k] = (square * d).sum(1) - p[:k] * offset[:k] ** 3
        fourths[:k] = torch.linalg.vector_norm(square, 2, dim=1).square_() - p[:k] * offset[:k] ** 4
        del d, square
    return torch.stack([row_n, mean * row_n, m2, zeros, negatives, lo, hi, absolute, cubes, fourths], 1)


class _RowKernel:
    """:func:`_rows` under ``torch.compile`` (made at the first call): a log step's rows in a few fused kernels
    instead of ~15 passes over them, with dynamic sizes: a compile per dtype, and per none, one or more rows with 3rd
    and 4th powers and one or more rows (Dynamo specializes 0 and 1), under :func:`_own_limits`.
    A compile that fails returns None, with one warning naming ``stats.compile``; the rows are then described
    eagerly, with the same values to float64's rounding. A call that runs out of device memory returns None too, as
    no failure of the compiler: that call's rows are described eagerly (raising the error where it lasts)."""

    def __init__(self) -> None:
        self._fn: Any = None
        self.failed: str | None = None  # why it did not compile
        self.calls = 0  # the layouts' calls it answered

    def __call__(self, *args: Any) -> torch.Tensor | None:
        if self.failed is not None:
            return None
        try:
            if self._fn is None:
                self._fn = torch.compile(_rows, fullgraph=True, dynamic=True)  # a compile per dtype, not per size
            with _own_limits():
                out = self._fn(*args, compiled=True)
        except torch.cuda.OutOfMemoryError:  # the device's memory, not the compiler: these rows eagerly (which
            return None  # raise it again if it lasts, with more of it to find), the next ones compiled again
        except Exception as e:  # any compiler's failure: the eager rows give the same values
            self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.warning("stats.compile: the statistics' fused kernel did not compile (%s); tensors are described "
                        "eagerly from now on, with the same values. Set stats.compile=false to skip the attempt.",
                        self.failed[:300])
            return None
        self.calls += 1
        return out


ROW_KERNEL = _RowKernel()


def _own_limits() -> contextlib.ExitStack:
    """The settings the statistics' kernel compiles under, for its calls only: room for all its variants (4
    dtypes x 0, 1 or more rows with higher powers x 1 or more rows) above Dynamo's recompile limit of 8, which
    is per function, and compiles in this process (each rank of a DDP job would otherwise start inductor's pool of
    compile workers at its first log step for these few kernels)."""
    stack = contextlib.ExitStack()
    dynamo = torch._dynamo.config
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    stack.enter_context(dynamo.patch({limit: max(64, getattr(dynamo, limit))}))
    import torch._inductor.config as inductor

    stack.enter_context(inductor.patch(compile_threads=1))
    return stack


def _combine(parts: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """Partials of parts of tensors (the ranks' ``[ranks * n, COLUMNS]``; on CUDA also each rank's rows) of the
    ``n`` tensors ``seg`` assigns them to, combined:
    each part's central moments moved to the common mean (d = part mean - mean) and summed: M2 + c d^2,
    M3 + 3 d M2 + c d^3, M4 + 4 d M3 + 6 d^2 M2 + c d^4 (c: the part's count)."""
    out = parts.new_zeros(n, COLUMNS).index_add_(0, seg, parts)
    count, m2, m3 = parts[:, 0], parts[:, 2], parts[:, 8]
    d = parts[:, 1] / count.clamp_min(1) - (out[:, 1] / out[:, 0].clamp_min(1))[seg]
    out[:, 2].index_add_(0, seg, count * d ** 2)
    out[:, 8].index_add_(0, seg, 3 * d * m2 + count * d ** 3)
    out[:, 9].index_add_(0, seg, 4 * d * m3 + 6 * d ** 2 * m2 + count * d ** 4)
    out[:, 5] = out.new_full((n,), math.inf).scatter_reduce_(0, seg, parts[:, 5], "amin")
    out[:, 6] = out.new_full((n,), -math.inf).scatter_reduce_(0, seg, parts[:, 6], "amax")
    return out


def _bin_values(x: torch.Tensor, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """What the histograms count, taken before :func:`_partials` uses ``x`` up, as float32 (``torch.histc``
    bins in the input's dtype), with the tensor each belongs to: every element where it lies (the pads NaN,
    which an extra bin per tensor takes and drops), or the sampled positions."""
    if layout.pos is None:
        every = x.to(torch.float32, copy=True)
        return every.view(-1).index_fill_(0, layout.pad_at, math.nan).view_as(x), layout.row_seg[:, None]
    return x.view(-1).take(layout.pos).float(), layout.pos_seg


def _histograms(values: torch.Tensor, seg: torch.Tensor, table: torch.Tensor, layout: _Layout,
                bins: int) -> torch.Tensor:
    """``[tensors * bins]`` counts of ``values`` over each tensor's [min, max] with ``torch.histc``'s float32
    arithmetic, scaled to the tensor's size where a subset was counted."""
    lo, hi = table[:, 5], table[:, 6]
    one = hi <= lo  # one value: a unit-wide range around it, as the bin edges
    lo, hi = torch.where(one, lo - 0.5, lo).float(), torch.where(one, hi + 0.5, hi).float()
    flat = seg.view(-1)  # index_select: a plain gather, cheaper than indexing; ((x - lo) * bins) / (hi - lo)
    at = (values - lo.index_select(0, flat).view(seg.shape)).mul_(bins)
    at = at.div_((hi - lo).index_select(0, flat).view(seg.shape)).clamp_(0, bins - 1).nan_to_num_(bins).long()
    at = at.add_(layout.bin_base).view(-1)
    counts = table.new_zeros(len(table) * (bins + 1)).index_add_(0, at, table.new_ones(1).expand(len(at)))
    counts = counts.view(-1, bins + 1)[:, :bins]
    return (counts if layout.scale is None else counts * layout.scale[:, None]).reshape(-1)


def _decode(host: np.ndarray, layout: _Layout, stats: list[str], bins: int) -> dict[str, Any]:
    """The decoder of :meth:`TensorStats.describe`'s values: metrics and histograms by key."""
    n_tensors = len(layout.keys)
    table = np.asarray(host[:n_tensors * COLUMNS], dtype=np.float64).reshape(n_tensors, COLUMNS)
    n, total, squares, zeros, negs, lo, hi, absolute, _, fourths = table.T
    has_nan = np.isnan(lo) | np.isnan(hi)
    finite = np.isfinite(lo) & np.isfinite(hi)
    with np.errstate(all="ignore"):
        col = {"norm": np.where(finite, np.sqrt(squares + total * total / n), np.where(has_nan, np.nan, np.inf)),
               "mean": np.where(has_nan | (lo == -np.inf) & (hi == np.inf), np.nan,  # as torch's sum says
                                np.where(hi == np.inf, np.inf, np.where(lo == -np.inf, -np.inf, total / n))),
               "std": np.where(finite & (n > 1), np.sqrt(np.maximum(squares, 0.0) / (n - 1)), np.nan),
               "min": lo, "max": hi, "frac_zero": zeros / n, "frac_neg": negs / n, "abs_mean": absolute / n,
               "kurtosis": np.where(finite & (squares > 0) & (np.arange(n_tensors) < layout.higher),
                                    n * fourths / (squares * squares), np.nan)}
    rows = np.stack([col[s] for s in stats], 1)
    if n.all():  # no empty tensor: one zip of the keys made once
        out: dict[str, Any] = dict(zip(layout.flat_keys, rows.ravel().tolist(), strict=True))
    else:
        out = {k: v for i in np.flatnonzero(n).tolist() for k, v in zip(layout.keys[i], rows[i].tolist(), strict=True)}
    if bins:
        counts = np.asarray(host[n_tensors * COLUMNS:], dtype=np.float64).reshape(n_tensors, bins)
        drawn = np.flatnonzero(finite).tolist()
        edges = bin_edges(lo[drawn], hi[drawn], bins)
        out.update({layout.hist_keys[i]: (counts[i], e) for i, e in zip(drawn, edges, strict=True)})
    return out


def bin_edges(lo: np.ndarray, hi: np.ndarray, bins: int) -> np.ndarray:
    """``[len(lo), bins + 1]`` edges of equal bins over each [lo, hi], the first exactly ``lo`` and the
    last exactly ``hi`` (as ``np.linspace``); a range of one value gets a unit-wide one around it."""
    one = hi <= lo
    lo, hi = np.where(one, lo - 0.5, lo), np.where(one, lo + 0.5, hi)
    edges = np.multiply.outer((hi - lo) / bins, np.arange(bins + 1.0)) + lo[:, None]
    edges[:, -1] = hi
    return edges
