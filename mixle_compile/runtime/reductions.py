"""The plan's gradient reductions, bucketed and overlapped with the backward.

Each use of a parameter has a chain of gradient updates in the plan (for example HSDP:
reduce_scatter over dp_shard, then all_reduce over dp_replicate, dividing by the data-parallel
size). Uses whose chains are identical (same collectives, groups and divisors) share buckets: as
soon as a use's last gradient of the window arrives in the backward it joins the open bucket, and
a full bucket starts its first collective asynchronously while the backward goes on, as DDP and
FSDP2 do. When the window closes, each bucket waits for its first collective, runs the rest of its
chain, and hands every member its reduced gradient (a shard after a reduce_scatter).

Buckets are cut by the order gradients arrive, which is the same on every rank of a group (the
same graph is differentiated in the same order), so every rank issues the same calls. Every call
carries its members' updates as coalesced parts, so accounting and evidence stay per update.

Layouts of a bucket's flat tensor: ``full`` is the members' whole gradient buffers one after the
other; a reduce_scatter needs its input rank-major (rank 0's rows of every member, then rank 1's,
...), and its output, the ``shard`` layout, is the members' shards one after the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mixle_compile.runtime.collectives import Collectives, Pending
from mixle_compile.runtime.errors import PlanMismatch
from mixle_compile.runtime.instructions import ParamInstruction
from mixle_compile.runtime.mesh import Mesh

BUCKET_BYTES = 8 << 20  # a bucket starts its collective once its members hold this many bytes
FIRST_BUCKET_BYTES = 1 << 20  # ... the window's first bucket sooner, so communication starts early


def chain_signature(use: ParamInstruction) -> tuple:
    return tuple((c.collective, c.rule, c.divisor) for c in use.gradient)


@dataclass
class Bucket:
    every_accumulation: bool
    signature: tuple
    members: list = field(default_factory=list)  # (use, local) pairs
    nbytes: int = 0
    flat: torch.Tensor | None = None
    layout: str = "full"
    stage: int = 0  # chain stages issued
    processed: int = 0  # chain stages whose result was divided and recorded
    pending: Pending | None = None


class GradientReducer:
    def __init__(self, mesh: Mesh, comm: Collectives, device: torch.device, capture: Callable | None) -> None:
        self.mesh = mesh
        self.comm = comm
        self.device = device
        self.capture = capture
        self.open: dict[tuple, Bucket] = {}
        self.issued: list[Bucket] = []
        self.ready: set[str] = set()

    # -- during the backward -----------------------------------------------------------------

    def use_ready(self, use: ParamInstruction, local, buffers: dict) -> None:
        """``use`` got its last gradient of the window: bucket it, and start full buckets."""
        self.ready.add(use.name)
        if not use.gradient:
            return
        key = (use.reduce_every_accumulation, chain_signature(use))
        bucket = self.open.get(key)
        if bucket is None:
            bucket = self.open[key] = Bucket(use.reduce_every_accumulation, key[1])
        bucket.members.append((use, local))
        bucket.nbytes += buffers[use.name].numel() * 4
        if bucket.nbytes >= (BUCKET_BYTES if self.issued else FIRST_BUCKET_BYTES):
            del self.open[key]
            self._start(bucket, buffers, async_op=True)

    # -- when the window closes -----------------------------------------------------------------

    def finish(self, *, every_accumulation: bool, accumulations: tuple[int, ...], uses, buffers: dict) -> list:
        """Run every due chain to the end; returns ``(use, local, reduced gradient)`` for every due use."""
        for key in [k for k in self.open if k[0] == every_accumulation]:
            self._start(self.open.pop(key), buffers, async_op=True)
        # Uses whose last gradient never arrived (unused in the forward, or a window closed early) are
        # reduced now, bucketed in plan order so that every rank still makes the same calls.
        for use, local in uses:
            if use.reduce_every_accumulation != every_accumulation or use.name in self.ready or use.folded:
                continue
            if use.name not in buffers:
                buffers[use.name] = torch.zeros(local.buffer_shape(), dtype=torch.float32, device=self.device)
            self.use_ready(use, local, buffers)
        for key in [k for k in self.open if k[0] == every_accumulation]:
            self._start(self.open.pop(key), buffers, async_op=False)
        done = [b for b in self.issued if b.every_accumulation == every_accumulation]
        self.issued = [b for b in self.issued if b.every_accumulation != every_accumulation]
        results = []
        for bucket in done:
            if bucket.pending is not None:
                bucket.pending.wait()
                bucket.pending = None
            while bucket.processed < bucket.stage:
                self._after_stage(bucket, accumulations)
            while bucket.stage < len(bucket.signature):
                self._stage(bucket, async_op=False)
                self._after_stage(bucket, accumulations)
            results.extend(self._split(bucket, buffers))
        if not every_accumulation:
            # No reduction planned (nothing differs between ranks holding it): the local gradient is final.
            for use, local in uses:
                if not use.gradient and not use.folded:  # (a folded use's gradient is in its tensor's first use's)
                    buffer = buffers.pop(use.name, None)
                    if buffer is None:
                        buffer = torch.zeros(local.buffer_shape(), dtype=torch.float32, device=self.device)
                    results.append((use, local, buffer.view(local.buffer_shape())[: local.rows]))
        for use, _ in uses:
            if use.reduce_every_accumulation == every_accumulation:
                self.ready.discard(use.name)
        return results

    def discard(self) -> None:
        for bucket in self.issued:
            if bucket.pending is not None:
                bucket.pending.wait()
        self.open.clear()
        self.issued.clear()
        self.ready.clear()

    # -- internals -------------------------------------------------------------------------

    def _start(self, bucket: Bucket, buffers: dict, *, async_op: bool) -> None:
        flats = [buffers[use.name].reshape(-1) for use, _ in bucket.members]
        # A lone member reduces in place: its buffer gets no more gradient in this window.
        bucket.flat = flats[0] if len(flats) == 1 else torch.cat(flats)
        bucket.layout = "full"
        self.issued.append(bucket)
        if bucket.signature:
            self._stage(bucket, async_op=async_op)

    def _stage(self, bucket: Bucket, *, async_op: bool) -> None:
        kind, rule, _ = bucket.signature[bucket.stage]
        chains = [use.gradient[bucket.stage] for use, _ in bucket.members]
        if kind == "all_reduce":
            sizes = self._sizes(bucket)
            parts = [(c.node_id, n * 4) for c, n in zip(chains, sizes, strict=True)]
            pending = self.comm.all_reduce(bucket.flat, rule=rule, parts=parts, async_op=async_op)
        elif kind == "reduce_scatter":
            if bucket.layout != "full" or not all(local.sharded for _, local in bucket.members):
                raise PlanMismatch(f"{chains[0].node_id}: a reduce_scatter of a gradient the runtime does not shard")
            count = bucket.members[0][1].shard_count
            if len(bucket.members) == 1:
                source = bucket.flat  # one padded buffer is rank-major already
            else:
                rows = []
                offset = 0
                for _, local in bucket.members:
                    n = local.gathered_numel()
                    rows.append(bucket.flat[offset : offset + n].view(count, -1))
                    offset += n
                source = torch.cat([part[r] for r in range(count) for part in rows])
            out = source.new_empty(source.numel() // count)
            parts = [
                (c.node_id, local.gathered_numel() * 4) for c, (_, local) in zip(chains, bucket.members, strict=True)
            ]
            pending = self.comm.reduce_scatter(out, source, rule=rule, parts=parts, async_op=async_op)
            bucket.flat, bucket.layout = out, "shard"
        else:
            raise PlanMismatch(
                f"{chains[0].node_id}: the runtime reduces gradients with all_reduce and reduce_scatter, not {kind}"
            )
        bucket.stage += 1
        bucket.pending = pending if async_op else None

    def _sizes(self, bucket: Bucket) -> list[int]:
        if bucket.layout == "shard":
            return [local.shard_numel() for _, local in bucket.members]
        return [local.buffer_numel() for _, local in bucket.members]

    def _after_stage(self, bucket: Bucket, accumulations: tuple[int, ...]) -> None:
        """Apply a finished stage's divisor, and record each member's result as evidence."""
        stage = bucket.processed
        bucket.processed += 1
        divisor = bucket.signature[stage][2]
        if divisor != 1:
            bucket.flat.div_(divisor)
        if self.capture is None:
            return
        reduced: set[str] = set()
        total = 1
        for _, rule, d in bucket.signature[: stage + 1]:
            reduced |= set(rule.split("+"))
            total *= d
        data_ranks = self.mesh.data_ranks_sharing(tuple(reduced))
        offset = 0
        for (use, local), n in zip(bucket.members, self._sizes(bucket), strict=True):
            piece = bucket.flat[offset : offset + n]
            offset += n
            if bucket.layout == "shard":
                shown, slices = (
                    piece.view(local.shard_rows, *local.full_shape[1:])[: local.valid_shard_rows],
                    local.shard_slices(),
                )
            else:
                shown, slices = piece.view(local.buffer_shape())[: local.rows], local.tp_slices
            # Tied uses: the copies of a weight on several stages (the chain's first all_reduce sums
            # them), or the uses of one tensor on this stage (added up before the chain).
            uses = use.tied_uses or use.name
            self.capture(use.gradient[stage].node_id, shown, ("grad", uses, data_ranks, accumulations, total, slices))

    def _split(self, bucket: Bucket, buffers: dict) -> list:
        out = []
        offset = 0
        for (use, local), n in zip(bucket.members, self._sizes(bucket), strict=True):
            piece = bucket.flat[offset : offset + n]
            offset += n
            if bucket.layout == "shard":
                grad = piece.view(local.shard_rows, *local.full_shape[1:])
            elif local.sharded:
                start = local.shard_index * local.shard_rows
                grad = piece.view(local.gathered_shape())[start : start + local.shard_rows]
            else:
                grad = piece.view(local.full_shape)
            out.append((use, local, grad))
            buffers.pop(use.name, None)
        return out
