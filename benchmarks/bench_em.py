"""EM iteration time against world size, and the decomposition's cut against a naive equal-count cut.

    python benchmarks/bench_em.py [--rows 16384] [--steps 6]

Prints, measured side by side in one run (ratios only; nothing is asserted):

1. a full-covariance Gaussian mixture fitted on 1, 2 and 4 data-parallel ranks: the median time
   of an EM iteration on rank 0 (which waits for the others in every all_reduce) as a ratio to
   one rank;
2. a component cut over tp=2 of a mixture whose components differ in size (the decomposition
   balances their work across the two ranks), against the naive cut that gives each rank the
   same number of components: the slowest rank's E-step + M-step time per iteration (each rank's
   least disturbed iteration), and the ratio naive / chosen.

Every run also checks planned == observed accounting; the first section runs the real launcher
(one process per rank, gloo), so on a machine with fewer cores than ranks the larger worlds
share cores; the second times each tp rank's share in this process, since on a
machine with fewer cores than ranks concurrent ranks would time each other's compute.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mixle_compile.runtime import run_plan  # noqa: E402
from mixle_compile.runtime.em.fit import sample_data  # noqa: E402
from mixle_compile.runtime.em.model import Scoring, initial_params, m_step, score, zero_statistics  # noqa: E402
from mixle_compile.runtime.em.plan import read_em_instructions  # noqa: E402
from mixle_compile.runtime.launch import compile_spec_file  # noqa: E402


def spec(root: str, mesh: str, rows: int, micro: int, steps: int) -> str:
    devices = 1
    for part in mesh.split(","):
        devices *= int(part.split(":")[1])
    return f"""
model:
  family: distribution
  root:{root}
mesh: {{{mesh}}}
training: {{global_batch_size: {rows}, micro_batch_size: {micro}, precision: fp32, steps: {steps}, seed: 1}}
backend: torch
resources: {{devices: {devices}, kind: cpu, memory: 4GiB}}
"""


GMM = """
    type: mixture
    component: {type: gaussian, dim: 6, covariance: full}
    repeat: 8"""

# Two costly components (full covariance) and six cheap ones (diagonal), all in 24 dimensions: an
# equal-count cut puts both costly ones on one rank.
UNEVEN = """
    type: mixture
    components:
      - {type: gaussian, dim: 24, covariance: full}
      - {type: gaussian, dim: 24, covariance: full}
      - {type: gaussian, dim: 24, covariance: diag}
      - {type: gaussian, dim: 24, covariance: diag}
      - {type: gaussian, dim: 24, covariance: diag}
      - {type: gaussian, dim: 24, covariance: diag}
      - {type: gaussian, dim: 24, covariance: diag}
      - {type: gaussian, dim: 24, covariance: diag}"""


def world_sizes(tmp: Path, rows: int, steps: int) -> list[tuple[int, float]]:
    out = []
    for world in (1, 2, 4):
        path = tmp / f"gmm-{world}.yaml"
        path.write_text(spec(GMM, f"dp_replicate: {world}", rows, rows // world, steps))
        report = run_plan(path, out_dir=tmp / f"run-{world}", progress=False)
        if not report.ok:
            raise SystemExit(f"world {world}: the run failed: {report.errors}")
        receipts = [json.loads(line) for line in report.receipts_path.read_text().splitlines()]
        walls = [r["wall_s"] for r in receipts]
        out.append((world, float(np.median(np.diff(walls)))))
    return out


def shares(em, owners: list[int], data: np.ndarray, steps: int) -> float:
    """The slowest tp rank's time per iteration scoring and updating its own components (all rows;
    the normaliser is computed in place of the collectives, whose cost is the same for both cuts)."""
    tree = em.tree
    params = initial_params(tree, data, em.seed + 1)
    times = []
    for rank in sorted(set(owners)):
        owned = tuple(k for k, o in enumerate(owners) if o == rank)
        per_iteration = []
        for _ in range(steps):
            started = time.perf_counter()
            sc = Scoring(params, zero_statistics(tree), cut=tree.root.id, owned=owned, combine=_normaliser)
            lp, acc = score(tree, tree.root, 0, data, sc)
            acc(np.ones(len(data)))
            m_step(tree, params, sc.stats, totals={tree.root.id: len(data)})
            per_iteration.append(time.perf_counter() - started)
        times.append(min(per_iteration))  # the least disturbed iteration: other processes share the cores
    return max(times)


def _normaliser(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = a.max(axis=1)
    return m, np.exp(a - m[:, None]).sum(axis=1)


def cuts(tmp: Path, rows: int, steps: int) -> tuple[list[int], list[int], float, float]:
    path = tmp / "uneven.yaml"
    path.write_text(spec(UNEVEN, "tp: 2", rows, rows, steps))
    doc = compile_spec_file(path)
    em = read_em_instructions(doc)
    report = run_plan(doc, out_dir=tmp / "run-cut", progress=False)
    if not report.ok:
        raise SystemExit(f"the component cut failed: {report.errors}")
    chosen = list(em.cut.owners)
    k = len(chosen)
    naive = [0 if u < k // 2 else 1 for u in range(k)]
    data = sample_data(em)
    return chosen, naive, shares(em, chosen, data, steps), shares(em, naive, data, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"$ python benchmarks/bench_em.py --rows {args.rows} --steps {args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sizes = world_sizes(tmp, args.rows, args.steps)
        base = sizes[0][1]
        print(f"\nGaussian mixture, 8 full-covariance components in 6 dimensions, {args.rows} rows, data parallel:")
        print(f"{'world':>6} {'s/iteration':>12} {'ratio to world 1':>17}")
        for world, t in sizes:
            print(f"{world:>6} {t:>12.4f} {t / base:>17.2f}")
        chosen, naive, t_chosen, t_naive = cuts(tmp, args.rows, args.steps)
        print(
            "\nComponent cut over tp=2 of 8 components in 24 dimensions (two full, six diagonal covariances), "
            f"{args.rows} rows:"
        )
        print(f"  decomposition's cut: owners {chosen}  slowest rank {t_chosen:.4f} s/iteration")
        print(f"  equal-count cut:     owners {naive}  slowest rank {t_naive:.4f} s/iteration")
        print(f"  equal-count / chosen: {t_naive / t_chosen:.2f}")


if __name__ == "__main__":
    main()
