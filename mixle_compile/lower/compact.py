"""A step's stage programs stated once with their repetition, and their check on that form.

The explicit program of a stage (:mod:`mixle_compile.lower.schedule`) lists every op of a step: the
pipeline's forwards, backwards and point-to-point batches for every micro-batch, each forward
preceded by the stage's forward-phase collectives and each backward followed by its backward-phase
ones, then the step's gradient reductions, the optimizer and a distributed optimizer's gathers. Its
size is micro-steps x layers. A :class:`StageProgram` states the same program in pieces that do not
grow with either product:

- ``body``: one run of the pipeline schedule's compute and point-to-point ops, where a stretch of
  ops that repeats with the micro-batch and batch numbers advancing by fixed steps is one
  :class:`Loop` (a 1F1B stage is a warm-up loop, a steady loop and a cool-down loop at any number
  of micro-batches);
- ``runs``: how many times the body runs back to back (torchtitan runs the schedule once per
  accumulation step), micro-batches and batches numbered on from the last run;
- ``before_forward`` / ``after_backward``: the collectives issued at every forward and backward,
  stated once;
- ``after_last_backward``: the gradient reductions, each with the number of times it is issued in
  a row (FSDP reduces every accumulation window), and ``end``: what follows the optimizer.

:func:`expand` gives the explicit program back, op for op (what the runtime executes and what
``explain`` lists on request); the compile never builds it.

The check (:func:`check_compact`) runs :func:`mixle_compile.lower.schedule.check_schedule` on a
*reduced* program per stage, which is exact for the full step:

1. Every op of every piece is checked where it is issued (its group rule exists and covers the
   rank; its peer stage exists), on every rank of small worlds and one per stage otherwise; there,
   the collectives whose rules lie inside a stage need no such check (such a rule exists and covers
   every rank), and every other op is checked in the simulated step.
2. Collectives at every forward and backward whose groups stay inside one pipeline stage are left
   out of the reduced program: every rank of a stage runs the same program, so the ranks of a
   column (one rank per stage, the same other coordinates) run the same as every other column, and
   a group inside one stage joins ranks that reach the collective in the same state. A collective
   whose group spans stages (the tied group) stays in; with one the check falls back to the explicit
   program. Checked on one rank per stage (a large world), the step's own collectives inside one
   stage (gradient reductions and gathers over data axes) are left out too: such a collective has a
   single checked member, which completes it on arrival, so it cannot hold the simulation up (its
   rule, inside a stage, exists and covers every rank, so there is nothing to check where it is
   issued either).
3. A gradient reduction issued ``k`` times in a row is kept once, its count part of what every
   member must agree on: ``k`` consecutive collectives on one group complete together or not at all.
4. With several runs, one run is checked alone as well as with the step's end: a run whose sends
   meet their receives within the run and whose collectives balance within the run leaves every
   rank where it started, so the next run behaves the same (the simulation's outcome does not
   depend on the interleaving), and the step is that run repeated and then its end.

5. A loop that repeats more than a few times (a steady state) is checked on a step with fewer of
   its repetitions, once the simulation of that shorter step shows a state that repeats itself
   shifted by a whole number of micro-batches (:mod:`mixle_compile.lower.periodic` says why that
   decides the full step); a shorter step that fails is checked again in full.
6. The simulated step leaves out the forwards and backwards where that decides the same
   (:func:`_without_compute`): untimed, a compute op never waits and is never waited for, so once
   each is seen on its own stage, splits no batch of point-to-point ops and anchors no gradient
   reduction, the simulation passes through the same states without it (at pp 16 a third of the
   ops). A step that fails is checked again with them, so that its problems name the program's own
   positions.

The reduced program grows with neither micro-batches, layers nor accumulation runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mixle_compile.lower.groups import RankGrid
from mixle_compile.lower.periodic import check_pumped
from mixle_compile.lower.schedule import Op, OpKind, ScheduleCheck, _insert, check_schedule
from mixle_compile.plan.ops import copy_op as _copy
from mixle_compile.plan.ops import unchecked_copy

# The stated form and its JSON are the plan's (plan/programs.py: the runtime reads them); the names
# stay importable from here for the lowering's callers.
from mixle_compile.plan.programs import (  # noqa: F401
    Loop,
    StageProgram,
    expand,
    expand_all,
    op_dict,
    op_from,
    plan_programs,
    program_dict,
    program_from,
)

#: Longest stretch of ops tried as the period of a loop (a 1F1B steady iteration is at most 6 ops;
#: an interleaved one at most 10).
MAX_PERIOD = 12


def compress(ops: Sequence[Op], max_period: int = MAX_PERIOD) -> tuple[Op | Loop, ...]:
    """``ops`` with every stretch that repeats with fixed micro-batch and batch steps folded into a
    :class:`Loop`; unrolling the result gives ``ops`` back exactly."""
    keys = [_key(op) for op in ops]
    out: list[Op | Loop] = []
    i, n = 0, len(ops)
    while i < n:
        best = None  # (covered, period, repeats, microbatch step, batch step)
        for period in range(1, min(max_period, (n - i) // 2) + 1):
            steps = _steps(keys, i, i + period, period)
            if steps is None:
                continue
            repeats = 2
            while i + (repeats + 1) * period <= n and _same_steps(
                keys, i + (repeats - 1) * period, i + repeats * period, period, steps
            ):
                repeats += 1
            if best is None or repeats * period > best[0]:
                best = (repeats * period, period, repeats, *steps)
        if best is None or best[0] <= best[1]:
            out.append(ops[i])
            i += 1
            continue
        covered, period, repeats, dm, db = best
        out.append(Loop(repeats, dm, db, tuple(ops[i : i + period])))
        i += covered
    return tuple(out)


def _key(op: Op) -> tuple:
    """An op without its micro-batch and batch numbers, and those numbers."""
    rest = (op.kind, op.stage, op.chunk, op.name, op.group, op.tag, op.peer, op.peer_chunk, op.bytes)
    return rest, op.microbatch, op.batch


def _delta(a: int | None, b: int | None) -> int | None | bool:
    if (a is None) != (b is None):
        return False
    return None if a is None else b - a


def _steps(keys: list, first: int, second: int, period: int) -> tuple[int, int] | None:
    """The (micro-batch, batch) steps taking the period at ``first`` to the one at ``second``."""
    dm = db = None
    for j in range(period):
        (ra, ma, ba), (rb, mb, bb) = keys[first + j], keys[second + j]
        if ra != rb:
            return None
        m, b = _delta(ma, mb), _delta(ba, bb)
        if m is False or b is False:
            return None
        if m is not None:
            if dm is None:
                dm = m
            elif m != dm:
                return None
        if b is not None:
            if db is None:
                db = b
            elif b != db:
                return None
    return dm or 0, db or 0


def _same_steps(keys: list, first: int, second: int, period: int, steps: tuple[int, int]) -> bool:
    dm, db = steps
    for j in range(period):
        (ra, ma, ba), (rb, mb, bb) = keys[first + j], keys[second + j]
        if ra != rb or (ma is None) != (mb is None) or (ba is None) != (bb is None):
            return False
        if ma is not None and mb - ma != dm:
            return False
        if ba is not None and bb - ba != db:
            return False
    return True


# ---------------------------------------------------------------------------
# The check on the stated form
# ---------------------------------------------------------------------------

_COMPUTE = (OpKind.forward, OpKind.backward)


def _without_compute(p: StageProgram) -> StageProgram | None:
    """``p`` without its forwards and backwards, for the check's simulation, or None where that
    could decide otherwise than ``p``.

    Untimed, a compute op is no step of the simulation: it never waits and no rank waits for it. It
    matters to the check in three ways only, each ruled out here: it is checked where it is issued
    (every compute op must be the program's own stage's); it ends a batch of point-to-point ops (no
    two point-to-point ops with one batch number may have only compute ops between them, so that
    leaving those out joins no batches); and the last backward anchors the gradient reductions (a
    program with some is kept whole). The step's other ops keep their order and their numbers, so
    the simulation goes through the same states, and a loop that would be left empty keeps the
    program whole (the loops, and so the periodic check's short step, stay the same)."""
    if p.runs != 1 or p.after_last_backward or p.before_forward or p.after_backward:
        return None
    compute, p2p = _COMPUTE, (OpKind.send, OpKind.recv)

    def joined(a: Op | None, b: Op, shift: int = 0, a_shift: int = 0) -> bool:
        """Whether ``a`` and ``b`` are messages of one batch (``b``'s number ``shift`` on)."""
        return (
            a is not None
            and a.kind in p2p
            and b.kind in p2p
            and a.batch is not None
            and b.batch is not None
            and a.batch + a_shift == b.batch + shift
        )

    body: list[Op | Loop] = []
    before: Op | None = None  # the last kept op (its batch number ``lag`` behind its last issue's)
    lag = 0
    gap = False  # compute ops since it
    for item in p.body:
        ops = item.ops if isinstance(item, Loop) else (item,)
        kept = []
        for op in ops:
            if op.kind in compute:
                if op.stage != p.stage:
                    return None
                gap = True
                continue
            if gap and joined(before, op, a_shift=lag):
                return None  # the compute ops between end a batch
            before, lag, gap = op, 0, False
            kept.append(op)
        if not isinstance(item, Loop):
            body.extend(kept)
            continue
        if not kept:
            return None
        if item.repeat > 1:
            # one repetition's last kept op and the next's first, across the loop's own compute ops
            if (ops[0].kind in compute or ops[-1].kind in compute) and joined(kept[-1], kept[0], item.batch_step):
                return None
            lag = (item.repeat - 1) * item.batch_step
        body.append(Loop(item.repeat, item.microbatch_step, item.batch_step, tuple(kept)))
    return unchecked_copy(p, body=tuple(body))  # a StageProgram validates nothing


def within_stage(grid: RankGrid, name: str | None) -> bool:
    """Whether every group of the rule ``name`` lies inside one pipeline stage."""
    try:
        rule = grid.rule(name)
    except (ValueError, KeyError):
        return False
    # by the coordinates it spans: the tied-embedding rule spans the first and last stage under its own name
    return all(span.axis != "pp" or span.count == 1 for span in rule.spans) and rule.covers(0)


def check_compact(
    programs: Sequence[StageProgram],
    grid: RankGrid,
    *,
    exhaustive_limit: int,
    buffered_sends: bool = False,
) -> ScheduleCheck:
    """Check the step the stated programs expand to (see the module docstring for why the reduced
    programs it simulates decide the full step)."""
    if len(programs) != grid.plan.pp:
        raise ValueError(f"got {len(programs)} stage programs for pp = {grid.plan.pp}")
    inside: dict[str | None, bool] = {}  # group rule -> within_stage (a step names a few rules, many times)

    def in_stage(name: str | None) -> bool:
        found = inside.get(name)
        if found is None:
            found = inside[name] = within_stage(grid, name)
        return found

    blocks_local = all(in_stage(op.group) for p in programs for op in (*p.before_forward, *p.after_backward))
    if not blocks_local:
        # A per-micro-batch collective spans stages: check the explicit step.
        check = check_schedule(
            expand_all(programs), grid, exhaustive_limit=exhaustive_limit, buffered_sends=buffered_sends
        )
        return dataclasses.replace(
            check, note=check.note + "; on the explicit programs (a per-micro-batch collective spans stages)"
        )
    problems: list[str] = []
    representatives = grid.world_size > exhaustive_limit
    # 1. Every piece's ops where they are issued: one forward and one backward carry the blocks, whose
    # order every member of their groups must agree on. Checked on one rank per stage nothing is left
    # to check there: each block's rule lies inside a stage (above), so it exists and covers every
    # rank, its group has one checked member, and an inserted op takes its stage from the program.
    if not representatives:
        templates = []
        for p in programs:
            probe = [
                Op(OpKind.forward, p.stage, microbatch=0, name="forward"),
                Op(OpKind.backward, p.stage, microbatch=0, name="backward"),
            ]
            probe = _insert(
                _insert(probe, p.before_forward, "before_forward", p.stage, None),
                p.after_backward,
                "after_backward",
                p.stage,
                None,
            )
            templates.append(tuple(op for op in probe if op.kind is OpKind.collective))
        block_check = check_schedule(templates, grid, exhaustive_limit=exhaustive_limit, buffered_sends=buffered_sends)
        problems += [f"a per-micro-batch collective: {text}" for text in block_check.problems]

    # 2. So too, on one rank per stage, the step's collectives whose groups lie inside a stage: each
    # has a single checked member, which completes it on arrival, and it is left out of the simulation.
    def local(op: Op) -> bool:
        return representatives and in_stage(op.group)

    left_out = any(local(op) for p in programs for op in (*(op for op, _ in p.after_last_backward), *p.end))

    # 2-3. The reduced step: one run with the step's end, each repeated reduction once (its count in its tag),
    # without the per-micro-batch collectives (checked where issued, in 1).
    def reduced(p: StageProgram, with_end: bool) -> StageProgram:
        counted = unchecked_copy(  # a StageProgram validates nothing
            p,
            runs=1,
            before_forward=(),
            after_backward=(),
            after_last_backward=tuple(
                (_copy(op, tag=f"{op.tag} x{k}") if k > 1 else op, 1)
                for op, k in p.after_last_backward
                if not local(op)
            ),
            end=tuple(op for op in p.end if not local(op)),
        )
        if not with_end:
            counted = unchecked_copy(counted, after_last_backward=(), end=(), optimizer=False)
        return counted

    expanded: dict[int, tuple[StageProgram, tuple[Op, ...]]] = {}

    def explicit(p: StageProgram) -> tuple[Op, ...]:
        # The periodic check expands a short step to find its loops, then simulates it: once each.
        hit = expanded.get(id(p))
        if hit is None or hit[0] is not p:
            hit = expanded[id(p)] = (p, expand(p, times=False, blocks=False))
        return hit[1]

    def simulated(stated: Sequence[StageProgram], observe) -> ScheduleCheck:
        return check_schedule(
            [explicit(p) for p in stated],
            grid,
            exhaustive_limit=exhaustive_limit,
            buffered_sends=buffered_sends,
            observe=observe,
        )

    # 5. Long loops are decided on a shorter step where they are seen to be periodic (lower/periodic.py).
    # 6. Simulated without their forwards and backwards where that decides the same (_without_compute);
    # a step that fails is checked again with them, so that its problems name the program's own ops.
    def decided(whole: list[StageProgram]) -> tuple[ScheduleCheck, int]:
        lean = [_without_compute(p) for p in whole]
        if any(p is None for p in lean):
            return check_pumped(whole, simulated, grid, explicit)
        found = check_pumped(lean, simulated, grid, explicit)
        return found if found[0].ok else (simulated(whole, None), 0)

    step, shorter = decided([reduced(p, True) for p in programs])
    problems += list(step.problems)
    repeated = max(p.runs for p in programs) > 1
    if repeated and not problems:
        # 4. One run alone: self-contained, so the runs compose.
        run, _ = decided([reduced(p, False) for p in programs])
        problems += [f"one run of the schedule alone: {text}" for text in run.problems]
        if len({p.runs for p in programs}) != 1:
            problems.append(
                f"the stages run the schedule {sorted({p.runs for p in programs})} times; every stage must run "
                "it equally often"
            )
    note = (
        f"{step.note}; on the stated programs: one run"
        + (f" of {programs[0].runs} (each self-contained, so the runs compose)" if repeated else "")
        + ", each repeated reduction once, per-micro-batch collectives inside a stage checked where issued"
        + ("; the step's collectives inside a stage, each with one checked rank, left out" if left_out else "")
        + (
            f"; the long loops on a step {shorter} micro-batches shorter, whose simulation repeats itself shifted"
            if shorter
            else ""
        )
    )
    return ScheduleCheck(tuple(problems), step.ranks_checked, step.representatives, note)
