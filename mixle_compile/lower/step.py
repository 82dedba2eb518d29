"""One training step's programs: the pipeline schedule with every planned collective in place.

Per stage: the pipeline schedule's forward and backward ops (and their p2p sends and receives,
which carry the PP updates); before each forward, the forward-phase collectives of that stage
(FSDP parameter gathers, then the per-layer TP/CP/EP activation collectives in layer order); after
each backward, the backward-phase ones; after the last backward, the gradient reductions in the
plan's order (tied syncs first); after the optimizer step, the parameter gathers of a distributed
optimizer. The programs are then checked: every group issues the same collectives in the same
order, every send meets its receive, and no rank waits in a cycle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mixle_compile.contracts import CollectiveKind, ParallelPlan
from mixle_compile.lower.groups import RankGrid, rule_name
from mixle_compile.engines import EngineProfile, engine_profile
from mixle_compile.lower.schedule import (
    Op,
    OpKind,
    ScheduleCheck,
    check_schedule,
    collective,
    insert_collectives,
    pipeline_schedule,
)
from mixle_compile.lower.updates import PlannedUpdate

EXHAUSTIVE_RANKS = 16

# Gradient reductions go in first, so that they land after the last backward's p2p batch; the
# per-micro-batch collectives inserted later sit right next to their compute op, before any send.
# (A tied-weight all_reduce placed before the last stage's final gradient send deadlocks stage 0.)
_ANCHOR = {"gradient": "after_last_backward", "parameter": "end", "forward": "before_forward", "backward": "after_backward"}


@dataclass(frozen=True)
class StepSchedule:
    programs: tuple[tuple[Op, ...], ...]  # one per pipeline stage; ranks of a stage run the same program
    check: ScheduleCheck


def grid_for(plan: ParallelPlan, updates: tuple[PlannedUpdate, ...], order: str | None) -> RankGrid:
    extra = sorted({tuple(u.update.mesh_axes) for u in updates if u.update.collective is not CollectiveKind.P2P})
    return RankGrid.from_plan(plan, order=order, extra_rules=[axes for axes in extra if axes != ("tied",)])


def step_schedule(
    plan: ParallelPlan,
    updates: tuple[PlannedUpdate, ...],
    grid: RankGrid,
    *,
    pipeline: str,
    virtual_stages: int,
    engine: EngineProfile | None = None,
) -> StepSchedule:
    engine = engine or engine_profile("torch")
    if plan.pp == 1:
        pipeline, virtual_stages = "gpipe", 1
    per_run = engine.schedule_microbatches(plan.microbatches, plan.gradient_accumulation_steps)
    runs = plan.microbatches * plan.gradient_accumulation_steps // per_run
    programs = _repeated(pipeline_schedule(plan.pp, per_run, pipeline, virtual_stages, family=engine.schedules), runs, per_run)
    for phase, anchor in _ANCHOR.items():
        for stage in range(plan.pp):
            # Per-micro-batch phases get one copy per compute op from the anchor; step-level phases
            # repeat an update as often as it occurs in a step (FSDP reduces each accumulation window).
            copies = (lambda u: 1) if phase in ("forward", "backward") else (lambda u: u.occurrences_per_step)
            ops = [
                collective(u.update.node_id, rule_name(u.update.mesh_axes), tag=u.update.collective.value, bytes=u.payload_bytes)
                for u in updates
                if u.phase == phase and u.stage == stage and u.update.collective is not CollectiveKind.P2P
                for _ in range(copies(u))
            ]
            if ops:
                programs = insert_collectives(programs, ops, at=anchor, stages=[stage])
    # Ranks of a stage run one program, so one representative per stage is an exact check;
    # small worlds are also checked rank by rank.
    check = check_schedule(programs, grid, exhaustive_limit=EXHAUSTIVE_RANKS, buffered_sends=engine.buffered_sends)
    return StepSchedule(programs, check)


def _repeated(programs: tuple[tuple[Op, ...], ...], runs: int, per_run: int) -> tuple[tuple[Op, ...], ...]:
    """A step of `runs` schedule runs back to back (torchtitan runs one per accumulation step), the
    micro-batches and point-to-point batches of each run numbered after the last; one optimizer step."""
    if runs == 1:
        return programs
    out = []
    for program in programs:
        body = [op for op in program if op.kind is not OpKind.optimizer]
        batches = 1 + max((op.batch for op in body if op.batch is not None), default=-1)
        ops = [
            dataclasses.replace(
                op,
                microbatch=None if op.microbatch is None else op.microbatch + r * per_run,
                batch=None if op.batch is None else op.batch + r * batches,
            )
            for r in range(runs)
            for op in body
        ]
        out.append(tuple(ops) + tuple(op for op in program if op.kind is OpKind.optimizer))
    return tuple(out)
