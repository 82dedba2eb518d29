"""Numerical evidence: every update's result compared with a single-process reference.

During a run with evidence, each rank records the result of every planned update it executes
(after its divisor): a gathered weight, a reduced gradient (shard), an activation or its gradient.
Each record says in global terms what it should equal, e.g. "the gradient of ``q_proj`` summed over
data ranks 0 and 1 for accumulation step 0, divided by 2, rows 0..15" (an Expect, described below).

The reference trains the same model in one process on the same global batches, one data rank's
micro-batches at a time with the same loss scaling, and keeps what the records refer to: the
weights before and after each step, each use's gradient per (accumulation step, data rank), and
every activation site's value and gradient. Comparing gives each update its maximum absolute error
(the largest ``|x - ref|`` of any element of any record) and its maximum relative error (the largest
``||x - ref|| / ||ref||``, Euclidean norms, of any record). The relative error is norm-wise because
AdamW turns rounding noise in a gradient element that is itself near its epsilon into a full-size
step of that one element, which says nothing about the update. A second identical run of the
distributed job gives determinism (bitwise equal records).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.autograd import Function

from mixle_compile.contracts import DistributedUpdate
from mixle_compile.plan.vocabulary import UpdateId
from mixle_compile.runtime.data import BatchLayout, TokenSource, local_batch
from mixle_compile.runtime.instructions import Instructions
from mixle_compile.runtime.model import LocalOps, TransformerShape, default_loss, module_loss, transformer_loss
from mixle_compile.runtime.parameters import DTYPES, apply_slices, initial_value
from mixle_compile.runtime.session import make_optimizer
from mixle_compile.runtime.tensor_parallel import LOSS_SITE, TensorParallel, VocabParallelCrossEntropy

# An Expect is a plain tuple (it is saved with torch.save and compared on rank 0):
#   ("param", use, slices, dtype)          the weight at the start of the step
#   ("param_after", use, slices, dtype)    the weight after the step's update
#   ("grad", use, data_ranks, accumulations, divisor, slices)
#                                          (use: one use's name, or a tuple of uses whose gradients
#                                          add up: the copies of a tied weight on several stages)
#   ("part", ranks, expect)                one rank's part of what ``expect`` describes: the records
#                                          of ``ranks`` add up to it (a gradient before its reduction
#                                          over cp, K and V gradients of a KV head shared over tp)
#   ("act", node_id, data_rank, slices)    an activation site's value or gradient
#   ("act_at", node_id, data_rank, slices, (dim, indices))
#                                          ... then the given indices of one dimension (the global
#                                          positions a context-parallel rank holds, in its order)
# slices: ((dim, start, stop), ...) applied in order to the global tensor.


def digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


class Recorder:
    """One rank's records of a run (values kept for the first run, digests for the repeat)."""

    def __init__(self, keep_values: bool) -> None:
        self.keep_values = keep_values
        self.context: tuple = (0, 0, 0)
        self.entries: list[tuple] = []  # (key, expect, value | None, digest)
        self._seen: dict[tuple, int] = {}

    def capture(self, node_id: str, tensor: torch.Tensor, expect: tuple) -> None:
        base = (node_id, *self.context)
        k = self._seen.get(base, 0)
        self._seen[base] = k + 1
        value = tensor.detach().float().cpu().clone() if self.keep_values else None
        self.entries.append(((*base, k), expect, value, digest(tensor)))


# ---------------------------------------------------------------------------
# The single-process reference
# ---------------------------------------------------------------------------


@dataclass
class ReferenceRecords:
    before: dict[int, dict[str, torch.Tensor]]  # step -> canonical name -> fp32 weight
    after: dict[int, dict[str, torch.Tensor]]
    grads: dict[tuple, torch.Tensor]  # (step, use, accumulation, data rank) -> fp32 gradient
    acts: dict[tuple, torch.Tensor]  # (step, accumulation, data rank, micro, node_id) -> value
    canonical: Mapping[str, str]  # use -> canonical name


class _Observe(Function):
    @staticmethod
    def forward(ctx, x, sink, forward_key: str, backward_key: str):
        ctx.sink, ctx.backward_key = sink, backward_key
        sink(forward_key, x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(ctx.backward_key, grad)
        return grad, None, None, None


class _ReferenceUse(Function):
    @staticmethod
    def forward(ctx, master, params, use: str):
        ctx.params, ctx.use = params, use
        dtype = params.dtypes[use]
        return master.to(dtype) if master.dtype != dtype else master.view_as(master)

    @staticmethod
    def backward(ctx, grad):
        buffers = ctx.params.buffers
        if ctx.use in buffers:
            buffers[ctx.use].add_(grad)
        else:
            buffers[ctx.use] = grad.float().clone()
        return None, None, None


class _ReferenceParams:
    def __init__(self, instructions: Instructions, values: Mapping[str, torch.Tensor] | None) -> None:
        self.canonical = {p.name: p.canonical for p in instructions.params}
        self.dtypes = {p.name: DTYPES.get(p.dtype, torch.float32) for p in instructions.params}
        self.masters: dict[str, torch.nn.Parameter] = {}
        for p in instructions.params:
            if p.canonical == p.name:
                value = values[p.name] if values is not None else initial_value(p, instructions.seed)
                self.masters[p.name] = torch.nn.Parameter(value.detach().float().clone())
        self.buffers: dict[str, torch.Tensor] = {}

    def weight(self, use: str) -> torch.Tensor:
        return _ReferenceUse.apply(self.masters[self.canonical[use]], self, use)


class _ReferenceOps(LocalOps):
    """Local ops that also record the activations the evidence compares."""

    def __init__(self, params: _ReferenceParams, sink, wanted: set[str]) -> None:
        self.params = params
        self.wanted = wanted
        self.sink = sink
        self.tp = TensorParallel(None, 1, 0, False, capture=lambda node, t, _: sink(node, t), observe_local=True)

    def weight(self, use):
        return self.params.weight(use)

    def copy(self, site, x):
        return self._observe(*UpdateId.activation_pair(site, "in"), x)

    def reduce(self, site, y):
        return self._observe(*UpdateId.activation_pair(site, "out"), y)

    def unit_end(self, unit, y):
        # A pipeline stage boundary (runtime/pipeline_plan.py): the residual stream after ``unit``.
        return self._observe(*UpdateId.activation_pair(unit, "boundary"), y)

    def observe_activation(self, forward_key, backward_key, x):
        """``x`` unchanged, recording its value and gradient under these keys when the plan has them
        (the rows a mixture-of-experts layer exchanges under expert parallelism, runtime/experts.py)."""
        return self._observe(forward_key, backward_key, x)

    def _observe(self, forward_key, backward_key, x):
        if forward_key in self.wanted or backward_key in self.wanted:
            return _Observe.apply(x, self.sink, forward_key, backward_key)
        return x

    def gather_output(self, site, y):
        # The whole output a column-parallel layer's gather yields (multi-token prediction's eh_proj),
        # and its gradient, what the gather of the sequence under sequence parallelism yields.
        return self._observe(*UpdateId.activation_pair(site, "out"), y)

    def cross_entropy(self, logits, targets, vocab_start, site=LOSS_SITE):
        return VocabParallelCrossEntropy.apply(logits, targets, self.tp, vocab_start, site)

    def gather_kv(self, site, k, v):
        # K and V of the whole sequence, [2, b, kv heads, s, d]: what a context-parallel gather yields.
        key, grad_key = UpdateId.activation_pair(site, "kv")
        if key in self.wanted or grad_key in self.wanted:
            both = _Observe.apply(torch.stack([k, v]), self.sink, key, grad_key)
            k, v = both[0], both[1]
        return k, v, None


def run_reference(
    instructions: Instructions,
    source: TokenSource | None,
    steps: int,
    *,
    batches=None,
    module: torch.nn.Module | None = None,
    loss_fn=None,
    values: Mapping[str, torch.Tensor] | None = None,
    progress=None,
) -> ReferenceRecords:
    """Train the plan's model in this process for ``steps`` steps and keep what evidence needs.

    ``batches(step, accumulation, data_rank) -> (inputs, targets)`` defaults to the token source's.
    ``progress(step, seconds)`` is called after each step (numbered from 1) with the time so far.
    """
    plan = instructions.plan
    dp, gas, mb = plan.data_parallel_size, plan.gradient_accumulation_steps, plan.microbatches
    layout = BatchLayout(instructions.micro_batch_size, mb, gas, dp)
    if batches is None:
        batches = lambda step, a, d: local_batch(source, layout, step, a, d)  # noqa: E731
    params = _ReferenceParams(instructions, values)
    optimizer = make_optimizer(instructions.optimizer, list(params.masters.values()), instructions.learning_rate)
    wanted = set(instructions.activation_sites)
    acts: dict[tuple, torch.Tensor] = {}
    context: list = [0, 0, 0, 0]

    def sink(node_id: str, t: torch.Tensor) -> None:
        if node_id in wanted:
            acts[(*context, node_id)] = t.detach().float().clone()

    ops = _ReferenceOps(params, sink, wanted)
    shape = TransformerShape.from_spec(instructions.spec) if instructions.family == "transformer" else None
    names = tuple(p.name for p in instructions.params)
    scale = 1.0 / (mb * gas)
    records = ReferenceRecords({}, {}, {}, acts, params.canonical)
    started = time.perf_counter()
    for step in range(steps):
        records.before[step] = {n: m.detach().clone() for n, m in params.masters.items()}
        for a in range(gas):
            for d in range(dp):
                params.buffers.clear()
                inputs, targets = batches(step, a, d)
                for m, (x, y) in enumerate(zip(inputs.chunk(mb), targets.chunk(mb), strict=True)):
                    context[:] = [step, a, d, m]
                    if shape is not None:
                        loss = transformer_loss(ops, shape, x, y)
                    else:
                        loss = module_loss(ops, module, names, loss_fn or default_loss, x, y)
                    (loss * scale).backward()
                for use, grad in params.buffers.items():
                    records.grads[(step, use, a, d)] = grad.clone()
        for name, master in params.masters.items():
            total = None
            for (s, use, _a, _d), grad in records.grads.items():
                if s == step and params.canonical[use] == name:
                    total = grad.clone() if total is None else total.add_(grad)
            master.grad = None if total is None else total.div_(dp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.after[step] = {n: m.detach().clone() for n, m in params.masters.items()}
        if progress is not None:
            progress(step + 1, time.perf_counter() - started)
    return records


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


def expected_value(records: ReferenceRecords, key: tuple, expect: tuple) -> torch.Tensor:
    node_id, step, accumulation, micro, _ = key
    kind = expect[0]
    if kind in ("param", "param_after"):
        _, use, slices, dtype = expect
        table = records.before if kind == "param" else records.after
        whole = table[step][records.canonical[use]]
        return apply_slices(whole, slices).to(_dtype(dtype)).float()
    if kind == "part":
        return expected_value(records, key, expect[2])
    if kind == "grad":
        _, use, data_ranks, accumulations, divisor, slices = expect
        total = None
        for u in (use,) if isinstance(use, str) else use:
            for a in accumulations:
                for d in data_ranks:
                    g = records.grads.get((step, u, a, d))
                    if g is not None:
                        total = g.clone() if total is None else total.add_(g)
        if total is None:
            raise KeyError(f"the reference has no gradient of {use} for step {step}")
        return apply_slices(total / divisor, slices)
    if kind == "act":
        _, site, data_rank, slices = expect
        return apply_slices(records.acts[(step, accumulation, data_rank, micro, site)], slices)
    if kind == "act_at":
        _, site, data_rank, slices, (dim, indices) = expect
        whole = apply_slices(records.acts[(step, accumulation, data_rank, micro, site)], slices)
        return whole.index_select(dim, torch.tensor(indices, dtype=torch.long))
    raise ValueError(f"unknown evidence record kind {kind!r}")


def _dtype(name: str) -> torch.dtype:
    return {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16}.get(name, torch.float32)


@dataclass
class UpdateEvidence:
    samples: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    deterministic: bool = True


def compare(records: ReferenceRecords, runs: list[dict]) -> dict[str, UpdateEvidence]:
    """``runs``: every rank's saved records (``{"first": entries, "repeat": {key: digest}}``)."""
    out: dict[str, UpdateEvidence] = {}
    parts: dict[tuple, list[torch.Tensor]] = {}  # (key, expect) -> the cp group's parts
    for saved in runs:
        repeat = saved["repeat"]
        for key, expect, value, first_digest in saved["first"]:
            ev = out.setdefault(key[0], UpdateEvidence())
            if repeat.get(key) != first_digest:
                ev.deterministic = False
            if expect[0] == "part":
                parts.setdefault((key, expect), []).append(value)
                continue
            _measure(ev, key, value, expected_value(records, key, expect))
    for (key, expect), values in parts.items():
        ranks = expect[1]
        if len(values) != len(ranks):
            raise ValueError(f"{key[0]}: {len(values)} of the ranks {list(ranks)} recorded their part")
        _measure(out[key[0]], key, torch.stack(values).sum(0), expected_value(records, key, expect))
    return out


def _measure(ev: UpdateEvidence, key: tuple, value: torch.Tensor, reference: torch.Tensor) -> None:
    if tuple(reference.shape) != tuple(value.shape):
        raise ValueError(f"{key[0]}: the record has shape {tuple(value.shape)}, the reference {tuple(reference.shape)}")
    error = value - reference
    diff = float(error.abs().max()) if value.numel() else 0.0
    rel = 0.0 if diff == 0.0 else float(error.norm()) / max(float(reference.norm()), 1e-30)
    ev.samples += 1
    ev.max_abs = max(ev.max_abs, diff)
    ev.max_rel = max(ev.max_rel, rel)


def with_evidence(update: DistributedUpdate, ev: UpdateEvidence | None, evidence_id: str) -> DistributedUpdate:
    fields = dict(update.as_dict())
    if ev is not None and ev.samples:
        fields.update(
            determinism_observed=ev.deterministic,
            maximum_absolute_error=ev.max_abs,
            maximum_relative_error=ev.max_rel,
            numerics_evidence_id=f"{evidence_id}/{update.node_id}",
            numerics_sample_count=ev.samples,
        )
    return DistributedUpdate.from_dict(fields)


def assemble_global(session) -> dict[str, torch.Tensor]:
    """Every parameter's whole tensor on every rank (bookkeeping gathers over the shard and tp groups)."""
    out = {}
    comm, mesh = session.comm, session.mesh
    for name, local in session.store.params.items():
        part = local.master.detach().float()
        if local.sharded:
            whole = torch.empty(local.gathered_shape(), dtype=part.dtype, device=part.device)
            comm.bookkeeping_all_gather(whole, part.contiguous(), rule=local.shard_rule, name="parameters:gather")
            part = whole[: local.rows]
        if local.instr.ep_dim is not None:
            part = _gather_experts(comm, mesh, part, local.instr.ep_dim)
        if local.tp_slices and local.tp_slices[0][0] != local.instr.ep_dim:
            dim = local.tp_slices[0][0]
            moved = part.movedim(dim, 0).contiguous()
            whole = torch.empty(
                (moved.shape[0] * mesh.degree("tp"), *moved.shape[1:]), dtype=part.dtype, device=part.device
            )
            comm.bookkeeping_all_gather(whole, moved, rule="tp", name="parameters:gather")
            replicas = local.instr.tp_replicas
            if replicas > 1:  # a KV head shared by `replicas` consecutive tp ranks: keep one copy of each
                whole = whole.view(mesh.degree("tp"), *moved.shape)[::replicas].reshape(-1, *moved.shape[1:])
            part = whole.movedim(0, dim)
        out[name] = part.cpu()
        for use in local.uses:
            out[use.name] = out[name]
    return out


def _gather_experts(comm, mesh, part: torch.Tensor, dim: int) -> torch.Tensor:
    """Every ep rank's experts of an expert weight (a bookkeeping gather over the ep group)."""
    size = mesh.group("ep").size
    moved = part.movedim(dim, 0).contiguous()
    whole = torch.empty((moved.shape[0] * size, *moved.shape[1:]), dtype=part.dtype, device=part.device)
    comm.bookkeeping_all_gather(whole, moved, rule="ep", name="parameters:gather")
    return whole.movedim(0, dim)
