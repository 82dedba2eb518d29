"""Tensor parallelism as conjugate pairs of collectives (autograd Functions).

Megatron's two operators, applied at every column-parallel input and row-parallel output:

- ``copy`` (at a column-parallel layer's input): forward identity, backward all_reduce of the
  input gradient (``SITE:in/grad``). Under sequence parallelism: forward all_gather of the sequence
  (``SITE:in``), backward reduce_scatter (``SITE:in/grad``).
- ``reduce`` (at a row-parallel layer's output): forward all_reduce of the partial sums
  (``SITE:out``), backward identity. Under sequence parallelism: forward reduce_scatter over the
  sequence (``SITE:out``), backward all_gather (``SITE:out/grad``).

Activations are sequence-first (``[s, b, h]``), so a sequence shard is a contiguous dimension-0
slice, which is what the flat collectives exchange.

The vocabulary-parallel cross entropy gathers one fp32 (log-sum-exp, target logit) pair per token
from every vocabulary shard (``lm_head:loss``, or a multi-token prediction depth's
``layers.{i}.mtp.head:loss``); every rank then holds the same per-token loss, and the backward needs
no communication.

A column-parallel layer whose output must be whole again (multi-token prediction's ``eh_proj``) gives
it through ``gather_output``: Megatron-Core's ``gather_from_tensor_model_parallel_region`` (forward
all_gather of the output features, ``SITE:out``; backward: this rank's slice of the gradient, no
communication), then under sequence parallelism ``scatter_to_sequence_parallel_region`` (forward:
this rank's sequence shard, no communication; backward all_gather of the sequence, ``SITE:out/grad``),
megatron/core/tensor_parallel/mappings.py ``_GatherFromModelParallelRegion`` and
``_ScatterToSequenceParallelRegion``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import Function

from mixle_compile.plan.vocabulary import UpdateId
from mixle_compile.runtime.collectives import Collectives, nbytes

TP = "tp"  # the group rule of tensor parallelism

# capture(node_id, tensor, seq_sharded): records an update's result as numerical evidence.
Capture = Callable[[str, torch.Tensor, bool], None]


class TensorParallel:
    """This rank's tensor-parallel group and how activations cross it."""

    def __init__(
        self,
        comm: Collectives | None,
        size: int,
        rank: int,
        sequence_parallel: bool,
        capture: Capture | None = None,
        *,
        observe_local: bool = False,
    ) -> None:
        self.comm = comm
        self.observe_local = observe_local  # the reference records sites where no collective runs
        self.size = size
        self.rank = rank
        self.sequence_parallel = sequence_parallel and size > 1
        self.capture = capture

    def _capture(self, node_id: str, tensor: torch.Tensor, seq_sharded: bool) -> None:
        if self.capture is not None:
            self.capture(node_id, tensor, seq_sharded)

    def copy(self, site: str, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return _GatherSequence.apply(x, self, site)
        return _CopyToParallel.apply(x, self, site)

    def reduce(self, site: str, y: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return y
        if self.sequence_parallel:
            return _ScatterSequence.apply(y, self, site)
        return _ReduceFromParallel.apply(y, self, site)

    def gather_output(self, site: str, y: torch.Tensor) -> torch.Tensor:
        """A column-parallel output (``[s, b, features / tp]``) made whole: its features gathered
        (``SITE:out``), then under sequence parallelism this rank's sequence shard of it (whose
        backward gathers the sequence, ``SITE:out/grad``)."""
        if self.size == 1:
            return y
        y = _GatherFeatures.apply(y, self, site)
        if self.sequence_parallel:
            y = _SplitSequence.apply(y, self, site)
        return y

    # -- the collectives ---------------------------------------------------------------

    def all_reduce(self, node_id: str, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous().clone()
        self.comm.all_reduce(t, rule=TP, parts=node_id)
        self._capture(node_id, t, False)
        return t

    def gather_sequence(self, node_id: str, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = t.new_empty((t.shape[0] * self.size, *t.shape[1:]))
        self.comm.all_gather(out, t, rule=TP, parts=node_id)
        self._capture(node_id, out, False)
        return out

    def scatter_sequence(self, node_id: str, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = t.new_empty((t.shape[0] // self.size, *t.shape[1:]))
        self.comm.reduce_scatter(out, t, rule=TP, parts=node_id)
        self._capture(node_id, out, True)
        return out

    def gather_features(self, node_id: str, t: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the last dimension, in rank order (one all_gather of the whole slices)."""
        t = t.contiguous()
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))  # rank-major, as the flat gather fills it
        self.comm.all_gather(out, t, rule=TP, parts=node_id)
        whole = out.view(self.size, *t.shape).movedim(0, -2).reshape(*t.shape[:-1], self.size * t.shape[-1])
        self._capture(node_id, whole, False)
        return whole

    def gather_rows(self, node_id: str, t: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``t`` (no evidence capture: the caller records the combined result)."""
        t = t.contiguous()
        out = t.new_empty((t.shape[0] * self.size, *t.shape[1:]))
        self.comm.all_gather(out, t, rule=TP, parts=((node_id, nbytes(out)),))
        return out


class _CopyToParallel(Function):
    @staticmethod
    def forward(ctx, x, tp: TensorParallel, site: str):
        ctx.tp, ctx.site = tp, site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(str(UpdateId.activation(ctx.site, "in", backward=True)), grad), None, None


class _ReduceFromParallel(Function):
    @staticmethod
    def forward(ctx, y, tp: TensorParallel, site: str):
        return tp.all_reduce(str(UpdateId.activation(site, "out")), y)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x, tp: TensorParallel, site: str):
        ctx.tp, ctx.site = tp, site
        return tp.gather_sequence(str(UpdateId.activation(site, "in")), x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.scatter_sequence(str(UpdateId.activation(ctx.site, "in", backward=True)), grad), None, None


class _ScatterSequence(Function):
    @staticmethod
    def forward(ctx, y, tp: TensorParallel, site: str):
        ctx.tp, ctx.site = tp, site
        return tp.scatter_sequence(str(UpdateId.activation(site, "out")), y)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.gather_sequence(str(UpdateId.activation(ctx.site, "out", backward=True)), grad), None, None


class _GatherFeatures(Function):
    """gather_from_tensor_model_parallel_region: forward all_gather of the last dimension, backward
    this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, y, tp: TensorParallel, site: str):
        ctx.rank, ctx.width = tp.rank, y.shape[-1]
        return tp.gather_features(str(UpdateId.activation(site, "out")), y)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None, None


class _SplitSequence(Function):
    """scatter_to_sequence_parallel_region: forward this rank's sequence shard, backward all_gather of
    the sequence (``SITE:out/grad``)."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel, site: str):
        ctx.tp, ctx.site = tp, site
        n = x.shape[0] // tp.size
        return x.narrow(0, tp.rank * n, n).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.gather_sequence(str(UpdateId.activation(ctx.site, "out", backward=True)), grad), None, None


LOSS_SITE = "lm_head:loss"


class VocabParallelCrossEntropy(Function):
    """Per-token cross entropy of logits split over the vocabulary (``[tokens, vocab / tp]``, fp32);
    ``site``: the update id of its gather (the output head's ``lm_head:loss``, a multi-token prediction
    depth's ``layers.{i}.mtp.head:loss``)."""

    @staticmethod
    def forward(ctx, logits, targets, tp: TensorParallel, vocab_start: int, site: str = LOSS_SITE):
        n_local = logits.shape[-1]
        local = targets - vocab_start
        inside = (local >= 0) & (local < n_local)
        local = local.clamp(0, n_local - 1)
        lse_local = torch.logsumexp(logits, dim=-1)
        target_local = logits.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~inside, 0.0)
        stats = torch.stack([lse_local, target_local], dim=1)
        if tp.size > 1:
            gathered = tp.gather_rows(site, stats).view(tp.size, -1, 2)
            lse = torch.logsumexp(gathered[..., 0], dim=0)
            target_logit = gathered[..., 1].sum(dim=0)
        else:
            lse, target_logit = lse_local, target_local
        if tp.size > 1 or tp.observe_local:
            tp._capture(site, torch.stack([lse, target_logit], dim=1), False)
        ctx.save_for_backward(logits, lse, local, inside)
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad):
        logits, lse, local, inside = ctx.saved_tensors
        probs = torch.exp(logits - lse.unsqueeze(1))
        rows = torch.arange(probs.shape[0], device=probs.device)
        probs[rows[inside], local[inside]] -= 1.0
        return probs * grad.unsqueeze(1), None, None, None, None
