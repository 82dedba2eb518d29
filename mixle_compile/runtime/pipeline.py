"""Pipeline parallelism: the plan's stage programs, replayed literally on each rank.

Each rank is one pipeline stage (its ``pp`` coordinate) and holds the chunks the plan places on it
(runtime/pipeline_plan.py). Every chunk's parameters live in a ParamStore of their own, the same
store the non-pipelined session uses, and its blocks run through the same ParallelOps, so tensor
parallelism (with sequence parallelism), context parallelism, FSDP/HSDP, data parallelism and a
distributed optimizer issue the plan's collectives for that stage exactly as they do without a
pipeline. The rank walks its program, ``schedule.stages[s]`` expanded (lower/compact.py), op by op:

- ``forward`` (micro-batch, chunk): the chunk's units on the micro-batch's input (token ids on the
  first virtual stage, else the received activation, a leaf that requires its gradient); the last
  virtual stage ends with the micro-batch's mean loss;
- ``backward``: the scaled loss's backward (last virtual stage) or the chunk output's backward with
  the received gradient; the input's gradient is what the previous stage receives;
- ``send`` / ``recv`` (tag ``activation`` or ``activation_grad``): point-to-point transfers over
  the ``pp`` group of the local activation (``[s / cp, b, h]``: a context-parallel rank's two
  chunks of the sequence; ``s / cp / tp`` under sequence parallelism); the consecutive transfers of
  one ``batch`` are issued together and their receives awaited, as the plan batches them (sends are
  awaited at the end of the step, as torch's pipelining runtime does); each is counted as
  the plan's ``stage.A->B:activation`` (``/grad``) before it is issued;
- ``collective``: activation and parameter-gather updates are issued by the forward and backward
  they belong to; the gradient reductions of the step run at the first one (bucketed and started
  during the backward, as without a pipeline). Under FSDP with gradient accumulation a chunk's
  gradients are reduce-scattered as soon as its last backward of an accumulation step is done,
  because the next accumulation step's gradients go into the same buffers;
- ``optimizer``: the step (after checking that this stage received gradients).

A program covers every micro-step of an optimizer step (every accumulation step's micro-batches in
the data layout of runtime/data.py), and every micro-batch's loss is scaled by one over their number.
``train_batch`` collects the accumulation steps' batches and runs the program when the window is full.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from mixle_compile.contracts import TORCH_CAPABILITIES, StepReceipt
from mixle_compile.plan.document import PlanDocument
from mixle_compile.plan.programs import plan_programs
from mixle_compile.plan.vocabulary import Axis, UpdateId
from mixle_compile.runtime.collectives import Collectives, Ledger
from mixle_compile.runtime.errors import PlanMismatch
from mixle_compile.runtime.instructions import Instructions
from mixle_compile.runtime.mesh import Mesh
from mixle_compile.runtime.model import TransformerShape, cp_positions, stage_forward
from mixle_compile.runtime.ops import ParallelOps
from mixle_compile.runtime.parameters import ParamStore
from mixle_compile.runtime.pipeline_plan import activation_shape, check_pipeline
from mixle_compile.runtime.session import fsdp_units, make_optimizer, micro_batches
from mixle_compile.runtime.tensor_parallel import TensorParallel

PP = Axis.PP.value  # the group rule of the stage-boundary transfers
WORLD = "world"


class StageParameters:
    """The parameters of every chunk of this stage, by name, as runtime/checkpoint.py reads a session's
    store (``store.params``): a checkpoint holds global rectangles, so one saved under a pipeline
    resumes on any mesh of the same model, pipelined or not, and the other way round."""

    def __init__(self, stores: dict[int, ParamStore]) -> None:
        self.stores = stores
        self.params = {name: local for store in stores.values() for name, local in store.params.items()}

    def masters(self) -> list[torch.nn.Parameter]:
        return [local.master for local in self.params.values()]


class PipelineSession:
    """One rank's stage of a pipelined plan (see the module docstring). The worker's training loop
    drives it like a DistributedSession: ``train_batch`` per accumulation step, a receipt per step."""

    capabilities = TORCH_CAPABILITIES

    def __init__(
        self,
        doc: PlanDocument,
        instructions: Instructions,
        mesh: Mesh,
        *,
        device: torch.device,
        recorder=None,
        detach_received: bool = False,
    ) -> None:
        self.instructions = instructions
        self.plan = instructions.plan
        self.mesh = mesh
        self.device = device
        self.recorder = recorder
        self.layout = check_pipeline(doc, instructions)
        self.stage = mesh.coord(PP)
        self.pp = self.plan.pp
        self.program = list(plan_programs(doc.schedule, doc.updates)[self.stage])
        self.ledger = Ledger(instructions.collectives)
        self.comm = Collectives(mesh, self.ledger, device)
        self.shape = TransformerShape.from_spec(instructions.spec)
        self.act_shape = activation_shape(instructions)
        capture = recorder.capture if recorder is not None else None
        self.stores: dict[int, ParamStore] = {}
        self.ops: dict[int, ParallelOps] = {}
        for chunk in range(self.layout.chunks):
            names = set(self.layout.params.get((self.stage, chunk), ()))
            chunk_instructions = dataclasses.replace(
                instructions, params=tuple(p for p in instructions.params if p.name in names)
            )
            store = ParamStore(
                chunk_instructions,
                mesh,
                self.comm,
                device=device,
                capture=capture,
                units=fsdp_units(chunk_instructions),
            )
            # One TensorParallel per chunk: under cp its evidence capture reads its own chunk's positions.
            tp = TensorParallel(
                self.comm,
                mesh.degree(Axis.TP),
                mesh.coord(Axis.TP),
                instructions.sequence_parallel,
                capture=self._capture_activation if recorder is not None else None,
            )
            self.stores[chunk] = store
            self.ops[chunk] = ParallelOps(store, tp)
        self.sequence_parallel = instructions.sequence_parallel and mesh.degree(Axis.TP) > 1
        seq = instructions.seq_len or 1
        cp = mesh.degree(Axis.CP)
        self.positions = (
            cp_positions(seq, cp, mesh.coord(Axis.CP)) if cp > 1 else list(range(seq))
        )  # this rank's tokens
        self.store = StageParameters(self.stores)  # every chunk's parameters: what checkpoints save and load
        self.optimizer = make_optimizer(instructions.optimizer, self.store.masters(), instructions.learning_rate)
        self.detach_received = detach_received  # a deliberately broken variant, for the tests
        self._closing = self._closing_backwards()
        self.step = 0
        self.busy_s: list[float] = []  # per step: time inside forward and backward ops
        self.wall_s: list[float] = []  # per step: time running the program
        self.steps_without_gradient: list[int] = []  # steps in which no parameter of this rank got a gradient
        self.gradient_seen: dict[str, bool] = {name: False for store in self.stores.values() for name in store.params}
        self._batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._examples = self._tokens = 0
        self.ledger.begin_window()

    # -- the session protocol (as the worker's training loop uses it) --------------------------

    @property
    def data_rank(self) -> int:
        return self.mesh.data_rank

    @property
    def _accumulated(self) -> int:
        """Accumulation steps collected for the step not run yet (a checkpoint is refused while any are)."""
        return len(self._batches) // self.plan.microbatches

    def train_batch(self, inputs, targets) -> StepReceipt:
        plan = self.plan
        inputs, targets = torch.as_tensor(inputs, device=self.device), torch.as_tensor(targets, device=self.device)
        self._batches.extend(micro_batches(inputs, targets, plan.microbatches))
        if len(self._batches) < self.instructions.micro_steps:
            return self._receipt(
                loss=None,
                skipped=True,
                collective_bytes=0,
                counts=None,
                accumulated=len(self._batches) // plan.microbatches,
            )
        batches, self._batches = self._batches, []
        loss_sum = self._run_program(batches)
        examples = sum(int(x.shape[0]) for x, _ in batches)
        tokens = sum(int(y.numel()) for _, y in batches)
        # The step's loss lives on the last stage, the examples on every stage: one all_reduce over
        # the world, each quantity contributed once per data rank (the first tp and cp rank of its stage).
        first_tp = self.mesh.coord(Axis.TP) == 0 and self.mesh.coord(Axis.CP) == 0
        counts = torch.tensor(
            [
                loss_sum if first_tp and self.stage == self.pp - 1 else 0.0,
                float(examples) if first_tp and self.stage == 0 else 0.0,
                float(tokens) if first_tp and self.stage == 0 else 0.0,
            ],
            dtype=torch.float64,
            device=self.device,
        )
        self.comm.bookkeeping_all_reduce(counts, rule=WORLD, name="receipt:global-counts")
        self._examples, self._tokens = examples, tokens
        receipt = self._receipt(
            loss=float(counts[0]) / self.mesh.data_parallel_size,
            skipped=False,
            collective_bytes=self.ledger.take_window_bytes(),
            counts=(int(round(float(counts[1]))), int(round(float(counts[2])))),
            accumulated=plan.gradient_accumulation_steps,
        )
        self.step += 1
        self.ledger.begin_window()
        return receipt

    def stats(self) -> dict:
        """What the run report needs from this rank: its stage, compute and step times, gradients seen."""
        return {
            "stage": self.stage,
            "busy_s": list(self.busy_s),
            "wall_s": list(self.wall_s),
            "steps_without_gradient": list(self.steps_without_gradient),
            "parameters_without_gradient": sorted(n for n, seen in self.gradient_seen.items() if not seen),
            "parameters": len(self.gradient_seen),
        }

    # -- the program ----------------------------------------------------------------------------

    def _closing_backwards(self) -> dict[int, tuple[bool, bool]]:
        """Per backward op (its index in the program): does it end its chunk's accumulation step, the step?"""
        mb = self.plan.microbatches
        last_of_accumulation: dict[tuple[int, int], int] = {}
        last_of_step: dict[int, int] = {}
        for i, op in enumerate(self.program):
            if op.kind == "backward":
                last_of_accumulation[(op.chunk, op.microbatch // mb)] = i
                last_of_step[op.chunk] = i
        ends_accumulation = set(last_of_accumulation.values())
        ends_step = set(last_of_step.values())
        return {
            i: (i in ends_accumulation, i in ends_step) for i, op in enumerate(self.program) if op.kind == "backward"
        }

    def _run_program(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        start = time.perf_counter()
        busy = 0.0
        mb = self.plan.microbatches
        gas = self.plan.gradient_accumulation_steps
        scale = 1.0 / len(batches)
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._grads: dict[tuple[int, int], torch.Tensor] = {}
        loss_sum = 0.0
        pending: list = []
        self._sends_in_flight: list = []
        batch_id = object()
        last = self.layout.last_virtual
        reduced = False
        for index, op in enumerate(self.program):
            if op.kind in ("send", "recv"):
                if op.batch != batch_id:
                    self._wait(pending)
                    batch_id = op.batch
                pending.append(self._transfer(op))
                continue
            self._wait(pending)
            batch_id = object()
            if op.kind == "forward":
                key = (op.chunk, op.microbatch)
                v = self.layout.virtual(self.stage, op.chunk)
                store = self.stores[op.chunk]
                self._set_context(op.microbatch // mb, op.microbatch % mb)
                t0 = time.perf_counter()
                x_in, y = batches[op.microbatch]
                with store.saved_tensor_hooks():
                    out = stage_forward(
                        self.ops[op.chunk],
                        self.shape,
                        self.layout.layers.get((self.stage, op.chunk), ()),
                        first=v == 0,
                        last=v == last,
                        x=self._inputs.get(key),
                        inputs=x_in,
                        targets=y,
                    )
                store.end_micro_batch()
                self._outputs[key] = out
                if v == last:
                    loss_sum += float(out.detach()) * scale
                busy += time.perf_counter() - t0
            elif op.kind == "backward":
                key = (op.chunk, op.microbatch)
                v = self.layout.virtual(self.stage, op.chunk)
                store = self.stores[op.chunk]
                accumulation = op.microbatch // mb
                ends_accumulation, ends_step = self._closing[index]
                self._set_context(accumulation, op.microbatch % mb)
                t0 = time.perf_counter()
                store.closing_accumulation = ends_accumulation
                store.closing_step = ends_step
                out = self._outputs.pop(key)
                if v == last:
                    (out * scale).backward()
                else:
                    out.backward(self._grads.pop(key))
                store.end_micro_batch()
                if ends_accumulation and gas > 1:
                    self._set_context(accumulation, None)
                    store.reduce_gradients(every_accumulation=True, accumulations=(accumulation,))
                busy += time.perf_counter() - t0
            elif op.kind == "collective":
                c = self.instructions.collectives.get(op.name)
                if c is None:
                    raise PlanMismatch(
                        f"stage {self.stage}'s program names the collective {op.name!r}, which the plan does "
                        "not declare"
                    )
                if not reduced and c.phase == "gradient":
                    self._reduce_gradients(gas)
                    reduced = True
            elif op.kind == "optimizer":
                if not reduced:
                    self._reduce_gradients(gas)
                    reduced = True
                self._optimizer_step()
        self._wait(pending)
        for work, _op, _key, _tensor, group, node_id in self._sends_in_flight:
            self.comm.guard(node_id, group, work.wait, kind="p2p")
        self._sends_in_flight.clear()
        if self._outputs or self._grads or self._inputs:
            raise PlanMismatch(
                f"stage {self.stage}'s program left {len(self._outputs)} forward output(s), {len(self._grads)} "
                "received gradient(s) "
                f"and {len(self._inputs)} received activation(s) unused at the end of the step"
            )
        self.wall_s.append(time.perf_counter() - start)
        self.busy_s.append(busy)
        return loss_sum

    def _reduce_gradients(self, gas: int) -> None:
        self._set_context(None, None)
        for store in self.stores.values():
            store.reduce_gradients(every_accumulation=False, accumulations=tuple(range(gas)))

    def _optimizer_step(self) -> None:
        any_gradient = False
        for store in self.stores.values():
            for name, local in store.params.items():
                g = local.master.grad
                if g is not None and bool((g != 0).any()):
                    self.gradient_seen[name] = True
                    any_gradient = True
        if self.gradient_seen and not any_gradient:
            self.steps_without_gradient.append(self.step)
        self.optimizer.step()
        for store in self.stores.values():
            store.zero_grad()
            store.after_optimizer_step()

    # -- transfers ------------------------------------------------------------------------------

    def _transfer(self, op):
        key = (op.chunk, op.microbatch)
        grad = op.tag == "activation_grad"
        group = self.mesh.group(PP)
        peer_rank = group.ranks[op.peer]
        if op.kind == "send":
            src, dst = self.stage, op.peer
            if grad:
                x = self._inputs.pop(key)
                if x.grad is not None:
                    tensor = x.grad.contiguous()
                elif self.detach_received:
                    # What a runtime that lost the autograd edge sends: nothing useful, without error.
                    tensor = torch.zeros_like(x)
                else:
                    raise PlanMismatch(
                        f"stage {self.stage}: micro-batch {op.microbatch} of chunk {op.chunk} has no input "
                        "gradient to send back; "
                        "the received activation is not part of this stage's graph"
                    )
            else:
                tensor = self._outputs[key].detach().contiguous()
            if tuple(tensor.shape) != self.act_shape:
                raise PlanMismatch(
                    f"stage {self.stage} was about to send a {list(tensor.shape)} activation; the plan's "
                    f"transfers carry {list(self.act_shape)}"
                )
        else:
            src, dst = op.peer, self.stage
            tensor = torch.empty(self.act_shape, dtype=self.shape.compute_dtype, device=self.device)
            (self._grads if grad else self._inputs)[key] = tensor
        node_id = str(UpdateId.transfer(src, dst, backward=grad))
        parts = ((node_id, tensor.numel() * tensor.element_size()),)
        self.ledger.check("p2p", PP, parts)
        receiving_chunk = op.chunk if op.kind == "recv" else op.peer_chunk
        tag = (op.microbatch * self.layout.chunks + receiving_chunk) * 2 + int(grad)
        issue = dist.isend if op.kind == "send" else dist.irecv
        work = self.comm.guard(
            node_id, group, lambda: issue(tensor, peer_rank, group=group.handle, tag=tag), kind="p2p"
        )
        self.ledger.record(parts)
        return (work, op, key, tensor, group, node_id)

    def _wait(self, pending: list) -> None:
        """Wait for a batch's receives. Its sends are awaited at the end of the step (their tensors
        kept alive until then), as torch's pipelining runtime does: a send never blocks its stage."""
        for entry in pending:
            work, op, key, tensor, group, node_id = entry
            if op.kind != "recv":
                self._sends_in_flight.append(entry)
                continue
            self.comm.guard(node_id, group, work.wait, kind="p2p")
            v = self.layout.virtual(self.stage, op.chunk)
            if op.tag == "activation":
                # The received activation is a leaf of this stage's graph: without requires_grad the
                # backward would stop here and every earlier stage would get no gradient.
                self._inputs[key] = tensor.detach() if self.detach_received else tensor.requires_grad_(True)
                site = self.layout.boundary(v - 1)
            else:
                site = str(UpdateId.parse(self.layout.boundary(v)).backward())
            if self.recorder is not None:
                mb = self.plan.microbatches
                self._set_context(op.microbatch // mb, op.microbatch % mb)
                self.recorder.capture(node_id, tensor, self._boundary_expect(site, tensor))
        pending.clear()

    # -- evidence -------------------------------------------------------------------------------

    def _set_context(self, accumulation, micro) -> None:
        if self.recorder is not None:
            self.recorder.context = (self.step, accumulation, micro)

    def _boundary_expect(self, site: str, tensor: torch.Tensor) -> tuple:
        """What a received activation (or gradient) equals in global terms: the residual stream at
        ``site``, at this rank's positions (cp), its tensor-parallel sequence shard (sequence parallel)."""
        positions = self.positions
        if self.sequence_parallel:
            n, r = tensor.shape[0], self.mesh.coord(Axis.TP)
            positions = positions[r * n : (r + 1) * n]
        if self.mesh.degree(Axis.CP) > 1:
            return ("act_at", site, self.mesh.data_rank, (), (0, tuple(positions)))
        return (
            "act",
            site,
            self.mesh.data_rank,
            ((0, positions[0], positions[-1] + 1),) if self.sequence_parallel else (),
        )

    def _capture_activation(self, node_id: str, tensor: torch.Tensor, seq_sharded: bool) -> None:
        slices = ()
        if seq_sharded:
            n, r = tensor.shape[0], self.mesh.coord(Axis.TP)
            slices = ((0, r * n, (r + 1) * n),)
        self.recorder.capture(node_id, tensor, ("act", node_id, self.mesh.data_rank, slices))

    def _receipt(self, *, loss, skipped: bool, collective_bytes: int, counts, accumulated: int) -> StepReceipt:
        return StepReceipt(
            step=self.step,
            loss=loss,
            local_examples=0 if skipped else self._examples,
            local_tokens=0 if skipped else self._tokens,
            microbatches=self.plan.microbatches,
            accumulation_steps=max(1, accumulated),
            data_parallel_size=self.plan.data_parallel_size,
            optimizer=self.instructions.optimizer,
            precision=self.instructions.precision,
            collective_bytes=collective_bytes,
            skipped=skipped,
            extra={"rank": self.mesh.rank, "collective_calls": self.ledger.calls, "stage": self.stage},
            global_examples_observed=None if counts is None else counts[0],
            global_tokens_observed=None if counts is None else counts[1],
        )
