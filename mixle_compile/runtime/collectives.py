"""The one counting layer every collective of the runtime passes through.

Each call names the planned updates it carries (``parts``: node id and bytes). The ledger refuses
a call the plan does not declare, or declares with another collective or group, before it is
issued, and tallies count and bytes per update, so that after a run the planned and observed
accounting can be compared exactly. Several updates may share one call (a coalesced bucket);
each is still counted once, with its own bytes, and the parts must add up to the call's payload.

Bytes follow the plan's convention for ``payload_bytes``, the full logical size entering the
collective on each rank: the tensor for all_reduce, the input for reduce_scatter, the output for
all_gather.

Collectives that are not training updates (the receipt's global counts, the report's gathers)
are *bookkeeping*: counted under their own names and never mixed with the plan's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mixle_compile.runtime.errors import CollectiveFailed, PlanMismatch
from mixle_compile.runtime.instructions import Collective
from mixle_compile.runtime.mesh import Mesh

# torch 2.13 renamed the flat-tensor collectives; older versions (>= 2.6) have only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Tally:
    count: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes


@dataclass
class Ledger:
    """Observed collectives of one rank: per planned update, and bookkeeping apart."""

    planned: Mapping[str, Collective]
    updates: dict[str, Tally] = field(default_factory=dict)
    bookkeeping: dict[str, Tally] = field(default_factory=dict)
    discarded: dict[str, Tally] = field(default_factory=dict)  # collectives of discarded windows
    # all_to_all updates whose traffic depends on the data (expert parallelism): per update, the
    # bytes this rank actually sent to and received from other ranks (its own rows stay local)
    exchanged: dict[str, list[int]] = field(default_factory=dict)
    calls: int = 0  # collective calls issued for planned updates (a coalesced call is one)
    window_bytes: int = 0  # planned-update bytes since the last receipt
    in_flight: str | None = None

    def check(self, kind: str, rule: str, parts: Sequence[tuple[str, int]]) -> None:
        for node_id, _ in parts:
            planned = self.planned.get(node_id)
            if planned is None:
                raise PlanMismatch(
                    f"the runtime was about to issue {kind} {node_id!r} on group {rule!r}, which the plan does "
                    "not declare"
                )
            if (planned.collective, planned.rule) != (kind, rule):
                raise PlanMismatch(
                    f"the runtime was about to issue {node_id!r} as {kind} on group {rule!r}, but the plan declares "
                    f"{planned.collective} on group {planned.rule!r}"
                )

    def record(self, parts: Sequence[tuple[str, int]]) -> None:
        self.calls += 1
        for node_id, nbytes in parts:
            self.updates.setdefault(node_id, Tally()).add(nbytes)
            self.window_bytes += nbytes

    def record_bookkeeping(self, name: str, nbytes: int) -> None:
        self.bookkeeping.setdefault(name, Tally()).add(nbytes)

    def begin_window(self) -> None:
        self._window_start = self.snapshot()
        self._exchanged_start = {k: list(v) for k, v in self.exchanged.items()}
        self.window_bytes = 0

    def discard_window(self) -> None:
        """Move the collectives of a discarded accumulation window out of the accounting."""
        start = getattr(self, "_window_start", {})
        for node_id, tally in self.updates.items():
            count, nbytes = start.get(node_id, (0, 0))
            moved = self.discarded.setdefault(node_id, Tally())
            moved.count += tally.count - count
            moved.bytes += tally.bytes - nbytes
            tally.count, tally.bytes = count, nbytes
        # The traffic of a discarded window's all_to_all calls leaves the measured traffic too.
        self.exchanged = {k: list(v) for k, v in getattr(self, "_exchanged_start", {}).items()}
        self.window_bytes = 0

    def take_window_bytes(self) -> int:
        nbytes, self.window_bytes = self.window_bytes, 0
        return nbytes

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {k: (t.count, t.bytes) for k, t in self.updates.items()}

    def as_dict(self) -> dict:
        return {
            "updates": {k: [t.count, t.bytes] for k, t in sorted(self.updates.items())},
            "bookkeeping": {k: [t.count, t.bytes] for k, t in sorted(self.bookkeeping.items())},
            "discarded": {k: [t.count, t.bytes] for k, t in sorted(self.discarded.items()) if t.count},
            "calls": self.calls,
            "exchanged": {k: list(v) for k, v in sorted(self.exchanged.items())},
        }


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Collectives:
    """Issues collectives on the plan's groups, counting every one in the ledger."""

    def __init__(self, mesh: Mesh, ledger: Ledger, device: torch.device | None = None) -> None:
        self.mesh = mesh
        self.ledger = ledger
        self.device = device or torch.device("cpu")  # where bookkeeping tensors live (nccl: the GPU)

    # -- planned updates -----------------------------------------------------------------
    # With ``async_op=True`` the call returns a Pending to wait on (the ledger counts it at issue).

    def all_reduce(
        self, tensor: torch.Tensor, *, rule: str, parts: Sequence[tuple[str, int]] | str, async_op: bool = False
    ):
        parts = self.planned_parts(parts, nbytes(tensor))
        return self.issue_planned(
            "all_reduce", rule, parts, lambda g, a: dist.all_reduce(tensor, group=g, async_op=a), async_op=async_op
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        rule: str,
        parts: Sequence[tuple[str, int]] | str,
        async_op: bool = False,
    ):
        parts = self.planned_parts(parts, nbytes(input))
        return self.issue_planned(
            "reduce_scatter",
            rule,
            parts,
            lambda g, a: _reduce_scatter_flat(output, input, group=g, async_op=a),
            local=lambda: output.copy_(input),
            async_op=async_op,
        )

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        rule: str,
        parts: Sequence[tuple[str, int]] | str,
        async_op: bool = False,
    ):
        parts = self.planned_parts(parts, nbytes(output))
        return self.issue_planned(
            "all_gather",
            rule,
            parts,
            lambda g, a: _all_gather_flat(output, input, group=g, async_op=a),
            local=lambda: output.copy_(input),
            async_op=async_op,
        )

    # -- bookkeeping ---------------------------------------------------------------------

    def bookkeeping_all_reduce(
        self, tensor: torch.Tensor, *, rule: str, name: str, op=dist.ReduceOp.SUM, async_op: bool = False
    ):
        group = self.mesh.group(rule)
        self.ledger.record_bookkeeping(name, nbytes(tensor))
        if group.handle is None:
            return Pending(self, name, group, "bookkeeping", None) if async_op else None
        if async_op:
            work = self.guard(name, group, lambda: dist.all_reduce(tensor, op=op, group=group.handle, async_op=True))
            return Pending(self, name, group, "bookkeeping", work)
        self.guard(name, group, lambda: dist.all_reduce(tensor, op=op, group=group.handle))
        return None

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        rule: str,
        parts: str,
        nbytes: int,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        """``all_to_all_single`` with uneven splits (rows of dimension 0 to and from each rank of the
        group, in group order). Its data-dependent size cannot be the plan's ``payload_bytes``, so the
        caller states the bytes the update counts (``nbytes``); what actually crossed to and from the
        other ranks is tallied apart (``Ledger.exchanged``)."""
        group = self.mesh.group(rule)
        me = group.index_of(self.mesh.rank)
        row_in = input[0].numel() * input.element_size() if input.shape[0] else 0
        row_out = output[0].numel() * output.element_size() if output.shape[0] else 0
        sent = sum(n for i, n in enumerate(input_splits) if i != me) * row_in
        received = sum(n for i, n in enumerate(output_splits) if i != me) * row_out
        self.issue_planned(
            "all_to_all",
            rule,
            self.planned_parts(parts, nbytes),
            lambda g, a: dist.all_to_all_single(
                output, input, list(output_splits), list(input_splits), group=g, async_op=a
            ),
            local=lambda: output.copy_(input),
        )
        tally = self.ledger.exchanged.setdefault(parts, [0, 0, 0])
        tally[0] += 1
        tally[1] += sent
        tally[2] += received

    def bookkeeping_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        rule: str,
        name: str,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> None:
        """Rows of ``input`` to every rank of the group (equal splits unless given), in group order."""
        group = self.mesh.group(rule)
        self.ledger.record_bookkeeping(name, nbytes(input))
        if group.handle is None:
            output.copy_(input)
        else:
            outs = None if output_splits is None else list(output_splits)
            ins = None if input_splits is None else list(input_splits)
            self.guard(name, group, lambda: dist.all_to_all_single(output, input, outs, ins, group=group.handle))

    def bookkeeping_all_gather(self, output: torch.Tensor, input: torch.Tensor, *, rule: str, name: str) -> None:
        group = self.mesh.group(rule)
        self.ledger.record_bookkeeping(name, nbytes(output))
        if group.handle is None:
            output.copy_(input)
        else:
            self.guard(name, group, lambda: _all_gather_flat(output, input, group=group.handle))

    def bookkeeping_gather_object(self, obj: object, *, name: str) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        group = self.mesh.group("world")
        self.ledger.record_bookkeeping(name, 0)
        if group.handle is None:
            return [obj]
        out = [None] * group.size if self.mesh.rank == 0 else None
        self.guard(name, group, lambda: dist.gather_object(obj, out, dst=0, group=group.handle))
        return out

    def bookkeeping_broadcast(self, tensor: torch.Tensor, *, name: str, src: int = 0) -> None:
        group = self.mesh.group("world")
        self.ledger.record_bookkeeping(name, nbytes(tensor))
        if group.handle is not None:
            self.guard(name, group, lambda: dist.broadcast(tensor, src=src, group=group.handle))

    def barrier(self, name: str) -> None:
        group = self.mesh.group("world")
        self.ledger.record_bookkeeping(name, 0)
        if group.handle is not None:
            # A barrier as a one-element all_reduce: it honours the group's timeout on gloo.
            flag = torch.zeros(1, device=self.device)
            self.guard(name, group, lambda: dist.all_reduce(flag, group=group.handle))

    # -- building blocks (the collectives above, and callers with calls of their own) ----

    @staticmethod
    def planned_parts(parts: Sequence[tuple[str, int]] | str, total: int) -> Sequence[tuple[str, int]]:
        """``parts`` as (node id, bytes) pairs: one update's name carries the call's ``total``;
        the pairs of a coalesced call must add up to it."""
        if isinstance(parts, str):
            return ((parts, total),)
        if sum(n for _, n in parts) != total:
            raise PlanMismatch(
                f"a coalesced call of {total} bytes attributes {sum(n for _, n in parts)} bytes to its updates"
            )
        return parts

    def issue_planned(
        self, kind: str, rule: str, parts: Sequence[tuple[str, int]], issue, local=None, async_op: bool = False
    ):
        """Check ``parts`` against the plan, run ``issue(group_handle, async_op)`` on ``rule``'s group
        (``local()`` instead on a one-rank group), and count it; a Pending when ``async_op``."""
        self.ledger.check(kind, rule, parts)
        group = self.mesh.group(rule)
        what = parts[0][0] if len(parts) == 1 else f"{parts[0][0]} (+{len(parts) - 1} coalesced)"
        pending = None
        if group.handle is None:
            if local is not None:
                local()
        elif async_op:
            work = self.guard(what, group, lambda: issue(group.handle, True), kind=kind)
            pending = Pending(self, what, group, kind, work)
        else:
            self.guard(what, group, lambda: issue(group.handle, False), kind=kind)
        self.ledger.record(parts)
        if async_op:
            return pending or Pending(self, what, group, kind, None)
        return None

    def guard(self, what: str, group, call, kind: str = "bookkeeping"):
        """Run ``call()`` with ``what`` marked in flight; a failure or timeout becomes CollectiveFailed
        naming the collective and its group. Returns what ``call`` returns."""
        self.ledger.in_flight = f"{kind} {what!r} on group {group.rule} (ranks {', '.join(map(str, group.ranks))})"
        try:
            result = call()
        except Exception as exc:  # gloo/nccl raise RuntimeError (or DistBackendError) on timeouts and dead peers
            text = str(exc)
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()
            cause = "timed out" if timed_out else "failed"
            raise CollectiveFailed(
                f"rank {self.mesh.rank}: {self.ledger.in_flight} {cause}: "
                f"{text.splitlines()[0] if text else type(exc).__name__}",
                node_id=what,
                rule=group.rule,
                ranks=group.ranks,
                timed_out=timed_out,
            ) from exc
        self.ledger.in_flight = None
        return result


class Pending:
    """An issued asynchronous collective; ``wait`` fails like a synchronous one would."""

    def __init__(self, comm: Collectives, what: str, group, kind: str, work) -> None:
        self.comm, self.what, self.group, self.kind, self.work = comm, what, group, kind, work

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            self.comm.guard(self.what, self.group, work.wait, kind=self.kind)
