"""The per-step schedule of every pipeline stage, and a checker that it cannot deadlock.

A *program* is the ordered list of :class:`Op` one rank issues in a training
step: forward and backward compute per microbatch (and virtual chunk), the
point-to-point sends and receives of activations and their gradients between
adjacent pipeline stages, collectives in issue order, and the optimizer step.
Every rank of a pipeline stage runs its stage's program; collectives name a
group *rule* (see :mod:`mixle_compile.lower.groups`), which each rank resolves
to its own group.

Execution model used by the checker (deliberately pessimistic, so that a
schedule it accepts also runs where sends do not buffer):

* a send completes only when the peer has posted the matching receive
  (rendezvous), and a receive when the peer has posted the send;
* point-to-point ops that share a ``batch`` number and are adjacent in a
  program are posted together (one ``batch_isend_irecv`` call) and the batch
  completes when each of its ops has met its partner;
* messages between two ranks are paired in issue order, as NCCL pairs them
  (it ignores tags): the k-th send from A to B meets B's k-th receive from A;
* a collective completes when every member of its group has reached its
  collective with the same ordinal on that group (NCCL sequences a
  communicator by issue order, not by name).

Whether the step finishes does not depend on the interleaving chosen by the
simulation: an op's completion depends only on other ranks having reached
given ops, a condition that stays true once it holds.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from mixle_compile.contracts import ParallelPlan
from mixle_compile.lower.groups import GroupRule, RankGrid
from mixle_compile.plan.ops import _P2P, ACTIVATION, ACTIVATION_GRAD, Op, OpKind, _instance, _require_count
from mixle_compile.plan.ops import insert_templates as _insert
from mixle_compile.plan.programs import Loop, StageProgram, expand
from mixle_compile.schedules import (
    SCHEDULES,
    ScheduleFamily,
    bubble_fraction,
    interleaved_group,
    refusal,
    runs,
    warmup_forwards,
)

__all__ = [
    "OpKind",
    "ACTIVATION",
    "ACTIVATION_GRAD",
    "SCHEDULES",
    "Op",
    "collective",
    "pipeline_schedule",
    "pipeline_bodies",
    "bubble_fraction",
    "insert_collectives",
    "INSERT_ANCHORS",
    "rank_programs",
    "ScheduleCheck",
    "Simulation",
    "check_schedule",
    "simulate_schedule",
    "schedule_bubble",
]


def collective(name: str, group: str, tag: str = "", bytes: int = 0) -> Op:
    """A collective template (``stage`` is filled in by :func:`insert_collectives`)."""
    return Op(OpKind.collective, stage=0, name=name, group=group, tag=tag, bytes=bytes)


# ---------------------------------------------------------------------------
# Pipeline schedules
# ---------------------------------------------------------------------------


#: A stretch of a stage's iterations: the iterations of one repetition (each a list of compute
#: units ``(kind, chunk, microbatch)``), how many repetitions, and the micro-batch step between two.
Segment = tuple[list[list[tuple[OpKind, int, int]]], int, int]


def _segments(
    family: ScheduleFamily, schedule: str, pp: int, m: int, v: int, stage: int, group: int | None = None
) -> list[Segment]:
    """The stage's compute ops as ``(kind, chunk, microbatch)``, grouped into iterations and stated
    as repeated stretches (their number does not grow with ``m``).

    Between two iterations a stage issues one batched point-to-point call.
    GPipe and 1F1B issue one after every compute op; interleaved 1F1B pairs
    a forward with a backward in its steady state. The warm-up and the
    interleaved micro-batch groups are the engine's (:mod:`mixle_compile.schedules`).
    """
    F, B = OpKind.forward, OpKind.backward
    if schedule == "gpipe":
        return [([[(F, 0, 0)]], m, 1), ([[(B, 0, 0)]], m, 1)]
    if schedule == "1f1b":
        # Warm-up forwards fill the pipe below this stage; then one forward,
        # one backward; the cool-down drains the backwards still in flight.
        warmup = warmup_forwards(schedule, pp, m, 1, stage, 1)
        return [
            ([[(F, 0, 0)]], warmup, 1),
            ([[(F, 0, warmup)], [(B, 0, 0)]], m - warmup, 1),
            ([[(B, 0, m - warmup)]], warmup, 1),
        ]
    # Interleaved: microbatches advance in groups through the chunks,
    # forwards chunk by chunk upwards and backwards downwards. The order repeats
    # every group * v units with the micro-batches one group on; Megatron's last
    # group may be smaller (m % group micro-batches, at least pp: get_schedule_table).
    total = m * v
    group = interleaved_group(family, pp, m, group)
    period = group * v
    whole, smaller = divmod(m, group)  # whole groups, and the micro-batches of a last, smaller one
    head = whole * period  # the units of the whole groups; the last group's follow

    def unit(k: int, backward: bool) -> tuple[int, int]:
        if k < head:
            first, within = divmod(k, period)
            chunk, mb = within // group, first * group + within % group
        else:
            chunk, mb = (k - head) // smaller, whole * group + (k - head) % smaller
        return (v - 1 - chunk if backward else chunk), mb

    def stretch(first: int, last: int, iteration, ahead: int = 0) -> list[Segment]:
        """Iterations ``first..last`` as repeated periods while every unit they read (up to ``ahead``
        units beyond the iteration's own) lies in the whole groups, then the rest one by one."""
        full = min((last - first) // period, max(0, (head - ahead - first) // period))
        rest = range(first + full * period, last)
        return [
            ([iteration(k) for k in range(first, first + period)] if full else [], full, group),
            ([iteration(k) for k in rest], 1 if rest else 0, 0),
        ]

    warmup = warmup_forwards(schedule, pp, m, v, stage, group)
    return (
        stretch(0, warmup, lambda k: [(F, *unit(k, False))])
        + stretch(0, total - warmup, lambda i: [(F, *unit(warmup + i, False)), (B, *unit(i, True))], warmup)
        + stretch(total - warmup, total, lambda k: [(B, *unit(k, True))])
    )


def _shift_units(iteration: list[tuple[OpKind, int, int]], by: int) -> list[tuple[OpKind, int, int]]:
    return [(kind, chunk, mb + by) for kind, chunk, mb in iteration]


def pipeline_schedule(
    pp: int,
    microbatches: int,
    schedule: str,
    virtual_stages: int = 1,
    *,
    family: ScheduleFamily | str = ScheduleFamily.TORCH,
    activation_bytes: int = 0,
    optimizer_step: bool = True,
    group: int | None = None,
) -> tuple[tuple[Op, ...], ...]:
    """The program of each pipeline stage under ``schedule`` (one tuple of ops per stage).

    Point-to-point ops are issued as each stage really issues them: between
    two iterations, one batched call that sends what the last iteration
    produced and receives what the next one needs.  An iteration is one
    compute op under GPipe and 1F1B (so 1F1B's steady state sends a forward's
    output together with receiving the next backward's gradient) and, under
    interleaving, a forward and a backward in the steady state (one call then
    carries up to two sends and two receives).  Under ``interleaved_1f1b`` chunk ``c`` of
    stage ``s`` is virtual stage ``c * pp + s``, so the last stage sends to
    the first across chunks.  With ``optimizer_step`` every program ends with
    an ``optimizer`` op.

    ``family`` is the engine whose schedules are built (``torch`` or ``megatron``); ``group`` is
    Megatron's ``microbatch_group_size_per_vp_stage`` (None: pp). Raises
    ``ValueError`` for an unknown schedule or family, for ``virtual_stages > 1`` outside
    ``interleaved_1f1b``, and with the engine's own requirement (:mod:`mixle_compile.schedules`,
    the rule the verifier checks) for numbers its schedule refuses.
    """
    bodies = pipeline_bodies(
        pp, microbatches, schedule, virtual_stages, family=family, activation_bytes=activation_bytes, group=group
    )
    return tuple(
        expand(StageProgram(stage=stage, body=body, optimizer=optimizer_step)) for stage, body in enumerate(bodies)
    )


def pipeline_bodies(
    pp: int,
    microbatches: int,
    schedule: str,
    virtual_stages: int = 1,
    *,
    family: ScheduleFamily | str = ScheduleFamily.TORCH,
    activation_bytes: int = 0,
    group: int | None = None,
) -> tuple[tuple[Op | Loop, ...], ...]:
    """Each stage's compute and point-to-point ops of :func:`pipeline_schedule` (without the
    optimizer), stated with their repetition: a stretch of iterations that repeats with the
    micro-batches one step on is one :class:`Loop`, so the size does not grow with the number of
    micro-batches. Unrolled, a body is the explicit program op for op."""
    for what, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    _require_count("activation_bytes", activation_bytes)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    try:
        family = ScheduleFamily(family)
    except ValueError:
        raise ValueError(f"unknown schedule family {family!r}; valid: {', '.join(ScheduleFamily)}") from None
    if virtual_stages != 1 and schedule != "interleaved_1f1b":
        raise ValueError(f"virtual_stages = {virtual_stages} needs pipeline_schedule interleaved_1f1b, not {schedule}")
    if virtual_stages != 1 and pp == 1:
        raise ValueError("virtual stages need pp > 1: their chunks pass activations between stages")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise ValueError(f"group must be an integer >= 1 or None, got {group!r}")
    if group is not None and family is not ScheduleFamily.MEGATRON:
        raise ValueError("a micro-batch group size is Megatron's (microbatch_group_size_per_vp_stage)")
    refused = refusal(family, schedule, pp, microbatches, virtual_stages, group)
    if refused is not None:
        g = group or pp
        raise ValueError(f"{refused.code}: {refused.broken(pp, microbatches, g)}; {refused.fix(pp, microbatches, g)}")
    schedule = runs(family, schedule, pp, virtual_stages)
    last_virtual = pp * virtual_stages - 1
    # One checked op per kind and payload; the others are its unchecked copies (its fields' copy,
    # set, made an op by plan/ops.py's _instance) with the stage, chunk, micro-batch, peer and batch number the schedule
    # computes (counts below pp, virtual_stages, the micro-batches and the step's calls), so that a
    # long schedule does not validate every op it lists.
    F, B, send_kind, recv_kind = OpKind.forward, OpKind.backward, OpKind.send, OpKind.recv
    checked = {
        (kind, tag): Op(kind, 0, name=kind.value, tag=tag, microbatch=0, **extra).__dict__
        for kind, tag, extra in (
            (F, "", {}),
            (B, "", {}),
            *(
                (kind, tag, {"peer": 0, "peer_chunk": 0, "bytes": activation_bytes, "batch": 0})
                for kind in (send_kind, recv_kind)
                for tag in (ACTIVATION, ACTIVATION_GRAD)
            ),
        )
    }

    def message(stage: int, unit: tuple[OpKind, int, int], send: bool, batch: int) -> list[Op]:
        """The send of a compute op's output, or the receive of its input (none at the model's ends),
        issued in the batched call numbered ``batch``."""
        kind, chunk, mb = unit
        forward = kind is F
        other = chunk * pp + stage + (1 if forward == send else -1)
        if not 0 <= other <= last_virtual:
            return []
        values = checked[send_kind if send else recv_kind, ACTIVATION if forward else ACTIVATION_GRAD].copy()
        values["stage"], values["chunk"], values["microbatch"] = stage, chunk, mb
        values["peer"], values["peer_chunk"], values["batch"] = other % pp, other // pp, batch
        return [_instance(Op, values)]

    def compute(kind: OpKind, stage: int, chunk: int, mb: int) -> Op:
        values = checked[kind, ""].copy()
        values["stage"], values["chunk"], values["microbatch"] = stage, chunk, mb
        return _instance(Op, values)

    return tuple(
        _stage_body(
            stage, _segments(family, schedule, pp, microbatches, virtual_stages, stage, group), message, compute
        )
        for stage in range(pp)
    )


def _stage_body(stage: int, segments: list[Segment], message, compute) -> tuple[Op | Loop, ...]:
    """A stage's ops from its iterations: before each iteration one batched call sends what the last
    one produced and receives what this one needs. Receiving an iteration ahead, in the same call as
    the sends, is what keeps neighbours from waiting on each other's later calls: with receives
    posted only right before their compute op, interleaved schedules deadlock as soon as sends do
    not buffer. A segment's second and later repetitions are one loop: their calls are the same with
    every micro-batch one step on (the first repetition's first call depends on what came before)."""
    items: list[Op | Loop] = []
    batch = 0
    previous: list[tuple[OpKind, int, int]] = []

    def issue(iteration: list[tuple[OpKind, int, int]], out: list[Op]) -> None:
        nonlocal batch, previous
        together = [op for unit in previous for op in message(stage, unit, True, batch)]
        together += [op for unit in iteration for op in message(stage, unit, False, batch)]
        if together:
            out += together
            batch += 1
        out += [compute(kind, stage, chunk, mb) for kind, chunk, mb in iteration]
        previous = iteration

    for template, repeat, step in segments:
        if repeat < 1 or not template:
            continue
        first: list[Op] = []
        for iteration in template:
            issue(iteration, first)
        items += first
        if repeat == 1:
            continue
        start = batch
        body: list[Op] = []
        for iteration in template:
            issue(_shift_units(iteration, step), body)
        if repeat == 2:
            items += body
            continue
        per_repeat = batch - start
        items.append(Loop(repeat - 1, step, per_repeat, tuple(body)))
        batch = start + (repeat - 1) * per_repeat
        previous = _shift_units(template[-1], (repeat - 1) * step)
    tail: list[Op] = []
    issue([], tail)
    return tuple(items + tail)


# ---------------------------------------------------------------------------
# Adding collectives
# ---------------------------------------------------------------------------

#: Where :func:`insert_collectives` can put collectives.
INSERT_ANCHORS = (
    "start",  # first thing in the step
    "before_forward",  # right before each forward compute op (after its receive)
    "after_backward",  # right after each backward compute op (before its send)
    "after_last_backward",  # after the last backward and the send that follows it
    "before_optimizer",  # right before the optimizer op
    "end",  # last thing in the step
)


def insert_collectives(
    programs: Sequence[Sequence[Op]],
    collectives: Sequence[Op],
    *,
    at: str,
    stages: Iterable[int] | None = None,
    where: Callable[[Op], bool] | None = None,
) -> tuple[tuple[Op, ...], ...]:
    """Insert ``collectives`` (in that order) into every stage's program at an anchor.

    ``at`` is one of :data:`INSERT_ANCHORS`; ``stages`` limits the stages
    (default: all); for the per-op anchors ``where`` selects the compute ops
    (for example ``lambda op: op.microbatch == 0``), and each inserted copy
    takes that op's chunk and microbatch.  Inserted copies take the stage of
    the program.  Repeated calls at one anchor keep call order: earlier
    insertions come first.  Returns new programs; the input is unchanged.
    """
    if at not in INSERT_ANCHORS:
        raise ValueError(f"unknown anchor {at!r}; valid anchors: {', '.join(INSERT_ANCHORS)}")
    for op in collectives:
        if op.kind is not OpKind.collective:
            raise ValueError(f"insert_collectives inserts collectives only, got {op.describe()}")
    chosen = set(range(len(programs))) if stages is None else set(stages)
    unknown = sorted(chosen - set(range(len(programs))))
    if unknown:
        raise ValueError(f"no stage {unknown[0]} among the {len(programs)} stage programs")
    result = []
    for stage, program in enumerate(programs):
        program = list(program)
        if stage in chosen:
            program = _insert(program, collectives, at, stage, where)
        result.append(tuple(program))
    return tuple(result)


def rank_programs(
    stage_programs: Sequence[Sequence[Op]], grid: RankGrid, ranks: Iterable[int] | None = None
) -> dict[int, tuple[Op, ...]]:
    """Concrete per-rank programs: each rank runs its pipeline stage's program.

    ``ranks`` defaults to every rank of the world (an explicit enumeration:
    for large worlds pass the few ranks you need).
    """
    if len(stage_programs) != grid.plan.pp:
        raise ValueError(f"got {len(stage_programs)} stage programs for pp = {grid.plan.pp}")
    chosen = range(grid.world_size) if ranks is None else ranks
    return {rank: tuple(stage_programs[grid.stage_of(rank)]) for rank in chosen}


# ---------------------------------------------------------------------------
# Checking: matching, collective sequences, and a deadlock-finding simulation
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleCheck:
    """Outcome of :func:`check_schedule`.

    ``representatives`` is true when only one rank per pipeline stage was
    checked (ranks of a stage run the same program up to relabelling, so the
    other ranks of a stage behave exactly like the one checked).
    """

    problems: tuple[str, ...]
    ranks_checked: int
    representatives: bool
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Simulation:
    """Outcome of running programs under the blocking model of this module."""

    finished: bool
    makespan: Fraction | float
    busy: Mapping[int, Fraction | float] = field(repr=False)
    deadlock: tuple[str, ...] = ()
    #: Per rank, the compute ops as run: (start, duration, position in the rank's program).
    spans: Mapping[int, tuple[tuple[Any, Any, int], ...]] = field(default_factory=dict, repr=False)

    @property
    def bubble(self) -> float:
        """Mean idle fraction of the simulated ranks (0 when nothing ran)."""
        if not self.busy or not self.makespan:
            return 0.0
        idle = sum(self.makespan - b for b in self.busy.values())
        return float(idle / (self.makespan * len(self.busy)))


Programs = Mapping[int, Sequence[Op]] | Sequence[Sequence[Op]]


@dataclass
class _World:
    """The ranks being checked and how their ops resolve to concrete groups and peers."""

    grid: RankGrid
    programs: dict[int, tuple[Op, ...]]
    representatives: bool
    rules: dict[str, GroupRule | None] = field(default_factory=dict)
    # Found by _check_ops, which every check runs first, for the passes after it:
    channels: Any = None  # (sends, receives) per ordered rank pair, in issue order
    collectives: Any = None  # per rank, the positions of its collectives

    def rule(self, name: str) -> GroupRule | None:
        if name not in self.rules:
            try:
                self.rules[name] = self.grid.rule(name)
            except (ValueError, KeyError):
                self.rules[name] = None
        return self.rules[name]


def _prepare(programs: Programs, grid: RankGrid | None, exhaustive_limit: int) -> _World:
    if isinstance(programs, Mapping):
        if grid is None:
            raise ValueError("per-rank programs need the grid that places their ranks")
        missing = [r for r in range(grid.world_size) if r not in programs]
        extra = [r for r in programs if not (isinstance(r, int) and 0 <= r < grid.world_size)]
        if missing or extra:
            raise ValueError(
                f"per-rank programs must cover ranks 0..{grid.world_size - 1} exactly "
                f"(missing {missing[:5]}, unknown {extra[:5]}); pass per-stage programs to check representatives"
            )
        return _World(grid, {r: tuple(p) for r, p in programs.items()}, False)
    stage_programs = [tuple(p) for p in programs]
    if grid is None:
        grid = RankGrid.from_plan(ParallelPlan(pp=max(len(stage_programs), 1)))
    if len(stage_programs) != grid.plan.pp:
        raise ValueError(f"got {len(stage_programs)} stage programs for pp = {grid.plan.pp}")
    if grid.world_size <= exhaustive_limit:
        return _World(grid, rank_programs(stage_programs, grid), False)
    # One rank per stage: the one whose other coordinates are all zero.
    ranks = [grid.rank_at_stage(0, s) for s in range(grid.plan.pp)]
    return _World(grid, rank_programs(stage_programs, grid, ranks), True)


def check_schedule(
    programs: Programs,
    grid: RankGrid | None = None,
    *,
    exhaustive_limit: int = 1024,
    buffered_sends: bool = False,
    observe: Callable[[SimulationState], None] | None = None,
) -> ScheduleCheck:
    """Check that a step's programs match up and cannot deadlock.

    ``programs`` is either a mapping from every rank to its program, or one
    program per pipeline stage (every rank of a stage runs it).  ``grid``
    resolves group rules and peer stages to ranks; it defaults, for
    per-stage programs, to a pipeline-only grid.  Per-stage programs of a
    world larger than ``exhaustive_limit`` are checked on one representative
    rank per stage, which is exact because every rank of a stage runs the
    same program and the group rules are uniform across a stage.

    Checks: (a) every member of every group issues the same sequence of
    collectives on it (names and tags, in order); (b) every send has exactly
    one matching receive (peer, tag, microbatch, chunks, bytes) and vice
    versa, and messages between two ranks are received in the order sent;
    (c) a simulation with blocking sends, receives and collectives reaches
    the end of every program, else the cycle of waits is reported with the
    ranks and ops involved. With ``buffered_sends`` a send completes when it is
    posted (its wait is deferred to the end of the step, as torch's
    ``_PipelineScheduleRuntime`` does); receives still wait for their send.
    ``observe`` is called with the simulation's :class:`SimulationState` once per round of turns,
    before the first checked rank's turn.
    """
    world = _prepare(programs, grid, exhaustive_limit)
    problems: list[str] = []
    problems += _check_ops(world)
    if not problems:
        problems += _check_collective_sequences(world)
        problems += _check_messages(world)
        problems += list(_simulate(world, None, buffered_sends=buffered_sends, observe=observe).deadlock)
    count = len(world.programs)
    note = (
        f"checked {count} representative ranks, one per pipeline stage: ranks of a stage run the "
        f"same program up to relabelling of their groups"
        if world.representatives
        else f"checked all {count} ranks"
    )
    return ScheduleCheck(tuple(problems), count, world.representatives, note)


def simulate_schedule(
    programs: Programs,
    grid: RankGrid | None = None,
    *,
    forward_cost: Fraction | float | int = 1,
    backward_cost: Fraction | float | int = 2,
    cost: Callable[[Op], Fraction | float | int] | None = None,
    exhaustive_limit: int = 1024,
    buffered_sends: bool = False,
) -> Simulation:
    """Run the programs under the blocking model and time them.

    Forward and backward ops take ``forward_cost`` and ``backward_cost``;
    communication and the optimizer take no time unless ``cost`` (which
    overrides both) says otherwise.  Pass ``Fraction`` costs for exact
    answers.  Ops must be well formed (see :func:`check_schedule`).
    ``buffered_sends`` as in :func:`check_schedule`.
    """
    world = _prepare(programs, grid, exhaustive_limit)
    if cost is None:

        def cost(op: Op):
            if op.kind is OpKind.forward:
                return forward_cost
            if op.kind is OpKind.backward:
                return backward_cost
            return 0

    bad = _check_ops(world)
    if bad:
        raise ValueError("cannot simulate malformed programs: " + "; ".join(bad[:3]))
    return _simulate(world, cost, buffered_sends=buffered_sends)


def schedule_bubble(
    programs: Programs,
    grid: RankGrid | None = None,
    *,
    forward_cost: Fraction | float | int = 1,
    backward_cost: Fraction | float | int = 2,
) -> float:
    """Idle fraction of the emitted schedule, by simulation (mean over ranks).

    With unit forwards and two-unit backwards (the default) GPipe and 1F1B
    give :func:`bubble_fraction`; under interleaving pass costs divided by
    the number of chunks (a chunk holds that share of the layers).
    """
    result = simulate_schedule(programs, grid, forward_cost=forward_cost, backward_cost=backward_cost)
    if not result.finished:
        raise ValueError("the schedule deadlocks: " + "; ".join(result.deadlock))
    return result.bubble


# -- (checks) ------------------------------------------------------------------


def _check_ops(world: _World) -> list[str]:
    """Every op checked where it is issued (its stage, its group rule, its peer stage); in the same
    pass over the programs, what the later checks read of a world whose ops are all well placed:
    its channels and its collectives' positions."""
    problems = []
    grid = world.grid
    send, recv, collective = OpKind.send, OpKind.recv, OpKind.collective
    sends: dict[tuple[int, int], list[tuple[int, Op]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, Op]]] = defaultdict(list)
    collectives: dict[int, list[int]] = {}
    for rank, program in world.programs.items():
        stage = grid.stage_of(rank)
        fine: set[tuple] = set()  # what an op is checked on, where it had no problem on this rank
        peers: dict[int, int] = {}  # peer stage -> its rank with this rank's other coordinates
        positions: list[int] = []
        for position, op in enumerate(program):
            kind = op.kind
            if kind is send or kind is recv:
                peer = peers.get(op.peer)
                if peer is None or op.stage != stage:
                    checked = (op.stage, kind, op.group, op.peer)
                    if checked not in fine and _misplaced(world, rank, stage, position, op, problems):
                        continue
                    fine.add(checked)
                    peer = peers[op.peer] = grid.rank_at_stage(rank, op.peer)
                if kind is send:
                    sends[(rank, peer)].append((position, op))
                else:
                    recvs[(peer, rank)].append((position, op))
            elif kind is collective:
                checked = (op.stage, kind, op.group, op.peer)
                if checked not in fine:
                    if _misplaced(world, rank, stage, position, op, problems):
                        continue
                    fine.add(checked)
                positions.append(position)
            elif op.stage != stage:
                _misplaced(world, rank, stage, position, op, problems)
        collectives[rank] = positions
    if not problems:
        world.channels, world.collectives = (sends, recvs), collectives
    return problems


def _misplaced(world: _World, rank: int, stage: int, position: int, op: Op, problems: list[str]) -> bool:
    """Whether ``op`` (at ``position`` of ``rank``'s program) cannot be issued there; adds why to
    ``problems``."""
    grid = world.grid
    pp = grid.plan.pp
    found = []
    if op.stage != stage:
        found.append(f"belongs to stage {op.stage}, but rank {rank} is on stage {stage}")
    if op.kind is OpKind.collective:
        rule = world.rule(op.group)
        if rule is None:
            found.append(f"unknown group rule {op.group!r}; known: {', '.join(grid.rule_names)}")
        elif not rule.covers(rank):
            found.append(f"rank {rank} is in no group of rule {op.group!r}")
    if op.kind in _P2P:
        if op.peer >= pp:
            found.append(f"peer stage {op.peer} does not exist (pp = {pp})")
        elif op.peer == stage:
            found.append(f"a stage cannot {op.kind.value} to itself")
    if found:  # the op's place is written only for a problem (most ops have none)
        where = f"rank {rank} (stage {stage}) op {position} ({op.describe()})"
        problems += [f"{where}: {text}" for text in found]
    return bool(found)


def _steps(program: Sequence[Op], timed: bool) -> tuple[list[tuple[str, list[int]]], list[int]]:
    """A program's steps: a compute op, a collective, or a batch of point-to-point ops posted
    together (ops of one batch number in a row), and the step each op belongs to. Untimed, a
    compute op is no step (-1): it never waits, so passing over it changes nothing but the clock."""
    send, recv, collective = OpKind.send, OpKind.recv, OpKind.collective
    out: list[tuple[str, list[int]]] = []
    index: list[int] = []
    previous: Any = _NO_BATCH  # the batch number of the last op when it is a point-to-point op
    for position, op in enumerate(program):
        kind = op.kind
        if kind is send or kind is recv:
            batch = op.batch
            if batch is not None and batch == previous:
                out[-1][1].append(position)
            else:
                out.append(("p2p", [position]))
            previous = batch
        else:
            previous = _NO_BATCH
            if kind is not collective and not timed:
                index.append(-1)
                continue
            out.append(("collective" if kind is collective else "compute", [position]))
        index.append(len(out) - 1)
    return out, index


_NO_BATCH = object()


def _instances(world: _World) -> dict[tuple[str, int], list[int]]:
    """Every group instance used by some checked rank -> its checked members."""
    used = {world.programs[rank][p].group for rank, found in world.collectives.items() for p in found}
    members: dict[tuple[str, int], list[int]] = defaultdict(list)
    rules = {world.rule(name).name: world.rule(name) for name in used}
    for _, rule in sorted(rules.items()):
        for rank in world.programs:
            index = rule.group_index_of(rank)
            if index is not None:
                members[(rule.name, index)].append(rank)
    return members


def _collective_keys(world: _World, rank: int) -> list[tuple[tuple[str, int], Op]]:
    keys = []
    program = world.programs[rank]
    for position in world.collectives[rank]:
        op = program[position]
        rule = world.rule(op.group)
        keys.append(((rule.name, rule.group_index_of(rank)), op))
    return keys


def _show_ranks(ranks: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f", ... ({len(ranks)} ranks)" if len(ranks) > limit else "")


def _check_collective_sequences(world: _World) -> list[str]:
    problems = []
    sequences: dict[tuple[str, int], dict[int, list[Op]]] = defaultdict(lambda: defaultdict(list))
    for rank in world.programs:
        for key, op in _collective_keys(world, rank):
            sequences[key][rank].append(op)
    for key, members in sorted(_instances(world).items()):
        seqs = {rank: [(op.name, op.tag) for op in sequences[key].get(rank, [])] for rank in members}
        reference_rank = members[0]
        reference = seqs[reference_rank]
        for rank in members[1:]:
            other = seqs[rank]
            if other == reference:
                continue
            position = next(
                (i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b),
                min(len(reference), len(other)),
            )
            mine = _show_item(reference, position)
            theirs = _show_item(other, position)
            problems.append(
                f"group {key[0]} #{key[1]} (ranks {_show_ranks(members)}): collective {position} is "
                f"{mine} on rank {reference_rank} but {theirs} on rank {rank}; every member must issue "
                f"the same collectives in the same order"
            )
    return problems


def _show_item(sequence: list[tuple[str, str]], position: int) -> str:
    if position >= len(sequence):
        return "missing"
    name, tag = sequence[position]
    return f"{name} {tag!r}" if tag else name


def _check_messages(world: _World) -> list[str]:
    problems = []
    sends, recvs = world.channels
    for src, dst in sorted(set(sends) | set(recvs)):
        out = sends.get((src, dst), [])
        into = recvs.get((src, dst), [])
        # what a send and its receive must agree on, in the sender's terms (tag, micro-batch, chunks, bytes)
        sent = [(op.tag, op.microbatch, op.chunk, op.target_chunk, op.bytes) for _, op in out]
        received = [(op.tag, op.microbatch, op.target_chunk, op.chunk, op.bytes) for _, op in into]
        if sent == received:
            continue  # every send meets its receive, in order
        unmatched_sends = _multiset_minus(list(zip(sent, out, strict=True)), received)
        unmatched_recvs = _multiset_minus(list(zip(received, into, strict=True)), sent)
        for _, (position, op) in unmatched_sends:
            problems.append(
                f"rank {src} op {position} ({op.describe()}) has no matching recv on rank {dst} "
                f"(same tag, microbatch, chunks and bytes)"
            )
        for _, (position, op) in unmatched_recvs:
            problems.append(
                f"rank {dst} op {position} ({op.describe()}) has no matching send on rank {src} "
                f"(same tag, microbatch, chunks and bytes)"
            )
        if not unmatched_sends and not unmatched_recvs:
            k = next(i for i, (a, b) in enumerate(zip(sent, received, strict=True)) if a != b)
            problems.append(
                f"messages from rank {src} to rank {dst} are received out of order: send {k} is "
                f"{out[k][1].describe()} but receive {k} is {into[k][1].describe()}; point-to-point "
                f"messages pair in issue order, not by tag"
            )
    return problems


def _multiset_minus(items: list[tuple[tuple, Any]], other: list[tuple]) -> list[tuple[tuple, Any]]:
    available: dict[tuple, int] = defaultdict(int)
    for key in other:
        available[key] += 1
    left = []
    for key, payload in items:
        if available[key]:
            available[key] -= 1
        else:
            left.append((key, payload))
    return left


# -- (simulation) ----------------------------------------------------------------


@dataclass(frozen=True)
class SimulationState:
    """What the simulation holds between two ranks' turns, shown to an observer (read only):
    the ranks waiting for a turn, each rank's step (``pc``, an index into ``steps``) and whether it
    has posted it, the ops that met their partner, the buffered sends not yet received, every
    rank's steps (a kind and the positions of its ops) and each point-to-point op's partner (per
    rank, by position: ``partner[rank][position] = (other rank, its position)``). The
    simulation's future depends on nothing else (and on the ops still to come)."""

    queue: deque
    pc: dict[int, int]
    posted: dict[int, bool]
    matched: dict[tuple[int, int], Any]
    sent: dict[tuple[int, int], Any]
    steps: dict[int, list[tuple[str, list[int]]]]
    partner: dict[int, dict[int, tuple[int, int]]]


def _simulate(
    world: _World,
    cost: Callable[[Op], Any] | None,
    *,
    buffered_sends: bool = False,
    observe: Callable[[SimulationState], None] | None = None,
) -> Simulation:
    """Run the programs; ``cost`` None: untimed (whether they finish, and where they wait)."""
    programs = world.programs
    ranks = list(programs)
    send = OpKind.send
    timed = cost is not None
    # Steps: a compute op (timed only), a collective, or a batch of point-to-point ops (_steps).
    steps: dict[int, list[tuple[str, list[int]]]] = {}
    step_index: dict[int, list[int]] = {}
    for rank, program in programs.items():
        steps[rank], step_index[rank] = _steps(program, timed)

    # Partners of point-to-point ops, paired in issue order per channel; per rank, by position.
    partner: dict[int, dict[int, tuple[int, int]]] = {rank: {} for rank in ranks}
    sends, recvs = world.channels
    for (src, dst), out in sends.items():
        mine, theirs = partner[src], partner[dst]
        for (send_pos, _), (recv_pos, _) in zip(out, recvs.get((src, dst), []), strict=False):
            mine[send_pos] = (dst, recv_pos)
            theirs[recv_pos] = (src, send_pos)

    # Collectives: (instance, ordinal on it) and how many checked ranks must arrive.
    members = _instances(world)
    collective_key: dict[tuple[int, int], tuple] = {}
    for rank in programs:
        ordinal: dict[tuple[str, int], int] = defaultdict(int)
        positions = world.collectives[rank]
        for position, (key, _) in zip(positions, _collective_keys(world, rank), strict=True):
            collective_key[(rank, position)] = (key, ordinal[key])
            ordinal[key] += 1

    pc = dict.fromkeys(ranks, 0)
    clock: dict[int, Any] = dict.fromkeys(ranks, 0)
    busy: dict[int, Any] = dict.fromkeys(ranks, 0)
    spans: dict[int, list[tuple[Any, Any, int]]] = {r: [] for r in ranks}
    posted = dict.fromkeys(ranks, False)
    matched: dict[tuple[int, int], Any] = {}  # (rank, position) -> time the op met its partner
    sent: dict[tuple[int, int], Any] = {}  # buffered sends posted, and when
    arrivals: dict[tuple, list[int]] = defaultdict(list)
    queue = deque(ranks)
    state = SimulationState(queue, pc, posted, matched, sent, steps, partner) if observe else None
    # Watched, a rank's turn ends after every step, so that the ranks advance together and the
    # observer sees the steady state (whether the step finishes does not depend on the turns).
    step_turns = observe is not None
    first = ranks[0] if ranks else None  # the observer looks once per round, at the first rank's turn
    lengths = {r: len(steps[r]) for r in ranks}

    # A posted point-to-point step's ops that have not met their partner yet, and when the last of
    # those that did met it (an op meets its partner only once its own step is posted).
    unmet = dict.fromkeys(ranks, 0)
    latest: dict[int, Any] = dict.fromkeys(ranks, 0)

    def meet(rank: int, position: int, when) -> None:
        matched[(rank, position)] = when
        unmet[rank] -= 1
        if when > latest[rank]:
            latest[rank] = when

    def complete(rank: int) -> None:
        """Finish ``rank``'s point-to-point step if every op of it met its partner."""
        if unmet[rank]:
            return
        clock[rank] = latest[rank]
        pc[rank] += 1
        posted[rank] = False
        queue.append(rank)

    while queue:
        if state is not None and queue[0] == first:
            observe(state)
        rank = queue.popleft()
        program = programs[rank]
        rank_steps = steps[rank]
        length = lengths[rank]
        while pc[rank] < length:
            kind, positions = rank_steps[pc[rank]]
            if kind == "compute":
                spent = cost(program[positions[0]])
                spans[rank].append((clock[rank], spent, positions[0]))
                clock[rank] += spent
                busy[rank] += spent
                pc[rank] += 1
                if step_turns:
                    queue.append(rank)
                    break
                continue
            if kind == "collective":
                if posted[rank]:
                    break
                posted[rank] = True
                key = collective_key[(rank, positions[0])]
                arrived = arrivals[key]
                arrived.append(rank)
                if len(arrived) < len(members[key[0]]):
                    break
                when = max(clock[r] for r in arrived)
                for other in arrived:
                    clock[other] = max(clock[other], when)
                    pc[other] += 1
                    posted[other] = False
                    if other != rank:
                        queue.append(other)
                if step_turns:
                    queue.append(rank)
                    break
                continue
            # A batch of sends and receives.
            if not posted[rank]:
                posted[rank] = True
                unmet[rank] = len(positions)
                latest[rank] = clock[rank]
                mine = partner[rank]
                for position in positions:
                    found = mine.get(position)
                    if found is None:
                        continue
                    other, other_pos = found
                    waiting = posted[other] and pc[other] < lengths[other] and step_index[other][other_pos] == pc[other]
                    if buffered_sends:
                        if program[position].kind is send:
                            # The message waits for its receive (in `sent` until it is posted); the
                            # sender goes on.
                            meet(rank, position, clock[rank])
                            if not waiting:
                                sent[(rank, position)] = clock[rank]
                                continue
                            meet(other, other_pos, clock[rank])
                            complete(other)
                            continue
                        if (other, other_pos) in sent:
                            meet(rank, position, max(clock[rank], sent.pop((other, other_pos))))
                        continue
                    if waiting:
                        when = max(clock[rank], clock[other])
                        meet(rank, position, when)
                        meet(other, other_pos, when)
                        complete(other)
            if unmet[rank]:
                break
            clock[rank] = latest[rank]
            pc[rank] += 1
            posted[rank] = False
            if step_turns:
                queue.append(rank)
                break

    stuck = [r for r in ranks if pc[r] < lengths[r]]
    deadlock = _explain_deadlock(world, stuck, steps, pc, partner, collective_key, members, arrivals, matched)
    makespan = max(clock.values(), default=0)
    return Simulation(not stuck, makespan, busy, tuple(deadlock), {r: tuple(v) for r, v in spans.items()})


def _explain_deadlock(world, stuck, steps, pc, partner, collective_key, members, arrivals, matched) -> list[str]:
    if not stuck:
        return []
    grid = world.grid
    stuck_set = set(stuck)
    waits: dict[int, list[tuple[int | None, str]]] = {}
    for rank in stuck:
        kind, positions = steps[rank][pc[rank]]
        program = world.programs[rank]
        targets: list[tuple[int | None, str]] = []
        if kind == "collective":
            key = collective_key[(rank, positions[0])]
            arrived = set(arrivals[key])
            for other in members[key[0]]:
                if other not in arrived:
                    targets.append((other, f"{program[positions[0]].describe()}"))
        else:
            for position in positions:
                if (rank, position) in matched:
                    continue
                op = program[position]
                other = partner[rank].get(position, (None,))[0]
                if other is None:
                    other = grid.rank_at_stage(rank, op.peer)
                    targets.append((None, f"{op.describe()}, which rank {other} never posts"))
                else:
                    targets.append((other, op.describe()))
        waits[rank] = targets

    def where(rank: int) -> str:
        return f"rank {rank} (stage {grid.stage_of(rank)})"

    def state(rank: int) -> str:
        if rank in stuck_set:
            kind, positions = steps[rank][pc[rank]]
            return f"is blocked at {world.programs[rank][positions[0]].describe()}"
        return "has finished its program"

    # Look for a cycle of waits among the blocked ranks.
    cycle = _find_cycle({r: [t for t, _ in ts if t in stuck_set] for r, ts in waits.items()})
    messages = []
    if cycle:
        links = []
        for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
            what = next(text for t, text in waits[a] if t == b)
            links.append(f"{where(a)} waits in {what} for rank {b}")
        messages.append("deadlock: a cycle of waits: " + "; ".join(links))
    else:
        for rank in stuck[:4]:
            target, what = waits[rank][0] if waits[rank] else (None, "?")
            if target is None:
                messages.append(f"deadlock: {where(rank)} waits forever in {what}")
            else:
                messages.append(f"deadlock: {where(rank)} waits in {what} for rank {target}, which {state(target)}")
    if len(stuck) > 1:
        messages.append(f"{len(stuck)} ranks cannot finish: {_show_ranks(stuck)}")
    return messages


def _find_cycle(graph: Mapping[int, list[int]]) -> list[int]:
    """A cycle of the directed graph, as a list of nodes, or ``[]``."""
    colour: dict[int, int] = {}
    for start in graph:
        if start in colour:
            continue
        path: list[int] = []
        on_path: dict[int, int] = {}
        stack = [(start, iter(graph.get(start, ())))]
        colour[start] = 1
        path.append(start)
        on_path[start] = 0
        while stack:
            node, children = stack[-1]
            advanced = False
            for child in children:
                if child in on_path:
                    return path[on_path[child] :]
                if child not in colour:
                    colour[child] = 1
                    on_path[child] = len(path)
                    path.append(child)
                    stack.append((child, iter(graph.get(child, ()))))
                    advanced = True
                    break
            if not advanced:
                stack.pop()
                path.pop()
                del on_path[node]
                colour[node] = 2
    return []
