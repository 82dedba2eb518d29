"""Building the decomposition graph of a model.

Entry point: :func:`build_model_graph`. Every model family becomes a ``networkx.DiGraph`` whose
nodes are decomposition nodes (a distribution node, a neural block, a tied tensor, the expert
axis) and whose edges are ownership. A node used from several parents (``{ref: NAME}`` to
``model.shared``, or a tied neural tensor) is one graph node with several in-edges and counts
once. The builder never raises for a bad model: an unknown ref or a cycle comes back as a
diagnostic, and the graph keeps only the edges that do not close a cycle, so every later query
terminates.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from mixle_compile.diagnostics import Code, Diagnostic, Severity, register_code
from mixle_compile.graph.axes import DecompAxis, ReductionOp
from mixle_compile.graph.work import distribution_node_cost, parameter_work
from mixle_compile.parameters import DTYPE_BYTES, Parameter, model_parameters
from mixle_compile.spec import codes as spec_codes
from mixle_compile.spec.models import (
    HMM,
    Composite,
    DistributionModel,
    Mixture,
    Ref,
    Sequence,
    Spec,
    TransformerModel,
)
from mixle_compile.spec.source import Path_, SourceDocument, dotted

GRAPH_CYCLE = register_code(
    Code(
        "G001",
        "graph-cycle",
        "The model's decomposition graph contains a cycle.",
        "The decomposition graph is a DAG: a node owns its children, and a node shared with "
        "`{ref: NAME}` is one node with several parents. A node that owns itself, directly or "
        "through other shared nodes, has no finite size. The message prints the cycle as a path of "
        "nodes, e.g. `model.shared.a -> model.shared.b -> model.shared.a`; remove one of the refs "
        "on it. The graph keeps every other edge, so the rest of the model can still be sized.",
    )
)

# Edge attributes: `multiplicity` copies of the child are held by the parent (a mixture's
# `component` with `repeat: K` is one child held K times); `units` of them are units of the
# parent's decomposition axis (0 for a child held whole, such as an HMM's transitions).
DISTRIBUTION_ROOT = "model.root"
NEURAL_ROOT = "model"
UNKNOWN_FILE = "<spec>"


@dataclass(frozen=True)
class DecompositionNode:
    """One node of the decomposition graph, as a typed value (see :meth:`ModelGraph.node`).

    ``private_*`` counts this node and the descendants only it holds (shared nodes excluded), once
    per copy; ``subtree_*`` adds every shared node reachable from here, each once.
    """

    path: str
    kind: str
    axis: DecompAxis
    num_units: int
    reduction: ReductionOp
    exact: bool
    shared_children: tuple[str, ...]
    own_param_bytes: int
    own_work: float
    field_path: Path_
    shared: bool
    instances: int
    private_param_bytes: int
    private_work: float
    subtree_param_bytes: int
    subtree_work: float


@dataclass(frozen=True)
class ModelGraph:
    """The decomposition graph of one model: a frozen DAG, its root, and what went wrong building it.

    ``order`` lists the nodes reachable from the root children-first (a reverse topological
    order), which lets every size be computed in one pass without recursion.
    """

    graph: nx.DiGraph = field(repr=False)
    root: str
    order: tuple[str, ...] = field(repr=False)
    diagnostics: tuple[Diagnostic, ...] = ()
    document: SourceDocument | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        """Whether the graph was built without errors (no cycle, every ref resolved)."""
        return not any(d.severity is Severity.error for d in self.diagnostics)

    def node(self, node_id: str | None = None) -> DecompositionNode:
        """The typed attributes of ``node_id`` (the root when omitted)."""
        attrs = self.graph.nodes[self.root if node_id is None else node_id]
        return DecompositionNode(**{name: attrs[name] for name in DecompositionNode.__dataclass_fields__})

    def diagnostic(
        self, code: str, message: str, field_path: Path_, *, hint: str = "", extra_fields: tuple[Path_, ...] = ()
    ) -> Diagnostic:
        """A diagnostic at ``field_path`` of the spec, with file:line:col when the source is known."""
        return spec_diagnostic(self.document, code, message, field_path, hint=hint, extra_fields=extra_fields)


def spec_diagnostic(
    document: SourceDocument | None,
    code: str,
    message: str,
    field_path: Path_,
    *,
    hint: str = "",
    extra_fields: tuple[Path_, ...] = (),
) -> Diagnostic:
    """A diagnostic at ``field_path``; without the source document it points at line 1 of ``<spec>``."""
    if document is not None:
        return document.diagnostic(code, message, field_path, hint=hint, extra_fields=extra_fields)
    fields = tuple(dotted(p) for p in (field_path, *extra_fields) if p)
    return Diagnostic(code, Severity.error, message, hint, UNKNOWN_FILE, 1, 1, fields)


def build_model_graph(
    spec: Spec | DistributionModel, document: SourceDocument | None = None, *, precision: str = "fp64"
) -> ModelGraph:
    """Build the decomposition graph of ``spec.model`` (any family), or of a distribution model alone.

    ``document`` (from :func:`mixle_compile.spec.load_spec`) gives diagnostics their file:line:col.
    A distribution model given without its spec is sized at ``precision`` (fp64 unless told: EM,
    and mixle, fit in float64); a spec's own ``training.precision`` always wins.
    """
    if isinstance(spec, DistributionModel):
        spec = _ModelOnly(spec, _Precision(precision))
    # The build allocates many small, long-lived objects and frees none of them; the cyclic garbage
    # collector would rescan them all again and again (quadratic in the tree size), so it waits.
    collecting = gc.isenabled()
    gc.disable()
    try:
        builder = _Builder(document)
        if isinstance(spec.model, DistributionModel):
            root, order = builder.distribution(spec.model, DTYPE_BYTES[spec.training.precision])
        else:
            root, order = builder.neural(spec)
        _annotate_sizes(builder.nodes, builder.children, root, order)
        g = nx.DiGraph()
        g.add_nodes_from(builder.nodes.items())
        g.add_edges_from(
            (parent, child, data) for parent, kids in builder.children.items() for child, data in kids.items()
        )
    finally:
        if collecting:
            gc.enable()
    return ModelGraph(nx.freeze(g), root, tuple(order), tuple(builder.diagnostics), document)


@dataclass(frozen=True)
class _Precision:
    precision: str


@dataclass(frozen=True)
class _ModelOnly:
    """What the builder reads of a spec, for a distribution model given alone."""

    model: DistributionModel
    training: _Precision


# --------------------------------------------------------------------------- building


class _Builder:
    def __init__(self, document: SourceDocument | None):
        # Plain dicts while building (networkx's views cost a call per lookup); the frozen
        # DiGraph is made once at the end.
        self.nodes: dict[str, dict[str, Any]] = {}
        self.children: dict[str, dict[str, dict[str, Any]]] = {}
        self.diagnostics: list[Diagnostic] = []
        self.document = document

    def add_node(
        self,
        node_id: str,
        *,
        kind: str,
        field_path: Path_,
        own_param_bytes: int,
        own_work: float,
        axis: DecompAxis = DecompAxis.NONE,
        num_units: int = 1,
        reduction: ReductionOp = ReductionOp.REPLICATE,
        shared: bool = False,
        shared_children: tuple[str, ...] = (),
    ) -> None:
        self.children[node_id] = {}
        self.nodes[node_id] = dict(
            path=node_id,
            kind=kind,
            axis=axis,
            num_units=num_units,
            reduction=reduction,
            exact=True,  # every split declared here is exact EM / exact gradient arithmetic
            shared_children=shared_children,
            own_param_bytes=own_param_bytes,
            own_work=own_work,
            field_path=field_path,
            shared=shared,
        )

    def add_edge(self, parent: str, child: str, multiplicity: int, units: int, role: str) -> None:
        kids = self.children[parent]
        if child in kids:  # the same shared node listed twice under one parent
            kids[child]["multiplicity"] += multiplicity
            kids[child]["units"] += units
            return
        kids[child] = {"multiplicity": multiplicity, "units": units, "role": role}

    # -- distribution trees ------------------------------------------------------------

    def distribution(self, model: DistributionModel, scalar_bytes: int) -> tuple[str, list[str]]:
        """Iterative depth-first walk: refs may chain deeper than Python's recursion limit."""
        shared = model.shared
        grey: set[str] = set()
        done: set[str] = set()
        order: list[str] = []
        stack: list[list[Any]] = []  # [node_id, field_path, children, next child index]

        def enter(node_id: str, node: Any, field_path: Path_, is_shared: bool) -> None:
            cost = distribution_node_cost(node)
            axis, reduction, units = _distribution_axis(node)
            held_whole: tuple[str, ...] = ()
            if isinstance(node, HMM) and node.transitions is not None:
                t = node.transitions
                held_whole = (
                    dotted(("model", "shared", t.ref)) if isinstance(t, Ref) else dotted((*field_path, "transitions")),
                )
            self.add_node(
                node_id,
                kind=node.type,
                field_path=field_path,
                own_param_bytes=cost.param_count * scalar_bytes,
                own_work=cost.work,
                axis=axis,
                num_units=units,
                reduction=reduction,
                shared=is_shared,
                shared_children=held_whole,
            )
            grey.add(node_id)
            stack.append([node_id, field_path, _distribution_children(node), 0])

        def resolve(child: Any, child_path: Path_) -> tuple[str, Any, Path_, bool] | None:
            """The graph node a child stands for: itself, or the shared node its ref names."""
            if not isinstance(child, Ref):
                return dotted(child_path), child, child_path, False
            if child.ref in shared:
                target_path: Path_ = ("model", "shared", child.ref)
                return dotted(target_path), shared[child.ref], target_path, True
            self.diagnostics.append(
                spec_diagnostic(
                    self.document,
                    spec_codes.UNKNOWN_REF.code,
                    f"`ref: {child.ref}` names no entry of model.shared",
                    (*child_path, "ref"),
                    hint="define it under `model.shared`",
                )
            )
            return None

        root = resolve(model.root, ("model", "root"))
        if root is None:  # nothing to build: a placeholder keeps the graph's shape valid
            self.add_node(DISTRIBUTION_ROOT, kind="ref", field_path=("model", "root"), own_param_bytes=0, own_work=0.0)
            return DISTRIBUTION_ROOT, [DISTRIBUTION_ROOT]
        enter(*root)
        while stack:
            frame = stack[-1]
            node_id, field_path, children, i = frame
            if i == len(children):
                stack.pop()
                grey.discard(node_id)
                done.add(node_id)
                order.append(node_id)
                continue
            frame[3] = i + 1
            key, child, multiplicity, units, role = children[i]
            child_path = (*field_path, *key)
            found = resolve(child, child_path)
            if found is None:
                continue
            target = found[0]
            if target in grey:
                on_stack = [f[0] for f in stack]
                cycle = on_stack[on_stack.index(target) :] + [target]
                self.diagnostics.append(
                    spec_diagnostic(
                        self.document,
                        GRAPH_CYCLE.code,
                        "the model graph has a cycle: " + " -> ".join(cycle),
                        child_path,
                        hint="a node cannot contain itself; remove one of the refs on this cycle",
                    )
                )
                continue
            self.add_edge(node_id, target, multiplicity, units, role)
            if target not in done:
                enter(*found)
        return root[0], order

    # -- neural models -----------------------------------------------------------------

    def neural(self, spec: Spec) -> tuple[str, list[str]]:
        """Root -> one block per layer (or per top-level name), tied tensors shared, experts as one axis.

        Unit e of the expert axis is expert e of every mixture-of-experts layer, because expert
        parallelism places expert e of all layers on the same rank.
        """
        model = spec.model
        params = model_parameters(spec)
        is_transformer = isinstance(model, TransformerModel)
        top_k = (model.experts_per_token or 1) if is_transformer else 1  # a modules spec states no top-k
        index_of = {p.name: i for i, p in enumerate(params)}

        def where(p: Parameter, *tail: str) -> Path_:
            return ("model", *tail) if is_transformer else ("model", "parameters", index_of[p.name])

        self.add_node(NEURAL_ROOT, kind=model.family, field_path=("model",), own_param_bytes=0, own_work=0.0)
        blocks: dict[str, list[Parameter]] = {}
        tied: dict[str, list[Parameter]] = defaultdict(list)
        experts: list[Parameter] = []
        for p in params:
            if p.role == "expert":
                experts.append(p)
                continue
            group = f"layers.{p.layer}" if p.layer is not None else p.name.split(".")[0]
            blocks.setdefault(group, []).append(p)
            if p.shared_group is not None:
                tied[p.shared_group].append(p)

        taken: set[str] = {NEURAL_ROOT}

        def fresh(wanted: str) -> str:
            node_id, n = wanted, 1
            while node_id in taken:  # a modules parameter may be named like a node we add
                n += 1
                node_id = f"{wanted}#{n}"
            taken.add(node_id)
            return node_id

        tied_ids = {}
        for group, members in tied.items():
            node_id = fresh(f"model.tied.{group}")
            tied_ids[group] = node_id
            self.add_node(
                node_id,
                kind="tied",
                field_path=where(members[0]),
                own_param_bytes=members[0].bytes,  # one logical tensor, however many places use it
                own_work=max(parameter_work(p) for p in members),
                shared=True,
            )
        for group, members in blocks.items():
            node_id = fresh(f"model.{group}")
            private = [p for p in members if p.shared_group is None]
            self.add_node(
                node_id,
                kind="block",
                field_path=where(members[0]),
                own_param_bytes=sum(p.bytes for p in private),
                own_work=sum(parameter_work(p) for p in private),
            )
            self.add_edge(NEURAL_ROOT, node_id, 1, 0, "block")
            for p in members:
                if p.shared_group is not None:
                    self.add_edge(node_id, tied_ids[p.shared_group], 1, 0, "tied")
        if experts:
            num_experts = experts[0].shape[0]
            axis_id, unit_id = fresh("model.experts"), fresh("model.experts.expert")
            self.add_node(
                axis_id,
                kind="experts",
                field_path=where(experts[0], "num_experts"),
                own_param_bytes=0,
                own_work=0.0,
                axis=DecompAxis.COMPONENT,
                num_units=num_experts,
                reduction=ReductionOp.SUM,
            )
            self.add_node(
                unit_id,
                kind="expert",
                field_path=where(experts[0], "num_experts"),
                own_param_bytes=sum(p.bytes // p.shape[0] for p in experts),
                own_work=sum(parameter_work(p, top_k / p.shape[0]) / p.shape[0] for p in experts),
            )
            self.add_edge(NEURAL_ROOT, axis_id, 1, 0, "experts")
            self.add_edge(axis_id, unit_id, num_experts, num_experts, "expert")
        return NEURAL_ROOT, _children_first(self.children, NEURAL_ROOT)


def _distribution_axis(node: Any) -> tuple[DecompAxis, ReductionOp, int]:
    if isinstance(node, Mixture):
        return DecompAxis.COMPONENT, ReductionOp.LOGSUMEXP_RESPONSIBILITY, node.num_components
    if isinstance(node, Composite):
        return DecompAxis.FACTOR, ReductionOp.SUM, len(node.factors)
    if isinstance(node, HMM):
        return DecompAxis.STATE, ReductionOp.SUM, node.num_states
    if isinstance(node, Sequence):
        # The sequence axis is the data axis: one model unit, sized from the data, never cut here.
        return DecompAxis.SEQUENCE, ReductionOp.SUM, 1
    return DecompAxis.NONE, ReductionOp.REPLICATE, 1


def _distribution_children(node: Any) -> list[tuple[Path_, Any, int, int, str]]:
    """(field key, child, multiplicity, units along the node's axis, role) for every child."""
    out: list[tuple[Path_, Any, int, int, str]] = []
    if isinstance(node, Mixture):
        if node.components is not None:
            out += [(("components", i), c, 1, 1, "component") for i, c in enumerate(node.components)]
        else:
            out.append((("component",), node.component, node.repeat, node.repeat, "component"))
    elif isinstance(node, Composite):
        out += [(("factors", i), c, 1, 1, "factor") for i, c in enumerate(node.factors)]
    elif isinstance(node, HMM):
        if node.emissions is not None:
            out += [(("emissions", i), c, 1, 1, "emission") for i, c in enumerate(node.emissions)]
        else:
            out.append((("emission",), node.emission, node.num_states, node.num_states, "emission"))
        if node.transitions is not None:
            out.append((("transitions",), node.transitions, 1, 0, "transitions"))
        if node.length is not None:
            out.append((("length",), node.length, 1, 0, "length"))
    elif isinstance(node, Sequence):
        out.append((("base",), node.base, 1, 1, "base"))
        if node.length is not None:
            out.append((("length",), node.length, 1, 0, "length"))
    return out


# --------------------------------------------------------------------------- sizing

_NOTHING: frozenset[str] = frozenset()


def _children_first(children: dict[str, dict[str, Any]], root: str) -> list[str]:
    """Nodes reachable from ``root``, every node after all of its children (iterative post-order)."""
    order: list[str] = []
    seen = {root}
    stack = [(root, iter(children[root]))]
    while stack:
        node, pending = stack[-1]
        child = next(pending, None)
        if child is None:
            stack.pop()
            order.append(node)
        elif child not in seen:
            seen.add(child)
            stack.append((child, iter(children[child])))
    return order


def _annotate_sizes(
    nodes: dict[str, dict[str, Any]], children: dict[str, dict[str, Any]], root: str, order: list[str]
) -> None:
    """Copies, private and subtree sizes of every node, in one pass each way over ``order``.

    A shared node is held once, however many parents use it: it is left out of its parents'
    private sizes and collected in the set of shared nodes each subtree reaches, so that a
    subtree counts each shared node once.
    """
    nodes[root]["instances"] = 1
    for n in reversed(order):  # parents first: copies of a node = copies of its only parent x multiplicity
        copies = nodes[n].setdefault("instances", 1)
        for child, data in children[n].items():
            if not nodes[child]["shared"]:
                nodes[child]["instances"] = copies * data["multiplicity"]
    reaches: dict[str, frozenset[str]] = {}
    for n in order:  # children first
        attrs = nodes[n]
        private_bytes, private_work, reach = attrs["own_param_bytes"], attrs["own_work"], _NOTHING
        for child, data in children[n].items():
            below = reaches[child]
            kid = nodes[child]
            if kid["shared"]:
                reach = reach | below | {child}
            else:
                m = data["multiplicity"]
                private_bytes += m * kid["private_param_bytes"]
                private_work += m * kid["private_work"]
                if below:
                    reach = reach | below
        reaches[n] = reach
        attrs["private_param_bytes"] = private_bytes
        attrs["private_work"] = private_work
        if reach:
            private_bytes += sum(nodes[s]["private_param_bytes"] for s in reach)
            private_work += sum(nodes[s]["private_work"] for s in reach)
        attrs["subtree_param_bytes"] = private_bytes
        attrs["subtree_work"] = private_work
