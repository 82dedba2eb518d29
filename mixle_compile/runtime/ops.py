"""What the model code calls on a distributed rank: weights from the parameter store, activations
across the tensor-parallel group (see model.Ops), and context parallelism.

Context parallelism (cp > 1) follows the plan's ``layers.{i}.attn:kv`` updates: each attention
layer all_gathers K and V of every cp rank's chunks over the ``cp`` group (one call carrying both),
and its backward reduce_scatters their gradients back to the ranks holding those chunks
(``:kv/grad``). The gathered keys stay in rank order; the mask compares global positions, so
their order does not matter. The loss of a micro-batch is the mean over the whole sequence: each
rank's mean over its own tokens, averaged over cp (a bookkeeping all_reduce of one number for the
value; the gradient of each rank's part is divided by cp, and the plan's gradient reduction over cp
adds the parts up).
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from mixle_compile.plan.vocabulary import Axis, UpdateId, kv_replica_size
from mixle_compile.runtime.experts import expert_parallel
from mixle_compile.runtime.model import cp_positions
from mixle_compile.runtime.parameters import ParamStore
from mixle_compile.runtime.tensor_parallel import LOSS_SITE, TensorParallel, VocabParallelCrossEntropy

CP = Axis.CP.value  # the group rule of context parallelism


class ParallelOps:
    def __init__(self, store: ParamStore, tp: TensorParallel) -> None:
        self.store = store
        self.tp = tp
        self.tp_size = tp.size
        self.tp_rank = tp.rank
        mesh = store.mesh
        self.cp_size = mesh.degree(CP)
        self.cp_rank = mesh.coord(CP)
        self._positions: list[int] = []  # the global positions of this rank's tokens (cp > 1)
        self._record = store.capture  # (node_id, tensor, expect), when recording evidence
        self.experts = expert_parallel(store, tp)  # mixture-of-experts layers (runtime/experts.py)
        if self.cp_size > 1 and tp.capture is not None and self._record is not None:
            # Activations hold this rank's positions only: say which, in global coordinates.
            tp.capture = self._capture_positions

    def weight(self, use: str) -> torch.Tensor:
        return self.store.weight(use)

    def unit_begin(self, unit: str, x):
        return self.store.unit_begin(unit, x)

    def unit_end(self, unit: str, y):
        return self.store.unit_end(unit, y)

    def copy(self, site: str, x):
        return self.tp.copy(site, x)

    def reduce(self, site: str, y):
        return self.tp.reduce(site, y)

    def gather_output(self, site: str, y):
        return self.tp.gather_output(site, y)

    def cross_entropy(self, logits, targets, vocab_start: int, site: str = LOSS_SITE):
        return VocabParallelCrossEntropy.apply(logits, targets, self.tp, vocab_start, site)

    # -- context parallelism ---------------------------------------------------------------

    def context_positions(self, seq: int, device) -> torch.Tensor | None:
        if self.cp_size == 1:
            return None
        self._positions = cp_positions(seq, self.cp_size, self.cp_rank)
        return torch.tensor(self._positions, dtype=torch.long, device=device)

    def gather_kv(self, site: str, k: torch.Tensor, v: torch.Tensor):
        if self.cp_size == 1:
            return k, v, None
        seq = k.shape[2] * self.cp_size
        keys = [p for r in range(self.cp_size) for p in cp_positions(seq, self.cp_size, r)]
        k_all, v_all = _GatherContext.apply(k, v, self, site)
        return k_all, v_all, torch.tensor(keys, dtype=torch.long, device=k.device)

    def context_mean(self, loss: torch.Tensor) -> torch.Tensor:
        if self.cp_size == 1:
            return loss
        return _ContextMean.apply(loss, self)

    def _gather_kv(self, site: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = torch.stack([k, v]).contiguous()  # [2, b, heads, s, d]
        _, b, heads, s, d = local.shape
        out = local.new_empty(local.numel() * self.cp_size)
        node_id = str(UpdateId.activation(site, "kv"))
        self.store.comm.all_gather(out, local.reshape(-1), rule=CP, parts=node_id)
        both = (
            out.view(self.cp_size, 2, b, heads, s, d)
            .permute(1, 2, 3, 0, 4, 5)
            .reshape(2, b, heads, self.cp_size * s, d)
        )
        if self._record is not None:
            seq = s * self.cp_size
            keys = [p for r in range(self.cp_size) for p in cp_positions(seq, self.cp_size, r)]
            self._record(
                node_id,
                both,
                ("act_at", node_id, self.store.mesh.data_rank, self._head_slices(site, d, heads), (3, tuple(keys))),
            )
        return both[0], both[1]

    def _scatter_kv_grad(self, site: str, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.stack([dk, dv])  # [2, b, heads, cp * s, d], keys in rank order
        _, b, heads, seq, d = both.shape
        s = seq // self.cp_size
        rank_major = both.view(2, b, heads, self.cp_size, s, d).permute(3, 0, 1, 2, 4, 5).contiguous().reshape(-1)
        out = rank_major.new_empty(rank_major.numel() // self.cp_size)
        node_id = str(UpdateId.activation(site, "kv", backward=True))
        self.store.comm.reduce_scatter(out, rank_major, rule=CP, parts=node_id)
        out = out.view(2, b, heads, s, d)
        if self._record is not None:
            expect = (
                "act_at",
                node_id,
                self.store.mesh.data_rank,
                self._head_slices(site, d, heads),
                (3, tuple(self._positions)),
            )
            sharing = self._kv_sharing(site)
            # A KV head shared over tp gets from each rank only its own query heads' part.
            self._record(node_id, out, ("part", sharing, expect) if len(sharing) > 1 else expect)
        return out[0], out[1]

    def _kv_sharing(self, site: str) -> tuple[int, ...]:
        """The ranks holding this rank's KV heads of ``site`` (itself alone unless heads are shared over tp)."""
        use = self.store.of_use.get(f"{site}.k_proj.weight")
        if use is None:  # MLA: every head its own key and value, split over tp, never shared
            return (self.store.mesh.rank,)
        k = use.instr
        rules = [c.rule for c in k.gradient if kv_replica_size(c.rule) is not None]
        return self.store.mesh.group(rules[0]).ranks if rules and k.tp_replicas > 1 else (self.store.mesh.rank,)

    def _head_slices(self, site: str, head_dim: int, heads: int) -> tuple:
        """This rank's KV heads (dimension 2 of ``[2, b, heads, s, d]``, ``heads`` of them here) when tp
        splits or shares them."""
        use = self.store.of_use.get(f"{site}.k_proj.weight")
        if use is None:  # MLA: the key/value up projection splits whole heads over tp, in rank order
            return ((2, self.tp_rank * heads, (self.tp_rank + 1) * heads),) if self.tp_size > 1 else ()
        slices = use.tp_slices
        if not slices:
            return ()
        _, start, stop = slices[0]
        return ((2, start // head_dim, stop // head_dim),)

    def _capture_positions(self, node_id: str, tensor: torch.Tensor, seq_sharded: bool) -> None:
        positions = self._positions
        if UpdateId.parse(node_id).kind == "loss":  # one row per token, [s, b] flattened sequence-first
            batch = tensor.shape[0] // len(positions)
            index = [p * batch + j for p in positions for j in range(batch)]
        elif seq_sharded:  # a tensor-parallel shard of this rank's positions
            n = tensor.shape[0]
            index = positions[self.tp_rank * n : (self.tp_rank + 1) * n]
        else:
            index = positions
        self._record(node_id, tensor, ("act_at", node_id, self.store.mesh.data_rank, (), (0, tuple(index))))


class _GatherContext(Function):
    """K and V of every cp rank's chunks (forward all_gather, backward reduce_scatter over cp)."""

    @staticmethod
    def forward(ctx, k, v, ops: ParallelOps, site: str):
        ctx.ops, ctx.site = ops, site
        return ops._gather_kv(site, k, v)

    @staticmethod
    def backward(ctx, dk, dv):
        # K and V have one shape; autograd passes None for an output that got no gradient.
        dk = dk if dk is not None else torch.zeros_like(dv)
        dv = dv if dv is not None else torch.zeros_like(dk)
        grad_k, grad_v = ctx.ops._scatter_kv_grad(ctx.site, dk, dv)
        return grad_k, grad_v, None, None


class _ContextMean(Function):
    """The mean over the whole sequence from each cp rank's mean over its own (equally many) tokens."""

    @staticmethod
    def forward(ctx, loss, ops: ParallelOps):
        ctx.cp = ops.cp_size
        total = loss.detach().reshape(1).to(torch.float64)
        ops.store.comm.bookkeeping_all_reduce(total, rule=CP, name="loss:context-mean")
        return (total / ops.cp_size).to(loss.dtype).reshape(loss.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.cp, None
