"""EM iteration time against the number of data ranks, for a full-covariance Gaussian mixture.

The same data set (``--rows`` observations, sampled from the spec's seed) is fitted on 1, 2 and 4
data-parallel ranks (``dp_replicate``); the report's receipts give each iteration's wall time on
rank 0. Printed per world size: the median iteration time after the first, the speed-up against
one rank, the collective bytes per iteration, and the fit's largest relative error against the
single-process fit (``--reference``). Nothing asserts an absolute time.

    .venv/bin/python benchmarks/bench_em.py [--rows 8192] [--steps 10] [--ranks 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mixle_compile.runtime import run_plan  # noqa: E402
from mixle_compile.runtime.launch import compile_spec_file  # noqa: E402

SPEC = """
model:
  family: distribution
  root: {{type: mixture, name: gmm, component: {{type: gaussian, dim: {dim}, covariance: full}}, repeat: {k}}}
mesh: {{dp_replicate: {world}}}
training: {{global_batch_size: {rows}, micro_batch_size: {micro}, precision: fp32, steps: {steps}, seed: 7}}
backend: torch
resources: {{devices: {world}, kind: cpu, memory: 4GiB}}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--components", type=int, default=16)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    base = None
    print(f"{'ranks':>5} {'iteration ms':>12} {'speed-up':>8} {'bytes/iter':>10} {'max rel err':>11} {'ok':>3}")
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.ranks:
            spec = Path(tmp) / f"gmm{world}.yaml"
            spec.write_text(SPEC.format(dim=args.dim, k=args.components, world=world, rows=args.rows, micro=args.rows // world, steps=args.steps))
            report = run_plan(compile_spec_file(spec), reference=True, out_dir=Path(tmp) / f"out{world}", progress=False)
            receipts = [json.loads(line) for line in report.receipts_path.read_text().splitlines()]
            times = [b["wall_s"] - a["wall_s"] for a, b in zip(receipts, receipts[1:])]
            ms = 1000 * statistics.median(times) if times else float("nan")
            base = base or ms
            err = report.data["evidence"]["fit_max_relative_error"]
            print(f"{world:>5} {ms:>12.2f} {base / ms:>8.2f} {receipts[-1]['collective_bytes']:>10} {err:>11.1e} {'yes' if report.ok else 'NO':>3}")


if __name__ == "__main__":
    main()
