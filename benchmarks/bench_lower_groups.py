"""Rank groups at 64 and at 131,072 ranks, side by side.

Times, for each plan: building the grid with every group rule and its
symbolic description, then 1,000 ``group_of`` queries (random ranks, rules in
turn), then the same queries answered as group indices only.  Prints best-of
repeats and the ratio large/small; the groups stay symbolic, so the ratio
should be about 1 (``group_of`` also returns the ranks, so it grows with the
size of the groups asked for, not with the world; the last line shows how
many ranks those answers hold).

Run: ``python benchmarks/bench_lower_groups.py``
"""

from __future__ import annotations

import json
import random
import time

from mixle_compile.contracts import ParallelPlan
from mixle_compile.lower.groups import RankGrid

SMALL = ParallelPlan(tp=2, cp=2, pp=2, dp_shard=4, dp_replicate=2, ep=2)
LARGE = ParallelPlan(tp=8, cp=2, pp=16, dp_shard=64, dp_replicate=8, ep=8)
QUERIES = 1_000
REPEATS = 7


def build(plan: ParallelPlan) -> RankGrid:
    grid = RankGrid.from_plan(plan)
    json.dumps(grid.as_dict())  # every rule's size, count and generators
    return grid


def queries(plan: ParallelPlan) -> list[tuple[int, int]]:
    draw = random.Random(7)
    rules = len(RankGrid.from_plan(plan).rules)
    return [(i % rules, draw.randrange(plan.world_size)) for i in range(QUERIES)]


def best(action) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(plan: ParallelPlan) -> dict[str, float]:
    asked = queries(plan)

    def group_of() -> None:
        grid = build(plan)
        for rule, rank in asked:
            grid.rules[rule].group_of(rank)

    def group_index_of() -> None:
        grid = build(plan)
        for rule, rank in asked:
            grid.rules[rule].group_index_of(rank)

    return {
        "build grid + all rules": best(lambda: build(plan)),
        f"build + {QUERIES:,} group_of": best(group_of),
        f"build + {QUERIES:,} group_index_of": best(group_index_of),
    }


def main() -> None:
    small, large = measure(SMALL), measure(LARGE)
    width = max(len(name) for name in small)
    print(f"{'':{width}}  {SMALL.world_size:>10,} ranks  {LARGE.world_size:>10,} ranks  ratio")
    for name in small:
        ratio = large[name] / small[name]
        print(f"{name:{width}}  {small[name] * 1e3:>13.3f} ms  {large[name] * 1e3:>13.3f} ms  {ratio:5.2f}")
    returned = []
    for plan in (SMALL, LARGE):
        grid = RankGrid.from_plan(plan)
        returned.append(sum(len(grid.rules[rule].group_of(rank)) for rule, rank in queries(plan)))
    print(
        f"{'ranks returned by the group_of queries':{width}}  {returned[0]:>16,}  {returned[1]:>16,}  "
        f"{returned[1] / returned[0]:5.2f}"
    )
    grid = RankGrid.from_plan(LARGE)
    biggest = max(grid.rules, key=lambda r: r.size)
    print(
        f"(largest group at {LARGE.world_size:,} ranks: {biggest.name}, {biggest.size:,} ranks; "
        f"{sum(r.num_groups for r in grid.rules):,} groups in all, none listed)"
    )


if __name__ == "__main__":
    main()
