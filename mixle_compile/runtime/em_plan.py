"""A distribution plan, read as EM instructions. Torch-free, so that `run` refuses before starting.

Executed today: a mixture whose components are all Gaussians (one dimension, one covariance kind,
``diag`` or ``full``) or all categoricals (one number of values), under data parallelism
(dp_replicate, dp_shard) and a cut of its components over tp (the decomposition's cuts and
permutation say which tp rank owns each component). Refused with the reason: factor cuts, HMMs,
composites, other node kinds.

Every collective the EM worker issues is one of the plan's updates:

- ``<node>:statistics`` (all_reduce sum over the data axes): the node's sufficient statistics.
  The mixture's own node carries the responsibilities' sums (one per component); a component's
  node carries its weighted sums (Gaussian: sum of x and of x x^T, or of x^2 when diagonal;
  categorical: the counts of each value). These have as many elements as the parameters the plan
  sized, so the bytes on the wire are the plan's ``payload_bytes`` scaled from the plan's
  precision to float64, the precision EM runs in;
- ``log_likelihood`` (all_reduce sum over the data axes): the iteration's total log-likelihood;
- under a component cut, per micro-batch, ``model.root:normaliser/max`` then ``/sum`` (all_reduce
  max, then sum, over tp): the posterior normaliser, a logsumexp over the components of every tp
  rank. Each tp rank sends its share of the statistics padded to the plan's local shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from mixle_compile.contracts import ParallelPlan
from mixle_compile.lower.groups import rule_name
from mixle_compile.parameters import DTYPE_BYTES
from mixle_compile.plan.artifact import plan_spec
from mixle_compile.plan.document import PlanDocument
from mixle_compile.runtime.errors import RuntimeRefusal
from mixle_compile.runtime.instructions import Collective
from mixle_compile.spec.models import Categorical, DistributionModel, Gaussian, Mixture, Spec

FLOAT64_BYTES = 8
ROOT = "model.root"
LOG_LIKELIHOOD = "log_likelihood"
NORMALISER_MAX = f"{ROOT}:normaliser/max"
NORMALISER_SUM = f"{ROOT}:normaliser/sum"


@dataclass(frozen=True)
class EMInstructions:
    spec: Spec
    plan: ParallelPlan
    content_digest: str
    kind: str  # gaussian | categorical
    num_components: int
    dim: int  # Gaussian dimension (1 for categorical data)
    covariance: str | None  # diag | full (Gaussian)
    num_values: int | None  # categorical
    component_nodes: tuple[str, ...]  # per component: the node id whose parameters it is
    seed: int
    steps: int
    global_batch_size: int
    micro_batch_size: int
    precision: str
    collectives: Mapping[str, Collective]
    owners: tuple[int, ...]  # per component: the tp coordinate that scores and updates it
    local_units: int  # rows of a tp rank's share of the per-component parameters (padded)
    micro_steps: int

    def owned(self, tp_coord: int) -> list[int]:
        return [k for k, o in enumerate(self.owners) if o == tp_coord]

    @property
    def data_axes(self) -> tuple[str, ...]:
        return tuple(a for a in ("dp_replicate", "dp_shard") if self.plan.size(a) > 1)

    def expected_bytes(self, c: Collective) -> int:
        """Bytes one call of this update carries: statistics in float64, the rest as planned."""
        if c.node_id.endswith(":statistics"):
            return c.payload_bytes * FLOAT64_BYTES // DTYPE_BYTES[self.precision]
        return c.payload_bytes


def is_distribution(doc: PlanDocument) -> bool:
    model = doc.spec.get("model") if isinstance(doc.spec, dict) else getattr(doc.spec, "model", None)
    family = model.get("family") if isinstance(model, dict) else getattr(model, "family", None)
    return family == "distribution"


def read_em_instructions(doc: PlanDocument) -> EMInstructions:
    """The plan as EM instructions; raises RuntimeRefusal naming what this runtime cannot execute."""
    if not doc.verdict.ok:
        raise RuntimeRefusal(f"the plan did not verify ({doc.verdict.errors} error(s)); fix the spec and recompile instead of running it")
    spec = plan_spec(doc)
    plan = ParallelPlan.from_dict(doc.mesh.degrees)
    model = spec.model
    if not isinstance(model, DistributionModel):
        raise RuntimeRefusal(f"not a distribution model: {model.family!r}")
    later = [f"{a}={plan.size(a)}" for a in ("pp", "cp", "ep", "etp") if plan.size(a) > 1]
    if later:
        raise RuntimeRefusal(f"a distribution model is fitted by EM over data ranks only; the plan has {', '.join(later)}")
    root = model.root
    if not isinstance(root, Mixture):
        raise RuntimeRefusal(
            f"the EM runtime executes a mixture of Gaussians or of categoricals at the root; this distribution model's root is a "
            f"{getattr(root, 'type', type(root).__name__)!r} node (HMMs and composites are not executed yet)"
        )
    if root.component is not None:
        components = [root.component] * (root.repeat or 1)
        nodes = tuple(f"{ROOT}.component" for _ in components)
    else:
        components = list(root.components or ())
        nodes = tuple(f"{ROOT}.components[{k}]" for k in range(len(components)))
    kinds = {type(c) for c in components}
    if kinds == {Gaussian}:
        shapes = {(c.dim, c.covariance) for c in components}
        if len(shapes) != 1:
            raise RuntimeRefusal("the EM runtime fits Gaussian mixtures whose components share one dimension and one covariance kind")
        (dim, covariance), = shapes
        kind, num_values = "gaussian", None
    elif kinds == {Categorical}:
        values = {c.num_values for c in components}
        if len(values) != 1:
            raise RuntimeRefusal("the EM runtime fits categorical mixtures whose components share one number of values")
        kind, dim, covariance, num_values = "categorical", 1, None, values.pop()
    else:
        names = sorted(getattr(c, "type", type(c).__name__) for c in components)
        raise RuntimeRefusal(
            f"the EM runtime fits mixtures of Gaussians or of categoricals; this distribution model's mixture components are {', '.join(names)}"
        )
    owners = tuple(0 for _ in components)
    local_units = len(components)
    if plan.tp > 1:
        owners, local_units = _component_cut(doc, root, len(components), plan.tp)
    collectives = {}
    for u in doc.updates:
        collectives[u.node_id] = Collective(
            node_id=u.node_id, collective=u.collective, axes=tuple(u.mesh_axes), rule=rule_name(u.mesh_axes) if u.mesh_axes else "",
            phase=u.phase, stage=u.stage, tensor=u.tensor, payload_bytes=u.payload_bytes, group_size=u.group_size,
            occurrences_per_step=u.occurrences_per_step, divisor=u.gradient_divisor,
        )
    known = {f"{n}:statistics" for n in set(nodes) | {ROOT}} | {LOG_LIKELIHOOD}
    if plan.tp > 1:
        known |= {NORMALISER_MAX, NORMALISER_SUM}
    for node_id, c in collectives.items():
        if node_id not in known or c.collective != "all_reduce":
            raise RuntimeRefusal(f"the plan declares the collective {node_id!r} ({c.collective} over {', '.join(c.axes)}), which the EM runtime does not execute")
    t = spec.training
    rows = t.global_batch_size
    if plan.data_parallel_size > rows:
        raise RuntimeRefusal(f"training.global_batch_size={rows} gives fewer rows than the {plan.data_parallel_size} data ranks")
    return EMInstructions(
        spec=spec, plan=plan, content_digest=doc.content_digest, kind=kind, num_components=len(components), dim=dim,
        covariance=covariance, num_values=num_values, component_nodes=nodes, seed=t.seed, steps=t.steps,
        global_batch_size=rows, micro_batch_size=t.micro_batch_size, precision=t.precision,
        collectives=MappingProxyType(collectives), owners=owners, local_units=local_units,
        micro_steps=plan.microbatches * plan.gradient_accumulation_steps,
    )


def _component_cut(doc: PlanDocument, root: Mixture, num_components: int, tp: int) -> tuple[tuple[int, ...], int]:
    """Which tp coordinate owns each component, and the rows of a tp rank's padded share."""
    dec = doc.decomposition if isinstance(doc.decomposition, dict) else doc.decomposition.model_dump(mode="json")
    if dec.get("axis") != "component" or dec.get("path") != ROOT or dec.get("reduction") != "logsumexp":
        raise RuntimeRefusal(
            f"the EM runtime executes a cut of the root mixture's components over tp; this plan cuts {dec.get('axis')!r} at "
            f"{dec.get('path')!r}, which it does not execute yet"
        )
    if root.component is None:
        raise RuntimeRefusal(
            "under a component cut the EM runtime executes a mixture written as `component:` with `repeat:`; a list of "
            "`components:` is not executed over tp yet: set mesh.tp to 1"
        )
    permutation = dec.get("permutation") or list(range(num_components))
    owners = [-1] * num_components
    for cut in dec["cuts"]:
        for position in range(cut["start"], cut["stop"]):
            owners[permutation[position]] = int(cut["device"]["rank"])
    if any(o < 0 or o >= tp for o in owners):
        raise RuntimeRefusal("the plan's decomposition does not give every component to one tp rank")
    local = {tuple(p.local_shape)[0] for p in doc.parameters if p.logical_id in (ROOT, f"{ROOT}.component")}
    if len(local) != 1:
        raise RuntimeRefusal("the plan's mixture weights and components are split over tp in different shares")
    local_units = local.pop()
    if max(owners.count(r) for r in range(tp)) > local_units:
        raise RuntimeRefusal(f"a tp rank owns more components than the {local_units} rows of its share of the parameters")
    return tuple(owners), local_units
