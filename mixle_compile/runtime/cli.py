"""The `run` command's argument handling, shared by ``python -m mixle_compile.runtime`` and the CLI.

Exit statuses follow the CLI's: 0 the run finished and its accounting (and evidence) hold, 1 a
violation (a planned/observed difference, evidence out of tolerance, a failed, dead or stalled
rank), 2 refused before starting (unreadable or unverified plan, world-size mismatch, an axis this
runtime does not execute).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from mixle_compile.runtime.errors import CollectiveFailed, RunFailed, RuntimeRefusal, SpecRejected

EXIT_CLEAN, EXIT_VIOLATIONS, EXIT_REFUSED = 0, 1, 2
DEFAULT_TIMEOUT_S = 60.0  # launch.DEFAULT_TIMEOUT_S; repeated so that building the parser imports nothing


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="a plan.json written by `compile`, or a spec file (compiled first)")
    parser.add_argument("--steps", type=_count, help="optimizer steps (default: the spec's training.steps)")
    parser.add_argument("--reference", action="store_true", help="also train in one process and record every update's numerical evidence")
    parser.add_argument("--out", metavar="DIR", help="directory for receipts.jsonl, report.json and logs (default: a new temporary directory)")
    parser.add_argument("--data", metavar="FILE", help="token ids (.npy, .bin uint16, or whitespace-separated text); default: seeded synthetic tokens")
    parser.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_TIMEOUT_S, metavar="S", help=f"collective timeout in seconds (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--repeat-data", action="store_true", help="allow a --data file shorter than one global batch (its samples repeat)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--save-every", type=_count, metavar="N", help="save a checkpoint every N optimizer steps and after the last one (see docs/checkpoints.md)")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="where checkpoints go (default: OUT/checkpoints)")
    parser.add_argument("--keep-checkpoints", type=_count, metavar="K", help="keep only this run's K newest checkpoints, never deleting another run's (default: all)")
    parser.add_argument("--overwrite-checkpoints", action="store_true",
                        help="allow replacing committed checkpoints in --checkpoint-dir at steps this run will save (refused otherwise)")
    parser.add_argument(
        "--resume", metavar="CKPT",
        help="continue from a checkpoint: a checkpoint directory (its latest complete step) or one step-NNNNNNNN directory; "
             "the plan may have another mesh; --steps stays the total",
    )


def run_command(args: argparse.Namespace) -> int:
    from mixle_compile.runtime.launch import run_plan

    try:
        report = run_plan(args.plan, steps=args.steps, out_dir=args.out, reference=args.reference, data_path=args.data,
                          timeout_s=args.timeout, progress=not args.quiet, save_every=getattr(args, "save_every", None),
                          checkpoint_dir=getattr(args, "checkpoint_dir", None), keep_checkpoints=getattr(args, "keep_checkpoints", None),
                          resume=getattr(args, "resume", None), repeat_data=getattr(args, "repeat_data", False),
                          overwrite_checkpoints=getattr(args, "overwrite_checkpoints", False))
    except SpecRejected as exc:  # a spec with errors exits 1 in every verb
        print(f"mixle-compile run: {exc}", file=sys.stderr)
        return EXIT_VIOLATIONS
    except RuntimeRefusal as exc:
        print(f"mixle-compile run: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (RunFailed, CollectiveFailed) as exc:  # under torchrun a rank's own collective failure reaches here
        print(f"mixle-compile run: the run failed:\n{exc}", file=sys.stderr)
        return EXIT_VIOLATIONS
    if os.environ.get("RANK", "0") == "0":
        print(report.summary())
    return EXIT_CLEAN if report.ok else EXIT_VIOLATIONS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mixle_compile.runtime", description="Replay a compiled plan on real process groups.")
    add_run_arguments(parser)
    return run_command(parser.parse_args(argv))
