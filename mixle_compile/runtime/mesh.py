"""This rank's coordinates and process groups, built exactly as the plan's group rules say.

The plan states its groups symbolically (lower/groups.py): a rule's group ``index`` has base rank
``sum(digit_j(index) * stride_j)`` over ``base_dims`` and members ``base + sum(k_i * stride_i)``
over ``dims``. ``torch.distributed.new_group`` is a collective over the whole world, so every rank
walks the rules in the plan's one global creation order and creates every group, its own or not.
Two rules with the same members (``dp_shard`` and ``dp_shard+cp`` when cp = 1) share one process
group, and groups of one rank are never created; both tests are rank-independent, so every rank
still makes the same calls in the same order.

The same groups also make a torch ``DeviceMesh`` (``Mesh.device_mesh``): the plan's dense grid
as a tensor of ranks, outermost axis first, one mesh dimension per axis of degree > 1, each
dimension on the process group the plan's rule of that axis created (no second set of groups).
At start-up every dense rule whose axes are mesh dimensions (``tp``, ``dp_shard``,
``dp_replicate+dp_shard``, ...) is checked against the mesh: the ranks the mesh gives this rank
for those dimensions must be exactly the rule's group, or the run does not start.
"""

from __future__ import annotations

import datetime
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mixle_compile.plan.document import GroupRuleEntry, PlanGroups
from mixle_compile.plan.vocabulary import DATA_PARALLEL_AXES
from mixle_compile.runtime.errors import RuntimeRefusal

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


def device_mesh_layout(groups: PlanGroups) -> tuple[tuple[str, ...], torch.Tensor]:
    """``(mesh_dim_names, ranks)``: the plan's dense grid as a DeviceMesh's rank tensor, outermost
    axis first, axes of degree 1 left out (a one-rank plan has no dimensions)."""
    dims = sorted((d for d in groups.dense.dims if d.size > 1), key=lambda d: -d.stride)
    names = tuple(d.axis for d in dims)
    world = groups.world_size
    if math.prod(d.size for d in dims) != world:
        raise RuntimeRefusal(
            f"the plan's dense grid ({', '.join(f'{d.axis}={d.size}' for d in groups.dense.dims)}) does not cover its "
            f"world size {world}; the plan is inconsistent: recompile it"
        )
    table = torch.full([d.size for d in dims], -1, dtype=torch.int)
    for rank in range(world):
        index = tuple((rank // d.stride) % d.size for d in dims)
        if table[index] >= 0:
            raise RuntimeRefusal(
                f"the plan's dense grid gives ranks {int(table[index])} and {rank} the same coordinates "
                f"{dict(zip(names, index, strict=True))}; the plan is inconsistent: recompile it"
            )
        table[index] = rank
    return names, table


def device_mesh_problems(
    groups: PlanGroups, names: tuple[str, ...], table: torch.Tensor, rank: int, members: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """Every dense rule whose axes are all on the mesh (or of degree 1) whose group of ``rank`` differs
    from the ranks the mesh tensor gives ``rank`` along those dimensions."""
    where = (table == rank).nonzero()
    if len(where) != 1:
        return [f"rank {rank} appears {len(where)} times in the device mesh"]
    coordinate = where[0].tolist()
    dense_axes = {d.axis for d in groups.dense.dims}
    problems = []
    for rule in groups.rules:
        if rule.grid != groups.dense.name or not set(rule.axes) <= dense_axes or rule.name not in members:
            continue  # the expert grid, the tied group, a KV-replica block of tp: not mesh dimensions
        index = tuple(slice(None) if name in rule.axes else coordinate[i] for i, name in enumerate(names))
        from_mesh = tuple(sorted(table[index].reshape(-1).tolist()))
        if from_mesh != tuple(members[rule.name]):
            problems.append(
                f"rule {rule.name!r} puts rank {rank} in the group {list(members[rule.name])}, but the device mesh "
                f"({', '.join(names) or 'no dimensions'}) gives {list(from_mesh)}"
            )
    return problems


class Mesh:
    """Coordinates of this rank on every plan axis, and its group for every rule."""

    device_mesh = None  # the torch DeviceMesh of the plan's dense grid (None for one rank)

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
        self._dense_dims = {d.axis: (d.stride, d.size) for d in groups.dense.dims}
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
        mesh = Mesh(groups, rank, world, mine)
        mesh.device_mesh = _device_mesh(groups, rank, mine)
        return mesh

    @staticmethod
    def single(groups: PlanGroups) -> Mesh:
        """The mesh of a one-rank plan, without process groups."""
        return Mesh(
            groups,
            0,
            1,
            {rule.name: Group(rule.name, (0,), None) for rule in groups.rules} | {WORLD: Group(WORLD, (0,), None)},
        )

    def release(self) -> None:
        """Drop this mesh's process-group handles (after destroy_process_group), so that they are torn
        down now, on this thread, rather than at some later garbage collection."""
        self._groups = {}
        self.device_mesh = None
        import gc

        gc.collect()

    def group(self, rule: str) -> Group:
        try:
            return self._groups[rule]
        except KeyError:
            raise KeyError(
                f"the plan has no group rule {rule!r}; its rules: {', '.join(sorted(self._groups))}"
            ) from None

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
        if "edp" in reduced_axes:
            # An expert's gradient holds the tokens its ep group sent it, then is summed over the
            # expert-data group: the data ranks of every rank in both (rank coordinates add up).
            me = self.rank
            ranks = {e + d - me for e in self.group("ep").ranks for d in self.group("edp").ranks}
            return tuple(sorted({self.data_rank_of(r) for r in ranks}))
        choices = []
        for axis in DATA_PARALLEL_AXES:
            choices.append(range(self.degree(axis)) if axis in reduced_axes else (self.coord(axis),))
        shard = self.degree("dp_shard")
        return tuple(sorted(r * shard + s for r, s in itertools.product(*choices)))

    def data_rank_of(self, rank: int) -> int:
        """The data rank of any rank of the world (see ``data_rank``)."""

        def coord(axis: str) -> int:
            stride, size = self._dense_dims.get(axis, (1, 1))
            return (rank // stride) % size

        return coord("dp_replicate") * self.degree("dp_shard") + coord("dp_shard")


def _device_mesh(groups: PlanGroups, rank: int, mine: Mapping[str, Group]):
    """The DeviceMesh of the plan's dense grid on the process groups just created, checked against
    every dense rule; refuses to start when they disagree."""
    from torch.distributed.device_mesh import DeviceMesh

    names, table = device_mesh_layout(groups)
    problems = device_mesh_problems(groups, names, table, rank, {name: g.ranks for name, g in mine.items()})
    missing = [name for name in names if name not in mine or mine[name].handle is None]
    problems += [f"the plan has no group rule for the mesh axis {name!r}" for name in missing]
    if problems:
        raise RuntimeRefusal(
            "the plan's rank groups disagree with its own mesh: " + "; ".join(problems) + "; recompile the plan"
        )
    if not names:
        return None
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device_mesh = DeviceMesh.from_group(
        [mine[name].handle for name in names], device_type, mesh=table, mesh_dim_names=names
    )
    for name in names:
        ranks = tuple(sorted(dist.get_process_group_ranks(device_mesh.get_group(name))))
        if ranks != mine[name].ranks:
            raise RuntimeRefusal(
                f"the device mesh's {name!r} dimension runs on ranks {list(ranks)}, but the plan's group of "
                f"rank {rank} "
                f"over {name} is {list(mine[name].ranks)}; recompile the plan"
            )
    return device_mesh
