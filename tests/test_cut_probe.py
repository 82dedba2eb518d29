"""The cut's feasibility probe on runs of reachable boundaries, checked against brute force and the dense sweep."""

from __future__ import annotations

import contextlib
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mixle_compile.decompose import (
    ContiguousCut,
    brute_force_contiguous_cut,
    cut_bottleneck,
    exchangeable_cut,
    optimal_contiguous_cut,
)
from mixle_compile.decompose import cut as cut_module
from tests.test_decompose import assert_valid, cut_cases


@contextlib.contextmanager
def probe(mode: str):
    """``runs``: as shipped; ``vector``: every run's starts checked in one vectorised pass;
    ``dense``: every probe falls back to the sweep over all boundaries."""
    saved = cut_module._MAX_RUNS, cut_module._SCALAR_STARTS
    if mode == "vector":
        cut_module._SCALAR_STARTS = 0
    elif mode == "dense":
        cut_module._MAX_RUNS = 0
    try:
        yield
    finally:
        cut_module._MAX_RUNS, cut_module._SCALAR_STARTS = saved


def solve(mode: str, *case) -> ContiguousCut | None:
    with probe(mode):
        return optimal_contiguous_cut(*case)


@settings(max_examples=300, deadline=None)
@given(cut_cases(), st.sampled_from(["vector", "dense"]))
def test_each_probe_matches_brute_force(case, mode):
    fast = solve(mode, *case)
    oracle = brute_force_contiguous_cut(*case)
    assert (fast is None) == (oracle is None)
    if fast is not None:
        assert fast.bottleneck == oracle.bottleneck
        assert_valid(fast, *case)


# Hand-made edge cases: (works, bytes, throughputs, capacities, min units per shard).
EDGE_CASES = {
    # the fast first device has no room at all: its shard is empty and the others take everything
    "empty-shard-first": ([3, 1, 4, 1, 5], [1] * 5, [9.0, 1.0, 1.0], [-1, 10, 10], 1),
    "empty-shard-middle": ([3, 1, 4, 1, 5], [1] * 5, [1.0, 9.0, 1.0], [10, 0, 10], 1),
    # one unit heavier than every device: no cut
    "unit-heavier-than-all": ([1, 1, 1], [1, 9, 1], [1.0, 1.0], [5, 5], 1),
    # a unit only the second device holds: the first must stop before it
    "unit-heavier-than-one": ([1, 1, 1, 1], [1, 1, 6, 1], [5.0, 1.0], [9, 7], 1),
    # memory, not work, decides: the fast device can hold only two units
    "memory-bound": ([5, 5, 5, 5, 5, 5], [3] * 6, [10.0, 1.0], [6, 100], 1),
    # a minimum of two per shard splits the reachable boundaries into several runs
    "min-units-fragments": ([1, 9, 1, 9, 1, 9, 1], [0, 5, 0, 5, 0, 5, 0], [1.0, 1.0, 1.0, 1.0], [5, 5, 5, 5], 2),
    "min-units-exact-fit": ([2, 2, 2, 2, 2, 2], [1] * 6, [1.0, 1.0, 1.0], [2, 2, 2], 2),
    "min-units-too-many": ([1, 1, 1], [0] * 3, [1.0, 1.0], [9, 9], 4),
    "zero-work": ([0, 0, 0, 0], [1] * 4, [1.0, 2.0], [2, 2], 1),
    "one-device": ([4, 2, 7], [1, 1, 1], [3.0], [3], 3),
}


def test_edge_cases_match_brute_force_in_every_probe():
    for name, case in EDGE_CASES.items():
        oracle = brute_force_contiguous_cut(*case)
        for mode in ("runs", "vector", "dense"):
            fast = solve(mode, *case)
            assert (fast is None) == (oracle is None), (name, mode)
            if fast is not None:
                assert fast.bottleneck == oracle.bottleneck, (name, mode)
                assert_valid(fast, *case)
    assert brute_force_contiguous_cut(*EDGE_CASES["unit-heavier-than-all"]) is None
    assert solve("runs", *EDGE_CASES["empty-shard-first"]).shards[0].device == 1


def test_a_minimum_above_one_makes_several_runs_and_one_unit_minimum_one_run():
    works, unit_bytes, speeds, rooms, m = EDGE_CASES["min-units-fragments"]
    search = cut_module._Sweep(works, unit_bytes, speeds, rooms, m)
    assert max(len(runs) for runs in search._reach_runs(float("inf"))) > 1
    search = cut_module._Sweep(works, unit_bytes, speeds, rooms, 1)
    assert all(len(runs) == 1 for runs in search._reach_runs(10.0))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_large_cases_agree_with_the_dense_sweep(seed):
    # too large for brute force: the dense sweep (itself checked against brute force above) is the oracle
    rng = random.Random(seed)
    n = rng.randint(200, 3000)
    works = [round(rng.lognormvariate(0, 1), 3) * rng.choice([0, 1, 1, 1]) for _ in range(n)]
    unit_bytes = [rng.randint(0, 50) for _ in range(n)]
    num_devices = rng.randint(1, 9)
    speeds = [rng.choice([0.5, 1.0, 2.0, 8.0]) for _ in range(num_devices)]
    total = sum(unit_bytes)
    rooms = [rng.randint(-1, 2 * total // num_devices + 60) for _ in range(num_devices)]
    case = (works, unit_bytes, speeds, rooms, rng.choice([1, 1, 2, 3, 7, 40]))
    runs, dense = solve("runs", *case), solve("dense", *case)
    assert (runs is None) == (dense is None)
    if runs is not None:
        assert runs.bottleneck == dense.bottleneck
        assert_valid(runs, *case)


@settings(max_examples=150, deadline=None)
@given(cut_cases())
def test_the_exchangeable_cut_is_the_better_of_the_two_orders_exactly(case):
    works, unit_bytes, speeds, rooms, m = case
    fixed = brute_force_contiguous_cut(*case)
    index = cut_module._longest_first_order(np.asarray(works, dtype=float), np.asarray(unit_bytes), speeds, rooms)
    reordered = None
    if index is not None:
        order = index.tolist()
        reordered = brute_force_contiguous_cut(
            [works[i] for i in order], [unit_bytes[i] for i in order], speeds, rooms, m
        )
    free = exchangeable_cut(*case)
    candidates = [c.bottleneck for c in (fixed, reordered) if c is not None]
    assert (free is None) == (not candidates)
    if free is not None:
        assert free.bottleneck == min(candidates)
        if fixed is not None and free.bottleneck == fixed.bottleneck:
            assert free.order == tuple(range(len(works)))  # ties keep the given order
        assert_valid(free, *case)


def test_many_light_units_fill_the_devices_to_one_finish_time():
    rng = random.Random(7)
    n = 20_000  # past the units placed one by one
    works = [rng.lognormvariate(0, 1) for _ in range(n)]
    speeds = [4.0, 4.0, 1.0, 1.0, 1.0]
    fixed = optimal_contiguous_cut(works, [1] * n, speeds, [n] * 5)
    free = exchangeable_cut(works, [1] * n, speeds, [n] * 5)
    assert free.bottleneck <= fixed.bottleneck
    assert free.bottleneck <= sum(works) / sum(speeds) * (1 + 1e-3)
    assert cut_bottleneck(free, works, speeds) == free.bottleneck
    assert sorted(free.order) == list(range(n))
    # rooms too tight for the shares of the fill: units go one by one and still all fit
    rooms = [n // 5 + 1] * 5
    tight = exchangeable_cut(works, [1] * n, speeds, rooms)
    assert tight is not None
    assert_valid(tight, works, [1] * n, speeds, rooms, 1)


def test_the_fill_ends_every_device_within_one_unit_of_a_common_finish():
    rng = np.random.default_rng(3)
    works = rng.uniform(0.0, 1.0, 5000)
    speeds = [4.0, 1.0, 2.0]
    load, room = [100.0, 0.0, 30.0], [10**9] * 3  # unequal starting loads
    device_of = np.full(5000, -1)
    units = np.argsort(-works, kind="stable")
    assert cut_module._fill_to_common_finish(units, device_of, load, room, works, np.ones(5000, dtype=np.int64), speeds)
    finish = [load[d] / speeds[d] for d in range(3)]
    assert max(finish) - min(finish) <= 2 * works.max() / min(speeds)
    assert abs(sum(load) - 130.0 - works.sum()) < 1e-6
    assert (device_of >= 0).all() and room == [10**9 - int((device_of == d).sum()) for d in range(3)]
    # a share that does not fit its room: nothing is placed
    tight = [10**9, 10, 10**9]
    before = device_of.copy()
    assert not cut_module._fill_to_common_finish(
        units, device_of, list(load), tight, works, np.ones(5000, dtype=np.int64), speeds
    )
    assert (device_of == before).all()
