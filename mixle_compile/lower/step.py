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

from dataclasses import dataclass

from mixle_compile.contracts import CollectiveKind, ParallelPlan
from mixle_compile.lower.groups import RankGrid, rule_name
from mixle_compile.lower.schedule import Op, ScheduleCheck, check_schedule, collective, insert_collectives, pipeline_schedule
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
    extra = sorted({tuple(u.update.mesh_axes) for u in updates if u.update.collective is not CollectiveKind.p2p})
    return RankGrid.from_plan(plan, order=order, extra_rules=[axes for axes in extra if axes != ("tied",)])


def step_schedule(
    plan: ParallelPlan,
    updates: tuple[PlannedUpdate, ...],
    grid: RankGrid,
    *,
    pipeline: str,
    virtual_stages: int,
) -> StepSchedule:
    micro_steps = plan.microbatches * plan.gradient_accumulation_steps
    if plan.pp == 1:
        pipeline, virtual_stages = "gpipe", 1
    programs = pipeline_schedule(plan.pp, micro_steps, pipeline, virtual_stages)
    for phase, anchor in _ANCHOR.items():
        for stage in range(plan.pp):
            # Per-micro-batch phases get one copy per compute op from the anchor; step-level phases
            # repeat an update as often as it occurs in a step (FSDP reduces each accumulation window).
            copies = (lambda u: 1) if phase in ("forward", "backward") else (lambda u: u.occurrences_per_step)
            ops = [
                collective(u.update.node_id, rule_name(u.update.mesh_axes), tag=u.update.collective.value, bytes=u.payload_bytes)
                for u in updates
                if u.phase == phase and u.stage == stage and u.update.collective is not CollectiveKind.p2p
                for _ in range(copies(u))
            ]
            if ops:
                programs = insert_collectives(programs, ops, at=anchor, stages=[stage])
    # Ranks of a stage run one program, so one representative per stage is an exact check;
    # small worlds are also checked rank by rank.
    return StepSchedule(programs, check_schedule(programs, grid, exhaustive_limit=EXHAUSTIVE_RANKS))
