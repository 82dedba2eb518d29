"""Checking a long step on a short one: a steady loop's repetitions that the simulation shows are
periodic are left out, so the check costs the same at 16 and at 512 micro-batches.

A stage program's long loops (a 1F1B steady state, GPipe's forwards and backwards, an interleaved
schedule's rounds) repeat the same ops with the micro-batch numbers a fixed step on. The check
(:func:`mixle_compile.lower.schedule.check_schedule`) simulates a *pumped-down* step instead: every
stage's ``p``-th long loop loses the same number ``delta_p`` of micro-batches, and every op after
it is numbered ``delta_p`` lower, which is exactly the step with ``delta_p`` fewer micro-batches in
that loop.

Why the short step decides the long one. Whether a step finishes does not depend on the order in
which the simulation gives ranks their turns (an op completes once other ranks have reached given
ops, which stays true), so any order that finishes proves the step finishes; the watched
simulation gives each rank one step per turn, so that the ranks advance together. What can happen
next depends only on the ranks' state (each rank's step and whether it has posted it, the ops that
met their partner in the current steps, the buffered sends not yet received) and on the ops still to
come, and never on a micro-batch number, only on whether two agree. Suppose that at two moments every
rank is inside its ``p``-th long loop, at the same offset of the loop's body, every rank ``K``
micro-batches further on at the second, and the two states are equal once positions are read
relative to each rank's place (posted and matched flags, and outstanding sends between the same
relative positions). Then what took the first state to the second can be done again from the
second, shifted by ``K``, for as long as every rank stays in its loop. If in addition every pair of
stages exchanges as many messages per ``K`` micro-batches of loop in each direction (so a message's
partner, the receive with the same ordinal on its channel, is shifted the same way), the step with
``delta_p = j * K`` more micro-batches in the loop has a run that is the short step's with that
stretch done ``j`` more times: it finishes if the short one finishes, and every message it pairs is
a pair of the short step shifted, so the sends and receives agree as they do there. Loops that
issue a collective are never pumped (a collective's group ordinal is not shifted), and the pieces
checked outside the simulation (each op where it is issued, the collective sequences) see every op
of a pumped loop in the short step, which keeps at least ``keep`` repetitions.

A step without point-to-point ops (one pipeline stage) is shortened without watching it: its long
loops hold no collective (such a loop is never pumped), so they are compute ops, which never wait
and are never waited for, and the shorter step issues every rank's collectives in the same order.

When no such pair of moments shows up, the loops keep twice as many repetitions and the short step
is simulated again, up to the full step; a short step that fails is checked again in full, so that
a problem is reported with the positions of the real step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from mixle_compile.lower.groups import RankGrid
from mixle_compile.lower.schedule import OpKind, ScheduleCheck, SimulationState
from mixle_compile.plan.ops import unchecked_copy
from mixle_compile.plan.programs import Loop, StageProgram, shifted_op

#: Repetitions a long loop keeps in the first short step tried (doubled on every retry): two show a
#: period whenever the ranks are in their loops together from its start (1F1B's steady state, an
#: interleaved schedule's rounds of micro-batch groups); GPipe's stages enter their loops one after
#: another, so it takes the retries.
KEEP_REPEATS = 2


@dataclasses.dataclass(frozen=True)
class _Pumped:
    """A short step: each stage's program, its long loops' places in the expanded program
    ``(first op, ops per repetition, repetitions, micro-batch step)`` per phase, and how many
    micro-batches each phase lost."""

    programs: tuple[StageProgram, ...]
    regions: tuple[tuple[tuple[int, int, int, int], ...], ...]
    loops: tuple[tuple[Loop, ...], ...]
    deltas: tuple[int, ...]


def check_pumped(
    programs: Sequence[StageProgram],
    check: Callable[[Sequence[StageProgram], Callable[[SimulationState], None] | None], ScheduleCheck],
    grid: RankGrid,
    expand: Callable[[StageProgram], Sequence],
) -> tuple[ScheduleCheck, int]:
    """``check`` of ``programs`` (one run each), decided on a short step where the simulation shows
    the long loops periodic; returns the check and the micro-batches left out (0: the full step).

    ``check(programs, observe)`` runs the schedule check on the expansion of ``programs`` and calls
    ``observe`` at every turn of its simulation; ``expand`` expands one program (to find its loops'
    places)."""
    keep = KEEP_REPEATS
    longest = max((item.repeat for p in programs for item in p.body if isinstance(item, Loop)), default=0)
    if keep < longest and not any(_messages(p) for p in programs):
        # No point-to-point op (one stage): the long loops, without a collective (_pump_down), hold
        # compute ops only, so a shorter step issues the same collectives in the same order.
        pumped = _pump_down(programs, keep, None, expand)
        if pumped is not None:
            return check(pumped.programs, None), sum(pumped.deltas)
    while keep < longest:
        units: list[int] | None = None
        for _ in range(2):
            pumped = _pump_down(programs, keep, units, expand)
            if pumped is None:
                break
            periods = _Periods(pumped, grid)
            result = check(pumped.programs, periods)
            if not result.ok:
                return check(programs, None), 0
            units = periods.units()
            if units is None:
                break
            if all(delta % unit == 0 for delta, unit in zip(pumped.deltas, units, strict=True)):
                if _balanced(pumped, units):
                    return result, sum(pumped.deltas)
                break
        keep *= 2
    return check(programs, None), 0


def _pump_down(
    programs: Sequence[StageProgram], keep: int, units: Sequence[int] | None, expanded: Callable
) -> _Pumped | None:
    """The short step keeping ``keep`` (or a few more) repetitions of every long loop, or None when
    the stages' long loops do not line up (not as many on every stage, a collective inside one, a
    loop that does not advance the micro-batches)."""
    long_loops = _long_loops(programs, keep)
    if long_loops is None:
        return None
    phases = len(long_loops[0])
    deltas = []
    for phase in range(phases):
        loops = [p.body[found[phase]] for p, found in zip(programs, long_loops, strict=True)]
        if any(loop.microbatch_step < 1 or _has_collective(loop) for loop in loops):
            return None
        unit = math.lcm(*(loop.microbatch_step for loop in loops), *(units[phase : phase + 1] if units else ()))
        delta = min((loop.repeat - keep) * loop.microbatch_step for loop in loops) // unit * unit
        if delta < 1:
            return None
        deltas.append(delta)
    short, regions, kept = [], [], []
    for p, found in zip(programs, long_loops, strict=True):
        body, places, dm, db, position = [], [], 0, 0, 0
        for i, item in enumerate(p.body):
            item = _shift(item, -dm, -db)
            if i in found:
                phase = found.index(i)
                removed = deltas[phase] // item.microbatch_step
                item = Loop(item.repeat - removed, item.microbatch_step, item.batch_step, item.ops)
                places.append((position, len(item.ops), item.repeat, item.microbatch_step))
                dm += deltas[phase]
                db += removed * item.batch_step
            body.append(item)
            position += item.repeat * len(item.ops) if isinstance(item, Loop) else 1
        program = unchecked_copy(p, body=tuple(body))  # a StageProgram validates nothing
        ops = expanded(program)
        # With nothing inserted (as many ops as the body unrolled, and the optimizer), each loop's
        # place holds it unrolled, as the body is unrolled in order.
        if len(ops) != program.runs * position + program.optimizer:
            for (first, _, _, _), loop in zip(places, (body[i] for i in found), strict=True):
                if not _repeats(ops, first, loop):
                    return None  # something was inserted inside the loop: not a plain repetition
        short.append(program)
        regions.append(tuple(places))
        kept.append(tuple(body[i] for i in found))
    return _Pumped(tuple(short), tuple(regions), tuple(kept), tuple(deltas))


def _long_loops(programs: Sequence[StageProgram], keep: int) -> list[list[int]] | None:
    """Per stage, the places of its long loops in its body: the loops longer than the least length
    (``keep`` or more) above which every stage has as many loops (a 1F1B stage's warm-up is as long
    as the stages after it, so only the steady loops are long on every stage); None when no length
    gives every stage as many."""
    loops = [[(i, item.repeat) for i, item in enumerate(p.body) if isinstance(item, Loop)] for p in programs]
    for threshold in sorted({keep} | {repeat for found in loops for _, repeat in found if repeat > keep}):
        places = [[i for i, repeat in found if repeat > threshold] for found in loops]
        if places[0] and all(len(found) == len(places[0]) for found in places):
            return places
    return None


def _shift(item, dm: int, db: int):
    if not dm and not db:
        return item
    if isinstance(item, Loop):
        return Loop(
            item.repeat, item.microbatch_step, item.batch_step, tuple(shifted_op(op, dm, db) for op in item.ops)
        )
    return shifted_op(item, dm, db)


def _repeats(ops: Sequence, first: int, loop: Loop) -> bool:
    """Whether ``ops`` from ``first`` on are ``loop`` unrolled (:meth:`Loop.unrolled`), compared op
    by op without building the unrolled copies."""
    length = len(loop.ops)
    if len(ops) < first + length * loop.repeat:
        return False
    for i in range(loop.repeat):
        dm, db = i * loop.microbatch_step, i * loop.batch_step
        for j, base in enumerate(loop.ops):
            op = ops[first + i * length + j]
            if op is base:
                continue
            expected = dict(base.__dict__)
            if base.microbatch is not None:
                expected["microbatch"] = base.microbatch + dm
            if base.batch is not None:
                expected["batch"] = base.batch + db
            if op.__dict__ != expected:
                return False
    return True


def _messages(program: StageProgram) -> bool:
    """Whether a program sends or receives (a point-to-point op in its body)."""
    p2p = (OpKind.send, OpKind.recv)
    return any(op.kind in p2p for item in program.body for op in (item.ops if isinstance(item, Loop) else (item,)))


def _has_collective(loop: Loop) -> bool:
    return any(op.kind is OpKind.collective for op in loop.ops)


class _Periods:
    """Watches a short step's simulation for two moments whose states are equal up to a shift of
    every rank by the same micro-batches inside one long loop (see the module docstring)."""

    def __init__(self, pumped: _Pumped, grid: RankGrid) -> None:
        self.pumped = pumped
        self.stage = {}
        self.seen: list[dict] = [{} for _ in pumped.deltas]
        self.found: list[set[int]] = [set() for _ in pumped.deltas]
        self.grid = grid

    def __call__(self, state: SimulationState) -> None:
        if not self.stage:
            self.stage = {r: self.grid.stage_of(r) for r in state.pc}
        ranks = list(self.stage)
        if state.queue[0] != ranks[0]:
            return  # one look per round of turns (a state that repeats does so at the same rank's turn)
        phase = self._phase(state, ranks[0])
        if phase is None:
            return
        parts, levels = [], {}
        for r in ranks:
            place = self._place(state, r, phase)
            if place is None:
                return
            level, offset, positions = place
            levels[r] = level
            parts.append((offset, state.posted[r], tuple((r, q) in state.matched for q in positions)))
        base = levels[ranks[0]]
        outstanding = []
        for src, position in state.sent:
            dst, other = state.partner[src][position]
            a, b = self._relative(src, position, phase), self._relative(dst, other, phase)
            if a is None or b is None:
                return
            outstanding.append((src, a[0] - levels[src], a[1], dst, b[0] - levels[dst], b[1]))
        key = (
            tuple(parts),
            tuple(levels[r] - base for r in ranks),
            tuple(sorted(outstanding)),
        )
        first = self.seen[phase].setdefault(key, base)
        if base > first:
            self.found[phase].add(base - first)

    def _phase(self, state: SimulationState, rank: int) -> int | None:
        if state.pc[rank] >= len(state.steps[rank]):
            return None
        position = state.steps[rank][state.pc[rank]][1][0]
        for phase, (first, length, repeat, _) in enumerate(self.pumped.regions[self.stage[rank]]):
            if first <= position < first + length * repeat:
                return phase
        return None

    def _relative(self, rank: int, position: int, phase: int) -> tuple[int, int] | None:
        """(micro-batches into the loop, offset in its body) of an op of the loop, else None."""
        first, length, repeat, step = self.pumped.regions[self.stage[rank]][phase]
        if not first <= position < first + length * repeat:
            return None
        repetition, offset = divmod(position - first, length)
        return repetition * step, offset

    def _place(self, state: SimulationState, rank: int, phase: int) -> tuple[int, int, list[int]] | None:
        if state.pc[rank] >= len(state.steps[rank]):
            return None
        positions = state.steps[rank][state.pc[rank]][1]
        start, end = self._relative(rank, positions[0], phase), self._relative(rank, positions[-1], phase)
        if start is None or end is None:
            return None
        return start[0], start[1], positions

    def units(self) -> list[int] | None:
        """Per long loop, the shortest period seen (in micro-batches), or None if one showed none."""
        if not all(self.found):
            return None
        return [min(found) for found in self.found]


def _balanced(pumped: _Pumped, units: Sequence[int]) -> bool:
    """Whether, per long loop, every stage sends each other stage as many messages per period as
    that stage receives from it (so that pairing by channel order shifts with the period)."""
    pp = len(pumped.programs)
    for phase, unit in enumerate(units):
        sends: dict[tuple[int, int], int] = {}
        recvs: dict[tuple[int, int], int] = {}
        for stage, loops in enumerate(pumped.loops):
            loop = loops[phase]
            per = unit // loop.microbatch_step
            for op in loop.ops:
                if op.kind is OpKind.send:
                    sends[(stage, op.peer)] = sends.get((stage, op.peer), 0) + per
                elif op.kind is OpKind.recv:
                    recvs[(op.peer, stage)] = recvs.get((op.peer, stage), 0) + per
        if any(sends.get((a, b), 0) != recvs.get((a, b), 0) for a in range(pp) for b in range(pp)):
            return False
    return True
