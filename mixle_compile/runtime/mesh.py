"""This rank's coordinates and process groups, built exactly as the plan's group rules say.

The plan states its groups symbolically (lower/groups.py): a rule's group ``index`` has base rank
``sum(digit_j(index) * stride_j)`` over ``base_dims`` and members ``base + sum(k_i * stride_i)``
over ``dims``. ``torch.distributed.new_group`` is a collective over the whole world, so every rank
walks the rules in the plan's one global creation order and creates every group, its own or not.
Two rules with the same members (``dp_shard`` and ``dp_shard+cp`` when cp = 1) share one process
group, and groups of one rank are never created; both tests are rank-independent, so every rank
still makes the same calls in the same order.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from mixle_compile.plan.document import GroupRuleEntry, PlanGroups

WORLD = "world"  # the rule name of the group of every rank (bookkeeping: receipts, reports)


def rule_members(rule: GroupRuleEntry, index: int) -> tuple[int, ...]:
    base = 0
    for stride, length in rule.base_dims:
        index, digit = divmod(index, length)
        base += digit * stride
    offsets = [0]
    for stride, length in rule.dims:
        offsets = [o + k * stride for k in range(length) for o in offsets]
    return tuple(sorted(base + o for o in offsets))


@dataclass(frozen=True)
class Group:
    rule: str
    ranks: tuple[int, ...]
    handle: object | None  # the ProcessGroup; None for a group of one rank

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index_of(self, rank: int) -> int:
        return self.ranks.index(rank)


class Mesh:
    """Coordinates of this rank on every plan axis, and its group for every rule."""

    def __init__(self, groups: PlanGroups, rank: int, world_size: int, mine: Mapping[str, Group]) -> None:
        if groups.world_size != world_size:
            raise ValueError(f"the plan's groups are for world size {groups.world_size}, not {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.coords: dict[str, int] = {}
        for grid in (groups.dense, groups.expert):
            for d in grid.dims:
                self.coords[d.axis] = (rank // d.stride) % d.size
        self.degrees = {d.axis: d.size for d in groups.dense.dims}
        self._groups = dict(mine)

    @staticmethod
    def create(groups: PlanGroups, *, timeout_s: float) -> Mesh:
        """Create every process group of the plan, in its creation order (a collective call)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        timeout = datetime.timedelta(seconds=timeout_s)
        created: dict[tuple[int, ...], object] = {}
        mine: dict[str, Group] = {}
        for rule in groups.rules:
            for index in range(rule.num_groups):
                ranks = rule_members(rule, index)
                if len(ranks) > 1 and ranks not in created:
                    created[ranks] = dist.new_group(list(ranks), timeout=timeout)
                if rank in ranks:
                    mine[rule.name] = Group(rule.name, ranks, created.get(ranks))
        everyone = tuple(range(world))
        if world > 1 and everyone not in created:
            created[everyone] = dist.new_group(list(everyone), timeout=timeout)
        mine[WORLD] = Group(WORLD, everyone, created.get(everyone))
        return Mesh(groups, rank, world, mine)

    @staticmethod
    def single(groups: PlanGroups) -> Mesh:
        """The mesh of a one-rank plan, without process groups."""
        return Mesh(groups, 0, 1, {rule.name: Group(rule.name, (0,), None) for rule in groups.rules} | {WORLD: Group(WORLD, (0,), None)})

    def release(self) -> None:
        """Drop this mesh's process-group handles (after destroy_process_group), so that they are torn
        down now, on this thread, rather than at some later garbage collection."""
        self._groups = {}
        import gc

        gc.collect()

    def group(self, rule: str) -> Group:
        try:
            return self._groups[rule]
        except KeyError:
            raise KeyError(f"the plan has no group rule {rule!r}; its rules: {', '.join(sorted(self._groups))}") from None

    def coord(self, axis: str) -> int:
        return self.coords.get(axis, 0)

    def degree(self, axis: str) -> int:
        return self.degrees.get(axis, 1)

    @property
    def data_parallel_size(self) -> int:
        return self.degree("dp_replicate") * self.degree("dp_shard")

    @property
    def data_rank(self) -> int:
        """Index of this rank's slice of the global batch: dp_replicate outer, dp_shard inner."""
        return self.coord("dp_replicate") * self.degree("dp_shard") + self.coord("dp_shard")

    def data_ranks_sharing(self, reduced_axes: tuple[str, ...]) -> tuple[int, ...]:
        """Data ranks whose contributions a reduction over ``reduced_axes`` sums, this rank's included."""
        choices = []
        for axis in ("dp_replicate", "dp_shard"):
            choices.append(range(self.degree(axis)) if axis in reduced_axes else (self.coord(axis),))
        shard = self.degree("dp_shard")
        return tuple(sorted(r * shard + s for r, s in itertools.product(*choices)))
