"""Each rank's parameters, materialised from the plan's layouts: uses, FSDP gathers, gradient buffers.

Values are defined in global coordinates: every parameter's whole tensor follows from the seed and
its name alone, and a rank keeps the slice its layout gives it (the tensor-parallel slice, then the
dimension-0 shard over the data axes, padded to equal shards as FSDP does). So any plan of the same
spec starts from the same model, and the single-process reference starts from it too.

Every use of a parameter goes through one autograd Function that routes the gradient of that use
into an fp32 buffer of its own. Tied weights on one stage are one tensor with two uses, and the
plan reduces each use's gradient with its own updates; the reduced results add up in the tensor's
gradient (the reductions themselves are in reductions.py).

FSDP (``fsdp`` mode) follows the plan's updates literally: a parameter is all-gathered before its
forward use (``:param/gather-forward``), freed when its unit (a transformer block) ends, gathered
again when the backward reaches that unit (``:param/gather-backward``), and its gradient is
reduce-scattered every accumulation step. Freeing works through saved-tensor hooks: autograd saves
a small handle in place of a gathered weight, and the handle resolves to the regathered one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.autograd import Function

from mixle_compile.plan.vocabulary import EXPERT_DATA, Axis, UpdateId, rule_name
from mixle_compile.runtime.collectives import Collectives
from mixle_compile.runtime.errors import PlanMismatch
from mixle_compile.runtime.instructions import Instructions, ParamInstruction
from mixle_compile.runtime.mesh import Mesh
from mixle_compile.runtime.reductions import GradientReducer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# capture(node_id, tensor, expect): records an update's result as numerical evidence.
Capture = Callable[[str, torch.Tensor, tuple], None]


def parameter_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(p: ParamInstruction, seed: int) -> torch.Tensor:
    """The whole (global) initial tensor of a parameter, in fp32."""
    shape = p.global_shape
    if p.role == "norm" or p.name.endswith("norm.weight"):
        return torch.ones(shape)
    if p.role == "bias":
        return torch.zeros(shape)
    # A copy of a tied weight on another pipeline stage starts as the weight itself.
    generator = torch.Generator().manual_seed(parameter_seed(seed, p.canonical))
    return torch.randn(shape, generator=generator) * 0.02


def tp_slice(p: ParamInstruction, tp: int, tp_rank: int) -> tuple[tuple[int, int, int], ...]:
    """``(dim, start, stop)`` of this rank's tensor-parallel slice (none when replicated over tp).

    A KV head shared by ``tp_replicas`` ranks: the tensor splits into tp / tp_replicas heads' rows
    and rank ``t`` holds head ``t // tp_replicas``."""
    if p.tp_dim is None or tp == 1:
        return ()
    pieces = tp // p.tp_replicas
    n = p.global_shape[p.tp_dim] // pieces
    index = tp_rank // p.tp_replicas
    return ((p.tp_dim, index * n, (index + 1) * n),)


def ep_slice(p: ParamInstruction, mesh: Mesh) -> tuple[tuple[int, int, int], ...]:
    """``(dim, start, stop)`` of this rank's experts (an expert weight split over the ep group), or none."""
    if p.ep_dim is None:
        return ()
    group = mesh.group(Axis.EP.value)
    n = p.global_shape[p.ep_dim] // group.size
    index = group.index_of(mesh.rank)
    return ((p.ep_dim, index * n, (index + 1) * n),)


def apply_slices(t: torch.Tensor, slices: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
    for dim, start, stop in slices:
        t = t.narrow(dim, start, stop - start)
    return t


def _context_parts(capture: Capture | None, instructions: Instructions, mesh: Mesh) -> Capture | None:
    """Under context parallelism a gradient reduced over tp (or a KV-replica group) but not yet over
    cp holds only this cp rank's tokens' part: its record says so, naming the cp group, and the
    evidence compares the sum of the group's parts with the reference (see reference.compare)."""
    if capture is None or mesh.degree(Axis.CP) == 1:
        return capture
    group = mesh.group(Axis.CP.value).ranks
    partial: set[str] = set()
    for p in instructions.params:
        for c in p.gradient:
            if Axis.CP in c.axes or EXPERT_DATA in c.axes:  # the expert-data group holds the cp ranks
                break
            partial.add(c.node_id)

    def record(node_id: str, tensor: torch.Tensor, expect: tuple) -> None:
        if expect[0] == "grad" and node_id in partial:
            expect = ("part", group, expect)
        capture(node_id, tensor, expect)

    return record


@dataclass(frozen=True)
class _Handle:
    """What autograd saves in place of a gathered weight."""

    use: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class LocalParameter:
    """One tensor of this rank (tied uses share it)."""

    def __init__(
        self,
        instr: ParamInstruction,
        uses: list[ParamInstruction],
        value: torch.Tensor,
        mesh: Mesh,
        device: torch.device,
    ) -> None:
        self.instr = instr
        self.uses = uses
        self.mode = instr.mode
        self.dtype = DTYPES.get(instr.dtype, torch.float32)
        self.tp_slices = tp_slice(instr, mesh.degree(Axis.TP), mesh.coord(Axis.TP)) + ep_slice(instr, mesh)
        full = apply_slices(value, self.tp_slices)
        self.full_shape = tuple(full.shape)
        self.rows = self.full_shape[0] if self.full_shape else 1
        if self.mode in ("fsdp", "zero"):
            self.shard_rule = rule_name(instr.shard_axes)
            group = mesh.group(self.shard_rule)
            self.shard_count = group.size
            self.shard_index = group.index_of(mesh.rank)
            self.shard_rows = math.ceil(self.rows / self.shard_count)
            padded = torch.zeros((self.shard_rows * self.shard_count, *self.full_shape[1:]))
            padded[: self.rows] = full
            shard = padded[self.shard_index * self.shard_rows : (self.shard_index + 1) * self.shard_rows]
            self.master = torch.nn.Parameter(shard.clone().to(device))
        else:
            self.shard_rule, self.shard_count, self.shard_index, self.shard_rows = "", 1, 0, self.rows
            self.master = torch.nn.Parameter(full.clone().to(device))
        # zero: the whole tensor every rank computes with (the optimizer updates only the shard)
        self.compute = (
            full.to(device=device, dtype=self.dtype, copy=True).requires_grad_(True) if self.mode == "zero" else None
        )

    @property
    def sharded(self) -> bool:
        return self.mode in ("fsdp", "zero")

    @property
    def valid_shard_rows(self) -> int:
        return max(0, min(self.shard_rows, self.rows - self.shard_index * self.shard_rows))

    def shard_slices(self) -> tuple[tuple[int, int, int], ...]:
        start = self.shard_index * self.shard_rows
        return self.tp_slices + ((0, start, start + self.valid_shard_rows),)

    def gathered_shape(self) -> tuple[int, ...]:
        return (self.shard_rows * self.shard_count, *self.full_shape[1:])

    def gathered_numel(self) -> int:
        return math.prod(self.gathered_shape())

    def shard_numel(self) -> int:
        return self.shard_rows * math.prod(self.full_shape[1:])

    def buffer_numel(self) -> int:
        return math.prod(self.buffer_shape())

    def buffer_shape(self) -> tuple[int, ...]:
        return self.gathered_shape() if self.sharded else self.full_shape


class ParamStore:
    """This rank's parameters: uses, gathers, gradient buffers and the plan's reductions."""

    def __init__(
        self,
        instructions: Instructions,
        mesh: Mesh,
        comm: Collectives | None,
        *,
        device: torch.device,
        values: Mapping[str, torch.Tensor] | None = None,
        capture: Capture | None = None,
        units: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.instructions = instructions
        self.mesh = mesh
        self.comm = comm
        self.device = device
        self.capture = capture
        self.params: dict[str, LocalParameter] = {}
        self.of_use: dict[str, LocalParameter] = {}
        self.use_instr: dict[str, ParamInstruction] = {p.name: p for p in instructions.params}
        uses: dict[str, list[ParamInstruction]] = {}
        for p in instructions.params:
            uses.setdefault(p.tensor_owner, []).append(p)
        for p in instructions.params:
            if p.tied_to is not None:
                continue
            value = values[p.name] if values is not None else initial_value(p, instructions.seed)
            if tuple(value.shape) != p.global_shape:
                raise ValueError(
                    f"the initial value of {p.name!r} has shape {tuple(value.shape)}, the plan says {p.global_shape}"
                )
            local = LocalParameter(p, uses[p.name], value.detach().float().cpu(), mesh, device)
            self.params[p.name] = local
            for u in uses[p.name]:
                self.of_use[u.name] = local
        self.plan_order = [(p, self.of_use[p.name]) for p in instructions.params]
        # The first use of a tensor tied on this stage -> every use whose gradient it reduces; its
        # reduction starts once all of them brought their window's last gradient (``_waiting``).
        self._folded_into: dict[str, tuple[str, ...]] = {}
        for p in instructions.params:
            if p.folded:
                self._folded_into[p.tied_to] = (*self._folded_into.get(p.tied_to, (p.tied_to,)), p.name)
        self._waiting: dict[str, set[str]] = {}
        # FSDP units: the weights gathered together, freed together, regathered together.
        self.units = {
            unit: tuple(u for u in members if self.of_use[u].mode == "fsdp") for unit, members in (units or {}).items()
        }
        self.unit_order = [unit for unit, members in self.units.items() if members]
        self.buffers: dict[str, torch.Tensor] = {}
        self.reducer = (
            GradientReducer(mesh, comm, device, _context_parts(capture, instructions, mesh))
            if comm is not None
            else None
        )
        self.closing_accumulation = False  # the micro-batch in flight ends an accumulation step
        self.closing_step = False  # ... and the optimizer step's window
        self._gathers: dict[tuple[str, str], list] = {}  # issued (maybe in flight) unit gathers
        self._gathered: set[tuple[str, str]] = set()  # unit gathers done in this micro-batch
        # The units being run forward, innermost last: a multi-token prediction depth's unit runs
        # inside the head's, whose weights (the output head, the embedding copy) every depth reads.
        self._units: list[str] = []
        self._held: dict[str, torch.Tensor] = {}  # gathered weights of the unit being run forward
        self._live: dict[int, str] = {}  # storage address -> use, for the saved-tensor hooks
        self._cache: dict[str, torch.Tensor] = {}  # regathered weights of units in backward
        self._unit_uses: dict[str, list[str]] = {}

    # -- the optimizer's view ------------------------------------------------------------

    def masters(self) -> list[torch.nn.Parameter]:
        return [p.master for p in self.params.values()]

    # -- uses (forward) --------------------------------------------------------------------

    def weight(self, use: str) -> torch.Tensor:
        local = self.of_use.get(use)
        if local is None:
            raise KeyError(f"the model uses a parameter {use!r} that the plan does not list")
        if local.mode == "fsdp":
            if use not in self._held:
                self._hold(use, self._gather_one(use, "forward"))
            return _GatheredUse.apply(local.master, self, use)
        source = local.compute if local.mode == "zero" else local.master
        return _LocalUse.apply(source, self, use)

    def _gather_one(self, use: str, phase: str) -> torch.Tensor:
        return self._collect(self._issue([use], phase, async_op=False))[use]

    def _issue(self, members, phase: str, *, async_op: bool) -> list:
        """Start the all_gathers of ``members`` (one call per shard group and dtype)."""
        groups: dict[tuple, list[str]] = {}
        for use in members:
            local = self.of_use[use]
            groups.setdefault((local.shard_rule, local.dtype), []).append(use)
        issued = []
        for (rule, dtype), uses in groups.items():
            locals_ = [self.of_use[u] for u in uses]
            count = locals_[0].shard_count
            shards = [local.master.detach().to(dtype).reshape(-1) for local in locals_]
            flat = shards[0] if len(shards) == 1 else torch.cat(shards)
            out = torch.empty(flat.numel() * count, dtype=dtype, device=self.device)
            parts = [
                (str(UpdateId.gather(u, phase)), local.gathered_numel() * out.element_size())
                for u, local in zip(uses, locals_, strict=True)
            ]
            pending = self.comm.all_gather(out, flat, rule=rule, parts=parts, async_op=async_op)
            issued.append((uses, out, pending, count, phase))
        return issued

    def _collect(self, issued: list) -> dict[str, torch.Tensor]:
        out_map = {}
        for uses, out, pending, count, phase in issued:
            if pending is not None:
                pending.wait()
            rows = out.view(count, -1)
            offset = 0
            for use in uses:
                local = self.of_use[use]
                n = local.shard_numel()
                whole = rows[:, offset : offset + n].reshape(local.gathered_shape())[: local.rows]
                offset += n
                out_map[use] = whole
                if self.capture is not None:
                    self.capture(
                        str(UpdateId.gather(use, phase)), whole, ("param", use, local.tp_slices, str(local.dtype))
                    )
        return out_map

    def _unit_gather(self, unit: str, phase: str) -> dict[str, torch.Tensor]:
        issued = self._gathers.pop((unit, phase), None)
        if issued is None:
            issued = self._issue(self.units[unit], phase, async_op=False)
        self._gathered.add((unit, phase))
        return self._collect(issued)

    def _prefetch(self, unit: str | None, phase: str) -> None:
        if unit is not None and (unit, phase) not in self._gathers and (unit, phase) not in self._gathered:
            self._gathers[(unit, phase)] = self._issue(self.units[unit], phase, async_op=True)

    def _neighbour(self, unit: str, step: int) -> str | None:
        if unit not in self.unit_order:
            return None
        i = self.unit_order.index(unit) + step
        return self.unit_order[i] if 0 <= i < len(self.unit_order) else None

    def accumulate(self, use: str, grad: torch.Tensor) -> None:
        local = self.of_use[use]
        arriving, instr = use, self.use_instr[use]
        if instr.folded:  # a tied use: its gradient joins the first use's, which is reduced for both
            use = instr.tied_to
            instr = self.use_instr[use]
        buffer = self.buffers.get(use)
        if buffer is None:
            shape = local.buffer_shape()
            if tuple(grad.shape) == shape and grad.dtype == torch.float32 and grad.is_contiguous():
                # The engine hands the gradient over and keeps no use of it: adopt it as the buffer.
                buffer = grad.detach()
            elif tuple(grad.shape) == shape:
                buffer = grad.to(torch.float32, copy=True)
            else:
                buffer = torch.zeros(shape, dtype=torch.float32, device=self.device)
                buffer[: local.rows].add_(grad)
            self.buffers[use] = buffer
        else:
            buffer[: local.rows].add_(grad)
        closing = self.closing_accumulation if instr.reduce_every_accumulation else self.closing_step
        if closing and self.reducer is not None:
            waiting = self._waiting.setdefault(use, set(self._folded_into.get(use, ())))
            waiting.discard(arriving)
            if not waiting:  # every use of the tensor has brought its last gradient of the window
                del self._waiting[use]
                self.reducer.use_ready(instr, local, self.buffers)

    # -- units: free after forward, regather for backward ---------------------------------

    def unit_begin(self, unit: str, x: torch.Tensor | None) -> torch.Tensor | None:
        self._units.append(unit)
        self._unit_uses[unit] = []
        if self.units.get(unit):
            for use, whole in self._unit_gather(unit, "forward").items():
                self._hold(use, whole)
            self._prefetch(self._neighbour(unit, +1), "forward")
        if x is not None and x.requires_grad and self._unit_uses[unit]:
            x = _UnitInput.apply(x, self, unit)
        return x

    def unit_end(self, unit: str, y: torch.Tensor) -> torch.Tensor:
        uses = self._unit_uses.get(unit, [])
        for use in uses:
            whole = self._held.pop(use, None)
            if whole is not None:
                self._live.pop(whole.untyped_storage().data_ptr(), None)
        if not self._units or self._units[-1] != unit:
            raise PlanMismatch(f"unit {unit!r} ends while {self._units[-1:] or 'none'} is the innermost one running")
        self._units.pop()
        if uses and y.requires_grad:
            y = _UnitOutput.apply(y, self, unit)
        return y

    def _hold(self, use: str, whole: torch.Tensor) -> None:
        self._held[use] = whole
        self._live[whole.untyped_storage().data_ptr()] = use
        if self._units:
            self._unit_uses[self._units[-1]].append(use)

    def regather_unit(self, unit: str) -> None:
        if self.units.get(unit):
            self._cache.update(self._unit_gather(unit, "backward"))
            self._prefetch(self._neighbour(unit, -1), "backward")
        else:
            for use in self._unit_uses.get(unit, []):
                self._cache[use] = self._gather_one(use, "backward")

    def release_unit(self, unit: str) -> None:
        for use in self._unit_uses.get(unit, []):
            self._cache.pop(use, None)

    def saved_tensor_hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if self._live:
            use = self._live.get(t.untyped_storage().data_ptr())
            if use is not None:
                return _Handle(use, t.size(), t.stride(), t.storage_offset())
        return t

    def _unpack(self, saved):
        if isinstance(saved, _Handle):
            whole = self._cache.get(saved.use)
            if whole is None:
                raise PlanMismatch(
                    f"the backward needs {saved.use!r} outside the unit that gathered it; the plan gathers a "
                    "weight again "
                    "only when the backward reaches its unit"
                )
            return whole.as_strided(saved.size, saved.stride, saved.offset)
        return saved

    def end_micro_batch(self) -> None:
        for issued in self._gathers.values():  # a prefetch nobody used still completes on every rank
            self._collect(issued)
        self._gathers.clear()
        self._gathered.clear()
        self._cache.clear()
        self._held.clear()
        self._live.clear()
        self._unit_uses.clear()
        self._units.clear()

    # -- gradient reductions ---------------------------------------------------------------

    def reduce_gradients(self, *, every_accumulation: bool, accumulations: tuple[int, ...]) -> None:
        """Run the plan's gradient updates due now, and add the results to the tensors' gradients."""
        self._waiting.clear()
        results = self.reducer.finish(
            every_accumulation=every_accumulation,
            accumulations=accumulations,
            uses=self.plan_order,
            buffers=self.buffers,
        )
        for _, local, grad in results:
            if local.master.grad is None:
                local.master.grad = grad
            else:
                local.master.grad.add_(grad)

    def after_optimizer_step(self) -> None:
        """The distributed optimizer's gathers: every rank computes with the updated whole tensor."""
        # (a tensor tied on one stage is gathered once, by its first use)
        members = [
            (use, local)
            for local in self.params.values()
            if local.mode == "zero"
            for use in local.uses
            if "parameter" in use.gathers
        ]
        if not members:
            return
        groups: dict[tuple, list] = {}
        for use, local in members:
            groups.setdefault((use.gathers["parameter"].rule, local.dtype), []).append((use, local))
        for (rule, dtype), group in groups.items():
            count = group[0][1].shard_count
            flat = torch.cat([local.master.detach().to(dtype).reshape(-1) for _, local in group])
            out = torch.empty(flat.numel() * count, dtype=dtype, device=self.device)
            parts = [
                (use.gathers["parameter"].node_id, local.gathered_numel() * out.element_size()) for use, local in group
            ]
            self.comm.all_gather(out, flat, rule=rule, parts=parts)
            rows = out.view(count, -1)
            offset = 0
            for use, local in group:
                n = local.shard_numel()
                whole = rows[:, offset : offset + n].reshape(local.gathered_shape())[: local.rows]
                offset += n
                with torch.no_grad():
                    local.compute.copy_(whole)
                if self.capture is not None:
                    self.capture(
                        use.gathers["parameter"].node_id,
                        whole,
                        ("param_after", use.name, local.tp_slices, str(local.dtype)),
                    )

    def zero_grad(self) -> None:
        self.buffers.clear()
        self._waiting.clear()
        for local in self.params.values():
            local.master.grad = None

    def discard(self) -> None:
        if self.reducer is not None:
            self.reducer.discard()
        self.zero_grad()


class _GatheredUse(Function):
    """A use of an FSDP parameter: all_gather in the forward, gradient into the use's buffer."""

    @staticmethod
    def forward(ctx, master, store: ParamStore, use: str):
        ctx.store, ctx.use = store, use
        return store._held[use]

    @staticmethod
    def backward(ctx, grad):
        ctx.store.accumulate(ctx.use, grad)
        return None, None, None


class _LocalUse(Function):
    """A use of a parameter every rank holds whole: its gradient goes into the use's buffer."""

    @staticmethod
    def forward(ctx, source, store: ParamStore, use: str):
        ctx.store, ctx.use = store, use
        dtype = store.of_use[use].dtype
        return source.to(dtype) if source.dtype != dtype else source.view_as(source)

    @staticmethod
    def backward(ctx, grad):
        ctx.store.accumulate(ctx.use, grad)
        return None, None, None


class _UnitOutput(Function):
    """Backward reaches the unit: gather its FSDP weights again."""

    @staticmethod
    def forward(ctx, y, store: ParamStore, unit: str):
        ctx.store, ctx.unit = store, unit
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.store.regather_unit(ctx.unit)
        return grad, None, None


class _UnitInput(Function):
    """Backward leaves the unit: free its regathered weights."""

    @staticmethod
    def forward(ctx, x, store: ParamStore, unit: str):
        ctx.store, ctx.unit = store, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.store.release_unit(ctx.unit)
        return grad, None, None
