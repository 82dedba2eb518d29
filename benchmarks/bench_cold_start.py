"""Cold start of the command line against a bare ``import torch``, measured side by side in one run.

    python benchmarks/bench_cold_start.py [--runs 7] [--spec examples/tiny-transformer.yaml]

Each command runs as a fresh interpreter, so every run pays the full import cost; the runs
interleave the three commands, so a busy machine slows them alike. One untimed run of each comes
first so that compiled bytecode is on disk for all of them alike (torch ships its own; the
project's is written then), as it is after any installation. Prints the median wall time of
``python -c "import torch"``, of ``python -m mixle_compile check SPEC`` and of
``python -m mixle_compile compile SPEC``, and each command's ratio to the bare import; then
``check`` once more from a copy of the package without bytecode, under
``PYTHONDONTWRITEBYTECODE=1``, so the project's sources are compiled at every start (installed
packages keep theirs): what a start costs where the environment forbids writing bytecode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--spec", default=str(ROOT / "examples" / "tiny-transformer.yaml"))
    args = parser.parse_args()
    spec = str(Path(args.spec).resolve())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        commands = {
            "import torch": [sys.executable, "-c", "import torch"],
            "check": [sys.executable, "-m", "mixle_compile", "check", spec],
            "compile": [sys.executable, "-m", "mixle_compile", "compile", spec, "-o", str(Path(tmp) / "plan.json")],
        }
        bare = Path(tmp) / "bare"
        shutil.copytree(ROOT / "mixle_compile", bare / "mixle_compile", ignore=shutil.ignore_patterns("__pycache__"))
        no_cache = dict(env, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(bare))
        runs = {name: (command, env, ROOT) for name, command in commands.items()}
        runs["check, no bytecode"] = (commands["check"], no_cache, bare)  # -m finds the package in cwd first
        times: dict[str, list[float]] = {name: [] for name in runs}
        for command, environment, cwd in runs.values():  # untimed: bytecode on disk for every command
            subprocess.run(command, env=environment, cwd=cwd, check=True, capture_output=True)
        for _ in range(args.runs):
            for name, (command, environment, cwd) in runs.items():
                start = time.perf_counter()
                subprocess.run(command, env=environment, cwd=cwd, check=True, capture_output=True)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["import torch"])
    print(f"median of {args.runs} fresh interpreters each, {Path(spec).name}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<19} {median * 1e3:8.0f} ms   {median / base:5.2f}x import torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
