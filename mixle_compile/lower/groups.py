"""Concrete ranks for every process group of a plan, computed symbolically.

Ranks are laid out on two mixed-radix grids over the same world:

* the **dense grid** (attention, embeddings, every non-expert parameter) with
  dimensions ``tp``, ``cp``, ``dp_shard``, ``dp_replicate`` and ``pp``;
* the **expert grid** (mixture-of-experts layers) with dimensions ``etp``,
  ``ep``, ``edp`` (expert data parallel) and ``pp``.

Both are laid out by one Megatron-style order string, innermost (fastest
varying rank) first, default ``"tp-cp-ep-dp-pp"``: tensor-parallel ranks are
adjacent, so they land on one node.  In the dense grid the token ``dp`` stands
for ``dp_shard`` (inner) then ``dp_replicate`` (outer), so that a shard group
is contiguous and replicas sit further apart, and ``ep`` is ignored.  In the
expert grid ``tp`` means ``etp``, ``dp`` means ``edp`` and ``cp`` is ignored;
``edp = world // (etp * ep * pp)``.  This is how Megatron-Core folds expert
parallelism over the attention ranks: the expert grid needs
``world % (etp * ep * pp) == 0`` and its pipeline groups must be the dense
grid's pipeline groups (both grids share the ``pp`` coordinate, which is what
lets one pipeline schedule drive dense and expert layers alike).
:meth:`RankGrid.from_plan` checks both and raises ``ValueError`` otherwise.

A :class:`GroupRule` describes every group of one axis (or combination of
axes) without listing ranks: a group is its *base rank* plus every
combination of ``(stride, length)`` steps, so ``group_of(rank)`` costs a few
divisions and the size of its answer, never the world size.  Lists of ranks
are produced only on request (:func:`enumerate_groups`).

A KV-replica rule (``tp_kv_replica<r>``, see :func:`kv_replica_axis`) splits
tp into blocks of ``r`` consecutive tp coordinates: the ranks that hold the
same KV head when there are fewer KV heads than tp ranks.

Process groups must be created in the same order on every rank
(``torch.distributed.new_group`` is a collective over the whole world);
:meth:`RankGrid.creation_order` yields that one global order: rules in
:attr:`RankGrid.rules` order, then groups by index.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from mixle_compile.contracts import ParallelPlan

# The names rules are written in belong to the plan's vocabulary (the runtime reads them too).
from mixle_compile.plan.vocabulary import (
    DATA_AXES,
    DATA_PARALLEL_AXES,
    DENSE_AXES,
    EMBEDDING_RULE,
    EXPERT_AXES,
    EXPERT_DATA,
    TIED_ALIAS,
    Axis,
    kv_replica_axis,
    kv_replica_size,
    rule_name,
)

__all__ = [
    "DEFAULT_ORDER",
    "DENSE_AXES",
    "EXPERT_AXES",
    "EMBEDDING_RULE",
    "TIED_ALIAS",
    "DEFAULT_RULES",
    "GridDim",
    "RankLayout",
    "AxisSpan",
    "GroupRule",
    "RankGrid",
    "enumerate_groups",
    "kv_replica_axis",
    "kv_replica_size",
    "rule_name",
]

#: Megatron's default order, innermost first.
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")

#: What each order token expands to, innermost first.
DENSE_TOKEN_AXES = {
    "tp": (Axis.TP,),
    "cp": (Axis.CP,),
    "ep": (),
    "dp": (Axis.DP_SHARD, Axis.DP_REPLICATE),
    "pp": (Axis.PP,),
}
EXPERT_TOKEN_AXES = {"tp": (Axis.ETP,), "cp": (), "ep": (Axis.EP,), "dp": (EXPERT_DATA,), "pp": (Axis.PP,)}

#: Rules every grid carries, in the global creation order.  Names join the axes
#: with ``+`` in canonical order (see :func:`rule_name`).
DEFAULT_RULES: tuple[tuple[str, ...], ...] = (
    (Axis.TP,),
    (Axis.CP,),
    (Axis.DP_SHARD,),
    (Axis.DP_REPLICATE,),
    (Axis.PP,),
    (Axis.DP_SHARD, Axis.CP),  # FSDP shard group when cp folds into it
    DATA_PARALLEL_AXES,  # data parallel
    DATA_AXES,  # dense gradient reduction
    (Axis.CP, Axis.TP),
    (Axis.TP, Axis.PP),  # model parallel
    (EMBEDDING_RULE,),
    (Axis.ETP,),
    (Axis.EP,),
    (EXPERT_DATA,),
    (Axis.EP, Axis.ETP),
)


# ---------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GridDim:
    """One dimension of a rank layout: moving one step along it adds ``stride``."""

    axis: str
    size: int
    stride: int

    def as_dict(self) -> dict[str, Any]:
        return {"axis": self.axis, "size": self.size, "stride": self.stride}


@dataclass(frozen=True)
class RankLayout:
    """A mixed-radix numbering of ranks: ``rank = sum(coord[d] * d.stride)``.

    ``dims`` is innermost first, each stride the product of the sizes inside it.
    """

    name: str
    dims: tuple[GridDim, ...]

    @staticmethod
    def build(name: str, axes_innermost_first: Sequence[tuple[str, int]]) -> RankLayout:
        dims = []
        stride = 1
        for axis, size in axes_innermost_first:
            dims.append(GridDim(axis, size, stride))
            stride *= size
        return RankLayout(name, tuple(dims))

    @cached_property
    def world_size(self) -> int:
        return math.prod(d.size for d in self.dims)

    @cached_property
    def axes(self) -> tuple[str, ...]:
        return tuple(d.axis for d in self.dims)

    def dim(self, axis: str) -> GridDim:
        for d in self.dims:
            if d.axis == axis:
                return d
        raise KeyError(f"the {self.name} grid has no axis {axis!r}; its axes: {', '.join(self.axes)}")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of ``rank`` on every axis of this layout."""
        _check_rank(rank, self.world_size)
        return {d.axis: (rank // d.stride) % d.size for d in self.dims}

    def rank(self, coords: Mapping[str, int]) -> int:
        """Inverse of :meth:`coords`; every axis of this layout must be given."""
        total = 0
        for d in self.dims:
            if d.axis not in coords:
                raise ValueError(f"coordinates for the {self.name} grid lack axis {d.axis!r}")
            value = coords[d.axis]
            if not 0 <= value < d.size:
                raise ValueError(f"coordinate {d.axis}={value} is outside 0..{d.size - 1}")
            total += value * d.stride
        return total

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dims": [d.as_dict() for d in self.dims]}


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in 0..{world_size - 1}, got {rank!r}")


# ---------------------------------------------------------------------------
# Group rules
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AxisSpan:
    """The coordinates a group covers on one axis: ``0, step, ..., (count-1)*step``.

    A plain axis group takes every coordinate (``step=1, count=size``); the
    tied-embedding group takes only the first and last pipeline stage.
    """

    axis: str
    step: int
    count: int


@dataclass(frozen=True)
class GroupRule:
    """Every group of one axis combination, described without listing ranks.

    A group is ``base + sum(k_i * stride_i)`` over :attr:`dims` with
    ``0 <= k_i < length_i``; group ``index`` has base rank
    ``sum(digit_j(index) * stride_j)`` over :attr:`base_dims` (digits
    innermost first).  Groups are numbered by ascending base rank and their
    members are listed in ascending rank order.
    """

    name: str
    axes: tuple[str, ...]
    layout: RankLayout
    spans: tuple[AxisSpan, ...]

    # -- shape ----------------------------------------------------------------

    @cached_property
    def dims(self) -> tuple[tuple[int, int], ...]:
        """``(stride, length)`` steps generating a group from its base rank, innermost first."""
        steps = [(self.layout.dim(s.axis).stride * s.step, s.count) for s in self.spans if s.count > 1]
        return tuple(sorted(steps))

    @cached_property
    def base_dims(self) -> tuple[tuple[int, int], ...]:
        """``(stride, length)`` digits of the group index, innermost first.

        An axis the rule does not span is a digit; so is the block index of an axis spanned by
        blocks of consecutive coordinates (``step == 1``, ``count < size``: the KV-replica groups
        of tp), whose blocks partition it."""
        spans = {s.axis: s for s in self.spans}
        out = []
        for d in self.layout.dims:
            s = spans.get(d.axis)
            if s is None:
                if d.size > 1:
                    out.append((d.stride, d.size))
            elif s.step == 1 and s.count < d.size:
                out.append((d.stride * s.count, d.size // s.count))
        return tuple(out)

    @cached_property
    def size(self) -> int:
        return math.prod(length for _, length in self.dims)

    @cached_property
    def num_groups(self) -> int:
        return math.prod(length for _, length in self.base_dims)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @cached_property
    def _coordinate_digits(self) -> tuple[tuple[int, int, int, int], ...]:
        """``(stride, size, step, count)`` of every spanned axis, for the per-rank queries."""
        return tuple((d.stride, d.size, s.step, s.count) for s in self.spans for d in (self.layout.dim(s.axis),))

    @cached_property
    def _runs(self) -> tuple[int, int, tuple[int, ...]]:
        """Members as runs: ``(step, length)`` of the innermost merged run, and run offsets.

        Adjacent dims that continue each other (``stride * length`` equals the
        next stride) merge into one arithmetic run, so a group with one run is
        built by ``range`` at C speed however large it is.
        """
        merged: list[list[int]] = []
        for stride, length in self.dims:
            if merged and merged[-1][0] * merged[-1][1] == stride:
                merged[-1][1] *= length
            else:
                merged.append([stride, length])
        if not merged:
            return 1, 1, (0,)
        step, length = merged[0]
        offsets = [0]
        for stride, count in merged[1:]:
            offsets = [o + k * stride for k in range(count) for o in offsets]
        return step, length, tuple(offsets)

    # -- queries ----------------------------------------------------------------

    def covers(self, rank: int) -> bool:
        """Whether ``rank`` belongs to some group of this rule.

        Always true except for the tied-embedding rule, which covers the first
        and last pipeline stage only.
        """
        _check_rank(rank, self.world_size)
        for stride, size, step, count in self._coordinate_digits:
            if step != 1:
                coord = (rank // stride) % size
                if coord % step or coord // step >= count:
                    return False
        return True

    def base_rank_of(self, rank: int) -> int | None:
        """Smallest rank of ``rank``'s group (``None`` when the rule does not cover it)."""
        if not self.covers(rank):
            return None
        base = rank
        for stride, size, step, count in self._coordinate_digits:
            coord = (rank // stride) % size
            # Within a block of consecutive coordinates, the offset from the block's first one.
            base -= (coord % count if step == 1 else coord) * stride
        return base

    def group_index_of(self, rank: int) -> int | None:
        """Index of ``rank``'s group (``None`` when the rule does not cover it); O(axes)."""
        if not self.covers(rank):
            return None
        index = 0
        multiplier = 1
        for stride, length in self.base_dims:
            index += ((rank // stride) % length) * multiplier
            multiplier *= length
        return index

    def group_of(self, rank: int) -> tuple[int, ...]:
        """Ranks of the group that contains ``rank``, ascending.

        Empty when the rule does not cover ``rank`` (a middle pipeline stage
        for the tied-embedding rule).  Costs the size of the answer, not the
        size of the world.
        """
        base = self.base_rank_of(rank)
        if base is None:
            return ()
        return self._members(base)

    def group(self, index: int) -> tuple[int, ...]:
        """Ranks of group ``index`` (``0 <= index < num_groups``), ascending."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_groups:
            raise ValueError(f"group index must be in 0..{self.num_groups - 1} for rule {self.name!r}, got {index!r}")
        base = 0
        for stride, length in self.base_dims:
            index, digit = divmod(index, length)
            base += digit * stride
        return self._members(base)

    def groups(self) -> Iterator[tuple[int, ...]]:
        """Every group in index order, lazily."""
        for index in range(self.num_groups):
            yield self.group(index)

    def _members(self, base: int) -> tuple[int, ...]:
        step, length, offsets = self._runs
        if len(offsets) == 1:
            start = base + offsets[0]
            return tuple(range(start, start + step * length, step))
        return tuple(itertools.chain.from_iterable(range(base + o, base + o + step * length, step) for o in offsets))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready and symbolic: how to generate the groups, never their ranks."""
        return {
            "name": self.name,
            "grid": self.layout.name,
            "axes": list(self.axes),
            "size": self.size,
            "num_groups": self.num_groups,
            "dims": [list(d) for d in self.dims],
            "base_dims": [list(d) for d in self.base_dims],
        }


def enumerate_groups(rule: GroupRule, limit: int | None = None) -> list[tuple[int, ...]]:
    """The groups of ``rule`` as explicit rank lists, the first ``limit`` of them if given.

    For reports that ask for ranks; everything else should stay symbolic.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    count = rule.num_groups if limit is None else min(limit, rule.num_groups)
    return [rule.group(index) for index in range(count)]


# ---------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------


def _parse_order(order: str | None) -> tuple[str, ...]:
    text = DEFAULT_ORDER if order is None else order
    if not isinstance(text, str):
        raise ValueError(f"order must be a string such as {DEFAULT_ORDER!r}, got {text!r}")
    tokens = tuple(text.split("-"))
    if sorted(tokens) != sorted(_ORDER_TOKENS):
        raise ValueError(
            f"order {text!r} must name each of {', '.join(_ORDER_TOKENS)} exactly once, "
            f"joined by '-', innermost first (e.g. {DEFAULT_ORDER!r})"
        )
    return tokens


@dataclass(frozen=True)
class RankGrid:
    """The dense and expert rank layouts of one plan, and its group rules."""

    plan: ParallelPlan
    order: str
    dense: RankLayout
    expert: RankLayout
    rules: tuple[GroupRule, ...] = field(repr=False)

    @staticmethod
    def from_plan(
        plan: ParallelPlan,
        order: str | None = None,
        extra_rules: Iterable[Sequence[str]] = (),
    ) -> RankGrid:
        """Lay out ``plan``'s ranks by ``order`` (innermost first, default ``tp-cp-ep-dp-pp``).

        ``extra_rules`` adds axis combinations after :data:`DEFAULT_RULES`
        (they join the creation order at the end).  Raises ``ValueError`` when
        the order is not a permutation of ``tp-cp-ep-dp-pp``, when
        ``etp * ep * pp`` does not divide the world, or when the expert grid's
        pipeline groups differ from the dense grid's.
        """
        tokens = _parse_order(order)
        world = plan.world_size
        degree = {
            "tp": plan.tp,
            "cp": plan.cp,
            "dp_shard": plan.dp_shard,
            "dp_replicate": plan.dp_replicate,
            "pp": plan.pp,
        }
        dense = RankLayout.build("dense", [(axis, degree[axis]) for t in tokens for axis in DENSE_TOKEN_AXES[t]])
        expert_model = plan.etp * plan.ep * plan.pp
        if world % expert_model:
            raise ValueError(
                f"the expert grid needs etp * ep * pp = {plan.etp} * {plan.ep} * {plan.pp} = {expert_model} "
                f"to divide the world size {world} ({plan.factorisation()}); "
                f"change ep or etp so that it does"
            )
        degree.update(etp=plan.etp, ep=plan.ep, edp=world // expert_model)
        expert = RankLayout.build("expert", [(axis, degree[axis]) for t in tokens for axis in EXPERT_TOKEN_AXES[t]])
        dense_pp, expert_pp = dense.dim("pp").stride, expert.dim("pp").stride
        if plan.pp > 1 and dense_pp != expert_pp:
            # Same pp size, so the pp groups coincide exactly when the strides do.
            inner = tokens[: tokens.index("pp")]
            raise ValueError(
                f"order {'-'.join(tokens)!r} puts {', '.join(inner)} inside pp, so a pipeline stage "
                f"spans {dense_pp} consecutive dense ranks but {expert_pp} expert ranks; "
                f"expert and dense layers must share pipeline groups: make the axes inside pp "
                f"multiply to the same number in both grids (e.g. etp = tp with cp and dp "
                f"outside pp), or move pp outermost"
            )
        grid = RankGrid(plan, "-".join(tokens), dense, expert, ())
        axes_list = list(DEFAULT_RULES) + [tuple(a) for a in extra_rules]
        rules: list[GroupRule] = []
        seen: set[str] = set()
        for axes in axes_list:
            rule = grid.rule(axes)
            if rule.name not in seen:
                seen.add(rule.name)
                rules.append(rule)
        object.__setattr__(grid, "rules", tuple(rules))
        return grid

    # -- coordinates ------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dense.world_size

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every dense and expert axis (``pp`` is shared)."""
        coords = self.dense.coords(rank)
        coords.update(self.expert.coords(rank))
        return coords

    def rank(self, coords: Mapping[str, int]) -> int:
        """The rank at ``coords``: a full set of dense axes, or of expert axes, or both (must agree)."""
        answers = []
        for layout in (self.dense, self.expert):
            if all(axis in coords for axis in layout.axes):
                answers.append(layout.rank(coords))
        if not answers:
            raise ValueError(
                f"coordinates {dict(coords)} name neither every dense axis ({', '.join(self.dense.axes)}) "
                f"nor every expert axis ({', '.join(self.expert.axes)})"
            )
        if len(set(answers)) > 1:
            raise ValueError(f"coordinates {dict(coords)} give dense rank {answers[0]} but expert rank {answers[1]}")
        return answers[0]

    def stage_of(self, rank: int) -> int:
        """Pipeline stage of ``rank``."""
        _check_rank(rank, self.world_size)
        d = self.dense.dim("pp")
        return (rank // d.stride) % d.size

    def rank_at_stage(self, rank: int, stage: int) -> int:
        """The rank at pipeline stage ``stage`` with every other coordinate of ``rank``."""
        d = self.dense.dim("pp")
        if not 0 <= stage < d.size:
            raise ValueError(f"stage must be in 0..{d.size - 1}, got {stage}")
        return rank + (stage - self.stage_of(rank)) * d.stride

    # -- rules --------------------------------------------------------------------

    def rule(self, axes: Sequence[str] | str) -> GroupRule:
        """The rule for ``axes`` (a tuple of axis names, or a rule name such as ``"dp_shard+cp"``)."""
        if isinstance(axes, str):
            for existing in self.rules:
                if existing.name == axes:
                    return existing
            axes = tuple(axes.split("+"))
        axes = tuple(axes)
        name = rule_name(axes)
        for existing in self.rules:
            if existing.name == name:
                return existing
        pp = self.dense.dim("pp")
        replicas = kv_replica_size(name)
        if replicas is not None:
            tp = self.dense.dim("tp").size
            if tp % replicas:
                raise ValueError(
                    f"rule {name!r}: {replicas} tp ranks per KV head must divide tp={tp}; "
                    f"num_kv_heads must divide tp (or tp divide num_kv_heads)"
                )
            return GroupRule(name, (name,), self.dense, (AxisSpan("tp", 1, replicas),))
        if name == EMBEDDING_RULE:
            span = AxisSpan("pp", pp.size - 1, 2) if pp.size > 1 else AxisSpan("pp", 1, 1)
            return GroupRule(name, (EMBEDDING_RULE,), self.dense, (span,))
        if all(a in self.dense.axes for a in axes):
            layout = self.dense
        elif all(a in self.expert.axes for a in axes):
            layout = self.expert
        else:
            raise ValueError(
                f"rule {name!r} mixes dense axes ({', '.join(self.dense.axes)}) with expert axes "
                f"({', '.join(self.expert.axes)}); a group lives on one grid"
            )
        ordered = tuple(sorted(axes, key=lambda a: layout.dim(a).stride))
        spans = tuple(AxisSpan(a, 1, layout.dim(a).size) for a in ordered)
        return GroupRule(name, tuple(name.split("+")), layout, spans)

    @property
    def rule_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rules)

    def creation_order(self) -> Iterator[tuple[GroupRule, int, tuple[int, ...]]]:
        """``(rule, index, ranks)`` for every group of every rule, in the one global order.

        Every rank must walk this same sequence when it creates process
        groups; a rank may skip entries only by a rank-independent test (for
        example ``len(ranks) == 1``).  Lazy: nothing is listed until asked for.
        """
        for rule in self.rules:
            for index in range(rule.num_groups):
                yield rule, index, rule.group(index)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready and symbolic description of the layouts and every rule, in creation order."""
        return {
            "order": self.order,
            "world_size": self.world_size,
            "dense": self.dense.as_dict(),
            "expert": self.expert.as_dict(),
            "rules": [rule.as_dict() for rule in self.rules],
        }
