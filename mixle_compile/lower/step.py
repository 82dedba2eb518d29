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
from mixle_compile.lower.compact import Loop, StageProgram, check_compact, compress, expand_all, within_stage
from mixle_compile.lower.groups import RankGrid, rule_name
from mixle_compile.lower.runs import EACH_BLOCK, LayerRuns
from mixle_compile.lower.schedule import Op, OpKind, ScheduleCheck, pipeline_bodies
from mixle_compile.lower.updates import PlannedUpdate
from mixle_compile.plan.ops import copy_op
from mixle_compile.plan.programs import BY_PHASE, NO_COLLECTIVES, Placement, phase_collectives
from mixle_compile.schedules import ScheduleFamily, pipelined

EXHAUSTIVE_RANKS = 16


@dataclass(frozen=True)
class StepSchedule:
    """One program per pipeline stage (every rank of a stage runs it), stated once with its
    repetition (:mod:`mixle_compile.lower.compact`), and the check of the step they expand to."""

    stages: tuple[StageProgram, ...]
    check: ScheduleCheck
    # How the plan states the programs' collectives (plan/programs.py): as its updates, placed by their
    # phase, or in the programs' bodies (a distribution model's EM step).
    collectives: str = BY_PHASE

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
    layer_runs: LayerRuns = EACH_BLOCK,
    group: int | None = None,
) -> StepSchedule:
    """The step's stage programs and their check. ``layer_runs``: the updates list a block of each run
    (lower/runs.py); a run listed once for several stages puts its collectives on the first of them
    only when their group lies inside one stage: the check, on one rank per stage, leaves such a
    collective out of the simulation on every stage alike (lower/compact.py), and the plan's readers
    place every stage's own from the unfolded updates."""
    engine = engine or engine_profile("torch")
    pipeline, virtual_stages = pipelined(pipeline, plan.pp, virtual_stages)
    per_run = engine.schedule_microbatches(plan.microbatches, plan.gradient_accumulation_steps)
    runs = plan.microbatches * plan.gradient_accumulation_steps // per_run
    # Megatron's interleaved micro-batch group (training.microbatch_group_size; P013 keeps it off the others)
    group = group if engine.schedules is ScheduleFamily.MEGATRON else None
    one_run = pipeline_bodies(plan.pp, per_run, pipeline, virtual_stages, family=engine.schedules, group=group)
    # One checked collective op per (group rule, collective) and stage, a handful per step; each
    # update's op is a copy of it with the update's name and bytes (an update id is a name, its bytes
    # a count), so that planning many updates does not validate as many ops.
    templates: dict[tuple[tuple[str, ...], str, int], Op] = {}

    def collective(u: Placement) -> Op:
        key = (u.mesh_axes, u.collective, u.stage)
        op = templates.get(key)
        if op is None:
            op = templates[key] = Op(OpKind.collective, u.stage, group=rule_name(u.mesh_axes), tag=u.collective)
        return copy_op(op, name=u.name, bytes=u.bytes)

    inside: dict[tuple[str, ...], bool] = {}

    def placements():
        for u in updates:
            axes = tuple(u.update.mesh_axes)
            stages = layer_runs.on_stages(u.layer, u.stage)
            if len(stages) > 1:
                found = inside.get(axes)
                if found is None:
                    found = inside[axes] = within_stage(grid, rule_name(axes))
                if found:
                    stages = (u.stage,)
            for stage in stages:
                yield Placement(
                    u.phase,
                    stage,
                    axes,
                    u.update.collective._value_,
                    u.update.node_id,
                    u.payload_bytes,
                    u.occurrences_per_step,
                )

    # Where each collective goes is the plan's rule (plan/programs.py), which its readers apply too.
    placed = phase_collectives(placements(), collective)
    stages = []
    for stage, body in enumerate(one_run):
        on_stage = placed.get(stage, NO_COLLECTIVES)
        stages.append(
            StageProgram(
                stage=stage,
                body=body,
                runs=runs,
                run_microbatches=per_run,
                run_batches=1 + max((_last_batch(item) for item in body), default=-1),
                optimizer=True,
                before_forward=on_stage.before_forward,
                after_backward=on_stage.after_backward,
                after_last_backward=on_stage.after_last_backward,
                end=on_stage.end,
            )
        )
    # Ranks of a stage run one program, so one representative per stage is an exact check;
    # small worlds are also checked rank by rank.
    buffered = engine.sends_buffered(plan.pp, group)
    check = check_compact(stages, grid, exhaustive_limit=EXHAUSTIVE_RANKS, buffered_sends=buffered)
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
