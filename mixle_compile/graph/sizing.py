"""Queries on a built :class:`ModelGraph`: sizes, work, and the axes the model can be cut along.

These keep the seed planner's names and meanings, computed from the graph instead of by walking
live objects: shared subtrees count once, a node's own dense block (an HMM's S*S transitions) is
its own bytes, and every shardable axis anywhere in the tree is a candidate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import networkx as nx

from mixle_compile.graph.axes import DecompAxis, ReductionOp
from mixle_compile.graph.build import ModelGraph


def _graph(model) -> ModelGraph:
    """The graph to query: a ModelGraph as it is; a spec, a distribution model or a live mixle
    model built into one on the way in (mixle_compile.mixle_models.as_model_graph)."""
    if isinstance(model, ModelGraph):
        return model
    from mixle_compile.mixle_models import as_model_graph

    return as_model_graph(model)


def as_decomp_axis(axis: Any) -> DecompAxis:
    """A :class:`DecompAxis` from a member, its value, or a mixle ``DecompAxis`` (a plain Enum of the same values)."""
    return DecompAxis(getattr(axis, "value", axis))


@dataclass(frozen=True)
class NodeSize:
    """Structural size of one node: its own bytes, and bytes and work of its whole subtree.

    ``copies`` is how many copies of this subtree its parent holds (a mixture's repeated
    component); a shared node is held once whatever ``copies`` says.
    """

    path: str
    axis: DecompAxis
    num_units: int
    own_param_bytes: int
    subtree_param_bytes: int
    subtree_work: float = 1.0  # as mixle: a node with no stated work weighs one unit
    children: tuple[NodeSize, ...] = ()
    copies: int = 1
    shared: bool = False


@dataclass(frozen=True)
class UnitRun:
    """``count`` consecutive, identical units of an axis: the graph node they come from and each one's size."""

    node: str
    count: int
    work: float
    param_bytes: int


@dataclass(frozen=True)
class AxisCandidate:
    """One shardable axis somewhere in the model, with the work and bytes of each of its units.

    Units are kept as runs so that ``repeat: 1000000`` costs one entry; ``unit_works`` and
    ``unit_bytes`` expand them (one entry per unit). A unit's size counts every copy of the axis
    node in the model (unit i is unit i of each copy), and leaves out shared nodes: those, the
    axis node's own parameters and everything outside the axis are ``held_whole_bytes``, held on
    every shard.
    """

    path: str
    axis: DecompAxis
    reduction: ReductionOp
    num_units: int
    unit_runs: tuple[UnitRun, ...]
    held_whole_bytes: int = 0
    exchangeable: bool = False  # units may be reordered freely (components of one mixture, experts)

    @property
    def unit_works(self) -> tuple[float, ...]:
        return tuple(w for run in self.unit_runs for w in (run.work,) * run.count)

    @property
    def unit_bytes(self) -> tuple[int, ...]:
        return tuple(b for run in self.unit_runs for b in (run.param_bytes,) * run.count)

    @property
    def unit_nodes(self) -> tuple[str, ...]:
        return tuple(n for run in self.unit_runs for n in (run.node,) * run.count)

    @property
    def total_work(self) -> float:
        return float(sum(run.work * run.count for run in self.unit_runs))

    @property
    def total_unit_bytes(self) -> int:
        return sum(run.param_bytes * run.count for run in self.unit_runs)

    @property
    def max_unit_work(self) -> float:
        return max((run.work for run in self.unit_runs), default=0.0)


def shard_children(model: ModelGraph | Any, node: str | None = None) -> tuple[tuple[str, int], ...]:
    """The children ``node`` splits along its axis, each with the number of units it provides.

    A repeated component is one child providing ``repeat`` units; a child held whole (an HMM's
    transitions, a sequence's length) is not listed. Empty for a node whose axis is ``none``.
    """
    model = _graph(model)
    n = model.root if node is None else node
    if model.graph.nodes[n]["axis"] is DecompAxis.NONE:
        return ()
    return tuple((child, data["units"]) for child, data in model.graph.succ[n].items() if data["units"] > 0)


def cost_children(model: ModelGraph | Any, node: str | None = None) -> tuple[str, ...]:
    """Every child of ``node``, for cost: the shardable ones and those held whole."""
    model = _graph(model)
    n = model.root if node is None else node
    return tuple(model.graph.succ[n])


def subtree_work(model: ModelGraph | Any, node: str | None = None) -> float:
    """Work per observation of ``node`` and all its descendants, each shared node counted once."""
    model = _graph(model)
    return model.graph.nodes[model.root if node is None else node]["subtree_work"]


def compute_cost(model: ModelGraph | Any, node: str | None = None) -> tuple[float, int]:
    """``(flops_per_observation_proxy, bytes)`` of a subtree (the whole model when ``node`` is omitted)."""
    model = _graph(model)
    attrs = model.graph.nodes[model.root if node is None else node]
    return attrs["subtree_work"], attrs["subtree_param_bytes"]


def size_model_tree(model: ModelGraph | Any, node: str | None = None) -> NodeSize:
    """The :class:`NodeSize` tree under ``node``; a shared subtree is one value reused under each parent."""
    model = _graph(model)
    g = model.graph
    top = model.root if node is None else node
    wanted = None if top == model.root else nx.descendants(g, top) | {top}
    built: dict[tuple[str, int], NodeSize] = {}

    def size(n: str, copies: int) -> NodeSize:
        key = (n, copies)
        if key not in built:
            attrs = g.nodes[n]
            built[key] = NodeSize(
                path=n,
                axis=attrs["axis"],
                num_units=attrs["num_units"],
                own_param_bytes=attrs["own_param_bytes"],
                subtree_param_bytes=attrs["subtree_param_bytes"],
                subtree_work=attrs["subtree_work"],
                children=tuple(built[(c, d["multiplicity"])] for c, d in g.succ[n].items()),
                copies=copies,
                shared=attrs["shared"],
            )
        return built[key]

    for n in model.order:  # children first, so every child's value exists before its parent's
        if wanted is not None and n not in wanted:
            continue
        for child, data in g.succ[n].items():
            size(child, data["multiplicity"])
    return size(top, 1)


def tree_axes(model: ModelGraph | Any) -> list[AxisCandidate]:
    """Every shardable axis anywhere in the tree (two or more units), parents before children."""
    model = _graph(model)
    nodes, succ = model.graph.nodes, model.graph.succ
    total_bytes = nodes[model.root]["subtree_param_bytes"]
    out: list[AxisCandidate] = []
    for n in reversed(model.order):
        attrs = nodes[n]
        if attrs["axis"] is DecompAxis.NONE or attrs["num_units"] < 2:
            continue
        kids = [(child, data["units"]) for child, data in succ[n].items() if data["units"] > 0]
        if sum(units for _, units in kids) != attrs["num_units"]:
            continue  # a child was dropped (a cycle or an unknown ref): this axis cannot be cut
        copies = attrs["instances"]
        runs = []
        for child, units in kids:
            kid = nodes[child]
            runs.append(UnitRun(child, units, copies * kid["private_work"], copies * kid["private_param_bytes"]))
        unit_bytes = sum(run.param_bytes * run.count for run in runs)
        out.append(
            AxisCandidate(
                path=n,
                axis=attrs["axis"],
                reduction=attrs["reduction"],
                num_units=attrs["num_units"],
                unit_runs=tuple(runs),
                held_whole_bytes=total_bytes - unit_bytes,
                # Mixture components and experts are labels: any order is the same model. Factors
                # read fixed record columns and states index the transition matrix, so they keep theirs.
                exchangeable=attrs["axis"] is DecompAxis.COMPONENT,
            )
        )
    return out


def parallel_benefit(candidate: AxisCandidate, max_workers: int | None = None) -> float:
    """Serial work removed by cutting ``candidate`` over ``max_workers`` workers.

    ``total_work - max(largest unit, total_work / min(P, num_units))``: the parallel time is
    bounded below by the heaviest unit, so a thin composite whose one heavy factor is a big
    mixture scores little, and the mixture inside it wins.
    """
    p = candidate.num_units if max_workers is None else min(max_workers, candidate.num_units)
    total = candidate.total_work
    return total - max(candidate.max_unit_work, total / max(1, p))


def best_parallel_axis(
    model: ModelGraph | Any,
    max_workers: int | None = None,
    allowed_axes: Iterable[DecompAxis | str] | None = None,
) -> AxisCandidate | None:
    """The axis whose cut removes the most serial work (:func:`parallel_benefit`), or ``None``.

    ``allowed_axes`` restricts the choice (e.g. ``{"component"}``); ties go to the candidate
    nearer the root. ``None`` when the tree has no shardable axis, e.g. a single leaf.
    """
    model = _graph(model)
    allowed = None if allowed_axes is None else {as_decomp_axis(a) for a in allowed_axes}
    candidates = [c for c in tree_axes(model) if allowed is None or c.axis in allowed]
    if not candidates:
        return None
    return max(candidates, key=lambda c: parallel_benefit(c, max_workers))
