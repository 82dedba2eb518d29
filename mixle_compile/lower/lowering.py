"""The lowering pass: a verified spec becomes layouts, updates, groups, a schedule, memory and traffic."""

from __future__ import annotations

from dataclasses import dataclass

from mixle_compile.contracts import ParallelPlan
from mixle_compile.diagnostics import Diagnostic
from mixle_compile.engines import engine_profile
from mixle_compile.layer_split import split_layers
from mixle_compile.lower.compact import check_compact
from mixle_compile.lower.exactly_once import ReductionProblem, check_exactly_once
from mixle_compile.lower.groups import RankGrid
from mixle_compile.lower.layouts import PlacedParameter, place_parameters
from mixle_compile.lower.memory import StageMemory, TrafficEntry, stage_memory, traffic
from mixle_compile.lower.runs import EACH_BLOCK, LayerRuns, transformer_runs
from mixle_compile.lower.step import EXHAUSTIVE_RANKS, StepSchedule, grid_for, stated, step_schedule
from mixle_compile.lower.updates import PlannedUpdate, activation_updates, gradient_updates
from mixle_compile.parameters import model_parameters
from mixle_compile.plan.programs import IN_BODY
from mixle_compile.spec.load import SourceDocument
from mixle_compile.spec.models import DistributionModel, Spec, TransformerModel, parallel_plan


@dataclass(frozen=True)
class Lowered:
    plan: ParallelPlan
    parameters: tuple[PlacedParameter, ...]
    updates: tuple[PlannedUpdate, ...]
    memory: tuple[StageMemory, ...]
    traffic: tuple[TrafficEntry, ...]
    reduction_problems: tuple[ReductionProblem, ...]
    grid: RankGrid
    schedule: StepSchedule | None  # None when not requested (large plans check it on demand)
    decomposition: dict | None = None  # the model cut of a distribution model (ModelDecomposition.as_dict())
    diagnostics: tuple[Diagnostic, ...] = ()
    # The blocks a run of blocks that lower alike is stated by (lower/runs.py): parameters, updates
    # and the stage programs list the first block of each run only. None: every block is listed.
    layer_runs: LayerRuns | None = None

    def count(self, layer: int | None) -> int:
        """How many blocks of its stage an entry of ``layer`` stands for."""
        return (self.layer_runs or EACH_BLOCK).count(layer)

    def on_stages(self, layer: int | None, stage: int) -> range:
        """The pipeline stages an entry of ``layer`` listed on ``stage`` stands for (lower/runs.py)."""
        return (self.layer_runs or EACH_BLOCK).on_stages(layer, stage)


def lower(
    spec: Spec, *, schedule: bool = True, document: SourceDocument | None = None, each_layer: bool = False
) -> Lowered:
    """Lower a spec that passed `check` (its mesh fits its devices and its model).

    `schedule=False` skips building and checking the per-step programs. `document` lets
    diagnostics point at the spec's source. A transformer's runs of blocks that lower alike are
    lowered once each (:mod:`mixle_compile.lower.runs`); `each_layer=True` lowers every block (the
    same plan, built the long way).
    """
    if isinstance(spec.model, DistributionModel):
        return _lower_distribution(spec, schedule=schedule, document=document)
    plan = parallel_plan(spec)
    t = spec.training
    num_layers = spec.model.num_layers if isinstance(spec.model, TransformerModel) else _module_layers(spec)
    kv_heads = (spec.model.num_kv_heads or spec.model.num_heads) if isinstance(spec.model, TransformerModel) else None
    engine = engine_profile(spec.backend)
    # A modules model's layers take the balanced split: the engines' rules are for transformers.
    split_engine = engine.name if isinstance(spec.model, TransformerModel) else "torch"
    mtp = spec.model.mtp_num_layers if isinstance(spec.model, TransformerModel) else 0
    split = split_layers(max(num_layers, 1), plan.pp, t.virtual_pipeline_stages, t.pipeline_layers, split_engine, mtp)
    runs = None
    if isinstance(spec.model, TransformerModel) and not each_layer:
        # A small world's schedule is checked rank by rank, on every stage's own collectives; a large
        # one's on a representative per stage, where a block's collectives (inside one stage) are
        # left out of the simulation, so its alike stages are listed once (lower/runs.py).
        runs = transformer_runs(spec.model, split, fold_stages=plan.world_size > EXHAUSTIVE_RANKS)
    listed = runs.first_layers if runs is not None else range(num_layers + mtp)
    placed = place_parameters(
        model_parameters(spec, listed),
        plan,
        num_layers=num_layers,
        virtual_stages=t.virtual_pipeline_stages,
        distributed_optimizer=t.distributed_optimizer,
        num_kv_heads=kv_heads,
        fsdp_over_cp=engine.fsdp_over_cp,
        layer_split=split,
    )
    stage_of = {i: split.location(i)[0] for i in listed}
    updates = tuple(
        gradient_updates(
            placed,
            plan,
            sequence_parallel=t.sequence_parallel,
            distributed_optimizer=t.distributed_optimizer,
            microbatches_per_step=plan.microbatches * plan.gradient_accumulation_steps,
        )
        + activation_updates(spec, plan, stage_of, listed)
    )
    grid = grid_for(plan, updates, spec.mesh.order)
    steps = (
        step_schedule(
            plan,
            updates,
            grid,
            pipeline=t.pipeline_schedule,
            virtual_stages=t.virtual_pipeline_stages,
            engine=engine,
            layer_runs=runs or EACH_BLOCK,
            group=t.microbatch_group_size,
        )
        if schedule
        else None
    )
    return Lowered(
        plan=plan,
        parameters=placed,
        updates=updates,
        memory=stage_memory(spec, plan, placed, split, runs or EACH_BLOCK),
        traffic=traffic(updates, runs or EACH_BLOCK),
        reduction_problems=check_exactly_once(
            placed, updates, plan, sequence_parallel=t.sequence_parallel, num_kv_heads=kv_heads
        ),
        grid=grid,
        schedule=steps,
        layer_runs=runs,
    )


def _lower_distribution(spec: Spec, *, schedule: bool, document: SourceDocument | None) -> Lowered:
    # Imported here: the graph costs networkx's import, which neural plans do not need.
    from mixle_compile.graph import build_model_graph
    from mixle_compile.lower.distribution import check_statistics_once, lower_distribution

    plan = parallel_plan(spec)
    graph = build_model_graph(spec, document)
    base_grid = RankGrid.from_plan(plan, order=spec.mesh.order)
    low = lower_distribution(spec, plan, graph, base_grid)
    grid = grid_for(plan, low.updates, spec.mesh.order)
    steps = None
    if schedule and not any(d.severity.value == "error" for d in low.diagnostics):
        buffered = engine_profile(spec.backend).buffered_sends
        programs = stated(low.programs)
        steps = StepSchedule(
            programs,
            check_compact(programs, grid, exhaustive_limit=EXHAUSTIVE_RANKS, buffered_sends=buffered),
            collectives=IN_BODY,  # the EM step's collectives sit in its program
        )
    return Lowered(
        plan=plan,
        parameters=low.parameters,
        updates=low.updates,
        memory=low.memory,
        traffic=traffic(low.updates),
        reduction_problems=check_statistics_once(graph, low, plan),
        grid=grid,
        schedule=steps,
        decomposition=low.decomposition.as_dict(),
        diagnostics=tuple(graph.diagnostics) + low.diagnostics,
    )


def _module_layers(spec: Spec) -> int:
    layers = [p.layer for p in model_parameters(spec) if p.layer is not None]
    return max(layers) + 1 if layers else 1
