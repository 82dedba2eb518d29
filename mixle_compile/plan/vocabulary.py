"""The plan's vocabulary: the names a plan is written in, stated once.

The lowering writes these names into a plan and the runtime reads them back out of it, so both
import them from here (the runtime never imports the lowering's internals):

- mesh axes: :class:`Axis` (the contracts' ``ParallelAxis``), the data-axis sets, and the
  communication domains cut from the same ranks (expert data ``edp``, the tied-embedding group
  ``tied``, a replicated KV head's ``tp_kv_head`` and ``tp_kv_replica<r>``);
- group-rule names (:func:`rule_name`): the axes of a collective joined in canonical order;
- placements: :class:`Replicate` and :class:`Shard`, written ``"replicate"`` and ``"shard(<dim>)"``
  (:meth:`Placement.parse` reads them with the contracts' grammar, ``str`` writes them);
- update ids (:class:`UpdateId`): ``<subject>:<kind>[/<step>]``, e.g. ``layers.0.mlp:out``,
  ``layers.0.mlp:out/grad`` (its backward conjugate), ``embed.weight:grad/scatter``,
  ``embed.weight:param/gather-forward``, ``stage.0->1:activation``.

Torch-free and free of the lowering, so that any layer can import it cheaply.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import ClassVar

# The grammar of a written placement is the contracts' (standard-library only, so it cannot import
# this module); the typed form is this one.
from mixle_compile.contracts import ParallelAxis, ParallelPlan, placement_dim

__all__ = [
    "DEGREE_AXES",
    "SHARD_AXES",
    "ALL_DATA_AXES",
    "BACKWARD",
    "GRADIENT_STEPS",
    "Axis",
    "DATA_AXES",
    "DATA_PARALLEL_AXES",
    "DENSE_AXES",
    "EMBEDDING_RULE",
    "EXPERT_AXES",
    "EXPERT_DATA",
    "KV_HEAD_AXIS",
    "KV_REPLICA_PREFIX",
    "REPLICATE",
    "STATISTICS",
    "TIED_ALIAS",
    "TIED_GROUP",
    "Placement",
    "PlacementError",
    "Replicate",
    "Shard",
    "UpdateId",
    "UpdateIdError",
    "expert_data_size",
    "kv_replica_axis",
    "kv_replica_size",
    "rule_name",
    "shard_dim",
]

# ---------------------------------------------------------------------------
# Axes and domains
# ---------------------------------------------------------------------------

#: The mesh axes a plan's degrees name (one StrEnum, the contracts' own).
Axis = ParallelAxis

#: The axes over which the data differs between ranks of a dense parameter's group: FSDP/HSDP's data
#: axes and cp, which FSDP folds into its shard group.
DATA_AXES: tuple[Axis, ...] = (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP)
#: The data-parallel axes proper (their product is the data-parallel size).
DATA_PARALLEL_AXES: tuple[Axis, ...] = (Axis.DP_REPLICATE, Axis.DP_SHARD)

#: The axes FSDP shards a dense parameter over when it folds cp into its shard group.
SHARD_AXES: tuple[Axis, ...] = (Axis.DP_SHARD, Axis.CP)
#: The degrees a mesh's summary lists (a checkpoint's manifest, a diff's mesh line), in mesh order.
DEGREE_AXES: tuple[Axis, ...] = (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP, Axis.PP, Axis.EP)

#: Expert data parallel: the world / (etp * ep * pp) ranks holding the same experts.
EXPERT_DATA = "edp"
#: The first and last pipeline stage of one model-parallel position (tied embeddings).
TIED_GROUP = "tied"
#: The KV head a tp rank holds when KV heads are replicated over tp (fewer KV heads than tp ranks):
#: coordinate tp_rank // r; the r ranks sharing one form the sub-axis :func:`kv_replica_axis`.
KV_HEAD_AXIS = "tp_kv_head"
#: Every domain over which a parameter's data differs: the dense data axes and expert data.
ALL_DATA_AXES: tuple[str, ...] = (*DATA_AXES, EXPERT_DATA)

#: Axes of each rank grid, in the canonical order used to name rules.
DENSE_AXES: tuple[str, ...] = (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP, Axis.PP)
EXPERT_AXES: tuple[str, ...] = (EXPERT_DATA, Axis.EP, Axis.ETP, Axis.PP)

#: Name of the tied-embedding rule: first and last pipeline stage of the same model-parallel
#: position (their tied input/output embedding gradients meet there).
EMBEDDING_RULE = "embedding"
#: Another accepted name for the same rule (the layouts call the tied group ``tied``).
TIED_ALIAS = TIED_GROUP

#: KV-head replication: the tp ranks ``t`` with the same ``t // r`` hold the same KV head. The axis
#: name carries ``r`` so that a rule can be rebuilt from its name and the plan's degrees alone.
KV_REPLICA_PREFIX = "tp_kv_replica"
_KV_REPLICA = re.compile(r"tp_kv_replica([1-9][0-9]*)")


def kv_replica_axis(replicas: int) -> str:
    """The name of the sub-axis of tp whose ``replicas`` ranks share one KV head."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"KV-head replicas must be a positive integer, got {replicas!r}")
    return f"{KV_REPLICA_PREFIX}{replicas}"


def kv_replica_size(axis: str) -> int | None:
    """``r`` for a KV-replica axis name (``tp_kv_replica<r>``), ``None`` for any other name."""
    match = _KV_REPLICA.fullmatch(axis) if isinstance(axis, str) else None
    return int(match.group(1)) if match else None


def expert_data_size(plan: ParallelPlan) -> int:
    """Ranks of the expert-data domain: world / (etp * ep * pp)."""
    return plan.world_size // (plan.etp * plan.ep * plan.pp)


def rule_name(axes: Iterable[str]) -> str:
    """Canonical rule name: the axes joined by ``+`` in canonical axis order."""
    axes = tuple(axes)
    if axes in ((EMBEDDING_RULE,), (TIED_ALIAS,)):
        return EMBEDDING_RULE
    if any(kv_replica_size(a) is not None for a in axes):
        if len(axes) != 1:
            raise ValueError(f"rule {axes}: a KV-replica axis ({KV_REPLICA_PREFIX}<r>) forms a rule alone")
        return axes[0]
    canonical = DENSE_AXES + tuple(a for a in EXPERT_AXES if a not in DENSE_AXES)
    unknown = [a for a in axes if a not in canonical]
    if unknown:
        raise ValueError(
            f"unknown axis {unknown[0]!r} in rule {axes}; valid axes: {', '.join(canonical)}, "
            f"or {EMBEDDING_RULE!r} alone"
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"rule {axes} names an axis twice")
    return "+".join(sorted(axes, key=canonical.index))


# ---------------------------------------------------------------------------
# Placements
# ---------------------------------------------------------------------------


class PlacementError(ValueError):
    """A placement that is neither ``"replicate"`` nor ``"shard(<dim>)"``."""


class Placement:
    """How a parameter is held over one mesh axis: :class:`Replicate` or :class:`Shard`."""

    __slots__ = ()
    dim: int | None

    @staticmethod
    def parse(text: str) -> Replicate | Shard:
        """The placement a plan writes as ``text``; :class:`PlacementError` for anything else."""
        try:
            if not isinstance(text, str):
                raise ValueError(text)
            dim = placement_dim(text)
        except ValueError:
            raise PlacementError(
                f"malformed placement {text!r}: expected 'replicate' or 'shard(<dim>)' with <dim> a "
                "non-negative integer written without leading zeros, e.g. 'shard(0)'"
            ) from None
        return REPLICATE if dim is None else Shard(dim)


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """The whole tensor on every rank of the axis."""

    dim: ClassVar[None] = None

    def __str__(self) -> str:
        return "replicate"


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """The tensor split on dimension ``dim`` into one slice per rank of the axis."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise PlacementError(f"a shard's dimension must be an integer >= 0, got {self.dim!r}")

    def __str__(self) -> str:
        return f"shard({self.dim})"


REPLICATE = Replicate()


def shard_dim(text: str) -> int | None:
    """The dimension a written placement shards, ``None`` for ``"replicate"``."""
    if isinstance(text, str):
        known = _SHARD_DIMS.get(text, _UNKNOWN)
        if known is not _UNKNOWN:
            return known
        dim = Placement.parse(text).dim
        if len(_SHARD_DIMS) < 4096:
            _SHARD_DIMS[text] = dim
        return dim
    return Placement.parse(text).dim


# Placements read so far (a plan writes a handful of distinct ones, read once per tensor and axis).
_SHARD_DIMS: dict[str, int | None] = {}
_UNKNOWN = object()


# ---------------------------------------------------------------------------
# Update ids
# ---------------------------------------------------------------------------


class UpdateIdError(ValueError):
    """A string that is not an update id."""


#: ``<subject>:<kind>[/<step>]``: the subject may contain anything but a colon at its end; kind and
#: step are words (a step may carry a ``-phase``).
_UPDATE_ID = re.compile(r"(?P<subject>.+):(?P<kind>[A-Za-z_]+)(?:/(?P<step>[A-Za-z_]+(?:-[A-Za-z_]+)?))?")
_TRANSFER = re.compile(r"stage\.(\d+)->(\d+)")

#: The step of an activation update's backward conjugate (``layers.0.mlp:out/grad``).
BACKWARD = "grad"
#: The step of an activation collective that activation checkpointing issues again in the backward
#: (``layers.0.attn:in/recompute``).
RECOMPUTE = "recompute"
#: The kinds of a parameter's own updates.
GRADIENT = "grad"
PARAMETER = "param"
#: The kind of a distribution model's sum of one node's sufficient statistics (EM).
STATISTICS = "statistics"
#: The gradient reduction steps, in the order they apply (lower/updates.py).
GRADIENT_STEPS = ("tied", "tp", "kv", "scatter", "reduce")


@dataclass(frozen=True, slots=True)
class UpdateId:
    """The node id of one planned update: what it moves (``subject``), which of its collectives
    (``kind``) and, where there are several, which step of it (``step``)."""

    subject: str
    kind: str
    step: str | None = None

    def __str__(self) -> str:
        return f"{self.subject}:{self.kind}" + (f"/{self.step}" if self.step else "")

    @classmethod
    def parse(cls, text: str) -> UpdateId:
        """The id ``text`` names; :class:`UpdateIdError` for anything else."""
        match = _UPDATE_ID.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise UpdateIdError(
                f"malformed update id {text!r}: expected '<subject>:<kind>' or '<subject>:<kind>/<step>', "
                "e.g. 'layers.0.mlp:out' or 'embed.weight:grad/scatter'"
            )
        return cls(match["subject"], match["kind"], match["step"])

    # Builders, one per shape of id the lowering plans.

    @classmethod
    def activation(cls, site: str, kind: str, *, backward: bool = False) -> UpdateId:
        """An activation collective at ``site`` (``layers.0.attn:kv``), or its backward conjugate."""
        return cls(site, kind, BACKWARD if backward else None)

    @classmethod
    def gradient(cls, tensor: str, step: str) -> UpdateId:
        """One step of a parameter's gradient reduction (``embed.weight:grad/scatter``)."""
        if step not in GRADIENT_STEPS:
            raise UpdateIdError(f"unknown gradient step {step!r}; valid steps: {', '.join(GRADIENT_STEPS)}")
        return cls(tensor, GRADIENT, step)

    @classmethod
    def gather(cls, tensor: str, phase: str | None = None) -> UpdateId:
        """A parameter all_gather: before its ``phase`` use (FSDP), or after the step (``None``: a
        distributed optimizer's gather of the updated shards)."""
        return cls(tensor, PARAMETER, f"gather-{phase}" if phase else "gather")

    @classmethod
    def statistics(cls, node: str) -> UpdateId:
        """The sum of a distribution node's sufficient statistics (``model.root:statistics``)."""
        return cls(node, STATISTICS)

    @classmethod
    def transfer(cls, src: int, dst: int, *, backward: bool = False) -> UpdateId:
        """A pipeline transfer from stage ``src`` to ``dst`` (``stage.0->1:activation``)."""
        return cls(f"stage.{src}->{dst}", "activation", BACKWARD if backward else None)

    @classmethod
    def activation_pair(cls, site: str, kind: str) -> tuple[str, str]:
        """The written ids of an activation collective and of its backward conjugate, the keys a
        rank's observations are recorded under (``layers.0.mlp:out``, ``layers.0.mlp:out/grad``)."""
        forward = cls.activation(site, kind)
        return str(forward), str(forward.backward())

    # Readers.

    def recomputed(self) -> UpdateId:
        """A forward activation collective as the recomputed forward issues it again."""
        return replace(self, step=RECOMPUTE)

    def backward(self) -> UpdateId:
        """The backward conjugate of a forward activation update."""
        return replace(self, step=BACKWARD)

    @property
    def is_backward(self) -> bool:
        return self.step == BACKWARD and self.kind != GRADIENT

    @property
    def stages(self) -> tuple[int, int] | None:
        """``(src, dst)`` of a pipeline transfer, ``None`` for any other update."""
        match = _TRANSFER.fullmatch(self.subject)
        if match is None or self.kind != "activation" or self.step not in (None, BACKWARD):
            return None
        return int(match.group(1)), int(match.group(2))
