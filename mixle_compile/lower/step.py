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
from mixle_compile.engines import EngineProfile, engine_profile
from mixle_compile.lower.compact import Loop, StageProgram, check_compact, compress, expand_all
from mixle_compile.lower.groups import RankGrid, rule_name
from mixle_compile.lower.schedule import Op, OpKind, ScheduleCheck, pipeline_bodies
from mixle_compile.lower.updates import PlannedUpdate
from mixle_compile.plan.ops import copy_op
from mixle_compile.schedules import pipelined

EXHAUSTIVE_RANKS = 16


@dataclass(frozen=True)
class StepSchedule:
    """One program per pipeline stage (every rank of a stage runs it), stated once with its
    repetition (:mod:`mixle_compile.lower.compact`), and the check of the step they expand to."""

    stages: tuple[StageProgram, ...]
    check: ScheduleCheck

    @property
    def programs(self) -> tuple[tuple[Op, ...], ...]:
        """The explicit programs, every op of the step (built on request: micro-steps x layers)."""
        return expand_all(self.stages)


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
    pipeline, virtual_stages = pipelined(pipeline, plan.pp, virtual_stages)
    per_run = engine.schedule_microbatches(plan.microbatches, plan.gradient_accumulation_steps)
    runs = plan.microbatches * plan.gradient_accumulation_steps // per_run
    one_run = pipeline_bodies(plan.pp, per_run, pipeline, virtual_stages, family=engine.schedules)
    by_phase: dict[tuple[str, int], list[PlannedUpdate]] = {}
    for u in updates:
        if u.update.collective is not CollectiveKind.P2P:
            by_phase.setdefault((u.phase, u.stage), []).append(u)

    # One checked collective op per (group rule, collective) and stage, a handful per step; each
    # update's op is a copy of it with the update's name and bytes (an update id is a name, its bytes
    # a count), so that planning many updates does not validate as many ops.
    templates: dict[tuple[tuple[str, ...], str, int], Op] = {}

    def template(axes: tuple[str, ...], tag: str, stage: int) -> Op:
        op = templates.get((axes, tag, stage))
        if op is None:
            op = templates[(axes, tag, stage)] = Op(OpKind.collective, stage, group=rule_name(axes), tag=tag)
        return op

    def ops(phase: str, stage: int) -> list[tuple[Op, int]]:
        return [
            (
                copy_op(
                    template(u.update.mesh_axes, u.update.collective._value_, stage),
                    name=u.update.node_id,
                    bytes=u.payload_bytes,
                ),
                u.occurrences_per_step,
            )
            for u in by_phase.get((phase, stage), ())
        ]

    stages = []
    for stage, body in enumerate(one_run):
        # Per-micro-batch phases get one copy per compute op from their anchor (_ANCHOR); step-level
        # phases repeat an update as often as it occurs in a step (FSDP reduces each accumulation window).
        stages.append(
            StageProgram(
                stage=stage,
                body=body,
                runs=runs,
                run_microbatches=per_run,
                run_batches=1 + max((_last_batch(item) for item in body), default=-1),
                optimizer=True,
                before_forward=tuple(op for op, _ in ops("forward", stage)),
                after_backward=tuple(op for op, _ in ops("backward", stage)),
                after_last_backward=tuple(ops("gradient", stage)),
                end=tuple(op for op, k in ops("parameter", stage) for _ in range(k)),
            )
        )
    # Ranks of a stage run one program, so one representative per stage is an exact check;
    # small worlds are also checked rank by rank.
    check = check_compact(stages, grid, exhaustive_limit=EXHAUSTIVE_RANKS, buffered_sends=engine.buffered_sends)
    return StepSchedule(tuple(stages), check)


def stated(programs: tuple[tuple[Op, ...], ...]) -> tuple[StageProgram, ...]:
    """Explicit programs (collectives in place) stated with their repetition: one run, no blocks."""
    return tuple(StageProgram(stage=s, body=compress(program), optimizer=False) for s, program in enumerate(programs))


def _last_batch(item: Op | Loop) -> int:
    """The highest batch number an op or a loop issues (-1: none)."""
    if isinstance(item, Loop):
        last = max((op.batch for op in item.ops if op.batch is not None), default=None)
        return -1 if last is None else last + (item.repeat - 1) * item.batch_step
    return -1 if item.batch is None else item.batch
