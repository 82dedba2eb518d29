"""Pipeline parallelism: the plan's stage programs, replayed literally.

Each rank is one pipeline stage (its ``pp`` coordinate). A stage holds the parameters the plan
places on it (``parameters[].stage`` and ``.chunk``: chunk ``c`` of stage ``s`` is virtual stage
``c * pp + s``); the embedding lives on the first virtual stage, the final norm and the head on
the last. The rank then walks its program in ``schedule.stages[s]`` op by op:

- ``forward`` (micro-batch, chunk): the chunk's layers on the micro-batch's input (token ids on
  the first virtual stage, else the received activation, marked as requiring its gradient); the
  last virtual stage ends with the loss;
- ``backward``: the loss's backward (last virtual stage) or the chunk's output backward with the
  received output gradient; the input's gradient is what the previous stage receives;
- ``send`` / ``recv`` (tag ``activation`` or ``activation_grad``): point-to-point transfers over
  the ``pp`` group; consecutive transfers of one batch are issued together and then awaited, as
  the plan batches them;
- ``optimizer``: the step.

Every transfer passes through the counting layer (runtime/collectives.py's ledger) as the plan's
``stage.A->B:activation`` or ``stage.A->B:activation/grad`` update, before it is issued.

This first version executes pp alone or with dp_replicate (gradients all-reduced where the
program's ``collective`` ops say, divided by the plan's divisor); with ``job`` a pipelined run is
repeated against a single-process reference (the same data, initial values, loss scaling and
optimizer), its accounting checked per rank, and its idle fraction measured from timestamps.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mixle_compile.plan.artifact import plan_text
from mixle_compile.plan.document import PlanDocument
from mixle_compile.runtime.collectives import Collectives, Ledger
from mixle_compile.runtime.data import BatchLayout, SyntheticTokens, local_batch
from mixle_compile.runtime.errors import RuntimeRefusal
from mixle_compile.runtime.instructions import Instructions, read_instructions
from mixle_compile.runtime.launch import load_plan_or_spec
from mixle_compile.runtime.mesh import Mesh
from mixle_compile.runtime.model import LocalOps, TransformerShape, _attention, _mlp, _norm, _rope_tables, _vocab_lookup, transformer_loss
from mixle_compile.runtime.parameters import initial_value
from mixle_compile.runtime.session import make_optimizer

PP_RULE = "pp"


def pipeline_instructions(doc: PlanDocument) -> Instructions:
    """The plan as instructions for the pipeline runtime; refuses what it does not execute yet."""
    instructions = read_instructions(doc, pipeline=True)
    plan = instructions.plan
    if instructions.family != "transformer":
        raise RuntimeRefusal("the pipeline runtime executes transformer plans only")
    others = [f"{axis}={plan.size(axis)}" for axis in ("dp_shard", "tp", "cp", "ep") if plan.size(axis) > 1]
    if others:
        raise RuntimeRefusal(f"the pipeline runtime executes pp alone or with dp_replicate for now (the plan also has {', '.join(others)})")
    held = [p.name for p in instructions.params if p.mode != "replicated"]
    if held:
        raise RuntimeRefusal(f"the pipeline runtime holds every parameter whole for now ({held[0]} is {instructions.param(held[0]).mode})")
    if plan.pp < 2:
        raise RuntimeRefusal("the plan has pp=1: run it with the ordinary runtime")
    if instructions.spec.model.tie_embeddings:
        raise RuntimeRefusal("tied embeddings across pipeline stages are not executed yet")
    return instructions


@dataclass
class _Layout:
    """Which parameters and layers each virtual stage holds (from the plan's parameter list)."""

    pp: int
    chunks: int
    params: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # (stage, chunk) -> names
    layers: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @staticmethod
    def of(doc: PlanDocument, pp: int) -> _Layout:
        chunks = 1 + max(int(p.chunk or 0) for p in doc.parameters)
        layout = _Layout(pp, chunks)
        for p in doc.parameters:
            key = (int(p.stage or 0), int(p.chunk or 0))
            layout.params.setdefault(key, []).append(p.logical_id)
            if p.layer is not None and p.layer not in layout.layers.setdefault(key, []):
                layout.layers[key].append(p.layer)
        for key in layout.layers:
            layout.layers[key].sort()
        return layout

    def virtual(self, stage: int, chunk: int) -> int:
        return chunk * self.pp + stage

    @property
    def last_virtual(self) -> int:
        return self.pp * self.chunks - 1


def _chunk_forward(ops: LocalOps, shape: TransformerShape, layers: list[int], first: bool, last: bool,
                   x: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One virtual stage: (embedding), its blocks, (final norm, head and the micro-batch's mean loss)."""
    ids = inputs.t()
    seq = ids.shape[0]
    if first:
        x = _vocab_lookup(ids, ops.weight("embed.weight"), 0)
        if shape.position_embedding == "learned":
            positions = torch.arange(seq).unsqueeze(1).expand_as(ids)
            x = x + _vocab_lookup(positions, ops.weight("pos_embed.weight"), 0)
    rope = _rope_tables(seq, shape.head_dim, x.dtype, x.device) if shape.position_embedding == "rope" else None
    for i in layers:
        unit = f"layers.{i}"
        x = x + _attention(ops, shape, unit, _norm(ops, shape, x, f"{unit}.attn_norm"), rope)
        x = x + _mlp(ops, shape, unit, _norm(ops, shape, x, f"{unit}.mlp_norm"))
    if not last:
        return x
    h = _norm(ops, shape, x, "final_norm")
    logits = F.linear(h, ops.weight("lm_head.weight")).float()
    return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.t().reshape(-1), 0).mean()


class PipelineStage:
    """One rank's stage of a pipelined plan (see the module docstring)."""

    def __init__(self, doc: PlanDocument, instructions: Instructions, mesh: Mesh, *, detach_received: bool = False) -> None:
        self.doc = doc
        self.instructions = instructions
        self.plan = instructions.plan
        self.mesh = mesh
        self.stage = mesh.coord("pp")
        self.pp = self.plan.pp
        self.layout = _Layout.of(doc, self.pp)
        self.program = list(doc.schedule.stages[self.stage])
        forwards = sum(1 for op in self.program if op.kind == "forward")
        if forwards != self.layout.chunks * instructions.micro_steps:
            raise RuntimeRefusal(
                f"stage {self.stage}'s program runs {forwards} forward(s) per step, not one per chunk and micro-step "
                f"({self.layout.chunks} x {instructions.micro_steps}); this runtime replays a program that covers the whole step"
            )
        self.ledger = Ledger(instructions.collectives)
        self.comm = Collectives(mesh, self.ledger)
        self.shape = TransformerShape.from_spec(instructions.spec)
        self.detach_received = detach_received  # a deliberately broken variant, for the tests
        names = [n for (s, _), ns in self.layout.params.items() if s == self.stage for n in ns]
        self.params: dict[str, torch.nn.Parameter] = {}
        for name in names:
            p = instructions.param(name)
            self.params[name] = torch.nn.Parameter(initial_value(p, instructions.seed).to(self.shape.compute_dtype))
        self.optimizer = make_optimizer(instructions.optimizer, list(self.params.values()), instructions.learning_rate)
        self.ops = LocalOps(self.params)
        self.gradient_norms: dict[str, float] = {}  # per parameter, summed over steps
        self.busy_s: list[float] = []  # per step: time inside forward and backward ops
        self.wall_s: list[float] = []  # per step: time inside train_step

    def train_step(self, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """One optimizer step over this step's micro-batches (every accumulation step's, in order)."""
        start = time.perf_counter()
        busy = 0.0
        scale = 1.0 / len(batch)
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._grads: dict[tuple[int, int], torch.Tensor] = {}
        loss_sum = 0.0
        act_shape = (self.instructions.seq_len or 1, self.instructions.micro_batch_size, self.shape.hidden_size)
        pending: list = []
        batch_id = object()
        last = self.layout.last_virtual
        for op in self.program:
            if op.kind in ("send", "recv"):
                if op.batch != batch_id:
                    self._wait(pending)
                    batch_id = op.batch
                pending.append(self._transfer(op, act_shape))
                continue
            self._wait(pending)
            batch_id = object()
            key = (op.chunk, op.microbatch)
            v = self.layout.virtual(self.stage, op.chunk) if op.chunk is not None else None
            if op.kind == "forward":
                t0 = time.perf_counter()
                x_in, y = batch[op.microbatch]
                out = _chunk_forward(self.ops, self.shape, self.layout.layers.get((self.stage, op.chunk), []), v == 0,
                                     v == last, self._inputs.get(key), x_in, y)
                self._outputs[key] = out
                if v == last:
                    loss_sum += float(out.detach()) * scale
                busy += time.perf_counter() - t0
            elif op.kind == "backward":
                t0 = time.perf_counter()
                out = self._outputs.pop(key)
                if v == last:
                    (out * scale).backward()
                else:
                    out.backward(self._grads.pop(key))
                busy += time.perf_counter() - t0
            elif op.kind == "collective":
                self._reduce(op.name)
            elif op.kind == "optimizer":
                for name, p in self.params.items():
                    norm = 0.0 if p.grad is None else float(p.grad.float().norm())
                    self.gradient_norms[name] = self.gradient_norms.get(name, 0.0) + norm
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            else:
                raise RuntimeRefusal(f"the pipeline runtime does not execute {op.kind!r} ops in a stage program yet")
        self._wait(pending)
        self.wall_s.append(time.perf_counter() - start)
        self.busy_s.append(busy)
        return loss_sum if self.stage == self.pp - 1 else None

    def _reduce(self, node_id: str) -> None:
        """A gradient all_reduce the plan's program issues here (data parallelism), divided as planned."""
        c = self.instructions.collectives[node_id]
        p = self.params.get(c.tensor)
        if c.collective != "all_reduce" or p is None:
            raise RuntimeRefusal(f"the pipeline runtime does not execute {c.collective} {node_id!r} yet")
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        self.comm.all_reduce(p.grad, rule=c.rule, parts=node_id)
        if c.divisor > 1:
            p.grad.div_(c.divisor)

    def _transfer(self, op, act_shape):
        key = (op.chunk, op.microbatch)
        grad = op.tag == "activation_grad"
        pp_group = self.mesh.group(PP_RULE)
        peer_rank = pp_group.ranks[op.peer]
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
                    raise RuntimeError(f"stage {self.stage}: micro-batch {op.microbatch} chunk {op.chunk} has no input gradient to send")
            else:
                tensor = self._outputs[key].detach().contiguous()
        else:
            src, dst = op.peer, self.stage
            tensor = torch.empty(act_shape, dtype=self.shape.compute_dtype)
            (self._grads if grad else self._inputs)[key] = tensor
        node_id = f"stage.{src}->{dst}:activation" + ("/grad" if grad else "")
        parts = ((node_id, tensor.numel() * tensor.element_size()),)
        self.ledger.check("p2p", PP_RULE, parts)
        receiving_chunk = op.chunk if op.kind == "recv" else op.peer_chunk
        tag = (op.microbatch * self.layout.chunks + receiving_chunk) * 2 + int(grad)
        fn = dist.isend if op.kind == "send" else dist.irecv
        work = self.comm._guard(node_id, pp_group, lambda: fn(tensor, peer_rank, group=pp_group.handle, tag=tag), kind="p2p")
        self.ledger.record(parts)
        return (work, op, key, tensor, pp_group, node_id)

    def _wait(self, pending: list) -> None:
        for work, op, key, tensor, group, node_id in pending:
            self.comm._guard(node_id, group, work.wait, kind="p2p")
            if op.kind == "recv" and op.tag == "activation":
                # The received activation is a leaf of this stage's graph: without requires_grad the
                # backward would stop here and the earlier stages would get no gradient.
                self._inputs[key] = tensor.detach() if self.detach_received else tensor.requires_grad_(True)
        pending.clear()


# ---------------------------------------------------------------------------
# a checked job: pipelined ranks, accounting, reference, bubble
# ---------------------------------------------------------------------------


def _step_batches(instructions: Instructions, source, step: int, data_rank: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One data rank's micro-batches of a step, every accumulation step's in order (runtime/data.py's layout)."""
    plan = instructions.plan
    layout = BatchLayout(instructions.micro_batch_size, plan.microbatches, plan.gradient_accumulation_steps, plan.data_parallel_size)
    out = []
    for a in range(plan.gradient_accumulation_steps):
        inputs, targets = local_batch(source, layout, step, a, data_rank)
        out.extend(zip(inputs.chunk(plan.microbatches), targets.chunk(plan.microbatches)))
    return out


def _rank_main(rank: int, world: int, port: int, plan_path: str, out_dir: str, steps: int, detach_received: bool, timeout_s: float) -> None:
    import datetime

    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        doc = load_plan_or_spec(plan_path)
        instructions = pipeline_instructions(doc)
        mesh = Mesh.create(doc.groups, timeout_s=timeout_s)
        stage = PipelineStage(doc, instructions, mesh, detach_received=detach_received)
        source = SyntheticTokens(instructions.spec.model.vocab_size, instructions.seq_len or 1, instructions.seed)
        losses = []
        for step in range(steps):
            losses.append(stage.train_step(_step_batches(instructions, source, step, mesh.data_rank)))
        torch.save(
            {
                "stage": stage.stage,
                "params": {n: p.detach().float() for n, p in stage.params.items()},
                "gradient_norms": stage.gradient_norms,
                "ledger": stage.ledger.as_dict(),
                "losses": losses,
                "busy_s": stage.busy_s,
                "wall_s": stage.wall_s,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
        stage.comm.barrier("pipeline:done")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_parameters(instructions: Instructions, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same model trained in one process: the same data, initial values, loss scaling and optimizer."""
    shape = TransformerShape.from_spec(instructions.spec)
    params = {p.name: torch.nn.Parameter(initial_value(p, instructions.seed).to(shape.compute_dtype)) for p in instructions.params}
    optimizer = make_optimizer(instructions.optimizer, list(params.values()), instructions.learning_rate)
    ops = LocalOps(params)
    source = SyntheticTokens(instructions.spec.model.vocab_size, instructions.seq_len or 1, instructions.seed)
    losses = []
    dp = instructions.plan.data_parallel_size
    for step in range(steps):
        total = 0.0
        for d in range(dp):
            batches = _step_batches(instructions, source, step, d)
            for x, y in batches:
                loss = transformer_loss(ops, shape, x, y)
                (loss / (len(batches) * dp)).backward()
                total += float(loss.detach()) / (len(batches) * dp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return {n: p.detach().float() for n, p in params.items()}, losses


def pipeline_accounting(doc: PlanDocument, instructions: Instructions, ledgers: dict[int, dict], stages: dict[int, int], steps: int) -> list[str]:
    """Planned == observed per update, on the ranks that execute it (both ends of a transfer, the
    ranks of the update's stage otherwise) and zero on every other rank."""
    import re

    errors = []
    for node_id, c in instructions.collectives.items():
        m = re.match(r"^stage\.(\d+)->(\d+):", node_id)
        executing = {int(m.group(1)), int(m.group(2))} if m else {c.stage}
        for rank, ledger in ledgers.items():
            planned = (c.occurrences_per_step * steps, c.payload_bytes * c.occurrences_per_step * steps) if stages[rank] in executing else (0, 0)
            observed = tuple(ledger["updates"].get(node_id, (0, 0)))
            if observed != planned:
                errors.append(f"{node_id}: rank {rank} planned {planned[0]} ({planned[1]} bytes), observed {observed[0]} ({observed[1]} bytes)")
    for rank, ledger in ledgers.items():
        for node_id in sorted(set(ledger["updates"]) - set(instructions.collectives)):
            errors.append(f"{node_id}: rank {rank} issued a transfer the plan does not declare")
    return errors


def _idle(busy: list[float], wall: list[float]) -> float:
    """1 - compute time / step time, over the steps after the first (which also opens the
    point-to-point connections); over every step when there is only one."""
    busy, wall = (busy[1:], wall[1:]) if len(wall) > 1 else (busy, wall)
    return 1.0 - sum(busy) / sum(wall)


def run_pipeline_job(path: str | Path, *, steps: int = 2, detach_received: bool = False, timeout_s: float = 60.0,
                     out_dir: str | None = None) -> dict:
    """Run a pipelined plan (a plan.json or a spec file) on local ranks and check it; returns a torch-free summary:

    ``accounting_errors``; per parameter ``relative_error`` (norm-wise, against the reference) and
    ``moved`` (changed from its initial value); ``stages_without_gradients``; losses of both runs
    (the mean over the global batch); per rank ``idle_fraction`` (1 - compute time / step time) and the plan's ``bubble_fraction``.
    """
    import torch.multiprocessing as mp

    doc = load_plan_or_spec(path)
    instructions = pipeline_instructions(doc)
    world = instructions.plan.world_size
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(out_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        plan_path = work / "plan.json"  # compiled once here; the ranks read it back (its digest verified)
        plan_path.write_text(plan_text(doc.model_dump(mode="json")))
        mp.start_processes(_rank_main, args=(world, _free_port(), str(plan_path), str(work), steps, detach_received, timeout_s),
                           nprocs=world, join=True, start_method="spawn")
        results = {r: torch.load(work / f"rank{r}.pt", weights_only=True) for r in range(world)}
    ref, ref_losses = reference_parameters(instructions, steps)
    init = {p.name: initial_value(p, instructions.seed) for p in instructions.params}
    relative, moved, held = {}, {}, set()
    stages_without = set()
    for r, res in results.items():
        for name, value in res["params"].items():
            held.add(name)
            relative[name] = max(relative.get(name, 0.0), float((value - ref[name]).norm() / ref[name].norm()))
            moved[name] = moved.get(name, True) and bool((value - init[name]).abs().max() > 0)
            if not moved[name] or not res["gradient_norms"].get(name, 0.0) > 0.0:
                stages_without.add(res["stage"])
    stages_without |= {int(p.stage or 0) for p in doc.parameters if p.logical_id not in held}
    last = [res["losses"] for res in results.values() if res["stage"] == instructions.plan.pp - 1]  # one per data rank
    return {
        "accounting_errors": pipeline_accounting(doc, instructions, {r: res["ledger"] for r, res in results.items()},
                                                 {r: res["stage"] for r, res in results.items()}, steps),
        "relative_error": relative,
        "max_relative_error": max(relative.values()),
        "moved": moved,
        "stages_without_gradients": sorted(stages_without),
        "losses": [sum(step) / len(last) for step in zip(*last)],
        "reference_losses": ref_losses,
        "idle_fraction": {r: _idle(res["busy_s"], res["wall_s"]) for r, res in results.items()},
        "stage_of_rank": {r: res["stage"] for r, res in results.items()},
        "bubble_fraction": float(doc.schedule.bubble_fraction),
        "transfers": {r: res["ledger"]["updates"] for r, res in results.items()},
    }
