"""The operations of a stage's step program, as a plan states them and a rank executes them.

An :class:`Op` is one operation a pipeline stage issues (a forward, a backward, a point-to-point
send or receive, a collective, the optimizer step). The lowering builds programs of them
(lower/schedule.py) and the runtime reads them from the plan (plan/programs.py), so both import
them from here; :func:`insert_templates` places collective templates at their anchors, which
both the builder and the reader of a plan's stated form do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "ACTIVATION",
    "ACTIVATION_GRAD",
    "Op",
    "OpKind",
    "copy_op",
    "insert_templates",
    "repeated",
    "shifted_copy",
    "unchecked_copy",
]


class OpKind(StrEnum):
    """What an op does."""

    forward = "forward"
    backward = "backward"
    send = "send"
    recv = "recv"
    collective = "collective"
    optimizer = "optimizer"


#: Payload tags of pipeline messages.
ACTIVATION = "activation"
ACTIVATION_GRAD = "activation_grad"


_P2P = (OpKind.send, OpKind.recv)


@dataclass(frozen=True)
class Op:
    """One operation of a rank's step program.

    ``stage`` is the pipeline stage that issues it and ``chunk`` its virtual
    chunk on that stage (model virtual stage ``chunk * pp + stage``).
    Collectives name the group rule in ``group`` and what they carry in
    ``tag``.  Sends and receives name the ``peer`` stage, the chunk there
    (``peer_chunk``, default: the same chunk) and the payload in ``tag``
    (:data:`ACTIVATION` or :data:`ACTIVATION_GRAD`); ``batch`` numbers the
    batched call a point-to-point op is issued in (``None``: issued alone).
    """

    kind: OpKind
    stage: int
    chunk: int = 0
    microbatch: int | None = None
    name: str = ""
    group: str | None = None
    tag: str = ""
    peer: int | None = None
    peer_chunk: int | None = None
    batch: int | None = None
    bytes: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", OpKind(self.kind))
        except ValueError:
            valid = ", ".join(k.value for k in OpKind)
            raise ValueError(f"Op.kind must be one of {valid}, got {self.kind!r}") from None
        for name in ("stage", "chunk", "bytes"):
            _require_count(f"Op.{name}", getattr(self, name))
        for name in ("microbatch", "peer", "peer_chunk", "batch"):
            if getattr(self, name) is not None:
                _require_count(f"Op.{name}", getattr(self, name))
        if self.kind is OpKind.collective and not self.group:
            raise ValueError("a collective Op needs `group`, the name of its group rule (e.g. 'dp_shard+cp')")
        if self.kind in _P2P and self.peer is None:
            raise ValueError(f"a {self.kind.value} Op needs `peer`, the pipeline stage it talks to")

    @property
    def target_chunk(self) -> int:
        """The peer's chunk of a send or receive."""
        return self.chunk if self.peer_chunk is None else self.peer_chunk

    def describe(self) -> str:
        """Short human-readable form for reports."""
        parts = [self.kind.value]
        if self.name and self.name != self.kind.value:
            parts.append(self.name)
        if self.kind is OpKind.collective:
            parts.append(f"on {self.group}")
        if self.kind is OpKind.send:
            parts.append(f"to stage {self.peer}")
        if self.kind is OpKind.recv:
            parts.append(f"from stage {self.peer}")
        if self.tag:
            parts.append(repr(self.tag))
        if self.microbatch is not None:
            parts.append(f"mb {self.microbatch}")
        parts.append(f"chunk {self.chunk}")
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["kind"] = self.kind.value
        return data


def unchecked_copy(obj: Any, **fields: Any) -> Any:
    """A frozen dataclass ``obj`` with ``fields`` replaced, without running its validation: for
    copies whose new values come from values already checked (validation dominates building long
    programs and planning many parameters)."""
    values = obj.__dict__.copy()  # a copy, then updated: about twice as fast as a merged literal
    values.update(fields)
    return _instance(type(obj), values)


def shifted_copy(op: Op, dm: int, db: int) -> Op:
    """``op`` with ``dm`` added to its micro-batch and ``db`` to its batch number, unchecked (the
    numbers of an op a loop unrolls to; :func:`unchecked_copy` written out for the case, as a step's
    check unrolls thousands of ops)."""
    values = op.__dict__.copy()
    microbatch, batch = values["microbatch"], values["batch"]
    if microbatch is not None:
        values["microbatch"] = microbatch + dm
    if batch is not None:
        values["batch"] = batch + db
    return _instance(Op, values)


def repeated(ops: Sequence[Op], repeat: int, microbatch_step: int, batch_step: int) -> list[Op]:
    """``ops`` issued ``repeat`` times, repetition ``i`` with ``i * microbatch_step`` added to every
    micro-batch number and ``i * batch_step`` to every batch number (the first is ``ops`` itself):
    :func:`shifted_copy` for a whole loop, the copies built in one place, as a step's check unrolls
    thousands of ops."""
    out = list(ops)
    fields = [(op.__dict__, op.microbatch, op.batch) for op in ops]
    for i in range(1, repeat):
        dm, db = i * microbatch_step, i * batch_step
        for values, microbatch, batch in fields:
            shifted = values.copy()  # a dict's copy, then set: about twice as fast as a merged literal
            if microbatch is not None:
                shifted["microbatch"] = microbatch + dm
            if batch is not None:
                shifted["batch"] = batch + db
            out.append(_instance(Op, shifted))
    return out


def _instance(cls: type, values: dict) -> Any:
    new = object.__new__(cls)
    object.__setattr__(new, "__dict__", values)  # a frozen dataclass: its own __setattr__ refuses
    return new


def copy_op(op: Op, **fields: Any) -> Op:
    """``op`` with ``fields`` replaced, for copies whose values come from other valid ops (a stage,
    chunk, micro-batch or batch number already checked): skips Op's validation."""
    return unchecked_copy(op, **fields)


def _require_count(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")


def insert_templates(program: list[Op], templates: Sequence[Op], at: str, stage: int, where) -> list[Op]:
    def copies(anchor: Op | None) -> list[Op]:
        if anchor is None:
            return [copy_op(t, stage=stage) for t in templates]
        return [copy_op(t, stage=stage, chunk=anchor.chunk, microbatch=anchor.microbatch) for t in templates]

    def skip_collectives(i: int) -> int:
        while i < len(program) and program[i].kind is OpKind.collective:
            i += 1
        return i

    if at == "start":
        position = skip_collectives(0)
        return program[:position] + copies(None) + program[position:]
    if at == "end":
        return program + copies(None)
    if at == "before_optimizer":
        position = next((i for i, op in enumerate(program) if op.kind is OpKind.optimizer), len(program))
        return program[:position] + copies(None) + program[position:]
    if at == "after_last_backward":
        last = max((i for i, op in enumerate(program) if op.kind is OpKind.backward), default=None)
        if last is None:
            return insert_templates(program, templates, "before_optimizer", stage, where)
        position = last + 1
        if position < len(program) and program[position].kind in _P2P:
            batch = program[position].batch
            position += 1
            while (
                batch is not None
                and position < len(program)
                and program[position].kind in _P2P
                and program[position].batch == batch
            ):
                position += 1
        position = skip_collectives(position)
        return program[:position] + copies(None) + program[position:]
    kind = OpKind.forward if at == "before_forward" else OpKind.backward
    out: list[Op] = []
    i = 0
    while i < len(program):
        op = program[i]
        selected = op.kind is kind and (where is None or where(op))
        if selected and kind is OpKind.forward:
            out += copies(op)
        out.append(op)
        i += 1
        if selected and kind is OpKind.backward:
            end = skip_collectives(i)
            out += program[i:end] + copies(op)
            i = end
    return out
