"""Decomposition benchmark: cut quality against the optimum and the lower bound, and scaling.

Run: ``python benchmarks/bench_decompose.py [--cases 200] [--seed 0] [--units 1000,10000,100000,1000000]``

Prints, side by side from one run:

* over seeded random heterogeneous cases, bottleneck / brute-force optimum and bottleneck /
  lower bound (median and max) for the exact contiguous cut, the exchangeable (reordering) cut,
  and the greedy split at cumulative-throughput quantiles that the previous planner used;
* graph build + decomposition time for trees of 10^3, 10^4 and 10^5 nodes and the growth ratio
  per tenfold (about 10 means linear);
* the cut alone (exact, and exchangeable) against the greedy split for 10^3 to 10^6 units: time,
  ratio to the greedy, ratio to the smallest case, and the growth exponent between sizes (1.0 is
  linear).

Ratios are what to read; absolute times depend on the machine and gate nothing.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mixle_compile.decompose import (  # noqa: E402
    bottleneck_lower_bound,
    brute_force_contiguous_cut,
    decompose_model,
    exchangeable_cut,
    optimal_contiguous_cut,
)
from mixle_compile.graph import build_model_graph  # noqa: E402
from mixle_compile.spec.models import Spec  # noqa: E402

UNLIMITED = 1 << 60


def quantile_split_bottleneck(works: list[float], throughputs: list[float], min_per_shard: int = 1) -> float:
    """The previous planner: close a shard when cumulative work passes the device's throughput quantile.

    Empty shards are dropped and the remaining counts paired with the first devices in order, as
    it did; the bottleneck is measured with that pairing.
    """
    n = len(works)
    max_shards = max(1, min(len(throughputs), n // max(1, min_per_shard)))
    speeds = throughputs[:max_shards]
    capacity, acc = [], 0.0
    for t in speeds:
        acc += t / sum(speeds)
        capacity.append(acc)
    total = sum(works) or 1.0
    counts, shard, cum = [0] * max_shards, 0, 0.0
    for w in works:
        cum += w
        while shard < max_shards - 1 and cum / total > capacity[shard] + 1e-12:
            shard += 1
        counts[shard] += 1
    counts = [c for c in counts if c > 0]
    worst, start = 0.0, 0
    for t, c in zip(throughputs, counts, strict=False):
        worst = max(worst, sum(works[start : start + c]) / t)
        start += c
    return worst


def random_case(rng: random.Random) -> tuple[list[float], list[float]]:
    """Heterogeneous units (log-normal work) on heterogeneous devices (1x to 8x throughput)."""
    num_devices = rng.randint(2, 5)
    num_units = rng.randint(num_devices, 14)
    works = [round(rng.lognormvariate(0.0, 1.0), 6) for _ in range(num_units)]
    throughputs = [float(rng.choice([1, 2, 4, 8])) * rng.uniform(0.8, 1.2) for _ in range(num_devices)]
    return works, throughputs


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f}  max {max(values):.3f}"


def quality(cases: int, seed: int) -> None:
    rng = random.Random(seed)
    ratios: dict[str, list[float]] = {k: [] for k in ("exact/opt", "greedy/opt", "exact/lb", "reorder/lb", "greedy/lb")}
    equal = 0
    started = time.perf_counter()
    for _ in range(cases):
        works, speeds = random_case(rng)
        no_bytes, rooms = [0] * len(works), [UNLIMITED] * len(speeds)
        optimum = brute_force_contiguous_cut(works, no_bytes, speeds, rooms).bottleneck
        exact = optimal_contiguous_cut(works, no_bytes, speeds, rooms).bottleneck
        reordered = exchangeable_cut(works, no_bytes, speeds, rooms).bottleneck
        greedy = quantile_split_bottleneck(works, speeds)
        lower = bottleneck_lower_bound(works, speeds)
        ratios["exact/opt"].append(exact / optimum)
        equal += exact == optimum
        ratios["greedy/opt"].append(greedy / optimum)
        ratios["exact/lb"].append(exact / lower)
        ratios["reorder/lb"].append(reordered / lower)
        ratios["greedy/lb"].append(greedy / lower)
    elapsed = time.perf_counter() - started
    print(f"cut quality over {cases} seeded random heterogeneous cases (seed {seed}; 2-5 devices, 2-14 units)")
    print("  bottleneck / brute-force optimum (contiguous, rank order)")
    print(f"    exact cut                   {summary(ratios['exact/opt'])}  (bit-equal in {equal} of {cases})")
    print(f"    greedy quantile split       {summary(ratios['greedy/opt'])}")
    print("  bottleneck / lower bound max(total / sum t, largest unit / fastest device)")
    print(f"    exact cut                   {summary(ratios['exact/lb'])}")
    print(f"    exact cut, units reordered  {summary(ratios['reorder/lb'])}")
    print(f"    greedy quantile split       {summary(ratios['greedy/lb'])}")
    print(f"  ({elapsed:.1f} s including the brute force)")


def tree_spec(num_nodes: int, rng: random.Random) -> Spec:
    """A mixture of composites of leaves (heterogeneous sizes) with about ``num_nodes`` nodes."""
    factors = 9
    components = max(2, (num_nodes - 1) // (factors + 1))
    leaves = [
        lambda: {"type": "gaussian", "dim": rng.randint(2, 24), "covariance": rng.choice(["diag", "full"])},
        lambda: {"type": "categorical", "num_values": rng.randint(2, 500)},
        lambda: {"type": "poisson", "dim": rng.randint(1, 8)},
    ]
    root = {
        "type": "mixture",
        "components": [
            {"type": "composite", "factors": [rng.choice(leaves)() for _ in range(factors)]} for _ in range(components)
        ],
    }
    return Spec.model_validate(
        {
            "model": {"family": "distribution", "root": root},
            "mesh": {"dp_replicate": 1},
            "training": {"global_batch_size": 1024, "precision": "fp32"},
            "backend": "torch",
            "resources": {
                "devices": [
                    {"kind": "fast", "memory": "8GiB", "throughput": "400GFLOPS", "count": 2},
                    {"kind": "slow", "memory": "4GiB", "throughput": "100GFLOPS", "count": 6},
                ]
            },
        }
    )


def scaling(seed: int, repeats: int = 3) -> None:
    rng = random.Random(seed)
    print(f"graph build + decomposition time (mixture of composites, 8 heterogeneous devices; best of {repeats})")
    previous = None
    for num_nodes in (10**3, 10**4, 10**5):
        spec = tree_spec(num_nodes, rng)
        best_build = best_cut = float("inf")
        for _ in range(repeats):
            gc.collect()  # start every repetition from the same heap
            t0 = time.perf_counter()
            graph = build_model_graph(spec)
            t1 = time.perf_counter()
            plan = decompose_model(graph, spec.resources, prefer_data_parallel=False)
            t2 = time.perf_counter()
            best_build, best_cut = min(best_build, t1 - t0), min(best_cut, t2 - t1)
        total = best_build + best_cut
        growth = "" if previous is None else f"  growth x{total / previous:.1f} per 10x nodes"
        print(
            f"  {graph.graph.number_of_nodes():>7,} nodes, {plan.num_units:>6,} units: build {best_build * 1e3:8.1f} ms"
            f"  decompose {best_cut * 1e3:8.1f} ms  total {total * 1e3:8.1f} ms"
            f"  bottleneck/lower bound {plan.bottleneck / plan.lower_bound:.4f}{growth}"
        )
        previous = total


def best_time(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def cut_scaling(seed: int, sizes: list[int], repeats: int = 3) -> None:
    rng = random.Random(seed)
    speeds = [400.0, 400.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0]
    print(f"the cut alone, {len(speeds)} heterogeneous devices, log-normal unit works (best of {repeats})")
    print(
        f"  {'units':>9} {'greedy s':>9} {'exact s':>9} {'reorder s':>10} {'exact/greedy':>13} {'reorder/greedy':>15}"
        f" {'exact/smallest':>15} {'exponent':>9} {'greedy/exact':>14}"
    )
    first = previous = None
    for n in sizes:
        works = [rng.lognormvariate(0.0, 1.0) for _ in range(n)]
        unit_bytes, rooms = [1000] * n, [UNLIMITED] * len(speeds)
        greedy = best_time(lambda works=works: quantile_split_bottleneck(works, speeds), repeats)
        exact = best_time(
            lambda works=works, unit_bytes=unit_bytes, rooms=rooms: optimal_contiguous_cut(
                works, unit_bytes, speeds, rooms
            ),
            repeats,
        )
        reorder = best_time(
            lambda works=works, unit_bytes=unit_bytes, rooms=rooms: exchangeable_cut(works, unit_bytes, speeds, rooms),
            repeats,
        )
        gap = (
            quantile_split_bottleneck(works, speeds)
            / optimal_contiguous_cut(works, unit_bytes, speeds, rooms).bottleneck
        )
        exponent = "" if previous is None else f"{math.log(exact / previous[1]) / math.log(n / previous[0]):.2f}"
        first = first or (n, exact)
        print(
            f"  {n:>9,} {greedy:9.3f} {exact:9.3f} {reorder:10.3f} {exact / greedy:13.2f} {reorder / greedy:15.2f}"
            f" {exact / first[1]:15.1f} {exponent:>9} {gap:14.6f}"
        )
        previous = (n, exact)
    print("  (exponent: growth of the exact cut's time between sizes; greedy/exact bottleneck in the last column)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--units", default="1000,10000,100000,1000000", help="unit counts for the cut alone")
    args = parser.parse_args()
    quality(args.cases, args.seed)
    print()
    scaling(args.seed)
    print()
    cut_scaling(args.seed, [int(u) for u in args.units.split(",")])


if __name__ == "__main__":
    main()
