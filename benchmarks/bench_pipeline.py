"""Pipeline bubble: the idle fraction measured by `run` next to the plan's model, per schedule.

Runs one pipelined plan per schedule (gpipe, 1f1b, interleaved 1f1b with 2 chunks per stage) on
local ranks with gloo, through the ordinary `run` path, and prints for each the measured idle
fraction (1 - time in forward and backward / step time, over the steps after the first, averaged
over the ranks, and per stage) beside the plan's bubble model ``(pp - 1) / (v * m + pp - 1)``.
The model counts compute only; on CPU with gloo a transfer costs about as much as a small stage's
compute, so a small model waits more than the model says. Nothing asserts an absolute time.

    .venv/bin/python benchmarks/bench_pipeline.py [--hidden 256] [--seq 128] [--steps 4] [--pp 2]
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
from pathlib import Path

SPEC = """\
model: {{family: transformer, vocab_size: 512, hidden_size: {hidden}, num_layers: {layers}, num_heads: 8, \
num_kv_heads: 4,
        ffn_hidden_size: {ffn}, tie_embeddings: false}}
mesh: {{pp: {pp}, microbatches: {mb}}}
training: {{global_batch_size: {gbs}, micro_batch_size: {mbs}, seq_len: {seq}, precision: fp32, optimizer: adamw,
           learning_rate: 1.0e-4, pipeline_schedule: {schedule}, virtual_pipeline_stages: {virtual}, steps: {steps}}}
backend: torch
resources: {{devices: {pp}, memory: 4GiB, kind: cpu}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mbs", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--mb", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from mixle_compile.runtime import run_plan

    layers = 2 * args.pp * 2  # two layers per virtual stage with 2 chunks
    print(
        f"pp={args.pp}, {layers} layers, hidden {args.hidden}, {args.seq} tokens x {args.mbs} per micro-batch, "
        f"{args.mb} micro-batches, {args.steps} steps"
    )
    print(f"{'schedule':<22} {'model':>6} {'measured':>9}  per stage")
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        text = SPEC.format(
            hidden=args.hidden,
            layers=layers,
            ffn=3 * args.hidden,
            pp=args.pp,
            mb=args.mb,
            gbs=args.mb * args.mbs,
            mbs=args.mbs,
            seq=args.seq,
            schedule=schedule,
            virtual=virtual,
            steps=args.steps,
        )
        with tempfile.TemporaryDirectory() as tmp:
            spec = Path(tmp) / "spec.yaml"
            spec.write_text(textwrap.dedent(text))
            report = run_plan(spec, out_dir=Path(tmp) / "out", progress=False)
        pipeline = report.data["pipeline"]
        per_stage = ", ".join(f"{v:.2f}" for v in pipeline["idle_fraction_per_stage"].values())
        label = schedule + (f" (v={virtual})" if virtual > 1 else "")
        print(
            f"{label:<22} {pipeline['bubble_model']:>6.2f} {pipeline['idle_fraction']:>9.2f}  {per_stage}"
            + ("" if report.ok else "  (run not ok: " + "; ".join(report.errors[:2]) + ")")
        )


if __name__ == "__main__":
    main()
