"""Mixture-of-experts layers: a top-k router and a set of experts, for every plan and the reference.

Routing (one function, ``route``, used by every rank and by the single-process reference): the
router's logits ``x @ W_router^T`` are computed in fp32, turned into probabilities with a softmax
over all experts, and each token goes to the ``experts_per_token`` most probable experts
(a stable sort: ties go to the lower expert index) with those probabilities as its weights, *not*
renormalised over the chosen experts (torchtitan's default). The layer's output for a token is
``sum_j weight_j * expert_j(x)``, an expert being the dense MLP's function on its own weights
(SwiGLU: ``down(silu(gate x) * up x)``; gelu and relu: ``down(act(up x))``). Expert weights are
stacked on dimension 0 (``[experts, ffn, hidden]`` for gate and up, ``[experts, hidden, ffn]``
for down); no capacity limit, no token is dropped, no auxiliary loss.

The layer sits where the dense MLP sits (model.py): its input comes through the tensor-parallel
``copy`` and its output leaves through ``reduce``, so the plan's ``layers.{i}.mlp`` activation
collectives are issued as for a dense layer. Under tensor parallelism (which needs sequence
parallelism here, as in Megatron):

- etp = tp: every tp rank routes all tokens of the gathered sequence and computes its slice of
  every expert's hidden features (column-parallel gate and up, row-parallel down); the partial
  outputs are summed by the ``reduce``. Each rank's router gradient is then a partial sum over
  the expert slices, which the plan's ``router:grad/tp`` all_reduce completes.
- etp = 1: experts are whole on every tp rank; tp rank ``t`` routes and computes only the tokens
  of its own sequence shard of the gathered input and contributes zeros for the others, so the
  ``reduce`` (a reduce_scatter) returns every rank its own tokens' output. The gradients of the
  experts are partial sums over disjoint tokens, which the plan's reduction over the expert-data
  group (it contains the tp ranks when etp = 1) completes.

Under expert parallelism (``TokenExchange``) the ep group joins ranks of one tp coordinate, and each
rank dispatches the rows it routes: its sequence shard (etp = 1) or all gathered tokens (etp = tp,
where what comes back is the rank's slice's part of every output, completed by the ``reduce``).
Under context parallelism each cp rank routes the tokens of its own chunks; ``slot_ids`` names
their global positions (``ops.context_positions``) for the evidence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd import Function

from mixle_compile.parameters import moe_layer_at
from mixle_compile.plan.vocabulary import UpdateId
from mixle_compile.spec.models import TransformerModel

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


@dataclass(frozen=True)
class ExpertShape:
    num_experts: int
    top_k: int
    frequency: int  # layers f, f + k, f + 2k, ... are mixture-of-experts layers
    activation: str
    shared: bool = False  # a shared expert beside the routed ones (model.py adds its output)
    shared_gate: bool = False  # its output scaled by sigmoid(x . w)
    first: int = 0  # f: the layers before it are dense

    @staticmethod
    def from_model(model: TransformerModel) -> ExpertShape | None:
        if not model.num_experts:
            return None
        return ExpertShape(
            model.num_experts,
            model.experts_per_token or 1,
            model.moe_layer_frequency,
            model.activation,
            bool(model.moe_shared_expert_hidden_size),
            model.moe_shared_expert_gate,
            model.moe_first_layer,
        )

    def is_moe_layer(self, layer: int) -> bool:
        return moe_layer_at(layer, num_experts=self.num_experts, frequency=self.frequency, first=self.first)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)`` of every token (``[tokens, top_k]``, fp32 and int64): the softmax
    probabilities of its ``top_k`` most probable experts, most probable first, not renormalised."""
    probs = torch.softmax(logits.float(), dim=-1)
    # A stable sort rather than topk, so that ties go to the lower expert index on every machine.
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    return weights[:, :top_k], experts[:, :top_k]


def expert_output(
    x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor, down: torch.Tensor, activation: str
) -> torch.Tensor:
    """One expert on its tokens ``x`` (``[n, hidden]``): the dense MLP's function on its weights."""
    hidden = F.linear(x, up)
    if gate is not None:
        inner = F.silu(F.linear(x, gate)) * hidden
    else:
        inner = _ACTIVATIONS[activation](hidden)
    return F.linear(inner, down)


def slot_inputs(tokens: torch.Tensor, top_k: int) -> torch.Tensor:
    """Every token once per chosen expert (``[tokens * top_k, hidden]``; row ``t * top_k + j``: token
    ``t``'s ``j``-th expert): what the experts receive."""
    return tokens.repeat_interleave(top_k, dim=0)


def run_experts(rows: torch.Tensor, expert_of_row: torch.Tensor, gate, up, down, activation: str) -> torch.Tensor:
    """Each row through its expert (``expert_of_row`` indexes the weights' dimension 0); ``[rows, hidden]``."""
    out = torch.zeros_like(rows)
    for e in range(up.shape[0]):
        chosen = (expert_of_row == e).nonzero().squeeze(1)
        if chosen.numel() == 0:
            continue
        y = expert_output(rows.index_select(0, chosen), None if gate is None else gate[e], up[e], down[e], activation)
        out = out.index_copy(0, chosen, y)
    return out


def combine(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Every token's weighted sum of its experts' outputs (``outputs``: ``[tokens * top_k, hidden]``)."""
    tokens, top_k = weights.shape
    return (outputs.view(tokens, top_k, -1) * weights.unsqueeze(-1).to(outputs.dtype)).sum(1)


class ExpertParallel:
    """How this rank's mixture-of-experts layers split their work (see the module docstring)."""

    def __init__(
        self, tp_size: int, tp_rank: int, etp: int, exchange: TokenExchange | None = None, cp_size: int = 1
    ) -> None:
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.cp_size = cp_size
        # etp = 1 under tp > 1: each tp rank takes the tokens of its own sequence shard.
        self.split_tokens = tp_size > 1 and etp == 1
        self.exchange = exchange  # ep > 1

    def token_rows(self, seq: int) -> tuple[int, int] | None:
        """The rows (sequence positions of the gathered input) this rank routes; None: all of them."""
        if not self.split_tokens:
            return None
        n = seq // self.tp_size
        return self.tp_rank * n, (self.tp_rank + 1) * n


def slot_ids(
    positions: torch.Tensor | None, seq: int, batch: int, top_k: int, rows: tuple[int, int] | None, device
) -> torch.Tensor:
    """The single-process reference's slot of every slot a rank routes (``[tokens * top_k]``): slot
    ``(p * batch + b) * top_k + j`` is the ``j``-th choice of sequence position ``p`` of sample ``b``.
    ``positions``: the global positions of the rank's ``seq`` rows under context parallelism (None:
    ``0 .. seq - 1``); ``rows``: the part of them the rank routes (``ExpertParallel.token_rows``)."""
    if positions is None:
        positions = torch.arange(seq, device=device)
    if rows is not None:
        positions = positions[rows[0] : rows[1]]
    tokens = (positions.unsqueeze(1) * batch + torch.arange(batch, device=device)).reshape(-1)
    return (tokens.unsqueeze(1) * top_k + torch.arange(top_k, device=device)).reshape(-1)


def expert_parallel(store, tp) -> ExpertParallel | None:
    """The ExpertParallel of a distributed rank (``store``: its ParamStore), None without experts."""
    instructions = store.instructions
    model = instructions.spec.model
    if not isinstance(model, TransformerModel) or not model.num_experts:
        return None
    plan = instructions.plan
    exchange = TokenExchange(store, model.num_experts, plan.etp > 1) if plan.ep > 1 else None
    return ExpertParallel(tp.size, tp.rank, plan.etp, exchange, store.mesh.degree("cp"))


def moe_mlp(ops, shape: ExpertShape, unit: str, h: torch.Tensor) -> torch.Tensor:
    """A mixture-of-experts layer on ``h`` (``[s, b, hidden]``, after the tensor-parallel copy)."""
    parallel: ExpertParallel | None = getattr(ops, "experts", None)
    seq, batch, hidden = h.shape
    rows = parallel.token_rows(seq) if parallel is not None else None
    x = h if rows is None else h[rows[0] : rows[1]]
    tokens = x.reshape(-1, hidden)
    logits = F.linear(tokens, ops.weight(f"{unit}.moe.router.weight"))
    weights, experts = route(logits, shape.top_k)
    gate = ops.weight(f"{unit}.moe.experts.gate_proj") if shape.activation == "swiglu" else None
    up = ops.weight(f"{unit}.moe.experts.up_proj")
    down = ops.weight(f"{unit}.moe.experts.down_proj")
    if parallel is not None and parallel.exchange is not None:
        slots = None
        if parallel.exchange.capture is not None:
            positions = ops.context_positions(seq * parallel.cp_size, tokens.device)
            slots = slot_ids(positions, seq, batch, shape.top_k, rows, tokens.device)
        outputs = parallel.exchange.run(unit, tokens, experts, slots, gate, up, down, shape.activation)
    else:
        # The reference observes what an expert-parallel run exchanges: the rows the experts receive
        # (``moe:dispatch``) and what they return (``moe:combine``), with their gradients.
        observe = getattr(ops, "observe_activation", None) or (lambda forward_key, backward_key, t: t)
        inputs = observe(*UpdateId.activation_pair(f"{unit}.moe", "dispatch"), slot_inputs(tokens, shape.top_k))
        outputs = run_experts(inputs, experts.reshape(-1), gate, up, down, shape.activation)
        outputs = observe(*UpdateId.activation_pair(f"{unit}.moe", "combine"), outputs)
    out = combine(outputs, weights).view(x.shape)
    if rows is None:
        return out
    before = out.new_zeros((rows[0], batch, hidden))
    after = out.new_zeros((seq - rows[1], batch, hidden))
    return torch.cat([before, out, after])


class TokenExchange:
    """Expert parallelism: this rank holds experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)`` and
    exchanges token rows with the other ranks of its ep group (see docs/runtime.md)."""

    def __init__(self, store, num_experts: int, split_experts: bool) -> None:
        self.store = store
        self.comm = store.comm
        mesh = store.mesh
        self.group = mesh.group(EP)
        self.size = self.group.size
        self.num_experts = num_experts
        self.local_experts = num_experts // self.size
        self.capture = store.capture
        # the data rank of every rank of the group, for the evidence of rows received from it
        self.source_data_ranks = [mesh.data_rank_of(r) for r in self.group.ranks]
        self.data_rank = mesh.data_rank
        # Experts split over tp (etp = tp > 1): what returns to a rank's own rows (the experts' outputs,
        # the gradients of their inputs) is its slice's part; the tp ranks' parts add up to the whole.
        self.tp_parts = mesh.group("tp").ranks if split_experts else None  # (etp > 1 means etp = tp)

    def run(
        self,
        unit: str,
        tokens: torch.Tensor,
        experts: torch.Tensor,
        slots: torch.Tensor | None,
        gate,
        up,
        down,
        activation: str,
    ) -> torch.Tensor:
        """The experts' outputs of every (token, choice) row, ``[tokens * top_k, hidden]`` in slot order
        (``slots``: each row's slot in the reference, when recording evidence)."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, hence by the rank holding it
        counts = torch.bincount(flat, minlength=self.num_experts)
        received_counts = torch.empty_like(counts)
        # Per-expert row counts first (bookkeeping: sizes, not data of an update), so that every rank
        # knows how many rows it receives from each rank for each of its experts.
        self.comm.bookkeeping_all_to_all(received_counts, counts, rule=EP, name=f"{unit}.moe:counts")
        send_splits = counts.view(self.size, self.local_experts).sum(1).tolist()
        receive_splits = received_counts.view(self.size, self.local_experts).sum(1).tolist()
        routed_bytes = flat.numel() * tokens.shape[1] * tokens.element_size()
        ids = None
        if slots is not None:
            # Which reference row each row is (token position and choice), for the evidence.
            own = slots.index_select(0, order)
            ids = torch.empty(sum(receive_splits), dtype=own.dtype, device=own.device)
            self.comm.bookkeeping_all_to_all(
                ids, own, rule=EP, name=f"{unit}.moe:row-ids", output_splits=receive_splits, input_splits=send_splits
            )
            ids = (own, ids)
        send = slot_inputs(tokens, top_k).index_select(0, order)
        received = _Exchange.apply(
            send,
            self,
            str(UpdateId.activation(f"{unit}.moe", "dispatch")),
            receive_splits,
            send_splits,
            routed_bytes,
            ids,
            True,
        )
        local = torch.arange(self.local_experts, device=flat.device).repeat(self.size)
        expert_of_row = local.repeat_interleave(received_counts.view(-1))
        outputs = run_experts(received, expert_of_row, gate, up, down, activation)
        back = _Exchange.apply(
            outputs,
            self,
            str(UpdateId.activation(f"{unit}.moe", "combine")),
            send_splits,
            receive_splits,
            routed_bytes,
            ids,
            False,
        )
        return back.new_zeros(back.shape).index_copy(0, order, back)

    def exchange(
        self, node_id: str, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], routed_bytes: int
    ) -> torch.Tensor:
        rows = rows.contiguous()
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        self.comm.all_to_all(
            out,
            rows,
            rule=EP,
            parts=node_id,
            nbytes=routed_bytes,
            output_splits=output_splits,
            input_splits=input_splits,
        )
        return out

    def record(self, node_id: str, rows: torch.Tensor, ids: torch.Tensor, splits: list[int] | None) -> None:
        """Evidence: rows of this rank's own tokens (``splits`` None) or received from each rank."""
        if splits is None:
            expect = ("act_at", node_id, self.data_rank, (), (0, tuple(ids.tolist())))
            self.capture(node_id, rows, expect if self.tp_parts is None else ("part", self.tp_parts, expect))
            return
        start = 0
        for source, n in enumerate(splits):
            if n:
                block = (0, tuple(ids[start : start + n].tolist()))
                self.capture(
                    node_id, rows[start : start + n], ("act_at", node_id, self.source_data_ranks[source], (), block)
                )
            start += n


EP = "ep"  # the group rule of expert parallelism


class _Exchange(Function):
    """Rows to the ranks holding their experts (dispatch) or back (combine); the backward sends the
    gradients the other way (``/grad``)."""

    @staticmethod
    def forward(
        ctx,
        rows,
        exchange: TokenExchange,
        node_id: str,
        output_splits,
        input_splits,
        routed_bytes: int,
        ids,
        outward: bool,
    ):
        ctx.exchange, ctx.node_id = exchange, node_id
        ctx.splits = (output_splits, input_splits)
        ctx.routed_bytes, ctx.ids, ctx.outward = routed_bytes, ids, outward
        out = exchange.exchange(node_id, rows, output_splits, input_splits, routed_bytes)
        if ids is not None:  # dispatch: received from other ranks; combine: back to the own rows
            exchange.record(node_id, out, ids[1] if outward else ids[0], output_splits if outward else None)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        node_id = str(UpdateId.parse(ctx.node_id).backward())
        out = ctx.exchange.exchange(node_id, grad, input_splits, output_splits, ctx.routed_bytes)
        if ctx.ids is not None:  # dispatch/grad: back to the own rows; combine/grad: received
            ctx.exchange.record(
                node_id, out, ctx.ids[0] if ctx.outward else ctx.ids[1], None if ctx.outward else input_splits
            )
        return out, None, None, None, None, None, None, None
