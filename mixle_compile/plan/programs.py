"""A stage's program as the plan states it: its repeated parts once, and how to expand it.

A :class:`StageProgram` is what a plan's ``schedule.stages`` holds (the lowering builds and checks it
in :mod:`mixle_compile.lower.compact`, which explains the form): a ``body`` of ops and loops
(:class:`Loop`) run ``runs`` times, the collectives issued at every forward and backward, the
gradient reductions with their counts and what follows the optimizer. :func:`expand` gives the
explicit program back, op for op; :func:`plan_programs` reads every stage's explicit program from a
plan, which is how the runtime reads a plan's schedule.

The plan states each collective once, as an update (``updates``); a stage program names none of
them. Where each goes follows from the update's phase (:func:`phase_collectives`, the one rule the
lowering builds the programs by and every reader reads them by): ``forward`` before every forward,
``backward`` after every backward, ``gradient`` after the last backward (``occurrences_per_step``
times in a row), ``parameter`` after the optimizer (as often), each list in the plan's order of the
updates. A plan whose collectives sit in its programs' bodies (a distribution model's EM step) says
so with ``schedule.collectives: in_body``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

# The op a program is made of, and its unchecked copy and insertion (the schedule's own).
from mixle_compile.plan.ops import Op, OpKind, _require_count, copy_op, repeated, shifted_copy
from mixle_compile.plan.ops import insert_templates as _insert
from mixle_compile.plan.vocabulary import rule_name

#: ``schedule.collectives``: the programs' collectives are the plan's updates, placed by their phase
#: (:func:`phase_collectives`), or they sit in the programs' bodies.
BY_PHASE = "by_phase"
IN_BODY = "in_body"


@dataclass(frozen=True)
class Loop:
    """``ops`` issued ``repeat`` times; repetition ``i`` adds ``i * microbatch_step`` to every
    micro-batch number and ``i * batch_step`` to every batch number of its ops."""

    repeat: int
    microbatch_step: int
    batch_step: int
    ops: tuple[Op, ...]

    def __post_init__(self) -> None:
        if self.repeat < 1 or not self.ops:
            raise ValueError("a loop repeats at least once and has at least one op")

    def unrolled(self) -> list[Op]:
        return repeated(self.ops, self.repeat, self.microbatch_step, self.batch_step)


@dataclass(frozen=True)
class StageProgram:
    """One pipeline stage's program, its repeated parts stated once (see the module docstring)."""

    stage: int
    body: tuple[Op | Loop, ...]
    runs: int = 1
    run_microbatches: int = 0  # added to micro-batch numbers per run
    run_batches: int = 0  # added to batch numbers per run
    optimizer: bool = True  # an optimizer op after the last run
    before_forward: tuple[Op, ...] = ()
    after_backward: tuple[Op, ...] = ()
    after_last_backward: tuple[tuple[Op, int], ...] = ()  # (collective, times in a row)
    end: tuple[Op, ...] = ()

    def run_ops(self) -> list[Op]:
        """One run's compute and point-to-point ops, unrolled."""
        out: list[Op] = []
        for item in self.body:
            out.extend(item.unrolled() if isinstance(item, Loop) else (item,))
        return out


def shifted_op(op: Op, dm: int, db: int) -> Op:
    """``op`` with ``dm`` added to its micro-batch and ``db`` to its batch number (unchecked copy)."""
    if not dm and not db:
        return op
    # The op is valid and its numbers stay those of a valid op (a loop unrolls to the ops it folded),
    # so the copy skips Op's validation, which dominates unrolling a long run.
    return shifted_copy(op, dm, db)


# ---------------------------------------------------------------------------
# Expansion
# ---------------------------------------------------------------------------

_OPTIMIZER = Op(OpKind.optimizer, 0, name="optimizer")


def expand(
    program: StageProgram, *, runs: int | None = None, times: bool = True, blocks: bool = True
) -> tuple[Op, ...]:
    """The explicit program: every op of the step in issue order.

    ``runs`` overrides the number of runs, ``times=False`` issues each gradient reduction once, and
    ``blocks=False`` leaves out the per-forward and per-backward collectives (the check's reduced
    program uses these)."""
    runs = program.runs if runs is None else runs
    one = program.run_ops()
    ops = (
        one
        if runs == 1
        else [shifted_op(op, r * program.run_microbatches, r * program.run_batches) for r in range(runs) for op in one]
    )
    if program.optimizer:
        _require_count("Op.stage", program.stage)  # what Op checks of it, without building one
        ops.append(copy_op(_OPTIMIZER, stage=program.stage))
    # Gradient reductions go in first, so that they land after the last backward's p2p batch; the
    # per-micro-batch collectives inserted later sit right next to their compute op, before any send.
    # (A tied-weight all_reduce placed before the last stage's final gradient send deadlocks stage 0.)
    gradient = [op for op, k in program.after_last_backward for _ in range(k if times else 1)]
    for anchor, inserted in (
        ("after_last_backward", gradient),
        ("end", program.end),
        ("before_forward", program.before_forward if blocks else ()),
        ("after_backward", program.after_backward if blocks else ()),
    ):
        if inserted:
            ops = _insert(ops, inserted, anchor, program.stage, None)
    return tuple(ops)


def expand_all(programs: Sequence[StageProgram]) -> tuple[tuple[Op, ...], ...]:
    return tuple(expand(p) for p in programs)


# ---------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------


def _fields(data: Any) -> Callable[..., Any]:
    """A getter of a plan entry's fields, ``get(name, default=None)``, for its JSON (a dict) or the
    plan document's model alike."""
    if isinstance(data, dict):
        return data.get
    return lambda name, default=None: getattr(data, name, default)


def op_dict(op: Op) -> dict[str, Any]:
    """An op as the plan writes it: every field (the plan's schema fills none in), the keys in
    canonical (sorted) order, so that the plan's text is written without sorting them again."""
    return {
        "batch": op.batch,
        "bytes": op.bytes,
        "chunk": op.chunk,
        "group": op.group,
        "kind": op.kind._value_,
        "microbatch": op.microbatch,
        "name": op.name,
        "peer": op.peer,
        "peer_chunk": op.peer_chunk,
        "stage": op.stage,
        "tag": op.tag,
    }


def op_from(data: Any) -> Op:
    """An op from its plan entry (a dict or a pydantic model with the same fields)."""
    get = _fields(data)
    return Op(
        OpKind(get("kind")),
        get("stage"),
        get("chunk", 0) or 0,
        get("microbatch"),
        get("name", "") or "",
        get("group"),
        get("tag", "") or "",
        get("peer"),
        get("peer_chunk"),
        get("batch"),
        get("bytes", 0) or 0,
    )


def program_dict(p: StageProgram) -> dict[str, Any]:
    """A stage program as the plan writes it, every key in canonical (sorted) order (:func:`op_dict`).
    Its collectives are not written: the plan states them as updates (:func:`phase_collectives`)."""
    body = [
        {
            "batch_step": item.batch_step,
            "microbatch_step": item.microbatch_step,
            "ops": [op_dict(op) for op in item.ops],
            "repeat": item.repeat,
        }
        if isinstance(item, Loop)
        else op_dict(item)
        for item in p.body
    ]
    return {
        "body": body,
        "optimizer": p.optimizer,
        "run_batches": p.run_batches,
        "run_microbatches": p.run_microbatches,
        "runs": p.runs,
        "stage": p.stage,
    }


def program_from(data: Any, collectives: StageCollectives | None = None) -> StageProgram:
    """A stage program from its plan entry (a dict or the plan document's model), with the
    collectives the plan's updates place on its stage (:func:`phase_collectives`; none: the
    program's body holds its collectives)."""
    get = _fields(data)

    def item(entry: Any) -> Op | Loop:
        value = _fields(entry)
        if value("repeat") is not None:
            return Loop(
                value("repeat"),
                value("microbatch_step"),
                value("batch_step"),
                tuple(op_from(op) for op in value("ops")),
            )
        return op_from(entry)

    placed = collectives or NO_COLLECTIVES
    return StageProgram(
        stage=get("stage"),
        body=tuple(item(e) for e in get("body")),
        runs=get("runs"),
        run_microbatches=get("run_microbatches"),
        run_batches=get("run_batches"),
        optimizer=get("optimizer"),
        before_forward=placed.before_forward,
        after_backward=placed.after_backward,
        after_last_backward=placed.after_last_backward,
        end=placed.end,
    )


def plan_programs(schedule: Any, updates: Sequence[Any]) -> tuple[tuple[Op, ...], ...]:
    """Every stage's explicit program from a plan's ``schedule`` and ``updates`` (the document's
    models or its JSON, the updates unfolded): what the runtime executes."""
    return tuple(expand(program) for program in plan_stage_programs(schedule, updates))


def plan_stage_programs(schedule: Any, updates: Sequence[Any]) -> tuple[StageProgram, ...]:
    """Every stage's program as the plan states it, its collectives placed from the updates."""
    get = _fields(schedule)
    stages = get("stages")
    if get("collectives", BY_PHASE) != BY_PHASE:
        return tuple(program_from(stage) for stage in stages)
    placed = phase_collectives((placement_of(u) for u in updates), checked_collective)
    return tuple(program_from(stage, placed.get(_fields(stage)("stage"))) for stage in stages)


# ---------------------------------------------------------------------------
# Where each update's collective goes
# ---------------------------------------------------------------------------


class Placement(NamedTuple):
    """What a stage program needs of an update to place its collective."""

    phase: str
    stage: int
    mesh_axes: tuple[str, ...]
    collective: str
    name: str
    bytes: int
    occurrences: int


class StageCollectives(NamedTuple):
    """The collectives of one stage's program, by where they are issued."""

    before_forward: tuple[Op, ...] = ()
    after_backward: tuple[Op, ...] = ()
    after_last_backward: tuple[tuple[Op, int], ...] = ()  # (collective, times in a row)
    end: tuple[Op, ...] = ()


NO_COLLECTIVES = StageCollectives()

#: The phases an update's collective can be issued in (its anchor in the program).
PHASES = ("forward", "backward", "gradient", "parameter")


def phase_collectives(updates: Iterable[Placement], make_op: Callable[[Placement], Op]) -> dict[int, StageCollectives]:
    """The collectives of every stage's program, from the updates in plan order: point-to-point
    updates are the body's sends and receives; every other update is one collective (``make_op``)
    issued where its phase says (the module docstring), a ``gradient`` one ``occurrences`` times in a
    row (FSDP reduces every accumulation window) and a ``parameter`` one as often."""
    lists: dict[int, tuple[list, list, list, list]] = {}
    for u in updates:
        if u.collective == "p2p":
            continue
        if u.phase not in PHASES:
            raise ValueError(f"update {u.name!r} has the phase {u.phase!r}; a collective's phase is one of {PHASES}")
        forward, backward, gradient, end = lists.setdefault(u.stage, ([], [], [], []))
        op = make_op(u)
        if u.phase == "forward":
            forward.append(op)
        elif u.phase == "backward":
            backward.append(op)
        elif u.phase == "gradient":
            gradient.append((op, u.occurrences))
        else:
            end.extend([op] * u.occurrences)
    return {stage: StageCollectives(*(tuple(part) for part in parts)) for stage, parts in lists.items()}


def placement_of(entry: Any) -> Placement:
    """An update's placement from its plan entry (a dict or the plan document's model)."""
    get = _fields(entry)
    return Placement(
        get("phase"),
        get("stage"),
        tuple(get("mesh_axes")),
        get("collective"),
        get("node_id"),
        get("payload_bytes"),
        get("occurrences_per_step"),
    )


def checked_collective(u: Placement) -> Op:
    """The collective op of an update read from a plan (validated: the values come from a file)."""
    if isinstance(u.occurrences, bool) or not isinstance(u.occurrences, int) or u.occurrences < 1:
        raise ValueError(f"update {u.name!r} occurs {u.occurrences!r} times per step; it must be at least once")
    return Op(OpKind.collective, u.stage, name=u.name, group=rule_name(u.mesh_axes), tag=u.collective, bytes=u.bytes)
