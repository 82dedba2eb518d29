"""How the spec readers scale: `check` and `compile` of a `modules` spec of N tensors, as JSON and as YAML.

    python benchmarks/bench_reader.py [--sizes 1000,10000,100000] [--runs 1]

Prints, per size and format, the median time of reading and checking the spec in this process and
of compiling it to plan text, the ratio to the smallest size, and the growth exponent between
consecutive sizes (log time ratio / log size ratio: 1.0 is linear, 2.0 quadratic). It ends with
the time to refuse a YAML alias bomb. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mixle_compile.check import check_file  # noqa: E402
from mixle_compile.compile import compile_file  # noqa: E402


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


def run_check(path: Path) -> None:
    result = check_file(path)
    assert not result.unreadable and result.errors == 0, [d.text() for d in result.diagnostics][:5]


def run_compile(path: Path) -> None:
    result = compile_file(path)
    assert result.plan is not None, [d.text() for d in result.check.diagnostics][:5]
    assert result.text  # the plan's bytes, as `compile -o` writes them


def median_s(run, path: Path, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run(path)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bomb_s() -> tuple[float, str]:
    from mixle_compile.spec.source import SourceError, parse_source

    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, cur in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 9) + "]")
    start = time.perf_counter()
    try:
        parse_source("\n".join(levels).encode(), "bomb.yaml", json_syntax=False)
    except SourceError as exc:
        return time.perf_counter() - start, exc.diagnostics[0].message
    raise AssertionError("the alias bomb was read")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: dict[tuple[str, str], list[tuple[int, float]]] = {}
    print(f"{'tensors':>8} {'format':>6} {'pass':>8} {'seconds':>9} {'/smallest':>10} {'exponent':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            data = spec(n)
            files = {"json": Path(tmp) / f"s{n}.json", "yaml": Path(tmp) / f"s{n}.yaml"}
            files["json"].write_text(json.dumps(data, indent=1))
            files["yaml"].write_text(yaml.safe_dump(data))
            for fmt, path in files.items():
                for name, run in (("check", run_check), ("compile", run_compile)):
                    seconds = median_s(run, path, args.runs)
                    series = rows.setdefault((fmt, name), [])
                    exponent = ""
                    if series:
                        m, previous = series[-1]
                        exponent = f"{math.log(seconds / previous) / math.log(n / m):.2f}"
                    series.append((n, seconds))
                    print(
                        f"{n:8d} {fmt:>6} {name:>8} {seconds:9.2f} {seconds / series[0][1]:10.1f} {exponent:>9}",
                        flush=True,
                    )
    for (fmt, name), series in rows.items():
        (n0, t0), (n1, t1) = series[0], series[-1]
        if n1 > n0:
            print(f"{fmt} {name}: exponent {math.log(t1 / t0) / math.log(n1 / n0):.2f} from {n0:,} to {n1:,} tensors")
    seconds, message = bomb_s()
    print(f"alias bomb refused in {seconds * 1e3:.1f} ms: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
