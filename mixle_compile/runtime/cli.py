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
from pathlib import Path

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
    parser.add_argument(
        "plan", metavar="PLAN", help="a plan.json written by `compile`, or a spec file (compiled first)"
    )
    parser.add_argument("--steps", type=_count, help="optimizer steps (default: the spec's training.steps)")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also train in one process and record every update's numerical evidence",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="directory for receipts.jsonl, report.json and logs (default: a new temporary directory)",
    )
    parser.add_argument(
        "--data",
        metavar="FILE",
        help="token ids (.npy, .bin uint16, or whitespace-separated text); default: seeded synthetic tokens",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"collective timeout in seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--repeat-data",
        action="store_true",
        help="allow a --data file shorter than one global batch (its samples repeat)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--save-every",
        type=_count,
        metavar="N",
        help="save a checkpoint every N optimizer steps and after the last one (see docs/checkpoints.md)",
    )
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="where checkpoints go (default: OUT/checkpoints)")
    parser.add_argument(
        "--keep-checkpoints",
        type=_count,
        metavar="K",
        help="keep only this run's K newest checkpoints, never deleting another run's (default: all)",
    )
    parser.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="allow replacing committed checkpoints in --checkpoint-dir at steps this run will save (refused "
        "otherwise)",
    )
    parser.add_argument(
        "--mixle-out",
        metavar="FILE",
        help="write the fitted model as mixle's to_dict() JSON (load it with mixle's from_dict); PLAN must be "
        "a spec whose "
        "model is {from: mixle, path: model.json}; saves a checkpoint after the last step where --save-every does not",
    )
    parser.add_argument(
        "--resume",
        metavar="CKPT",
        help="continue from a checkpoint: a checkpoint directory (its latest complete step) or one "
        "step-NNNNNNNN directory; "
        "the plan may have another mesh; --steps stays the total",
    )


def mixle_source(plan: str) -> Path:
    """The mixle model JSON a spec's ``model: {from: mixle, path}`` names, for ``--mixle-out``
    (RuntimeRefusal when ``plan`` is not such a spec: the fitted values go back into that model)."""
    from mixle_compile.spec.source import SourceError, read_source

    usage = (
        "--mixle-out writes the fitted parameters back into the mixle model they were fitted from, so PLAN "
        "must be a spec "
        "whose model is `{from: mixle, path: model.json}`"
    )
    path = Path(plan)
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise RuntimeRefusal(f"{usage}; {plan} is not a spec file")
    try:
        doc, _ = read_source(path)
    except SourceError:
        raise RuntimeRefusal(f"{usage}; {plan} cannot be read as a spec") from None
    model = doc.data.get("model") if isinstance(doc.data, dict) else None
    if not (isinstance(model, dict) and model.get("from") == "mixle" and isinstance(model.get("path"), str)):
        what = (
            f"a model read from {model.get('from')!r}"
            if isinstance(model, dict) and "from" in model
            else f"a {model.get('family')!r} model written out"
            if isinstance(model, dict) and "family" in model
            else "no model"
        )
        if "format_version" in (doc.data or {}):
            what = "a compiled plan (it holds the model, not the mixle file it was read from)"
        raise RuntimeRefusal(f"{usage}; {plan} has {what}")
    return path.parent / model["path"]


def write_mixle_out(report, source: Path, out: str) -> str:
    """Write the last checkpoint of ``report``'s EM run as mixle's to_dict() JSON; returns what it did."""
    import json

    from mixle_compile.mixle_models import FittedParametersError, MixleModelError, to_mixle_dict

    saved = report.data.get("run", {}).get("checkpoints", {}).get("saved") or []
    if not saved:
        raise RuntimeRefusal("--mixle-out: the run saved no checkpoint to read the fitted parameters from")
    try:
        payload = to_mixle_dict(saved[-1]["path"], source)
    except (FittedParametersError, MixleModelError) as exc:
        raise RuntimeRefusal(f"--mixle-out: {exc}") from None
    Path(out).write_text(json.dumps(payload) + "\n", encoding="utf-8")
    return f"fitted model (step {saved[-1]['step']}) written to {out} as mixle's to_dict() JSON"


def run_command(args: argparse.Namespace) -> int:
    from mixle_compile.runtime.launch import run_plan

    mixle_out = getattr(args, "mixle_out", None)
    save_every = getattr(args, "save_every", None)
    try:
        if mixle_out is not None:
            source = mixle_source(args.plan)
            if save_every is None:
                save_every = 2**31  # a checkpoint after the last step only (every N steps and after the last)
        report = run_plan(
            args.plan,
            steps=args.steps,
            out_dir=args.out,
            reference=args.reference,
            data_path=args.data,
            timeout_s=args.timeout,
            progress=not args.quiet,
            save_every=save_every,
            checkpoint_dir=getattr(args, "checkpoint_dir", None),
            keep_checkpoints=getattr(args, "keep_checkpoints", None),
            resume=getattr(args, "resume", None),
            repeat_data=getattr(args, "repeat_data", False),
            overwrite_checkpoints=getattr(args, "overwrite_checkpoints", False),
        )
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
        if mixle_out is not None:
            if not report.ok:
                print(
                    f"mixle-compile run: the run did not pass its checks, so {mixle_out} is not written",
                    file=sys.stderr,
                )
                return EXIT_VIOLATIONS
            try:
                print(write_mixle_out(report, source, mixle_out))
            except RuntimeRefusal as exc:
                print(f"mixle-compile run: {exc}", file=sys.stderr)
                return EXIT_VIOLATIONS
    return EXIT_CLEAN if report.ok else EXIT_VIOLATIONS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mixle_compile.runtime", description="Replay a compiled plan on real process groups."
    )
    add_run_arguments(parser)
    return run_command(parser.parse_args(argv))
