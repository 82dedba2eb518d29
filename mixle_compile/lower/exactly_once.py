"""An independent check that every partial gradient is reduced exactly once over the right axes.

This does not reuse the code that emitted the updates: it derives, from each parameter's role
and the mesh alone, the axes over which its local gradient is a partial sum, and compares them
with the reductions the plan actually lists. It catches the classic mistakes: cp left out of the
gradient reduction, a reduction done twice, an unsynchronised tied embedding, a tied sync after a
reduce-scatter (it must see whole gradients), a tied tensor on one stage reduced once per use,
expert gradients divided by the expert-group size instead of the data-parallel size, and the gradient
of a KV head shared by several tensor-parallel ranks (fewer KV heads than tp ranks) left unsummed over
the ranks sharing it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from mixle_compile.contracts import CollectiveKind, ParallelPlan, PayloadKind
from mixle_compile.lower.groups import kv_replica_axis, kv_replica_size
from mixle_compile.lower.layouts import PlacedParameter
from mixle_compile.lower.updates import PlannedUpdate

_REDUCTIONS = (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)


@dataclass(frozen=True)
class ReductionProblem:
    tensor: str
    message: str


_KV_WEIGHTS = (".attn.k_proj.weight", ".attn.k_proj.bias", ".attn.v_proj.weight", ".attn.v_proj.bias")


def expected_partial_axes(
    placed: PlacedParameter, plan: ParallelPlan, *, sequence_parallel: bool, num_kv_heads: int | None = None
) -> set[str]:
    """From first principles: where do ranks hold the same weights but see different data?

    ``num_kv_heads``: a transformer's KV heads. With fewer of them than tp ranks, tp / num_kv_heads
    consecutive tp ranks hold the same KV head and run different query heads against it, so each
    holds only part of that head's gradient."""
    p = placed.parameter
    axes: set[str] = set()
    if num_kv_heads and plan.tp > num_kv_heads and p.role != "expert" and p.name.endswith(_KV_WEIGHTS):
        axes.add(kv_replica_axis(plan.tp // num_kv_heads))
    if p.role == "expert":
        # Experts are replicated across the expert-data domain: every rank of the stage that is
        # neither another expert's rank nor another slice of the same expert.
        # With one expert-data rank the gradient is complete but still needs the data degree's
        # divisor, which the reduction over that one rank carries.
        if plan.world_size // (plan.etp * plan.ep * plan.pp) > 1 or plan.data_parallel_size > 1:
            axes.add("edp")
    else:
        for axis, degree in (("dp_replicate", plan.dp_replicate), ("dp_shard", plan.dp_shard), ("cp", plan.cp)):
            if degree > 1:
                axes.add(axis)
        if sequence_parallel and plan.tp > 1 and p.tp_dim is None:
            axes.add("tp")  # its inputs are sequence shards
    if p.shared_group is not None and plan.pp > 1:
        axes.add("tied")
    return axes


def check_exactly_once(
    placed: tuple[PlacedParameter, ...],
    updates: tuple[PlannedUpdate, ...],
    plan: ParallelPlan,
    *,
    sequence_parallel: bool,
    num_kv_heads: int | None = None,
) -> tuple[ReductionProblem, ...]:
    """Every problem found; an empty tuple means every gradient is reduced exactly once.

    ``num_kv_heads``: a transformer's KV heads (None: no KV heads shared over tp)."""
    by_tensor: dict[str, list[PlannedUpdate]] = {}
    for u in updates:
        if u.update.payload is PayloadKind.GRADIENT:
            by_tensor.setdefault(u.tensor, []).append(u)
    problems: list[ReductionProblem] = []
    known = {p.name for p in placed}
    for name in sorted(set(by_tensor) - known):
        problems.append(ReductionProblem(name, f"{name}: gradient updates for a tensor that is not a parameter"))
    tied_first: dict[str, str] = {}  # tied group on one stage -> the member that reduces for all
    for p in placed:
        expected = expected_partial_axes(p, plan, sequence_parallel=sequence_parallel, num_kv_heads=num_kv_heads)
        group = p.parameter.shared_group
        if group is not None and plan.pp == 1 and tied_first.setdefault(group, p.name) != p.name:
            # One tensor with several uses: their gradients add up locally, and the first member's
            # reductions reduce the sum; a reduction of its own would count it twice.
            for u in by_tensor.get(p.name, []):
                problems.append(
                    ReductionProblem(
                        p.name,
                        f"{p.name}: it is tied to {tied_first[group]} on the same stage, whose reductions "
                        "already reduce "
                        f"its gradient; {u.update.node_id} reduces it a second time",
                    )
                )
            continue
        reductions = [u for u in by_tensor.get(p.name, []) if u.update.collective in _REDUCTIONS]
        others = [u for u in by_tensor.get(p.name, []) if u.update.collective not in _REDUCTIONS]
        for u in others:
            problems.append(
                ReductionProblem(
                    p.name,
                    f"{p.name}: gradient update {u.update.node_id} uses {u.update.collective.value}, which "
                    "does not reduce",
                )
            )
        covered = Counter(axis for u in reductions for axis in u.update.mesh_axes)
        for axis in sorted(expected - set(covered)):
            problems.append(
                ReductionProblem(
                    p.name, f"{p.name}: its gradient is a partial sum over {axis} but is never reduced over {axis}"
                )
            )
        for axis, count in sorted(covered.items()):
            if axis not in expected:
                problems.append(
                    ReductionProblem(
                        p.name,
                        f"{p.name}: its gradient is reduced over {axis}, where it is not a partial sum (ranks "
                        "there already agree or hold other slices)",
                    )
                )
            elif count > 1:
                problems.append(
                    ReductionProblem(
                        p.name,
                        f"{p.name}: its gradient is reduced {count} times over {axis}; it must be reduced exactly once",
                    )
                )
        divisor = 1
        for u in reductions:
            divisor *= u.gradient_divisor
        data_reduced = expected - {"tp", "tied"} - {a for a in expected if kv_replica_size(a) is not None}
        want = plan.data_parallel_size if data_reduced else 1
        if divisor != want:
            problems.append(
                ReductionProblem(
                    p.name,
                    f"{p.name}: its reduced gradient is divided by {divisor}; the loss is a mean over the "
                    f"global batch, so divide by the data-parallel size {want}",
                )
            )
        tied_at = [i for i, u in enumerate(reductions) if "tied" in u.update.mesh_axes]
        scatter_at = [i for i, u in enumerate(reductions) if u.update.collective is CollectiveKind.REDUCE_SCATTER]
        if tied_at and scatter_at and min(scatter_at) < min(tied_at):
            problems.append(
                ReductionProblem(
                    p.name,
                    f"{p.name}: the tied-weight all_reduce must see whole gradients, but it comes after a "
                    "reduce_scatter",
                )
            )
    return tuple(problems)
