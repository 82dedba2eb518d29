"""How the runtime's plan reader scales with the model: `read_instructions` of plans of L layers.

    python benchmarks/bench_plan_reading.py [--layers 32,128,256]

Compiles examples/tiny-transformer.yaml with num_layers = L (FSDP x TP, as written), then prints
the median time of reading the plan as runtime instructions (what the launcher's preflight and
every rank do before training starts), the plan's size, and the growth from one size to the next
(linear: the layer ratio). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mixle_compile.compile import compile_loaded  # noqa: E402
from mixle_compile.plan import load_plan_text, plan_text  # noqa: E402
from mixle_compile.runtime.instructions import read_instructions  # noqa: E402
from mixle_compile.spec import load_spec_text  # noqa: E402

EXAMPLE = ROOT / "examples" / "tiny-transformer.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="32,128,256")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    previous = None
    print(f"{'layers':>7} {'updates':>8} {'read s':>8} {'growth':>14}")
    for layers in (int(x) for x in args.layers.split(",")):
        text = re.sub(r"num_layers: \d+", f"num_layers: {layers}", EXAMPLE.read_text())
        result = compile_loaded(load_spec_text(text, f"tiny-{layers}.yaml"))
        doc = load_plan_text(plan_text(result.plan), f"tiny-{layers}.plan.json")
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            read_instructions(doc)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        growth = f"{median / previous[1]:.1f}x for {layers / previous[0]:.0f}x" if previous else ""
        print(f"{layers:7d} {len(doc.updates):8d} {median:8.3f} {growth:>14}")
        previous = (layers, median)
    return 0


if __name__ == "__main__":
    sys.exit(main())
