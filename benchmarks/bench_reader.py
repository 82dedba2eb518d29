"""How the spec readers scale: `check` of a `modules` spec of N tensors, as JSON and as YAML.

    python benchmarks/bench_reader.py [--sizes 1000,4000,16000]

Prints, per size, the median time of reading and checking the spec in this process, as JSON and as
YAML, their ratio, and the growth from one size to the next (a linear reader grows by the size
ratio, 4x here; a quadratic one by its square). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mixle_compile.check import check_file  # noqa: E402


def spec(tensors: int) -> dict:
    parameters = [
        {"name": f"layers.{i // 4}.w{i % 4}", "shape": [64, 64], "role": "column" if i % 2 else "row", "layer": i // 4}
        for i in range(tensors)
    ]
    return {
        "model": {"family": "modules", "parameters": parameters},
        "mesh": {"dp_shard": 2},
        "training": {"global_batch_size": 2},
        "backend": "torch",
        "resources": {"devices": 2, "memory": "80GiB"},
    }


def median_s(path: Path, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = check_file(path)
        times.append(time.perf_counter() - start)
        assert not result.unreadable and result.errors == 0, [d.text() for d in result.diagnostics]
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,4000,16000")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    previous = None
    print(f"{'tensors':>8} {'json s':>8} {'yaml s':>8} {'json/yaml':>10} {'json growth':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            data = spec(n)
            as_json, as_yaml = Path(tmp) / f"s{n}.json", Path(tmp) / f"s{n}.yaml"
            as_json.write_text(json.dumps(data, indent=1))
            as_yaml.write_text(yaml.safe_dump(data))
            j, y = median_s(as_json, args.runs), median_s(as_yaml, args.runs)
            growth = f"{j / previous[1]:.1f}x for {n / previous[0]:.0f}x" if previous else ""
            print(f"{n:8d} {j:8.2f} {y:8.2f} {j / y:10.2f} {growth:>12}")
            previous = (n, j)
    return 0


if __name__ == "__main__":
    sys.exit(main())
