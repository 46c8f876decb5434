"""Every statistic of a packed CPU buffer in one compiled pass per tensor (numba), when numba is installed.

On the CPU a log step's statistics in torch cost about thirty ops, each a full pass over the packed
buffer plus the dispatcher's overhead; on a small model that is more than the training step itself.
Here one compiled loop per tensor reads each element once for the sums and counts (and once more for
the exact variance), numpy's SIMD ``reduceat`` gives the minima and maxima, and the histogram counts
a fixed set of positions and writes its bin edges: a few tens of microseconds instead of a few hundred.

Optional (``pip install hookexp[fast]``): without numba :mod:`hookexp.stats` uses its torch ops, which
give the same numbers. Compiled once per machine (numba's on-disk cache), imported only by a CPU run
that computes statistics. The kernels run single-threaded and release the GIL: they never start a
thread pool beside torch's.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from functools import cache
from typing import Any

import numpy as np

log = logging.getLogger("hookexp.stats")
# Reassociation lets the sums vectorise; no "nnan"/"ninf": NaN and Inf must propagate as in torch.
_FAST = {"contract", "reassoc", "nsz", "arcp"}


ENABLED = True  # False: always the torch ops (the tests compare both)


def usable(device_type: str) -> bool:
    """Whether a layout on this device type is described here: CPU, numba installed and working, not
    switched off."""
    return ENABLED and device_type == "cpu" and _working()


def _installed() -> bool:
    return importlib.util.find_spec("numba") is not None


@cache
def _working() -> bool:
    if not _installed():
        return False
    try:  # compiles (or loads from numba's cache) and runs every kernel once
        FusedLayout([0], [2], [None], np.ones(1)).describe(np.array([1.0, 2.0], dtype=np.float32), 2)
    except Exception as e:  # e.g. a numba too old for this numpy: the torch ops give the same numbers
        log.warning("statistics: numba is installed but unusable (%s: %s); using torch ops on the CPU instead",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return False
    return True


@cache
def _kernels() -> tuple[Any, Any]:
    import numba

    @numba.njit(cache=True, nogil=True, fastmath=_FAST)
    def moments(buf, starts, sizes, out):  # pragma: no cover - compiled
        """out[t] = norm, mean, std, -, -, frac_zero, frac_neg of buf[starts[t]:starts[t] + sizes[t]]."""
        for t in range(starts.shape[0]):
            m = sizes[t]
            x = buf[starts[t]:starts[t] + m]  # a slice, not buf[s + i]: only then does the loop vectorise
            total, squares = 0.0, 0.0
            zeros, negs = 0, 0
            for i in range(m):
                v = x[i]
                w = np.float64(v)
                total += w
                squares += w * w
                zeros += np.int64(v == 0)
                negs += np.int64(v < 0)  # NaN: neither zero nor negative, as in torch
            mean = total / m
            spread = 0.0  # the exact variance: a second pass around the mean, in float64
            for i in range(m):
                d = np.float64(x[i]) - mean
                spread += d * d
            out[t, 0] = math.sqrt(squares)
            out[t, 1] = mean
            out[t, 2] = math.sqrt(spread / (m - 1)) if m > 1 else math.nan
            out[t, 5] = zeros / m
            out[t, 6] = negs / m

    @numba.njit(cache=True, nogil=True)
    def histogram(buf, starts, sizes, lo, hi, pos, pos_start, bins, scale, counts, edges, idx):  # pragma: no cover
        """counts[t] += scale[t] * the bins (torch.histc's float32 arithmetic) of buf[starts[t] + p] for the positions p
        in pos[pos_start[t]:pos_start[t + 1]], or of every element of tensor t where that range is empty;
        edges[t] = the bins' edges, as :func:`hookexp.stats.bin_edges` computes them (the same float64 ops).
        A tensor whose range is not finite is skipped: it has no histogram (its counts stay 0, its edges NaN).
        The bins are found first (a loop that vectorises, into the scratch ``idx``), then counted in four
        interleaved tallies: one tally would wait on itself whenever neighbours share a bin (ReLU zeros)."""
        nb = np.float32(bins)
        tally = np.zeros((4, bins), dtype=np.int64)
        for t in range(starts.shape[0]):
            low = lo[t]
            if not (np.isfinite(low) and np.isfinite(hi[t])):
                edges[t, :] = np.nan
                continue
            e_lo, e_hi = np.float64(low), np.float64(hi[t])
            if e_hi <= e_lo:  # one value: a unit-wide bin range around it
                e_lo, e_hi = e_lo - 0.5, e_lo + 0.5
            step = (e_hi - e_lo) / bins
            for k in range(bins):
                edges[t, k] = step * k + e_lo
            edges[t, bins] = e_hi
            width = max(hi[t] - low, np.float32(1e-30))
            x = buf[starts[t]:starts[t] + sizes[t]]
            a, b = pos_start[t], pos_start[t + 1]
            n = b - a if b > a else sizes[t]
            if b > a:
                for j in range(n):
                    idx[j] = min(np.int32((x[pos[a + j]] - low) / width * nb), bins - 1)
            else:
                for j in range(n):
                    idx[j] = min(np.int32((x[j] - low) / width * nb), bins - 1)
            tally[:] = 0
            q = n // 4
            for j in range(q):
                tally[0, idx[4 * j]] += 1
                tally[1, idx[4 * j + 1]] += 1
                tally[2, idx[4 * j + 2]] += 1
                tally[3, idx[4 * j + 3]] += 1
            for j in range(4 * q, n):
                tally[0, idx[j]] += 1
            for k in range(bins):
                counts[t, k] += (tally[0, k] + tally[1, k] + tally[2, k] + tally[3, k]) * scale[t]

    return moments, histogram


class FusedLayout:
    """What the kernels need to know about one :class:`~hookexp.stats.Packed` layout: where each tensor
    starts in the (unpadded) buffer, its size, and the positions its histogram counts."""

    COLUMNS = 7  # norm, mean, std, min, max, frac_zero, frac_neg: GRAD_STATS

    def __init__(self, starts: list[int], sizes: list[int], picks: list[np.ndarray | None], hist_scale: np.ndarray):
        self.starts = np.asarray(starts, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        taken = [len(p) if p is not None else 0 for p in picks]  # 0: every element
        self.pos = np.concatenate([p for p in picks if p is not None] or [np.empty(0)]).astype(np.int64)
        self.pos_start = np.concatenate([[0], np.cumsum(taken)]).astype(np.int64)
        counted = [n if k == 0 else k for n, k in zip(sizes, taken, strict=True)]  # elements a histogram bins
        self._idx = np.empty(max(counted), dtype=np.int32)  # the histogram's scratch: one tensor's bins
        # a sampled tensor's counts are scaled to its size
        self.scale = np.asarray(hist_scale, dtype=np.float64)
        self.moments, self.histogram = _kernels()

    def describe(self, buf: np.ndarray, bins: int) -> np.ndarray:
        """The statistics, counts and edges of :meth:`split`, as one flat float64 array (the counts scaled to the
        tensor's size where a subset was counted)."""
        n = len(self.sizes)
        out = np.empty(n * (self.COLUMNS + 2 * bins + 1) if bins > 0 else n * self.COLUMNS)
        table, counts, edges = self.split(out, n, bins)
        self.moments(buf, self.starts, self.sizes, table)
        lo, hi = np.minimum.reduceat(buf, self.starts), np.maximum.reduceat(buf, self.starts)  # SIMD; NaN wins
        table[:, 3], table[:, 4] = lo, hi
        if bins > 0:
            counts.fill(0.0)
            self.histogram(buf, self.starts, self.sizes, lo, hi, self.pos, self.pos_start, bins, self.scale, counts,
                           edges, self._idx)
        return out

    @classmethod
    def split(cls, out: np.ndarray, n: int, bins: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """:meth:`describe`'s flat result as views: ``[n, COLUMNS]`` statistics, then (``bins`` > 0, else None)
        ``[n, bins]`` histogram counts and ``[n, bins + 1]`` bin edges."""
        table = out[:n * cls.COLUMNS].reshape(n, cls.COLUMNS)
        if bins <= 0:
            return table, None, None
        return (table, out[n * cls.COLUMNS:n * (cls.COLUMNS + bins)].reshape(n, bins),
                out[n * (cls.COLUMNS + bins):].reshape(n, bins + 1))
