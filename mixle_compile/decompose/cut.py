"""The optimal contiguous cut of a row of units across devices in rank order.

Problem. Units ``0..n-1`` have work ``w`` and bytes ``b``; devices ``0..D-1`` have throughput
``t`` and room ``cap`` (memory left after what every shard holds whole). Give each device, in
rank order, one contiguous (possibly empty) run of units so that every unit is placed, a
non-empty run has at least ``m`` units and fits its device's room, and the bottleneck
``max_d work(run_d) / t_d`` is as small as possible.

Algorithm (see ``docs/decomposition.md`` for the argument). For a fixed bottleneck ``T``,
feasibility is decided exactly by walking the devices in order and keeping the unit boundaries
reachable so far as sorted runs; each device extends a run with binary searches on the prefix
sums, so a probe costs O(devices · log units) when one unit per shard is allowed (the reachable
boundaries are then always one run). Feasibility is monotone in ``T``, so bisection finds the
least feasible ``T``. The bisection runs over the bit patterns of IEEE doubles, which are ordered
like the values they encode, and the comparisons are made on the same doubles the bottleneck is
reported in, so it ends exactly on the optimum (one of the values ``(P[e] - P[s]) / t_d``).

Shard work is always ``P[stop] - P[start]`` on the prefix sums ``P`` of the works in placement
order, so the reported bottleneck, the oracle's and a recomputation agree bit for bit.
"""

from __future__ import annotations

import bisect
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Bytes above this saturate: no device holds 4 EiB, and int64 prefix sums must not overflow.
_BYTES_CEILING = 1 << 62


@dataclass(frozen=True)
class Shard:
    """Units at placement positions ``start..stop-1`` on device ``device`` (an index into the device list)."""

    device: int
    start: int
    stop: int


@dataclass(frozen=True)
class ContiguousCut:
    """A cut: its non-empty shards in device order, its bottleneck, and the placement order of the units.

    ``order[k]`` is the unit at placement position ``k`` (the identity unless units were reordered).
    """

    shards: tuple[Shard, ...]
    bottleneck: float
    order: tuple[int, ...]


def bottleneck_lower_bound(unit_works: Sequence[float], throughputs: Sequence[float]) -> float:
    """``max(total work / sum of throughputs, largest unit / fastest device)``: no cut does better."""
    if not len(unit_works):
        return 0.0
    return max(float(sum(unit_works)) / float(sum(throughputs)), max(unit_works) / max(throughputs))


def prefix_sums(works: Sequence[float]) -> np.ndarray:
    """``P`` with ``P[0] = 0`` and ``P[i] = w[0] + ... + w[i-1]``: shard work is ``P[stop] - P[start]``."""
    out = np.zeros(len(works) + 1, dtype=np.float64)
    np.cumsum(np.asarray(works, dtype=np.float64), out=out[1:])
    return out


def cut_bottleneck(cut: ContiguousCut, unit_works: Sequence[float], throughputs: Sequence[float]) -> float:
    """Recompute a cut's bottleneck from the unit works and device throughputs."""
    prefix = prefix_sums([unit_works[i] for i in cut.order])
    return max(((prefix[s.stop] - prefix[s.start]) / throughputs[s.device] for s in cut.shards), default=0.0)


def optimal_contiguous_cut(
    unit_works: Sequence[float],
    unit_bytes: Sequence[int],
    throughputs: Sequence[float],
    capacities: Sequence[int],
    min_units_per_shard: int = 1,
) -> ContiguousCut | None:
    """The contiguous cut with the least bottleneck, units in the given order; ``None`` if none fits."""
    sweep = _Sweep(unit_works, unit_bytes, throughputs, capacities, min_units_per_shard)
    return sweep.optimum()


def exchangeable_cut(
    unit_works: Sequence[float],
    unit_bytes: Sequence[int],
    throughputs: Sequence[float],
    capacities: Sequence[int],
    min_units_per_shard: int = 1,
) -> ContiguousCut | None:
    """The best cut when units may be reordered (components of one mixture).

    Units are first assigned longest-processing-time first, each to the device where it would
    finish earliest among those with room (past the heaviest few thousand, the rest fill the
    devices up to a common finish time at once); grouping them by device gives an order, and the
    exact contiguous cut of that order can only improve on the assignment. The result is never
    worse than :func:`optimal_contiguous_cut` of the given order, which is kept on ties: the
    search of the reordered units only looks below the given order's optimum, and stops after one
    probe when nothing there is feasible.
    """
    n = len(unit_works)
    works = np.asarray(unit_works, dtype=np.float64)  # read the lists once
    sizes = _int64_or_list(unit_bytes)
    best = optimal_contiguous_cut(works, sizes, throughputs, capacities, min_units_per_shard)
    index = _longest_first_order(works, sizes, throughputs, capacities)
    if index is None or np.array_equal(index, np.arange(n)):
        return best
    order = tuple(index.tolist())
    reordered_bytes = sizes[index] if isinstance(sizes, np.ndarray) else [sizes[i] for i in order]
    search = _Sweep(works[index], reordered_bytes, throughputs, capacities, min_units_per_shard)
    reordered = search.optimum(strictly_below=None if best is None else best.bottleneck)
    if reordered is not None:
        return ContiguousCut(reordered.shards, reordered.bottleneck, order)
    return best


def _int64_or_list(unit_bytes: Sequence[int]) -> Sequence[int]:
    """Byte counts as an int64 array, or as given when one does not fit int64."""
    try:
        return np.asarray(unit_bytes, dtype=np.int64)
    except OverflowError:
        return list(unit_bytes)


def brute_force_contiguous_cut(
    unit_works: Sequence[float],
    unit_bytes: Sequence[int],
    throughputs: Sequence[float],
    capacities: Sequence[int],
    min_units_per_shard: int = 1,
) -> ContiguousCut | None:
    """Every contiguous cut tried, for small cases: the oracle the fast algorithm is checked against."""
    n, num_devices = len(unit_works), len(throughputs)
    prefix = prefix_sums(unit_works)
    byte_prefix = [0, *itertools.accumulate(int(b) for b in unit_bytes)]
    best: ContiguousCut | None = None
    for inner in itertools.combinations_with_replacement(range(n + 1), num_devices - 1):
        bounds = (0, *inner, n)
        shards, worst = [], 0.0
        for d in range(num_devices):
            start, stop = bounds[d], bounds[d + 1]
            if start == stop:
                continue
            if stop - start < min_units_per_shard or byte_prefix[stop] - byte_prefix[start] > capacities[d]:
                break
            worst = max(worst, (prefix[stop] - prefix[start]) / throughputs[d])
            shards.append(Shard(d, start, stop))
        else:
            if best is None or worst < best.bottleneck:
                best = ContiguousCut(tuple(shards), float(worst), tuple(range(n)))
    return best


# --------------------------------------------------------------------------- the search


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


# The reachable boundaries are kept as sorted disjoint runs. With one unit per shard allowed there
# is only ever one run (a prefix); a minimum above one can split it. Past this many runs a probe
# falls back to the vectorised sweep over every boundary, which costs O(n) whatever the shape.
_MAX_RUNS = 256
# Below this many candidate starts a run's new boundaries are found one start at a time; above,
# in one vectorised pass.
_SCALAR_STARTS = 48

Runs = list[tuple[int, int]]  # inclusive (first, last) boundaries, sorted, disjoint, not adjacent


class _Sweep:
    """Exact feasibility of a bottleneck ``T`` for fixed units, devices and order."""

    def __init__(
        self,
        unit_works: Sequence[float],
        unit_bytes: Sequence[int],
        throughputs: Sequence[float],
        capacities: Sequence[int],
        min_units: int,
    ):
        if min_units < 1:
            raise ValueError(f"min_units_per_shard must be >= 1, got {min_units}")
        works = np.asarray(unit_works, dtype=np.float64)
        if len(unit_bytes) != len(works) or len(capacities) != len(throughputs):
            raise ValueError("one byte count per unit and one capacity per device are needed")
        if len(works) and not (np.all(np.isfinite(works)) and works.min() >= 0):
            raise ValueError("unit works must be finite and >= 0")
        self.n = len(works)
        self.min_units = min_units
        self.max_work = float(works.max()) if len(works) else 0.0
        self.prefix = prefix_sums(works)
        ceiling = _BYTES_CEILING // max(1, self.n)
        sizes = _int64_or_list(unit_bytes)
        if isinstance(sizes, np.ndarray):
            saturated = np.minimum(sizes, ceiling)
        else:  # a count beyond int64: saturate one by one
            saturated = np.asarray([min(int(b), ceiling) for b in sizes], dtype=np.int64)
        self.byte_prefix = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(saturated, out=self.byte_prefix[1:])
        self.throughputs = [float(t) for t in throughputs]
        if not all(0.0 < t < float("inf") for t in self.throughputs):
            raise ValueError("device throughputs must be finite and > 0")
        # Units sum to at most the ceiling and a capacity stays below it, so B[s] + cap fits int64.
        self.capacities = [min(int(c), _BYTES_CEILING - 1) for c in capacities]
        self._index: np.ndarray | None = None
        self._byte_ends: dict[int, np.ndarray] = {}

    def optimum(self, strictly_below: float | None = None) -> ContiguousCut | None:
        """The least bottleneck's cut; with ``strictly_below``, only a cut whose bottleneck is smaller
        than that (``None`` when there is none), so a known cut bounds the search."""
        if self.n == 0:
            return ContiguousCut((), 0.0, ())
        if self.min_units > self.n or not self.feasible(float("inf")):
            return None
        hi = self._shards(float("inf"))[1]  # any feasible cut bounds the optimum from above
        if strictly_below is not None and hi >= strictly_below:
            if strictly_below <= 0.0:
                return None
            hi = _from_bits(_bits(strictly_below) - 1)  # the double just below
            if not self.feasible(hi):
                return None
        if hi == 0.0 or self.feasible(0.0):
            return self.cut(0.0)
        total = float(self.prefix[-1])
        lower = max(total / sum(self.throughputs), self.max_work / max(self.throughputs)) / 4
        lo_bits = _bits(lower) if 0.0 < lower < hi and not self.feasible(lower) else 0
        hi_bits = _bits(hi)
        # Invariant: the bit pattern lo_bits is infeasible, hi_bits feasible. Adjacent patterns
        # leave no double in between, so hi is then the least feasible bottleneck.
        while hi_bits - lo_bits > 1:
            mid = (lo_bits + hi_bits) // 2
            if self.feasible(_from_bits(mid)):
                hi_bits = mid
            else:
                lo_bits = mid
        return self.cut(_from_bits(hi_bits))

    def feasible(self, bottleneck: float) -> bool:
        history = self._reach_runs(bottleneck)
        if history is None:
            return self._reach(bottleneck, None)
        return history[-1][-1][1] == self.n

    def cut(self, bottleneck: float) -> ContiguousCut:
        """The cut found at a feasible ``bottleneck``; its own bottleneck is at most that."""
        shards, worst = self._shards(bottleneck)
        return ContiguousCut(shards, worst, tuple(range(self.n)))

    def _shards(self, bottleneck: float) -> tuple[tuple[Shard, ...], float]:
        history = self._reach_runs(bottleneck)
        shards = self._cut_dense(bottleneck) if history is None else self._cut_from_runs(bottleneck, history)
        worst = max((self.prefix[s.stop] - self.prefix[s.start]) / self.throughputs[s.device] for s in shards)
        return tuple(shards), float(worst)

    # ----------------------------------------------------------------- the probe on runs

    def _end(self, device: int, start: int, bottleneck: float) -> int:
        """The last boundary ``e`` whose run from ``start`` fits ``device`` at ``bottleneck``, exactly.

        Two binary searches on the prefix sums: bytes (integers, exact), then work, with the same
        comparison ``(P[e] - P[s]) / t <= T`` the bottleneck is reported in. It holds at ``e = s``
        and, works being non-negative, fails from some ``e`` on, so bisection finds the last ``e``.
        """
        capacity = self.capacities[device]
        if capacity < 0:  # not even the part held whole fits: this device takes nothing
            return start
        b = self.byte_prefix  # bisect reads the arrays in place: a few dozen reads per probe
        last = bisect.bisect_right(b, b[start] + capacity, start) - 1
        p, t = self.prefix, self.throughputs[device]
        base = p[start]
        if (p[last] - base) / t <= bottleneck:
            return last
        good, bad = start, last
        while bad - good > 1:
            mid = (good + bad) // 2
            if (p[mid] - base) / t <= bottleneck:
                good = mid
            else:
                bad = mid
        return good

    def _reach_runs(self, bottleneck: float) -> list[Runs] | None:
        """The reachable boundaries after each device, as runs; ``None`` when they fragment too much.

        Device ``d`` reaches ``e`` from a reachable ``s <= e - m`` when ``e <= end_d(s)``; the latest
        such ``s`` is the one to test, as ``end_d`` never decreases. For a run ``[a, b]`` of reachable
        starts, every ``e <= b`` is reachable already, ``e >= b + m`` is reachable iff
        ``e <= end_d(b)``, and ``b < e < b + m`` needs the start ``e - m`` itself: so only the starts
        ``s`` in ``[max(a, b - m + 1), b]`` matter, each adding ``[s + m, end_d(s)]`` when its first
        ``m`` units fit. Consecutive fitting starts give touching ranges, so a stretch of fitting
        starts ``s1..s2`` adds ``[s1 + m, end_d(s2)]``. With ``m = 1`` that is one start per run and
        one run in all: a probe costs O(devices · log units).
        """
        n, m = self.n, self.min_units
        runs: Runs = [(0, 0)]
        history: list[Runs] = [runs]
        for d in range(len(self.throughputs)):
            added: Runs = []
            for a, b in runs:
                first = max(a, b - m + 1)
                for s1, s2 in self._fitting_starts(d, first, b, bottleneck):
                    end = self._end(d, s2, bottleneck)
                    added.append((s1 + m, end))
            if added:
                runs = _merge(runs, added)
                if len(runs) > _MAX_RUNS:
                    return None
            history.append(runs)
            if runs[-1][1] == n:
                break
        return history

    def _fitting_starts(self, device: int, first: int, last: int, bottleneck: float) -> list[tuple[int, int]]:
        """Stretches ``(s1, s2)`` of starts in ``first..last`` whose first ``m`` units fit ``device``."""
        m, capacity, t = self.min_units, self.capacities[device], self.throughputs[device]
        last = min(last, self.n - m)
        if capacity < 0 or last < first:
            return []
        if last - first < _SCALAR_STARTS:
            p, b = self.prefix, self.byte_prefix
            out: list[tuple[int, int]] = []
            for s in range(first, last + 1):
                if b[s + m] - b[s] <= capacity and (p[s + m] - p[s]) / t <= bottleneck:
                    if out and out[-1][1] == s - 1:
                        out[-1] = (out[-1][0], s)
                    else:
                        out.append((s, s))
            return out
        starts = slice(first, last + 1)
        stops = slice(first + m, last + m + 1)
        fits = (self.byte_prefix[stops] - self.byte_prefix[starts] <= capacity) & (
            (self.prefix[stops] - self.prefix[starts]) / t <= bottleneck
        )
        edges = np.flatnonzero(np.diff(np.concatenate(([False], fits, [False])).astype(np.int8)))
        return [(first + int(s), first + int(e) - 1) for s, e in zip(edges[::2], edges[1::2], strict=True)]

    def _cut_from_runs(self, bottleneck: float, history: list[Runs]) -> list[Shard]:
        """Walk back from ``n``: a boundary new at device ``d`` came from the latest reachable
        ``s <= e - m`` before it, which ``d``'s run from ``s`` reaches (see :meth:`_reach_runs`)."""
        shards: list[Shard] = []
        stop = self.n
        for d in range(len(history) - 2, -1, -1):
            before = history[d]
            if _latest_at_most(before, stop) == stop:
                continue  # device d is empty
            start = _latest_at_most(before, stop - self.min_units)
            if start is None or self._end(d, start, bottleneck) < stop:
                raise AssertionError(f"boundary {stop} is not reachable from the runs before device {d}")
            shards.append(Shard(d, start, stop))
            stop = start
        if stop != 0:
            raise AssertionError(f"bottleneck {bottleneck!r} was found feasible before and is not now")
        shards.reverse()
        return shards

    # ----------------------------------------------------------------- the dense sweep (fallback)

    def _cut_dense(self, bottleneck: float) -> list[Shard]:
        predecessors: list[np.ndarray] = []
        if not self._reach(bottleneck, predecessors):
            raise AssertionError(f"bottleneck {bottleneck!r} was found feasible before and is not now")
        shards: list[Shard] = []
        stop = self.n
        for d in range(len(predecessors) - 1, -1, -1):
            start = int(predecessors[d][stop])
            if start != stop:
                shards.append(Shard(d, start, stop))
                stop = start
        shards.reverse()
        return shards

    @property
    def index(self) -> np.ndarray:
        if self._index is None:
            self._index = np.arange(self.n + 1)
        return self._index

    def _reach(self, bottleneck: float, predecessors: list[np.ndarray] | None) -> bool:
        """Sweep devices in rank order keeping which unit boundaries the devices so far can reach.

        Boundary ``e`` becomes reachable with device ``d`` when some reachable ``s <= e - m`` has
        ``d``'s longest fitting run from ``s`` ending at or after ``e``. That longest end never
        decreases as ``s`` grows (a sub-run of a fitting run fits), so the latest reachable
        ``s <= e - m`` is the one to test.
        """
        n, m, index = self.n, self.min_units, self.index
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        ends: dict[tuple[float, int], np.ndarray] = {}
        for throughput, capacity in zip(self.throughputs, self.capacities, strict=True):
            key = (throughput, capacity)
            if key not in ends:
                ends[key] = np.minimum(self._byte_end(capacity), self._work_end(bottleneck, throughput))
            end = ends[key]
            latest = np.maximum.accumulate(np.where(reach, index, -1))
            start = np.full(n + 1, -1)
            start[m:] = latest[: n + 1 - m]
            reached = start >= 0
            reached[reached] = end[start[reached]] >= index[reached]
            if predecessors is not None:
                predecessors.append(np.where(reach, index, np.where(reached, start, -1)))
            reach |= reached
            if reach[n]:
                return True
        return False

    def _byte_end(self, capacity: int) -> np.ndarray:
        """For every start ``s``, the last boundary ``e`` with the run's bytes within ``capacity``."""
        if capacity not in self._byte_ends:
            if capacity < 0:  # not even the part held whole fits: this device takes nothing
                self._byte_ends[capacity] = self.index.copy()
            else:
                bp = self.byte_prefix
                self._byte_ends[capacity] = np.searchsorted(bp, bp + capacity, side="right") - 1
        return self._byte_ends[capacity]

    def _work_end(self, bottleneck: float, throughput: float) -> np.ndarray:
        """For every start ``s``, the last boundary ``e`` with ``(P[e] - P[s]) / t <= T``, exactly."""
        p, n, index = self.prefix, self.n, self.index
        with np.errstate(over="ignore"):
            end = np.searchsorted(p, p + bottleneck * throughput, side="right") - 1
        end = np.clip(end, index, n)
        # searchsorted compared P[e] <= P[s] + T*t; settle the rounding against the exact test.
        while True:
            over = (end > index) & ((p[end] - p) / throughput > bottleneck)
            if not over.any():
                break
            end[over] -= 1
        while True:
            step = np.minimum(end + 1, n)
            under = (end < n) & ((p[step] - p) / throughput <= bottleneck)
            if not under.any():
                break
            end[under] += 1
        return end


def _merge(runs: Runs, added: Runs) -> Runs:
    """The union of two sets of runs, as sorted disjoint runs with touching ones joined."""
    out: Runs = []
    for a, b in sorted(runs + added):
        if out and a <= out[-1][1] + 1:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _latest_at_most(runs: Runs, x: int) -> int | None:
    """The largest boundary in ``runs`` that is at most ``x``, or ``None``."""
    i = bisect.bisect_right(runs, (x, float("inf"))) - 1
    return None if i < 0 else min(runs[i][1], x)


# Local search is quadratic in the units; beyond this many the longest-first assignment is
# already close to the lower bound (many small units balance well) and is used as it is.
_LOCAL_SEARCH_MAX_UNITS = 128
_RELATIVE_EPS = 1e-12


def _longest_first_order(
    unit_works: np.ndarray,
    unit_bytes: Sequence[int],
    throughputs: Sequence[float],
    capacities: Sequence[int],
) -> np.ndarray | None:
    """Units grouped by the device a longest-first assignment (then local search) gives them, in rank order."""
    num_devices, n = len(throughputs), len(unit_works)
    load = [0.0] * num_devices
    room = [int(c) for c in capacities]
    device_of = np.full(n, -1, dtype=np.int64)
    longest_first = np.argsort(-unit_works, kind="stable")
    head = longest_first[:_ONE_BY_ONE_UNITS].tolist()
    if not _assign_one_by_one(head, device_of, load, room, unit_works, unit_bytes, throughputs):
        return None
    rest = longest_first[len(head) :]
    if len(rest) and not _fill_to_common_finish(rest, device_of, load, room, unit_works, unit_bytes, throughputs):
        if not _assign_one_by_one(rest.tolist(), device_of, load, room, unit_works, unit_bytes, throughputs):
            return None
    if n <= _LOCAL_SEARCH_MAX_UNITS:
        assigned: list[list[int]] = [[] for _ in range(num_devices)]
        for i, d in enumerate(device_of.tolist()):
            assigned[d].append(i)
        _improve_assignment(assigned, load, room, unit_works, unit_bytes, throughputs)
        return np.asarray([i for units in assigned for i in sorted(units)], dtype=np.int64)
    return np.argsort(device_of, kind="stable")


# The heaviest units are placed one at a time; the many light ones after them, all at once.
_ONE_BY_ONE_UNITS = 4096


def _assign_one_by_one(
    units: list[int],
    device_of: np.ndarray,
    load: list[float],
    room: list[int],
    unit_works: Sequence[float],
    unit_bytes: Sequence[int],
    throughputs: Sequence[float],
) -> bool:
    """Each unit, in the given order, to the device with room where it finishes earliest (lowest rank on ties)."""
    num_devices = len(throughputs)
    for i in units:
        w, b = unit_works[i], int(unit_bytes[i])
        best, best_finish = -1, 0.0
        for d in range(num_devices):
            if b <= room[d]:
                finish = (load[d] + w) / throughputs[d]
                if best < 0 or finish < best_finish:
                    best, best_finish = d, finish
        if best < 0:
            return False
        load[best] += w
        room[best] -= b
        device_of[i] = best
    return True


def _fill_to_common_finish(
    units: np.ndarray,
    device_of: np.ndarray,
    load: list[float],
    room: list[int],
    unit_works: Sequence[float],
    unit_bytes: Sequence[int],
    throughputs: Sequence[float],
) -> bool:
    """Light units (longest first) dealt out in runs so every device ends near one finish time ``F``.

    ``F`` solves ``sum_d max(0, F * t_d - load_d) = remaining work`` (water filling); device ``d``
    takes the units whose cumulative work falls in its share. Nothing is placed, and ``False``
    returned, when a device's share would not fit its room (the caller then goes one by one).
    """
    t = np.asarray(throughputs, dtype=np.float64)
    loads = np.asarray(load, dtype=np.float64)
    idx = units
    works = np.asarray(unit_works, dtype=np.float64)[idx]
    remaining = float(works.sum())
    level = loads / t  # finish time of each device now
    by_level = np.argsort(level, kind="stable")
    finish = float(level.max())
    t_sum = load_sum = 0.0
    for k, d in enumerate(by_level.tolist()):  # the finish time with the k+1 least loaded devices filling
        t_sum += t[d]
        load_sum += loads[d]
        candidate = (remaining + load_sum) / t_sum
        if k + 1 == len(by_level) or candidate <= level[by_level[k + 1]]:
            finish = candidate
            break
    shares = np.maximum(0.0, finish * t - loads)
    bounds = np.cumsum(shares)
    before = np.cumsum(works) - works / 2  # a unit goes where the middle of its work falls
    device = np.minimum(np.searchsorted(bounds, before, side="right"), len(t) - 1)
    if not isinstance(unit_bytes, np.ndarray):
        return False  # a byte count beyond int64
    unit_b = unit_bytes[idx]
    placed_bytes = np.zeros(len(t), dtype=np.int64)
    np.add.at(placed_bytes, device, unit_b)  # exact: bytes are integers
    if any(int(placed_bytes[d]) > room[d] for d in range(len(t))):
        return False
    device_of[idx] = device
    placed_work = np.bincount(device, weights=works, minlength=len(t))
    for d in range(len(t)):
        load[d] += float(placed_work[d])
        room[d] -= int(placed_bytes[d])
    return True


def _improve_assignment(
    assigned: list[list[int]],
    load: list[float],
    room: list[int],
    unit_works: Sequence[float],
    unit_bytes: Sequence[int],
    throughputs: Sequence[float],
) -> None:
    """Move or swap units off the busiest devices while that lowers (bottleneck, sum of squared finish times).

    The squared sum breaks ties between devices sharing the bottleneck, so relieving one of them
    counts as progress; the pair strictly decreases, so the search ends.
    """
    num_devices = len(throughputs)
    w, b, t = unit_works, unit_bytes, throughputs
    for _ in range(4 * len(w) + 4):
        finish = [load[d] / t[d] for d in range(num_devices)]
        top = sorted(range(num_devices), key=lambda d: -finish[d])[:3]
        worst = finish[top[0]]
        squares = sum(f * f for f in finish)
        best: tuple[float, float, int, int, int, int] | None = None  # (max, squares, a, i, c, j or -1)

        def consider(
            a: int,
            i: int,
            c: int,
            j: int,
            fa: float,
            fc: float,
            finish: list[float] = finish,
            top: list[int] = top,
            worst: float = worst,
            squares: float = squares,
        ) -> None:
            nonlocal best
            others = next((finish[d] for d in top if d != a and d != c), 0.0)
            new_max = max(others, fa, fc)
            new_squares = squares - finish[a] ** 2 - finish[c] ** 2 + fa * fa + fc * fc
            better_max = new_max < worst * (1 - _RELATIVE_EPS)
            better_spread = new_max <= worst and new_squares < squares * (1 - _RELATIVE_EPS)
            if (better_max or better_spread) and (best is None or (new_max, new_squares) < best[:2]):
                best = (new_max, new_squares, a, i, c, j)

        for a in (d for d in range(num_devices) if finish[d] >= worst * (1 - _RELATIVE_EPS)):
            for i in assigned[a]:
                for c in range(num_devices):
                    if c == a:
                        continue
                    if b[i] <= room[c]:
                        consider(a, i, c, -1, (load[a] - w[i]) / t[a], (load[c] + w[i]) / t[c])
                    for j in assigned[c]:
                        if w[j] < w[i] and b[i] - b[j] <= room[c] and b[j] - b[i] <= room[a]:
                            delta = w[i] - w[j]
                            consider(a, i, c, j, (load[a] - delta) / t[a], (load[c] + delta) / t[c])
        if best is None:
            return
        _, _, a, i, c, j = best
        assigned[a].remove(i)
        assigned[c].append(i)
        load[a] -= w[i]
        load[c] += w[i]
        room[a] += int(b[i])
        room[c] -= int(b[i])
        if j >= 0:
            assigned[c].remove(j)
            assigned[a].append(j)
            load[c] -= w[j]
            load[a] += w[j]
            room[c] += int(b[j])
            room[a] -= int(b[j])
