"""How compile time and plan size grow with the model and with the step, at a fixed world size.

    python benchmarks/bench_plan_scaling.py [--quick] [--runs N]

Starts from examples/llama3-8b-hsdp-tp.yaml and varies one thing at a time:

- layers: 8 -> 1,000 (the example's mesh and step as written, 64 ranks);
- micro-batches: 16 -> 512 at pp 16 on 131,072 ranks (dp_replicate 2 x dp_shard 512 x tp 8 x pp 16,
  1F1B, no accumulation);
- accumulation steps: 1 -> 64 (the example's mesh, 8 layers);

every case with resources.memory of 4TiB so that 1,000 layers fit a rank; and last the headline case,
1,000 layers at pp 16 with 512 micro-batches on 131,072 ranks, against the 8-layer example and
against 16 layers on the same mesh and step. Each row is one compile (check, lower, the schedule
check, the plan document) plus writing its canonical bytes, the median of ``--runs`` runs.
Printed: seconds, plan bytes, the ratio to the smallest case, and the growth exponent
log(ratio) / log(size ratio) (1: linear, 0: flat). Nothing here asserts a time: the figures are
ratios measured side by side in one run.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mixle_compile.compile import compile_loaded  # noqa: E402
from mixle_compile.spec import load_spec_text  # noqa: E402

EXAMPLE = ROOT / "examples" / "llama3-8b-hsdp-tp.yaml"
BIG_WORLD = 131_072
MEMORY = "4TiB"


def base() -> dict:
    data = yaml.safe_load(EXAMPLE.read_text())
    # Room for 1,000 layers on a rank (the memory rule is not what is measured here).
    data["resources"]["memory"] = MEMORY
    return data


def example(layers: int = 8, accumulation: int | None = None) -> dict:
    data = base()
    data["model"]["num_layers"] = layers
    if accumulation is not None:
        data["mesh"]["gradient_accumulation_steps"] = accumulation
        dp = data["resources"]["devices"] // (data["mesh"]["tp"])
        data["training"]["global_batch_size"] = data["training"]["micro_batch_size"] * accumulation * dp
    return data


def pipelined(layers: int, microbatches: int) -> dict:
    data = base()
    data["model"]["num_layers"] = layers
    data["mesh"].update({"pp": 16, "dp_shard": "auto", "microbatches": microbatches, "gradient_accumulation_steps": 1})
    data["training"]["pipeline_schedule"] = "1f1b"
    data["resources"]["devices"] = BIG_WORLD
    dp = BIG_WORLD // (data["mesh"]["tp"] * 16)
    data["training"]["global_batch_size"] = data["training"]["micro_batch_size"] * microbatches * dp
    return data


def measure(data: dict, runs: int) -> tuple[float, int]:
    text = yaml.safe_dump(copy.deepcopy(data), sort_keys=False)
    times, size = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        loaded = load_spec_text(text, "bench.yaml")
        result = compile_loaded(loaded)
        if result.plan is None:
            shown = "; ".join(f"{d.code} {d.message}" for d in result.check.diagnostics[:3])
            raise SystemExit(f"the benchmark spec does not compile: {shown}")
        size = len(result.text.encode("utf-8"))  # the bytes `compile -o` writes
        times.append(time.perf_counter() - start)
        del result
    return statistics.median(times), size


def sweep(title: str, what: str, cases: list[tuple[int, dict]], runs: int) -> list[tuple[int, float, int]]:
    print(f"\n{title}")
    print(
        f"{what:>14} {'compile s':>10} {'plan bytes':>12} {'time x':>8} {'size x':>8} {'exp time':>9} {'exp size':>9}"
    )
    rows = []
    for n, data in cases:
        seconds, size = measure(data, runs)
        rows.append((n, seconds, size))
        n0, t0, s0 = rows[0]
        if n == n0:
            print(f"{n:>14} {seconds:>10.3f} {size:>12,} {1:>8.2f} {1:>8.2f} {'':>9} {'':>9}")
            continue
        scale = math.log(n / n0)
        print(
            f"{n:>14} {seconds:>10.3f} {size:>12,} {seconds / t0:>8.2f} {size / s0:>8.2f} "
            f"{math.log(seconds / t0) / scale:>9.3f} {math.log(size / s0) / scale:>9.3f}"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer, smaller points (layers to 128, micro-batches to 64, accumulation to 16)",
    )
    args = parser.parse_args()
    layers = [8, 32, 128] if args.quick else [8, 32, 128, 1000]
    micro = [16, 64] if args.quick else [16, 64, 512]
    accumulation = [1, 4, 16] if args.quick else [1, 8, 64]
    measure(example(8), 1)  # warm imports and caches
    sweep("layers (examples/llama3-8b-hsdp-tp.yaml, 64 ranks)", "layers", [(n, example(n)) for n in layers], args.runs)
    sweep(
        f"micro-batches (pp 16, 16 layers, {BIG_WORLD:,} ranks)",
        "micro-batches",
        [(m, pipelined(16, m)) for m in micro],
        args.runs,
    )
    sweep(
        "accumulation steps (8 layers, 64 ranks)", "accumulation", [(a, example(8, a)) for a in accumulation], args.runs
    )
    if not args.quick:
        # Side by side: the cases take turns, so that the machine's load weighs on all alike; a few
        # milliseconds each, so enough turns for a steady median on a shared machine.
        small, same_mesh, big = [], [], []
        for _ in range(max(5 * args.runs, 15)):
            small.append(measure(example(8), 1))
            same_mesh.append(measure(pipelined(16, 512), 1))
            big.append(measure(pipelined(1000, 512), 1))
        t_small, s_small = statistics.median(t for t, _ in small), small[0][1]
        t_same, s_same = statistics.median(t for t, _ in same_mesh), same_mesh[0][1]
        t_big, s_big = statistics.median(t for t, _ in big), big[0][1]
        print("\nheadline: 1,000 layers, pp 16, 512 micro-batches, 131,072 ranks against the 8-layer example")
        print(f"  8-layer example:  {t_small:8.3f} s  {s_small / 2**20:8.3f} MiB")
        print(f"  16-layer pp16:    {t_same:8.3f} s  {s_same / 2**20:8.3f} MiB  (the same mesh and step)")
        print(f"  1,000-layer pp16: {t_big:8.3f} s  {s_big / 2**20:8.3f} MiB")
        print(f"  time ratio {t_big / t_small:.2f} (target < 3), plan {s_big / 2**20:.2f} MiB (target < 5 MiB)")
        same = f"time {t_big / t_same:.2f}, plan {s_big / s_same:.2f}"
        print(f"  at the same mesh and step, 1,000 layers against 16: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
