"""How fast `check` is: verifying one spec after imports, and the whole command from a cold start.

    python benchmarks/bench_check.py [--runs N]

Prints, measured side by side in one run:

* per example spec, the median time of the verifier alone (facts, encoding, verdict and, for a
  failing spec, its minimal conflicts), after imports;
* the median wall time of `mixle-compile check examples/llama3-8b-hsdp-tp.yaml` as a fresh process
  (interpreter start and imports included), next to the same process that only loads the spec
  (no verifier) and a bare interpreter, with the ratios between them.

Nothing here asserts a time: the figures are for people, not for CI.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
EIGHT_B = EXAMPLES / "llama3-8b-hsdp-tp.yaml"


def median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def verifier_times(runs: int) -> list[tuple[str, float, int]]:
    from mixle_compile.spec import load_spec
    from mixle_compile.verify import verify_plan

    specs = sorted(EXAMPLES.glob("*.yaml")) + [
        EXAMPLES / "invalid" / "t002-kv-heads-split-or-replicated.yaml",
        EXAMPLES / "invalid" / "b001-global-batch-size.yaml",
        EXAMPLES / "invalid" / "r001-device-memory.yaml",
        EXAMPLES / "invalid" / "d003-elastic-range.yaml",
    ]
    out = []
    for path in specs:
        spec = load_spec(path).spec
        verify_plan(spec)  # first call pays for building z3's tactics once per process
        findings = len(verify_plan(spec).findings)
        out.append((str(path.relative_to(ROOT)), median_ms(lambda spec=spec: verify_plan(spec), runs), findings))
    return out


def cold_ms(argv: list[str], runs: int) -> float:
    def once() -> None:
        subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

    once()  # warm the file cache, not the interpreter
    return median_ms(once, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="repetitions per figure (default 15)")
    args = parser.parse_args()

    print("verifying one spec, after imports (median of", args.runs, "runs):")
    for name, ms, findings in verifier_times(args.runs):
        print(f"  {ms:7.1f} ms  {name}  ({findings} finding{'s' * (findings != 1)})")

    python = sys.executable
    check = cold_ms([python, "-m", "mixle_compile", "check", str(EIGHT_B)], args.runs)
    load_only = cold_ms(
        [python, "-c", f"from mixle_compile.spec import load_spec; load_spec({str(EIGHT_B)!r})"], args.runs
    )
    bare = cold_ms([python, "-c", "pass"], args.runs)
    print(f"\ncold process, median of {args.runs} runs ({EIGHT_B.relative_to(ROOT)}):")
    print(f"  {check:7.1f} ms  mixle-compile check (load + verify)")
    print(f"  {load_only:7.1f} ms  load the spec only (no verifier)")
    print(f"  {bare:7.1f} ms  python -c pass")
    print(f"  ratios: check / load-only = {check / load_only:.2f}, check / bare interpreter = {check / bare:.2f}")


if __name__ == "__main__":
    main()
