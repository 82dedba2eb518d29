"""A distribution plan, read as EM instructions. Torch-free, so that `run` refuses before starting.

Executed: any tree of mixtures, composites, HMMs and sequences (with or without a length
distribution) over Gaussian (diag, full), categorical, Poisson and exponential leaves (see
``em.model``), under data parallelism (dp_replicate,
dp_shard), a cut of one node's units over tp, or both. The cut node is a mixture (component cut:
the posterior normaliser is a logsumexp across tp) or a composite (factor cut: the factors'
log-likelihoods add up across tp), reached from the root through composites only, so that every
row reaches it with weight one. The decomposition's cuts and permutation say which tp rank owns
each unit.

Every collective the EM worker issues is one of the plan's updates:

- ``<node>:statistics`` (all_reduce sum over the data axes, and over tp for a node held whole and
  used by units on several tp ranks, such as shared HMM transitions): the node's sufficient
  statistics, float64, as many elements as the plan's ``payload_bytes / 8``. Under a cut, a node
  inside one unit is reduced only by the ranks that own that unit (the plan's parameter
  ``owner``); a node repeated once per unit travels as the rows of the rank's own units, padded to
  the plan's local shape;
- ``log_likelihood`` (all_reduce sum over the data axes): the iteration's total log-likelihood;
- under a cut, per micro-batch, ``<cut>:normaliser/max`` then ``/sum`` (component cut), or
  ``<cut>:normaliser/sum`` (factor cut), over tp: one float64 per row, padded to
  ``micro_batch_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from mixle_compile.contracts import ParallelPlan
from mixle_compile.plan.artifact import plan_spec
from mixle_compile.plan.document import PlanDocument
from mixle_compile.plan.vocabulary import DATA_PARALLEL_AXES, STATISTICS, Axis, UpdateId, UpdateIdError
from mixle_compile.runtime.em.model import ModelError, Tree, TreeNode, build_tree
from mixle_compile.runtime.errors import RuntimeRefusal
from mixle_compile.runtime.instructions import Collective
from mixle_compile.spec.models import DistributionModel

FLOAT64_BYTES = 8
ROOT = "model.root"
LOG_LIKELIHOOD = "log_likelihood"


@dataclass(frozen=True)
class Cut:
    """The tp cut: which node, along which axis, who owns each unit."""

    path: str
    axis: str  # component | factor
    owners: tuple[int, ...]  # per unit: the tp coordinate that scores and updates it
    largest_share: int  # units of the rank that owns the most

    def owned(self, tp_coord: int) -> tuple[int, ...]:
        return tuple(u for u, o in enumerate(self.owners) if o == tp_coord)

    @property
    def normaliser_max(self) -> str:
        return f"{self.path}:normaliser/max"

    @property
    def normaliser_sum(self) -> str:
        return f"{self.path}:normaliser/sum"


@dataclass(frozen=True)
class StatisticsUpdate:
    """How one ``<node>:statistics`` update is laid out on a rank.

    ``role``: ``whole`` (every rank sends all the node's rows), ``spanning`` (the same, summed over
    tp too: a shared node used by units on several tp ranks), ``cut`` (the cut
    node's own per-unit entries: the rank's units), ``sharded`` (a node repeated once per unit:
    ``rows_per_unit`` rows per owned unit), ``owned`` (a node inside one unit: only its owner's
    ranks execute it). ``elements``: float64 elements per call (the plan's payload / 8).
    """

    update: str
    node: str
    role: str
    elements: int
    owner: int | None = None
    rows_per_unit: int = 0

    def rows(self, tp_coord: int, cut: Cut | None, instances: int) -> list[int]:
        """The node's rows (instances; for ``cut``, its units) this rank sends, in order."""
        if self.role == "cut":
            return list(cut.owned(tp_coord))
        if self.role == "sharded":
            return [u * self.rows_per_unit + j for u in cut.owned(tp_coord) for j in range(self.rows_per_unit)]
        return list(range(instances))

    def executes(self, tp_coord: int) -> bool:
        return self.owner is None or self.owner == tp_coord


@dataclass(frozen=True)
class EMInstructions:
    spec: object
    plan: ParallelPlan
    content_digest: str
    tree: Tree
    seed: int
    steps: int
    global_batch_size: int
    micro_batch_size: int
    precision: str
    collectives: Mapping[str, Collective]
    statistics: tuple[StatisticsUpdate, ...]  # in plan order
    cut: Cut | None
    roles: Mapping[str, tuple[str, int | None]]  # per node: its role under the cut and its owner (see StatisticsUpdate)
    micro_steps: int

    @property
    def data_axes(self) -> tuple[str, ...]:
        return tuple(a for a in DATA_PARALLEL_AXES if self.plan.size(a) > 1)

    def owned(self, tp_coord: int) -> tuple[int, ...]:
        return self.cut.owned(tp_coord) if self.cut else ()

    def executes(self, node_id: str, tp_coord: int) -> bool:
        """Whether a rank with this tp coordinate issues the update."""
        for s in self.statistics:
            if s.update == node_id:
                return s.executes(tp_coord)
        return True

    def expected_bytes(self, c: Collective) -> int:
        """Bytes one call of this update carries (everything travels in float64, as planned)."""
        return c.payload_bytes

    def describe(self) -> dict:
        return {n.id: {"kind": n.kind, "instances": n.instances, "columns": n.width} for n in self.tree.nodes.values()}


def is_distribution(doc: PlanDocument) -> bool:
    model = doc.spec.get("model") if isinstance(doc.spec, dict) else getattr(doc.spec, "model", None)
    family = model.get("family") if isinstance(model, dict) else getattr(model, "family", None)
    return family == "distribution"


def _statistics_of(node_id: str) -> str | None:
    """The node whose sufficient statistics the update ``node_id`` sums, ``None`` for another update."""
    try:
        uid = UpdateId.parse(node_id)
    except UpdateIdError:
        return None
    return uid.subject if uid.kind == STATISTICS and uid.step is None else None


def read_em_instructions(doc: PlanDocument) -> EMInstructions:
    """The plan as EM instructions; raises RuntimeRefusal naming what this runtime cannot execute."""
    if not doc.verdict.ok:
        raise RuntimeRefusal(
            f"the plan did not verify ({doc.verdict.errors} error(s)); fix the spec and recompile instead of running it"
        )
    spec = plan_spec(doc)
    plan = ParallelPlan.from_dict(doc.mesh.degrees)
    model = spec.model
    if not isinstance(model, DistributionModel):
        raise RuntimeRefusal(f"not a distribution model: {model.family!r}")
    later = [f"{a}={plan.size(a)}" for a in (Axis.PP, Axis.CP, Axis.EP, Axis.ETP) if plan.size(a) > 1]
    if later:
        raise RuntimeRefusal(
            f"a distribution model is fitted by EM over data ranks and a tp cut only; the plan has {', '.join(later)}"
        )
    t = spec.training
    try:
        tree = build_tree(model, t.seq_len)
    except ModelError as exc:
        raise RuntimeRefusal(f"the EM runtime cannot fit this model: {exc}") from None
    collectives = {}
    for u in doc.updates:
        collectives[u.node_id] = Collective.of_update(u)
    cut = _read_cut(doc, tree, plan) if plan.tp > 1 else None
    roles = _roles(tree, cut)
    owners = {p.logical_id: p.owner for p in doc.parameters}
    known = {LOG_LIKELIHOOD}
    if cut is not None:
        known |= {cut.normaliser_sum} | ({cut.normaliser_max} if cut.axis == "component" else set())
    statistics = []
    for node_id, c in collectives.items():
        if c.collective != "all_reduce":
            raise RuntimeRefusal(
                f"the plan declares {node_id!r} as {c.collective}; the EM runtime executes all_reduce only"
            )
        if node_id in known:
            continue
        subject = _statistics_of(node_id)
        node = tree.nodes.get(subject) if subject is not None else None
        if node is None or not node.stat_width():
            raise RuntimeRefusal(
                f"the plan declares the collective {node_id!r} (over {', '.join(c.axes)}), which the EM "
                "runtime does not execute"
            )
        statistics.append(_statistics_update(node_id, node, c, roles, cut, owners.get(node.id), plan))
    data_axes = tuple(a for a in DATA_PARALLEL_AXES if plan.size(a) > 1)
    spanning = [
        n for n, (role, _) in roles.items() if role == "spanning" and str(UpdateId.statistics(n)) not in collectives
    ]
    if spanning:
        raise RuntimeRefusal(
            f"units on several tp ranks add to the statistics of {', '.join(spanning)}, but the plan never "
            "sums them over tp"
        )
    if data_axes:
        missing = [n.id for n in tree.with_statistics() if str(UpdateId.statistics(n.id)) not in collectives]
        if missing:
            raise RuntimeRefusal(
                f"the plan never reduces the statistics of {', '.join(missing)} over {', '.join(data_axes)}; "
                "recompile the spec"
            )
    rows = t.global_batch_size
    if plan.data_parallel_size > rows:
        raise RuntimeRefusal(
            f"training.global_batch_size={rows} gives fewer rows than the {plan.data_parallel_size} data ranks"
        )
    micro_steps = plan.microbatches * plan.gradient_accumulation_steps
    if cut is not None and -(-rows // plan.data_parallel_size) > micro_steps * t.micro_batch_size:
        raise RuntimeRefusal(
            f"under a tp cut every micro-batch exchanges one normaliser per row: {rows} rows over "
            f"{plan.data_parallel_size} data rank(s) "
            f"do not fit {micro_steps} micro-batch(es) of micro_batch_size={t.micro_batch_size}; raise micro_batch_size"
        )
    return EMInstructions(
        spec=spec,
        plan=plan,
        content_digest=doc.content_digest,
        tree=tree,
        seed=t.seed,
        steps=t.steps,
        global_batch_size=rows,
        micro_batch_size=t.micro_batch_size,
        precision=t.precision,
        collectives=MappingProxyType(collectives),
        statistics=tuple(statistics),
        cut=cut,
        roles=MappingProxyType(roles),
        micro_steps=micro_steps,
    )


def _read_cut(doc: PlanDocument, tree: Tree, plan: ParallelPlan) -> Cut:
    dec = doc.decomposition if isinstance(doc.decomposition, dict) else doc.decomposition.model_dump(mode="json")
    path, axis = dec.get("path"), dec.get("axis")
    node = tree.nodes.get(path)
    expected = {"component": ("mixture", "logsumexp"), "factor": ("composite", "sum")}.get(axis)
    if node is None or expected is None or (node.kind, dec.get("reduction")) != expected:
        raise RuntimeRefusal(
            f"the EM runtime executes a cut of a mixture's components or a composite's factors over tp; this plan cuts "
            f"{axis!r} at {path!r}"
        )
    if node.shared or node.instances != 1:
        raise RuntimeRefusal(
            f"{path} is held {'as a shared node' if node.shared else f'{node.instances} times'}; the EM "
            "runtime cuts a node "
            f"held once"
        )
    chain = _parents(tree).get(path, [])
    if any(tree.nodes[p].kind != "composite" for p in chain):
        raise RuntimeRefusal(
            f"{path} is reached through "
            f"{', '.join(tree.nodes[p].kind for p in chain if tree.nodes[p].kind != 'composite')}; "
            f"the EM runtime cuts a node reached from the root through composites only"
        )
    k = node.num_units
    permutation = dec.get("permutation") or list(range(k))
    owners = [-1] * k
    for c in dec.get("cuts", ()):
        for position in range(c["start"], c["stop"]):
            owners[permutation[position]] = int(c["device"]["rank"])
    if any(o < 0 or o >= plan.tp for o in owners):
        raise RuntimeRefusal("the plan's decomposition does not give every unit of the cut to one tp rank")
    return Cut(path, axis, tuple(owners), max(owners.count(r) for r in range(plan.tp)))


def _parents(tree: Tree) -> dict[str, list[str]]:
    """For every node held once (not shared), the chain of its ancestors from the root."""
    out: dict[str, list[str]] = {tree.root.id: []}
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for child in node.linked():
            if not child.shared and child.id not in out:
                out[child.id] = out[node.id] + [node.id]
                stack.append(child)
    return out


def _subtree(node: TreeNode) -> set[str]:
    seen, stack = {node.id}, [node]
    while stack:
        n = stack.pop()
        for child in n.linked():
            if child.id not in seen:
                seen.add(child.id)
                stack.append(child)
    return seen


def _roles(tree: Tree, cut: Cut | None) -> dict[str, tuple[str, int | None]]:
    """Per node with statistics: (role, owner) under the cut (see StatisticsUpdate)."""
    if cut is None:
        return {n.id: ("whole", None) for n in tree.nodes.values()}
    c = tree.nodes[cut.path]
    units_of: dict[str, set[int]] = {}
    for u in range(c.num_units):
        for n in _subtree(c.unit_child(u, 0)[0]):
            units_of.setdefault(n, set()).add(u)
    # The nodes reached from the root without passing through the cut node.
    reached_outside = set()
    stack = [tree.root]
    while stack:
        n = stack.pop()
        if n.id == cut.path or n.id in reached_outside:
            continue
        reached_outside.add(n.id)
        stack += n.linked()
    roles: dict[str, tuple[str, int | None]] = {cut.path: ("cut", None)}
    repeated = len(c.children) == 1 and c.num_units > 1
    for n, units in units_of.items():
        node = tree.nodes[n]
        if n in reached_outside:
            raise RuntimeRefusal(
                f"{n} is used both inside and outside the cut of {cut.path}; the EM runtime does not execute that cut"
            )
        if node.shared:
            owners = {cut.owners[u] for u in units}
            roles[n] = ("spanning", None) if len(units) > 1 else ("owned", owners.pop())
        elif repeated:
            roles[n] = ("sharded", None)
        else:
            roles[n] = ("owned", cut.owners[next(iter(units))])
    for n in reached_outside:
        roles.setdefault(n, ("whole", None))
    return roles


def _statistics_update(
    update: str, node: TreeNode, c: Collective, roles, cut: Cut | None, plan_owner: int | None, plan: ParallelPlan
) -> StatisticsUpdate:
    role, owner = roles.get(node.id, ("whole", None))
    width = node.stat_width()
    rows_per_unit = 0
    if role == "cut":
        elements = cut.largest_share * (width // node.num_units)
    elif role == "sharded":
        rows_per_unit = node.instances // len(cut.owners)
        elements = cut.largest_share * rows_per_unit * width
    else:
        elements = node.instances * width
    if c.payload_bytes != elements * FLOAT64_BYTES:
        raise RuntimeRefusal(
            f"the plan sizes {update} at {c.payload_bytes} bytes, but its float64 statistics on a rank are "
            f"{elements * FLOAT64_BYTES} bytes "
            f"({elements} elements); recompile the spec with this version"
        )
    if role == "owned" and plan_owner is not None and plan_owner != owner:
        raise RuntimeRefusal(
            f"the plan places {node.id} on tp rank {plan_owner}, but the cut gives its unit to tp rank {owner}"
        )
    if ("tp" in c.axes) != (role == "spanning"):
        raise RuntimeRefusal(
            f"the plan reduces {update} over {', '.join(c.axes)}, but "
            + (
                "units on several tp ranks add to it, so it must be summed over tp too"
                if role == "spanning"
                else "no two tp ranks hold parts of it"
            )
        )
    return StatisticsUpdate(update, node.id, role, elements, owner if role == "owned" else None, rows_per_unit)
