"""The run report: planned versus observed collectives, losses, and numerical evidence.

Torch-free, so the launcher reads a report without importing torch. Accounting is exact: for every
planned update and every rank that executes it (every rank; under pipeline parallelism the ranks
of the update's stage, and both ends of a stage-boundary transfer), the observed count must equal
``occurrences_per_step * steps`` and the observed bytes ``payload_bytes`` times that, and every
other rank must not have issued it; any difference, and any collective the plan does not declare,
is an error of the run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mixle_compile.contracts import DistributedUpdate
from mixle_compile.runtime.instructions import Instructions

REPORT_FILE = "report.json"
RECEIPTS_FILE = "receipts.jsonl"

# What "within tolerance" means for the reference comparison (norm-wise relative error), per
# precision. fp32 runs agree to about 1e-5 after a few AdamW steps on gloo, but AdamW's epsilon
# turns the rounding noise of a gradient element that is itself near 1e-8 into a visible step, which
# costs a small tensor up to about 1e-3; a real replay error (a missed or doubled reduction, a wrong
# divisor, a mis-sliced shard) is of order 1e-1 or more. bf16 keeps 8 bits of mantissa.
EVIDENCE_TOLERANCE = {"fp32": 1e-2, "bf16": 1e-1}


def accounting(
    instructions: Instructions, ledgers: Sequence[Mapping], steps: int, stages: Sequence[int] | None = None
) -> dict:
    """Planned vs observed per update, over every rank's ledger (see Ledger.as_dict).

    ``stages``: the pipeline stage of every rank (pp > 1); an update is then planned on the ranks of
    the stages that execute it (runtime/pipeline_plan.py) and planned zero times on every other rank."""
    from mixle_compile.runtime.pipeline_plan import executing_stages

    rows = []
    errors = []
    for node_id, c in instructions.collectives.items():
        planned_count = c.occurrences_per_step * steps
        planned_bytes = c.payload_bytes * planned_count
        observed = [tuple(ledger["updates"].get(node_id, (0, 0))) for ledger in ledgers]
        if stages is None:
            executing = list(range(len(ledgers)))
        else:
            where = executing_stages(c)
            executing = [r for r in range(len(ledgers)) if stages[r] in where]
        planned = [(planned_count, planned_bytes) if r in executing else (0, 0) for r in range(len(ledgers))]
        seen = [observed[r] for r in executing]
        counts = sorted({o[0] for o in seen})
        sizes = sorted({o[1] for o in seen})
        bad = [r for r in range(len(ledgers)) if observed[r] != planned[r]]
        match = not bad
        if bad:
            r = bad[0]
            errors.append(
                f"{node_id}: planned {planned[r][0]} x {c.collective} ({planned[r][1]} bytes) on rank {r} over "
                f"{steps} step(s), "
                f"observed {observed[r][0]} ({observed[r][1]} bytes)"
                + (f"; and {len(bad) - 1} more rank(s) differ" if len(bad) > 1 else "")
            )
        row = {
            "node_id": node_id,
            "collective": c.collective,
            "group": c.rule,
            "phase": c.phase,
            "planned_count": planned_count,
            "planned_bytes": planned_bytes,
            "observed_count": counts[0] if len(counts) == 1 else counts,
            "observed_bytes": sizes[0] if len(sizes) == 1 else sizes,
            "match": match,
        }
        if stages is not None:
            row["ranks"] = executing
        rows.append(row)
    for r, ledger in enumerate(ledgers):
        for node_id in sorted(set(ledger["updates"]) - set(instructions.collectives)):
            errors.append(f"{node_id}: rank {r} issued a collective the plan does not declare")
    bookkeeping: dict[str, list[int]] = {}
    for ledger in ledgers:
        for name, (count, nbytes) in ledger["bookkeeping"].items():
            total = bookkeeping.setdefault(name, [0, 0])
            total[0] += count
            total[1] += nbytes
    return {
        "ok": not errors,
        "errors": errors,
        "updates": rows,
        "updates_checked": len(rows),
        "ranks_checked": len(ledgers),
        "collective_calls_per_rank": [ledger["calls"] for ledger in ledgers],
        "bookkeeping": bookkeeping,
        "all_to_all_traffic": all_to_all_traffic(instructions, ledgers),
    }


def all_to_all_traffic(instructions: Instructions, ledgers: Sequence[Mapping]) -> dict:
    """Per all_to_all update whose traffic depends on the data (the expert-parallel token exchanges):
    the bytes every rank sent to and received from the other ranks of its group, summed over the
    ranks, against the plan's traffic model ((n - 1) / n of ``payload_bytes`` per call and rank,
    which assumes every rank sends equally to every other), and their ratio. The counted bytes of
    these updates (the accounting) are the rows each rank routes, which the plan states exactly."""
    out = {}
    for node_id in sorted({k for ledger in ledgers for k in ledger.get("exchanged", {})}):
        c = instructions.collectives[node_id]
        calls = sum(ledger.get("exchanged", {}).get(node_id, (0, 0, 0))[0] for ledger in ledgers)
        sent = sum(ledger.get("exchanged", {}).get(node_id, (0, 0, 0))[1] for ledger in ledgers)
        received = sum(ledger.get("exchanged", {}).get(node_id, (0, 0, 0))[2] for ledger in ledgers)
        modelled = calls * c.payload_bytes * (c.group_size - 1) / c.group_size
        out[node_id] = {
            "calls": calls,
            "sent_bytes": sent,
            "received_bytes": received,
            "modelled_bytes": modelled,
            "measured_over_modelled": sent / modelled if modelled else None,
        }
    return out


@dataclass(frozen=True)
class RunReport:
    """What `run` returns and writes (``report.json`` in the output directory)."""

    ok: bool
    errors: tuple[str, ...]
    out_dir: str
    steps: int
    world_size: int
    losses: tuple[float, ...]
    wall_s: float
    accounting_ok: bool
    updates_checked: int
    collective_calls_per_rank: tuple[int, ...]
    evidence: tuple[DistributedUpdate, ...] | None = None
    evidence_tolerance: float | None = None
    warnings: tuple[str, ...] = ()
    data: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def report_path(self) -> Path:
        return Path(self.out_dir) / REPORT_FILE

    @property
    def receipts_path(self) -> Path:
        return Path(self.out_dir) / RECEIPTS_FILE

    @property
    def max_relative_error(self) -> float | None:
        if not self.evidence:
            return None
        return max((u.maximum_relative_error or 0.0) for u in self.evidence if u.has_numerics_evidence)

    @property
    def max_absolute_error(self) -> float | None:
        if not self.evidence:
            return None
        return max((u.maximum_absolute_error or 0.0) for u in self.evidence if u.has_numerics_evidence)

    @staticmethod
    def from_dict(data: Mapping, out_dir: str | Path) -> RunReport:
        evidence = data.get("evidence")
        return RunReport(
            ok=bool(data["ok"]),
            errors=tuple(data["errors"]),
            out_dir=str(out_dir),
            steps=int(data["run"]["steps"]),
            world_size=int(data["plan"]["world_size"]),
            losses=tuple(float(x) for x in data["losses"]),
            wall_s=float(data["run"]["wall_s"]),
            accounting_ok=bool(data["accounting"]["ok"]),
            updates_checked=int(data["accounting"]["updates_checked"]),
            collective_calls_per_rank=tuple(data["accounting"]["collective_calls_per_rank"]),
            evidence=None if evidence is None else tuple(DistributedUpdate.from_dict(u) for u in evidence["updates"]),
            evidence_tolerance=None if evidence is None else float(evidence["tolerance"]),
            warnings=tuple(data.get("warnings", ())),
            data=dict(data),
        )

    @staticmethod
    def read(out_dir: str | Path) -> RunReport:
        path = Path(out_dir) / REPORT_FILE
        return RunReport.from_dict(json.loads(path.read_text(encoding="utf-8")), out_dir)

    def summary(self) -> str:
        lines = []
        first, last = (self.losses[0], self.losses[-1]) if self.losses else (float("nan"), float("nan"))
        run = self.data.get("run", {})
        resumed = run.get("resumed_from")
        # numbered from 1, as the progress lines and the checkpoints are: resumed after step 1 of 3, it ran steps 2..3
        span = f" (steps {run['first_step'] + 1}..{run['last_step']})" if resumed else ""
        lines.append(
            f"ran {self.steps} step(s){span} on {self.world_size} rank(s) in {self.wall_s:.1f} s: loss "
            f"{first:.4f} -> {last:.4f}"
        )
        if resumed:
            mesh = resumed.get("mesh", {})
            lines.append(
                f"resumed from {resumed['path']} (step {resumed['step']}, saved on "
                f"{mesh.get('world_size', '?')} rank(s), "
                f"plan {str(resumed.get('plan_digest', '?'))[:19]}), loaded in {resumed.get('load_s', 0.0):.2f} s"
            )
        saved = (run.get("checkpoints") or {}).get("saved") or []
        if saved:
            lines.append(
                f"checkpoints: {len(saved)} saved in {run['checkpoints']['root']}, latest step {saved[-1]['step']} "
                f"({max(s['save_s'] for s in saved):.2f} s per save at most)"
            )
        calls = self.collective_calls_per_rank
        lines.append(
            f"accounting: {self.updates_checked} planned updates, planned == observed on every rank: "
            f"{'yes' if self.accounting_ok else 'NO'} "
            f"({min(calls) if calls else 0}-{max(calls) if calls else 0} collective calls per rank)"
        )
        if self.evidence is not None:
            measured = [u for u in self.evidence if u.has_numerics_evidence]
            deterministic = all(u.determinism_observed for u in measured)
            lines.append(
                f"evidence: {len({u.node_id for u in measured})} updates against the single-process reference, "
                "max relative error "
                f"{self.max_relative_error:.2e} (tolerance {self.evidence_tolerance:.0e}), max absolute error "
                f"{self.max_absolute_error:.2e}, bitwise deterministic on repeat: {'yes' if deterministic else 'no'}"
            )
        pipeline = self.data.get("pipeline")
        if pipeline:
            idle = pipeline.get("idle_fraction")
            per_stage = ", ".join(
                f"{v:.2f}" if v is not None else "?" for v in pipeline.get("idle_fraction_per_stage", {}).values()
            )
            lines.append(
                f"pipeline: {pipeline['schedule']}, pp={pipeline['pp']}"
                + (f" x {pipeline['virtual_stages']} virtual stages" if pipeline["virtual_stages"] > 1 else "")
                + f", {pipeline['micro_steps']} micro-batches per step: measured idle fraction "
                + (f"{idle:.2f} (per stage {per_stage})" if idle is not None else "not measured")
                + f", the plan's bubble model {pipeline['bubble_model']:.2f}"
                + (
                    f" ({pipeline['bubble_model_per_step']:.2f} over the step's micro-batches)"
                    if abs(pipeline["bubble_model_per_step"] - pipeline["bubble_model"]) > 1e-12
                    else ""
                )
            )
        for warning in self.warnings:
            lines.append(f"warning: {warning}")
        for error in self.errors[:10]:
            lines.append(f"error: {error}")
        if len(self.errors) > 10:
            lines.append(f"... and {len(self.errors) - 10} more error(s) in {self.report_path}")
        lines.append(f"report: {self.report_path}  receipts: {self.receipts_path}")
        return "\n".join(lines)
