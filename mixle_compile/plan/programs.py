"""A stage's program as the plan states it: its repeated parts once, and how to expand it.

A :class:`StageProgram` is what a format-2 plan's ``schedule.stages`` holds (the lowering builds and
checks it in :mod:`mixle_compile.lower.compact`, which explains the form): a ``body`` of ops and
loops (:class:`Loop`) run ``runs`` times, the collectives issued at every forward and backward stated once,
the gradient reductions with their counts and what follows the optimizer. :func:`expand` gives the
explicit program back, op for op; :func:`plan_programs` reads every stage's explicit program from a
plan, which is how the runtime reads a plan's schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The op a program is made of, and its unchecked copy and insertion (the schedule's own).
from mixle_compile.plan.ops import Op, OpKind
from mixle_compile.plan.ops import copy_op as _copy
from mixle_compile.plan.ops import insert_templates as _insert


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
        return [
            shifted_op(op, i * self.microbatch_step, i * self.batch_step) for i in range(self.repeat) for op in self.ops
        ]


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
    return _copy(
        op,
        microbatch=None if op.microbatch is None else op.microbatch + dm,
        batch=None if op.batch is None else op.batch + db,
    )


# ---------------------------------------------------------------------------
# Expansion
# ---------------------------------------------------------------------------


def expand(
    program: StageProgram, *, runs: int | None = None, times: bool = True, blocks: bool = True
) -> tuple[Op, ...]:
    """The explicit program: every op of the step in issue order.

    ``runs`` overrides the number of runs, ``times=False`` issues each gradient reduction once, and
    ``blocks=False`` leaves out the per-forward and per-backward collectives (the check's reduced
    program uses these)."""
    runs = program.runs if runs is None else runs
    one = program.run_ops()
    ops = [shifted_op(op, r * program.run_microbatches, r * program.run_batches) for r in range(runs) for op in one]
    if program.optimizer:
        ops.append(Op(OpKind.optimizer, program.stage, name="optimizer"))
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
    get = data.get if isinstance(data, dict) else (lambda name, default=None: getattr(data, name, default))
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
    """A stage program as the plan writes it, every key in canonical (sorted) order (:func:`op_dict`)."""
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
        "after_backward": [op_dict(op) for op in p.after_backward],
        "after_last_backward": [{**op_dict(op), "times": k} for op, k in p.after_last_backward],
        "before_forward": [op_dict(op) for op in p.before_forward],
        "body": body,
        "end": [op_dict(op) for op in p.end],
        "optimizer": p.optimizer,
        "run_batches": p.run_batches,
        "run_microbatches": p.run_microbatches,
        "runs": p.runs,
        "stage": p.stage,
    }


def program_from(data: Any) -> StageProgram:
    """A stage program from its plan entry (a dict or the plan document's model)."""
    get = data.get if isinstance(data, dict) else (lambda name, default=None: getattr(data, name, default))

    def item(entry: Any) -> Op | Loop:
        value = entry.get if isinstance(entry, dict) else (lambda name, default=None: getattr(entry, name, default))
        if value("repeat") is not None:
            return Loop(
                value("repeat"),
                value("microbatch_step"),
                value("batch_step"),
                tuple(op_from(op) for op in value("ops")),
            )
        return op_from(entry)

    def times(entry: Any) -> int:
        return entry["times"] if isinstance(entry, dict) else entry.times

    return StageProgram(
        stage=get("stage"),
        body=tuple(item(e) for e in get("body")),
        runs=get("runs"),
        run_microbatches=get("run_microbatches"),
        run_batches=get("run_batches"),
        optimizer=get("optimizer"),
        before_forward=tuple(op_from(op) for op in get("before_forward")),
        after_backward=tuple(op_from(op) for op in get("after_backward")),
        after_last_backward=tuple((op_from(op), times(op)) for op in get("after_last_backward")),
        end=tuple(op_from(op) for op in get("end")),
    )


def plan_programs(schedule: Any) -> tuple[tuple[Op, ...], ...]:
    """Every stage's explicit program from a plan's ``schedule`` (the document's model or its JSON):
    what the runtime executes."""
    stages = schedule["stages"] if isinstance(schedule, dict) else schedule.stages
    return tuple(expand(program_from(stage)) for stage in stages)
