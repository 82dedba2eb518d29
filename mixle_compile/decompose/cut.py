"""The optimal contiguous cut of a row of units across devices in rank order.

Problem. Units ``0..n-1`` have work ``w`` and bytes ``b``; devices ``0..D-1`` have throughput
``t`` and room ``cap`` (memory left after what every shard holds whole). Give each device, in
rank order, one contiguous (possibly empty) run of units so that every unit is placed, a
non-empty run has at least ``m`` units and fits its device's room, and the bottleneck
``max_d work(run_d) / t_d`` is as small as possible.

Algorithm (see ``docs/decomposition.md`` for the argument). For a fixed bottleneck ``T``,
feasibility is decided exactly by sweeping the devices in order and keeping the set of unit
boundaries reachable so far; feasibility is monotone in ``T``, so bisection finds the least
feasible ``T``. The bisection runs over the bit patterns of IEEE doubles, which are ordered like
the values they encode, and the comparisons are made on the same doubles the bottleneck is
reported in, so it ends exactly on the optimum (one of the values ``(P[e] - P[s]) / t_d``).

Shard work is always ``P[stop] - P[start]`` on the prefix sums ``P`` of the works in placement
order, so the reported bottleneck, the oracle's and a recomputation agree bit for bit.
"""

from __future__ import annotations

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
    finish earliest among those with room; grouping them by device gives an order, and the exact
    contiguous cut of that order can only improve on the assignment. The result is never worse
    than :func:`optimal_contiguous_cut` of the given order, which is kept on ties.
    """
    n = len(unit_works)
    best = optimal_contiguous_cut(unit_works, unit_bytes, throughputs, capacities, min_units_per_shard)
    order = _longest_first_order(unit_works, unit_bytes, throughputs, capacities)
    if order is None or order == tuple(range(n)):
        return best
    reordered = optimal_contiguous_cut(
        [unit_works[i] for i in order], [unit_bytes[i] for i in order], throughputs, capacities, min_units_per_shard
    )
    if reordered is not None and (best is None or reordered.bottleneck < best.bottleneck):
        return ContiguousCut(reordered.shards, reordered.bottleneck, order)
    return best


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


# --------------------------------------------------------------------------- the sweep


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


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
        self.prefix = prefix_sums(works)
        saturated = [min(int(b), _BYTES_CEILING // max(1, self.n)) for b in unit_bytes]
        self.byte_prefix = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(np.asarray(saturated, dtype=np.int64), out=self.byte_prefix[1:])
        self.throughputs = [float(t) for t in throughputs]
        if not all(0.0 < t < float("inf") for t in self.throughputs):
            raise ValueError("device throughputs must be finite and > 0")
        # Units sum to at most the ceiling and a capacity stays below it, so B[s] + cap fits int64.
        self.capacities = [min(int(c), _BYTES_CEILING - 1) for c in capacities]
        self.index = np.arange(self.n + 1)
        self._byte_ends: dict[int, np.ndarray] = {}

    def optimum(self) -> ContiguousCut | None:
        if self.n == 0:
            return ContiguousCut((), 0.0, ())
        if self.min_units > self.n or not self.feasible(float("inf")):
            return None
        hi = self.cut(float("inf")).bottleneck  # any feasible cut bounds the optimum from above
        if hi == 0.0 or self.feasible(0.0):
            return self.cut(0.0)
        lower = bottleneck_lower_bound(np.diff(self.prefix), self.throughputs) / 4
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
        return self._reach(bottleneck, None)

    def cut(self, bottleneck: float) -> ContiguousCut:
        """The cut found at a feasible ``bottleneck``; its own bottleneck is at most that."""
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
        worst = max((self.prefix[s.stop] - self.prefix[s.start]) / self.throughputs[s.device] for s in shards)
        return ContiguousCut(tuple(shards), float(worst), tuple(range(self.n)))

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
        for d, (throughput, capacity) in enumerate(zip(self.throughputs, self.capacities)):
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


# Local search is quadratic in the units; beyond this many the longest-first assignment is
# already close to the lower bound (many small units balance well) and is used as it is.
_LOCAL_SEARCH_MAX_UNITS = 128
_RELATIVE_EPS = 1e-12


def _longest_first_order(
    unit_works: Sequence[float],
    unit_bytes: Sequence[int],
    throughputs: Sequence[float],
    capacities: Sequence[int],
) -> tuple[int, ...] | None:
    """Units grouped by the device a longest-first assignment (then local search) gives them, in rank order."""
    num_devices = len(throughputs)
    load = [0.0] * num_devices
    room = [int(c) for c in capacities]
    assigned: list[list[int]] = [[] for _ in range(num_devices)]
    for i in sorted(range(len(unit_works)), key=lambda i: (-unit_works[i], i)):
        w, b = unit_works[i], int(unit_bytes[i])
        best, best_finish = -1, 0.0
        for d in range(num_devices):
            if b <= room[d]:
                finish = (load[d] + w) / throughputs[d]
                if best < 0 or finish < best_finish:
                    best, best_finish = d, finish
        if best < 0:
            return None
        load[best] += w
        room[best] -= b
        assigned[best].append(i)
    if len(unit_works) <= _LOCAL_SEARCH_MAX_UNITS:
        _improve_assignment(assigned, load, room, unit_works, unit_bytes, throughputs)
    return tuple(i for units in assigned for i in sorted(units))


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

        def consider(a: int, i: int, c: int, j: int, fa: float, fc: float) -> None:
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
