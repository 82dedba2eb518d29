"""Lowering a distribution model fitted by EM: statistics over data ranks, units cut over tp.

The mesh says how many ranks share one copy of the data (dp_replicate * dp_shard) and how many
split the model (tp). The model cut is the decomposition's optimal contiguous cut of the best axis
(components of a mixture, factors of a composite) over the devices of one tp group; every tp group
uses the same cut. Per EM iteration, for each micro-batch of rows:

- E-step: each rank scores its own units; when the cut is a component cut, the posterior
  normaliser is a logsumexp across the tp group (all_reduce max, then all_reduce sum of
  exponentials); a factor cut sums the factors' log-likelihoods (all_reduce sum).
- M-step: every node's sufficient statistics are summed over the data ranks (all_reduce sum),
  and over tp as well for a node held whole on every shard while units on several shards use it
  (an HMM's shared transitions under a component cut); each unit is updated by the rank that
  owns it.

Statistics travel in float64 whatever ``training.precision`` says (EM runs in float64), one row
per instance of the node: its parameters' count plus the weight the leaf saw, where the maximiser
needs it (see ``STATISTICS_BEYOND_PARAMETERS``). A shard of a cut holds the rows of the units its
rank owns, padded to the largest rank's share.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import TYPE_CHECKING

from mixle_compile.contracts import (
    CollectiveKind,
    DistributedUpdate,
    ParallelPlan,
    ParameterLayout,
    PayloadKind,
    StateLayout,
)
from mixle_compile.decompose import Device, ModelDecomposition, decompose_model, devices_from_resources
from mixle_compile.diagnostics import Code, Diagnostic, register_code
from mixle_compile.graph import DecompAxis, ModelGraph, ReductionOp
from mixle_compile.lower.groups import RankGrid
from mixle_compile.lower.layouts import PlacedParameter
from mixle_compile.lower.memory import StageMemory
from mixle_compile.lower.schedule import Op, OpKind
from mixle_compile.lower.updates import PlannedUpdate, group_size
from mixle_compile.parameters import DTYPE_BYTES, Parameter
from mixle_compile.plan.vocabulary import DATA_PARALLEL_AXES, REPLICATE, Axis, Shard, UpdateId, rule_name
from mixle_compile.spec.models import Spec

if TYPE_CHECKING:
    from mixle_compile.lower.exactly_once import ReductionProblem

# Statistics elements per instance beyond the node's parameters: a Gaussian's mean and covariance,
# a Poisson's or exponential's rates need the total weight the leaf saw (the occupancy of an HMM
# state, the responsibility of a mixture component). A categorical's value counts sum to it; a
# mixture's responsibility sums and the transitions' expected initial states and transition counts
# have as many elements as the probabilities they estimate.
STATISTICS_BEYOND_PARAMETERS = {"gaussian": 1, "poisson": 1, "exponential": 1}
STATISTICS_BYTES = 8  # float64

# EM cuts these axes; cutting HMM states or sequence positions would need a collective per time
# step inside forward-backward.
EM_CUT_AXES = (DecompAxis.COMPONENT, DecompAxis.FACTOR)

UNSUPPORTED_AXIS = register_code(
    Code(
        "L001",
        "axis-not-for-em",
        "A mesh axis that a distribution model fitted by EM cannot use.",
        "A distribution model is fitted by EM with data-parallel ranks (dp_replicate, dp_shard) and "
        "a model cut over tp (mixture components or composite factors across ranks). Pipeline, "
        "context and expert parallelism have no meaning for it: set pp, cp, ep and etp to 1.",
    )
)
NOTHING_TO_CUT = register_code(
    Code(
        "L002",
        "nothing-to-cut",
        "mesh.tp > 1 but the model has no component or factor axis to cut across tp ranks.",
        "For a distribution model, tp ranks split the model's units (mixture components, composite "
        "factors). A model without such an axis, or with fewer units than tp, cannot use them: lower "
        "tp or move those ranks to dp_replicate.",
    )
)


@dataclass(frozen=True)
class DistributionLowering:
    parameters: tuple[PlacedParameter, ...]
    updates: tuple[PlannedUpdate, ...]
    memory: tuple[StageMemory, ...]
    programs: tuple[tuple[Op, ...], ...]
    decomposition: ModelDecomposition
    diagnostics: tuple[Diagnostic, ...]


def lower_distribution(spec: Spec, plan: ParallelPlan, graph: ModelGraph, grid: RankGrid) -> DistributionLowering:
    diagnostics = [
        graph.diagnostic(
            UNSUPPORTED_AXIS.code,
            f"mesh.{axis}={plan.size(axis)} has no meaning for a distribution model fitted by EM",
            ("mesh", axis),
            hint=f"set mesh.{axis} to 1",
        )
        for axis in ("pp", "cp", "ep", "etp")
        if plan.size(axis) > 1
    ]
    t = spec.training
    dtype_bytes = DTYPE_BYTES[t.precision]
    data_axes = tuple(a for a in DATA_PARALLEL_AXES if plan.size(a) > 1)
    rows_per_rank = max(1, t.global_batch_size // plan.data_parallel_size)
    all_devices = devices_from_resources(spec.resources)
    tp_group = grid.rule(("tp",)).group(0) if plan.tp > 1 else (0,)
    devices = tuple(all_devices[r] for r in tp_group)
    decomposition = decompose_model(
        graph,
        [Device(i, d.kind, d.memory_bytes, d.throughput, d.throughput_stated) for i, d in enumerate(devices)],
        n_data=rows_per_rank,
        min_components_per_shard=1,
        prefer_data_parallel=plan.tp == 1,
        allowed_axes=EM_CUT_AXES,
    )
    diagnostics += list(decomposition.diagnostics)
    cut = decomposition if decomposition.is_model_parallel else None
    if plan.tp > 1 and cut is None:
        diagnostics.append(
            graph.diagnostic(
                NOTHING_TO_CUT.code,
                f"mesh.tp={plan.tp} asks for a model cut, but {decomposition.rationale}",
                ("mesh", "tp"),
                hint="set mesh.tp to 1 and give those ranks to dp_replicate",
            )
        )

    # Which tp coordinate holds each unit of the cut node.
    unit_owner: dict[int, int] = {}
    if cut is not None:
        for c in cut.cuts:
            for position in range(c.start, c.stop):
                unit_owner[cut.permutation[position] if cut.permutation else position] = c.device.rank
    # A shard holds the units its rank owns, padded to the largest share (the cut may be uneven).
    largest_share = max((list(unit_owner.values()).count(r) for r in set(unit_owner.values())), default=1)
    num_units = max(1, len(unit_owner))

    placed: list[PlacedParameter] = []
    owners: dict[str, int] = {}
    updates: list[PlannedUpdate] = []
    for node_id in graph.order:
        node = graph.node(node_id)
        if node.own_param_bytes <= 0:
            continue
        elements = max(1, node.own_param_bytes // dtype_bytes)
        shape = (node.instances, elements) if node.instances > 1 else (elements,)
        placements: list[tuple[str, str]] = [(a, "replicate") for a in data_axes]
        local = list(shape)
        state = StateLayout.REPLICATED
        units_here = _units_reaching(graph, cut, node_id) if cut is not None else set()
        if cut is not None and node_id == cut.path:
            # The cut node's own per-unit parameters (a mixture's weights) split with its units.
            placements.append((Axis.TP.value, str(Shard(0))))
            local[0] = largest_share if len(shape) == 1 else shape[0] // num_units * largest_share
            state = StateLayout.SHARDED
        elif cut is not None and units_here and len(units_here) == 1:
            owners[node_id] = unit_owner[next(iter(units_here))]
            state = StateLayout.SHARDED
        elif cut is not None and len(units_here) > 1 and node.instances > 1 and not node.shared:
            # One node held once per unit (`repeat: K`): its copies split like the units.
            placements.append((Axis.TP.value, str(Shard(0))))
            local[0] = ceil(shape[0] / num_units) * largest_share
            state = StateLayout.SHARDED
        elif plan.tp > 1:
            placements.append((Axis.TP.value, str(REPLICATE)))
        layout = ParameterLayout(
            logical_id=node_id,
            global_shape=shape,
            placements=tuple(placements),
            shared_group=None,
            optimizer_state=state,
        )
        p = PlacedParameter(
            Parameter(node_id, shape, "distribution", t.precision), layout, 0, 0, tuple(local), owners.get(node_id)
        )
        placed.append(p)
        extra = STATISTICS_BEYOND_PARAMETERS.get(node.kind, 0)
        statistics_bytes = (
            p.local_numel + extra if len(shape) == 1 else local[0] * (elements + extra)
        ) * STATISTICS_BYTES
        # Partial over tp: a node held whole on every shard whose users sit on several shards.
        axes = data_axes + (("tp",) if cut is not None and len(units_here) > 1 and node.shared else ())
        if axes:
            updates.append(
                _all_reduce(
                    str(UpdateId.statistics(node_id)),
                    PayloadKind.SUFFICIENT_STATISTIC,
                    axes,
                    state,
                    "sum the sufficient statistics (exact in exact arithmetic)",
                    node_id,
                    "gradient",
                    statistics_bytes,
                    plan,
                    1,
                )
            )
    micro_steps = plan.microbatches * plan.gradient_accumulation_steps
    row_bytes = t.micro_batch_size * 8  # one float64 per row
    if cut is not None:
        steps = (
            (("max", "max of the local log-densities"), ("sum", "sum of exponentials"))
            if cut.reduction is ReductionOp.LOGSUMEXP_RESPONSIBILITY
            else (("sum", "sum of the factors' log-likelihoods"),)
        )
        for what, notes in steps:
            updates.append(
                _all_reduce(
                    f"{cut.path}:normaliser/{what}",
                    PayloadKind.MESSAGE,
                    ("tp",),
                    StateLayout.REPLICATED,
                    f"{cut.reduction.value} boundary of the {cut.axis.value} cut: {notes}",
                    cut.path,
                    "forward",
                    row_bytes,
                    plan,
                    micro_steps,
                )
            )
    if data_axes:
        updates.append(
            _all_reduce(
                "log_likelihood",
                PayloadKind.MESSAGE,
                data_axes,
                StateLayout.REPLICATED,
                "the iteration's total log-likelihood, reported and checked never to decrease",
                "log_likelihood",
                "gradient",
                8,
                plan,
                1,
            )
        )
    local_units = (
        max((c.stop - c.start for c in cut.cuts), default=1)
        if cut is not None
        else max(1, graph.node(graph.root).num_units)
    )
    responsibilities = t.micro_batch_size * local_units * 8
    params_bytes = sum(p.local_numel * dtype_bytes for p in placed if p.name not in owners) + max(
        (sum(p.local_numel * dtype_bytes for p in placed if owners.get(p.name) == k) for k in set(owners.values())),
        default=0,
    )
    memory = (StageMemory(0, params_bytes, 0, params_bytes, 0, responsibilities),)
    return DistributionLowering(
        parameters=tuple(placed),
        updates=tuple(updates),
        memory=memory,
        programs=(em_program(updates, micro_steps),),
        decomposition=decomposition,
        diagnostics=tuple(diagnostics),
    )


def _all_reduce(
    node_id: str,
    payload: PayloadKind,
    axes: tuple[str, ...],
    state: StateLayout,
    notes: str,
    tensor: str,
    phase: str,
    nbytes: int,
    plan: ParallelPlan,
    occurrences: int,
) -> PlannedUpdate:
    update = DistributedUpdate(
        node_id=node_id,
        payload=payload,
        collective=CollectiveKind.ALL_REDUCE,
        mesh_axes=axes,
        state_layout=state,
        notes=(notes,) if notes else (),
        contract_exact=True,
    )
    return PlannedUpdate(update, tensor, phase, 0, nbytes, group_size(axes, plan), occurrences)


def _units_reaching(graph: ModelGraph, cut: ModelDecomposition, node_id: str) -> set[int]:
    """The units of the cut node whose subtrees contain `node_id` (empty: outside the cut)."""
    g = graph.graph
    if node_id == cut.path:
        return set()
    children = list(g.successors(cut.path))
    units: set[int] = set()
    unit = 0
    for child in children:
        span = g.edges[cut.path, child].get("units", 1)
        if child == node_id or _reaches(g, child, node_id):
            units.update(range(unit, unit + span))
        unit += span
    return units


def _reaches(g, source: str, target: str) -> bool:
    stack, seen = [source], {source}
    while stack:
        for nxt in g.successors(stack.pop()):
            if nxt == target:
                return True
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False


def em_program(updates: list[PlannedUpdate], micro_steps: int) -> tuple[Op, ...]:
    """One EM iteration on any rank: per micro-batch score (with the normaliser's collectives) and
    accumulate statistics; then reduce the statistics and update each unit."""
    ops: list[Op] = []
    for mb in range(micro_steps):
        ops.append(Op(OpKind.forward, 0, microbatch=mb, name="e_step/score"))
        for u in updates:
            if u.phase == "forward":
                ops.append(
                    Op(
                        OpKind.collective,
                        0,
                        microbatch=mb,
                        name=u.update.node_id,
                        group=_group(u),
                        tag=u.update.collective.value,
                        bytes=u.payload_bytes,
                    )
                )
        ops.append(Op(OpKind.forward, 0, microbatch=mb, name="e_step/statistics"))
    for u in updates:
        if u.phase == "gradient":
            ops.append(
                Op(
                    OpKind.collective,
                    0,
                    name=u.update.node_id,
                    group=_group(u),
                    tag=u.update.collective.value,
                    bytes=u.payload_bytes,
                )
            )
    ops.append(Op(OpKind.optimizer, 0, name="m_step"))
    return tuple(ops)


def _group(u: PlannedUpdate) -> str:
    return rule_name(u.update.mesh_axes)


def check_statistics_once(
    graph: ModelGraph, low: DistributionLowering, plan: ParallelPlan
) -> tuple[ReductionProblem, ...]:
    """Independent check: each node's statistics are summed exactly once over the ranks that each
    hold a part of them: the data ranks, plus the tp ranks when units owned by different tp ranks
    all feed one node held whole.

    Derived by walking every unit's subtree and collecting which tp coordinates touch each node,
    not from the layouts the emitter wrote.
    """
    from mixle_compile.lower.exactly_once import ReductionProblem

    data_axes = {a for a in DATA_PARALLEL_AXES if plan.size(a) > 1}
    dec = low.decomposition
    touched: dict[str, set[int]] = {}
    if dec.is_model_parallel:
        g = graph.graph
        owner_of_unit = {}
        for c in dec.cuts:
            for position in range(c.start, c.stop):
                owner_of_unit[dec.permutation[position] if dec.permutation else position] = c.device.rank
        unit = 0
        for child in g.successors(dec.path):
            span = g.edges[dec.path, child].get("units", 1)
            owners_here = {owner_of_unit[u] for u in range(unit, unit + span)}
            stack, seen = [child], {child}
            while stack:
                node = stack.pop()
                # A node repeated once per unit is split with the units, not shared by them.
                if not (span > 1 and graph.node(node).instances >= span and not graph.node(node).shared):
                    touched.setdefault(node, set()).update(owners_here)
                for nxt in g.successors(node):
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            unit += span
    reduced: dict[str, list[tuple[str, ...]]] = {}
    for u in low.updates:
        if u.update.payload is PayloadKind.SUFFICIENT_STATISTIC:
            reduced.setdefault(u.tensor, []).append(tuple(u.update.mesh_axes))
    problems = []
    for p in low.parameters:
        expected = set(data_axes)
        if len(touched.get(p.name, ())) > 1:
            expected.add("tp")
        seen_axes = [a for axes in reduced.get(p.name, []) for a in axes]
        for axis in sorted(expected - set(seen_axes)):
            problems.append(
                ReductionProblem(
                    p.name, f"{p.name}: its statistics are partial over {axis} but never summed over {axis}"
                )
            )
        for axis in sorted(set(seen_axes)):
            if axis not in expected:
                problems.append(
                    ReductionProblem(
                        p.name,
                        f"{p.name}: its statistics are summed over {axis}, where ranks do not hold parts of them",
                    )
                )
            elif seen_axes.count(axis) > 1:
                problems.append(
                    ReductionProblem(
                        p.name, f"{p.name}: its statistics are summed {seen_axes.count(axis)} times over {axis}"
                    )
                )
    return tuple(problems)
