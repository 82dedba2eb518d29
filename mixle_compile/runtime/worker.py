"""One rank of `run`: the neural model's steps (``NeuralRank``) of the rank skeleton in
runtime/rank.py (join the group, train, account, and, rank 0, write the report).

Started by the local launcher (``python -m mixle_compile.runtime.worker``) or called in-process
when torchrun started this process. A failure is written to ``errors/rank<N>.json`` (what failed,
which collective was in flight on which group) before the process exits non-zero, so that the
launcher can name the rank that died or stalled.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from mixle_compile.plan.document import PlanDocument
from mixle_compile.runtime import faults
from mixle_compile.runtime.checkpoint import CheckpointOptions
from mixle_compile.runtime.data import BatchLayout, FileTokens, SyntheticTokens, TokenSource, local_batch
from mixle_compile.runtime.errors import CollectiveFailed
from mixle_compile.runtime.instructions import Instructions, read_instructions
from mixle_compile.runtime.mesh import Mesh
from mixle_compile.runtime.report import EVIDENCE_TOLERANCE, RECEIPTS_FILE, accounting
from mixle_compile.runtime.session import DistributedSession, device_for_rank


def token_source(instructions: Instructions, data_path: str | None) -> TokenSource:
    vocab = instructions.spec.model.vocab_size
    seq = instructions.seq_len or 1
    if data_path:
        return FileTokens(data_path, vocab, seq)
    return SyntheticTokens(vocab, seq, instructions.seed)


def batch_layout(instructions: Instructions) -> BatchLayout:
    p = instructions.plan
    return BatchLayout(
        instructions.micro_batch_size, p.microbatches, p.gradient_accumulation_steps, p.data_parallel_size
    )


class Diverged(RuntimeError):
    """The loss became NaN or infinite: the run stops at that step and fails."""


def _say(show: bool, text: str) -> None:
    """A progress line on standard error (rank 0, unless --quiet)."""
    if show:
        print(text, file=sys.stderr, flush=True)


def train(
    session: DistributedSession,
    source: TokenSource,
    steps: int,
    *,
    receipts=None,
    progress: bool = False,
    checkpoints: CheckpointOptions | None = None,
    data_source: dict | None = None,
    saved: list | None = None,
    label: str = "",
) -> list[float]:
    """Train from the session's step up to ``steps`` (a total); save checkpoints as ``checkpoints`` says.

    Progress lines number steps from 1, as the summary and the checkpoints (``step-00000003`` is the
    state after step 3) do; ``label`` names the pass (the reference's repeat) before them."""
    instructions = session.instructions
    layout = batch_layout(instructions)
    losses = []
    started = time.perf_counter()
    first = session.step
    every = max(1, (steps - first) // 10)
    save_every = checkpoints.every if checkpoints is not None and checkpoints.saves else None
    for step in range(first, steps):
        faults.before_step(session.mesh.rank, step, session)
        for a in range(layout.accumulation_steps):
            inputs, targets = local_batch(source, layout, step, a, session.mesh.data_rank)
            receipt = session.train_batch(inputs, targets)
        assert not receipt.skipped
        losses.append(receipt.loss)
        if receipts is not None:
            receipts.write(json.dumps(receipt.as_dict(), sort_keys=True) + "\n")
            receipts.flush()
        if not math.isfinite(receipt.loss):
            # The loss is reduced over every rank, so every rank stops here, at the same step.
            raise Diverged(
                f"training diverged: the loss of step {step + 1} is {receipt.loss} (every later step would train on it)"
            )
        if progress and ((step + 1 - first) % every == 0 or step + 1 == steps):
            print(
                f"{label}step {step + 1}/{steps}  loss {receipt.loss:.4f}  {time.perf_counter() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        if save_every and ((step + 1) % save_every == 0 or step + 1 == steps):
            from mixle_compile.runtime.checkpoint import prune_checkpoints
            from mixle_compile.runtime.checkpoint_dcp import save_session

            t0 = time.perf_counter()
            path = save_session(
                session,
                checkpoints.root,
                data_source=data_source() if callable(data_source) else data_source,
                on_written=lambda done=step + 1: faults.after_state_written(session.mesh.rank, done),
                run_id=checkpoints.run_id,
            )
            if saved is not None:
                saved.append({"step": step + 1, "path": str(path), "save_s": time.perf_counter() - t0})
            if session.mesh.rank == 0 and checkpoints.keep:
                prune_checkpoints(checkpoints.root, checkpoints.keep, run_id=checkpoints.run_id)
    return losses


def run_rank(
    doc: PlanDocument,
    *,
    steps: int,
    out_dir: Path,
    reference: bool,
    data_path: str | None,
    timeout_s: float,
    progress: bool,
    checkpoints: CheckpointOptions | None = None,
) -> dict | None:
    """Run this rank; rank 0 returns the report (also written to ``out_dir``), other ranks None.

    ``steps`` is the total: resumed from a checkpoint at step k, the rank runs steps k .. steps - 1."""
    from mixle_compile.runtime.em.plan import is_distribution
    from mixle_compile.runtime.rank import run_job

    options = dict(
        steps=steps,
        out_dir=out_dir,
        reference=reference,
        data_path=data_path,
        progress=progress,
        checkpoints=checkpoints or CheckpointOptions(),
    )
    if is_distribution(doc):  # a distribution model is fitted by EM (runtime/em/fit.py)
        from mixle_compile.runtime.em.fit import EMRank

        job = EMRank(doc, **options)
    else:
        job = NeuralRank(doc, **options)
    return run_job(job, doc.groups, out_dir=out_dir, timeout_s=timeout_s)


class NeuralRank:
    """One rank of a neural model's run, the steps ``rank.run_job`` calls: a (pipeline stage's)
    training session, resumed from a DCP checkpoint, trained, with the reference's repeat."""

    def __init__(
        self,
        doc: PlanDocument,
        *,
        steps: int,
        out_dir: Path,
        reference: bool,
        data_path: str | None,
        progress: bool,
        checkpoints: CheckpointOptions,
    ) -> None:
        self.doc, self.steps, self.out_dir, self.reference, self.data_path = doc, steps, out_dir, reference, data_path
        self.progress, self.checkpoints = progress, checkpoints
        self.session = self.comm = self.recorder = None
        self.resumed = None
        self.saved: list[dict] = []
        self.stage_stats = self.repeat_ledgers = None

    def prepare(self) -> int:
        self.instructions = read_instructions(self.doc)
        self.pipelined = self.instructions.plan.pp > 1
        self.source = token_source(self.instructions, self.data_path)
        return self.instructions.plan.world_size

    def open(self, mesh: Mesh) -> None:
        from mixle_compile.runtime.reference import Recorder

        self.mesh, self.device = mesh, device_for_rank()
        self.show = self.progress and mesh.rank == 0
        self.recorder = Recorder(keep_values=True) if self.reference else None
        self.session = open_rank_session(self.doc, self.instructions, mesh, device=self.device, recorder=self.recorder)
        self.comm = self.session.comm
        if self.checkpoints.resume is not None:
            from mixle_compile.runtime.checkpoint_dcp import load_session

            t0 = time.perf_counter()
            manifest = load_session(
                self.session, self.checkpoints.resume, hashes=False
            )  # the launcher verified every file's SHA-256
            self.session.step = batch_layout(self.instructions).step_at(manifest["data"]["samples_consumed"])
            self.resumed = {
                "path": str(self.checkpoints.resume),
                "step": self.session.step,
                "plan_digest": manifest["plan"]["content_digest"],
                "mesh": manifest["mesh"],
                "load_s": time.perf_counter() - t0,
            }
        self.first_step = self.session.step

    def train(self, receipts) -> None:
        from mixle_compile.runtime.checkpoint import source_description

        described: list[dict] = []

        def data_source() -> dict | None:  # rank 0 writes the manifest: only it hashes the token file, once
            if self.mesh.rank != 0:
                return None
            if not described:
                described.append(source_description(self.data_path, self.instructions.seed))
            return described[0]

        self.losses = train(
            self.session,
            self.source,
            self.steps,
            receipts=receipts,
            progress=self.show,
            checkpoints=self.checkpoints,
            data_source=data_source,
            saved=self.saved,
        )

    def gather(self, ledgers: list | None) -> None:
        from mixle_compile.runtime.reference import Recorder

        self.ledgers = ledgers
        if self.pipelined:
            self.stage_stats = self.comm.bookkeeping_gather_object(self.session.stats(), name="report:pipeline")
        if self.reference:
            # The repeat: the same job from the same start, for determinism (records as digests only).
            _say(self.show, "reference 1/3: the same run again from its first step, for determinism")
            repeat = Recorder(keep_values=False)
            again = open_rank_session(self.doc, self.instructions, self.mesh, device=self.device, recorder=repeat)
            train(again, self.source, self.steps, progress=self.show, label="repeat ")
            self.repeat_ledgers = again.comm.bookkeeping_gather_object(again.ledger.as_dict(), name="report:ledgers")
            evidence_dir = self.out_dir / "evidence"
            evidence_dir.mkdir(exist_ok=True)
            torch.save(
                {"first": self.recorder.entries, "repeat": {key: d for key, _, _, d in repeat.entries}},
                evidence_dir / f"rank{self.mesh.rank}.pt",
            )

    def close(self) -> None:
        self.session = self.comm = None

    def report(self, train_s: float) -> dict:
        doc, instructions, steps = self.doc, self.instructions, self.steps
        report = _report(
            instructions,
            self.ledgers,
            self.repeat_ledgers,
            self.losses,
            steps - self.first_step,
            train_s,
            self.data_path,
            stages=[s["stage"] for s in self.stage_stats] if self.pipelined else None,
        )
        if self.pipelined:
            from mixle_compile.runtime.pipeline_plan import pipeline_section

            report["pipeline"], problems = pipeline_section(doc, instructions, self.stage_stats)
            report["errors"].extend(problems)
            report["ok"] = not report["errors"]
        checkpoints = self.checkpoints
        report["run"].update(
            first_step=self.first_step,
            last_step=steps,
            resumed_from=self.resumed,
            checkpoints={
                "root": str(checkpoints.root) if checkpoints.root else None,
                "every": checkpoints.every,
                "saved": self.saved,
            },
        )
        if self.reference:
            self._add_evidence(report)
        return report

    def _add_evidence(self, report: dict) -> None:
        """The single-process reference, and every planned update's numerical evidence against it."""
        from mixle_compile.runtime.reference import compare, run_reference, with_evidence

        doc, instructions, steps, show = self.doc, self.instructions, self.steps, self.show
        _say(show, f"reference 2/3: the same model trained in one process, {steps} step(s)")
        every = max(1, steps // 10)
        records = run_reference(
            reference_instructions(doc, instructions),
            self.source,
            steps,
            progress=(
                lambda step, seconds: _say(
                    show and (step % every == 0 or step == steps), f"reference step {step}/{steps}  {seconds:.1f} s"
                )
            ),
        )
        _say(show, f"reference 3/3: comparing {len(doc.updates)} planned update(s) with the reference")
        saved = [
            torch.load(self.out_dir / "evidence" / f"rank{r}.pt", weights_only=True)
            for r in range(self.mesh.world_size)
        ]
        found = compare(records, saved)
        evidence_id = f"run-{instructions.content_digest.removeprefix('sha256:')[:12]}-{steps}"
        updates = [with_evidence(_planned_update(u), found.get(u.node_id), evidence_id) for u in doc.updates]
        tolerance = EVIDENCE_TOLERANCE[instructions.precision]
        # One verdict per update (the tied embedding's all_reduce is listed once per stage it joins).
        distinct = list({u.node_id: u for u in updates}.values())
        for u in distinct:
            if u.has_numerics_evidence and u.maximum_relative_error > tolerance:
                report["errors"].append(
                    f"{u.node_id}: relative error {u.maximum_relative_error:.2e} against the single-process "
                    f"reference exceeds {tolerance:.0e}"
                )
        for u in distinct:
            if not u.has_numerics_evidence:
                report["errors"].append(f"{u.node_id}: executed but no evidence was recorded")
        report["evidence"] = {"tolerance": tolerance, "run_id": evidence_id, "updates": [u.as_dict() for u in updates]}
        report["ok"] = not report["errors"]


def _planned_update(u):
    from mixle_compile.contracts import DistributedUpdate

    return DistributedUpdate.from_dict(u.update_fields())


def open_rank_session(doc: PlanDocument, instructions: Instructions, mesh: Mesh, *, device, recorder=None):
    """This rank's training session: a pipeline stage under pp > 1, else the whole (sharded) model."""
    if instructions.plan.pp > 1:
        from mixle_compile.runtime.pipeline import PipelineSession

        return PipelineSession(doc, instructions, mesh, device=device, recorder=recorder)
    return DistributedSession(instructions, mesh, device=device, recorder=recorder)


def reference_instructions(doc: PlanDocument, instructions: Instructions) -> Instructions:
    """What the single-process reference observes: the plan's activation sites, and under pp the
    residual stream at every virtual stage boundary (the stage-boundary transfers' evidence)."""
    if instructions.plan.pp == 1:
        return instructions
    import dataclasses

    from mixle_compile.runtime.pipeline_plan import read_layout

    sites = read_layout(doc).boundary_sites()
    return dataclasses.replace(instructions, activation_sites=(*instructions.activation_sites, *sites))


def _report(
    instructions: Instructions, ledgers, repeat_ledgers, losses, steps, train_s, data_path, stages=None
) -> dict:
    account = accounting(instructions, ledgers, steps, stages)
    errors = list(account["errors"])
    if repeat_ledgers is not None and [lg["updates"] for lg in repeat_ledgers] != [lg["updates"] for lg in ledgers]:
        errors.append("the repeated run issued different collectives from the first")
    plan = instructions.plan
    warnings = []
    if instructions.spec.training.activation_checkpointing != "none":
        warnings.append(
            f"training.activation_checkpointing={instructions.spec.training.activation_checkpointing!r} is not "
            "applied by "
            "this runtime: every activation is kept, so memory exceeds the plan's activation model"
        )
    return {
        "ok": not errors,
        "errors": errors,
        "warnings": warnings,
        "plan": {
            "content_digest": instructions.content_digest,
            "world_size": plan.world_size,
            "factorisation": plan.factorisation(),
            "degrees": plan.as_dict(),
            "family": instructions.family,
            "precision": instructions.precision,
            "optimizer": instructions.optimizer,
            "sequence_parallel": instructions.sequence_parallel,
        },
        "run": {
            "steps": steps,
            "train_s": train_s,
            "wall_s": train_s,
            "data": data_path or "synthetic",
            "torch": torch.__version__,
        },
        "losses": losses,
        "accounting": account,
        "evidence": None,
        "receipts": RECEIPTS_FILE,
    }


def write_failure(out_dir: Path, rank: int, exc: BaseException) -> None:
    info = {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    if isinstance(exc, CollectiveFailed):
        info.update(collective=exc.node_id, group=exc.rule, group_ranks=list(exc.ranks), timed_out=exc.timed_out)
    try:
        (out_dir / "errors").mkdir(parents=True, exist_ok=True)
        (out_dir / "errors" / f"rank{rank}.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    except OSError:
        pass


def die_with_launcher() -> None:
    """A rank started by the local launcher dies with it: Linux's parent-death signal (prctl
    PR_SET_PDEATHSIG) kills the rank when the launcher goes, even by SIGKILL, and a launcher already
    gone before the signal was armed is caught by comparing the parent's pid."""
    from mixle_compile.runtime.launch import LAUNCHER_ENV

    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher:
        return  # started by torchrun or by hand: that launcher owns the ranks' lifetime
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(launcher):
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    parser = argparse.ArgumentParser(prog="python -m mixle_compile.runtime.worker")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--data")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--save-every", type=int)
    parser.add_argument("--keep-checkpoints", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--run-id")
    args = parser.parse_args(argv)
    from mixle_compile.plan import load_plan_text

    out_dir = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    try:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        doc = load_plan_text(Path(args.plan).read_bytes(), args.plan)
        checkpoints = CheckpointOptions.from_worker_arguments(args)
        run_rank(
            doc,
            steps=args.steps,
            out_dir=out_dir,
            reference=args.reference,
            data_path=args.data,
            timeout_s=args.timeout,
            progress=args.progress,
            checkpoints=checkpoints,
        )
    except BaseException as exc:  # every failure leaves its note for the launcher
        write_failure(out_dir, rank, exc)
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: a communication thread still being torn down there can abort
    # a rank that has already finished its work and written its results.
    os._exit(code)
