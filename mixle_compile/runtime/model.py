"""The models the runtime trains, written once for every plan and for the single-process reference.

The model code never touches a process group. It asks an ``Ops`` object for each weight (which may
all-gather it), marks the units FSDP frees and regathers (embedding, each block, the head), and
passes activations through ``copy`` and ``reduce`` at the tensor-parallel boundaries; a
distributed run and the reference differ only in the ``Ops`` they pass.

The transformer: vocabulary-parallel embedding (plus learned positions, split the same way), then
blocks of pre-norm attention (column-parallel q, k, v with their heads split over tp, grouped-query
attention, rotary positions, causal) and a pre-norm MLP (column-parallel gate/up, row-parallel
down), a final norm and a vocabulary-parallel head with its cross entropy. Activations are
sequence-first, ``[s, b, h]``. Multi-head Latent Attention (``model.kv_lora_rank``) replaces q, k, v
with down projections to latents, whole on every tp rank, and up projections split by head
(``_latent_attention``).

Multi-token prediction (``model.mtp_num_layers`` D, DeepSeek-V3 as Megatron-Core 0.16 runs it; see
``_mtp_depth``): blocks ``num_layers .. num_layers + D - 1`` are the depths, on the last stage after
the final norm. Depth k embeds the tokens k + 1 ahead, joins them with the previous depth's hidden
state (the final norm's output for k = 0) through ``eh_proj``, runs a block of the last layer's kind
and its own norm, and predicts the token k + 2 ahead through the shared output head; their mean
loss, weighted by ``mtp_loss_scaling_factor``, adds its gradient to the main loss's.

Context parallelism (``ops.cp_size > 1``): the sequence is cut into ``2 * cp`` chunks and cp rank
``r`` keeps chunks ``r`` and ``2cp - 1 - r`` (an early and a late one, so that causal attention
costs every rank the same). Positions stay global (rotary and learned embeddings, the causal
mask); each attention layer gathers K and V of every chunk over cp (``ops.gather_kv``) and masks
by global position; the loss is the mean over the whole sequence (``ops.context_mean``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.autograd import Function

from mixle_compile.engines import engine_profile
from mixle_compile.parameters import MTP_EMBEDDING, AttentionWidths, attention_widths
from mixle_compile.plan.vocabulary import UpdateId
from mixle_compile.runtime.experts import ExpertShape, moe_mlp
from mixle_compile.runtime.tensor_parallel import LOSS_SITE  # the output head's cross entropy (its gather over tp)
from mixle_compile.spec.models import Spec, TransformerModel

NORM_EPS = 1e-5
ROPE_THETA = 10000.0
# training.mtp_loss_scaling_factor: null: Megatron-Core's default (megatron/core/transformer/
# transformer_config.py, ``mtp_loss_scaling_factor: Optional[float] = 0.1``), which this runtime follows
MTP_LOSS_SCALING_FACTOR = 0.1


class Ops(Protocol):
    tp_size: int
    tp_rank: int

    def weight(self, use: str) -> torch.Tensor: ...

    def unit_begin(self, unit: str, x: torch.Tensor | None) -> torch.Tensor | None: ...

    def unit_end(self, unit: str, y: torch.Tensor) -> torch.Tensor: ...

    def copy(self, site: str, x: torch.Tensor) -> torch.Tensor: ...

    def reduce(self, site: str, y: torch.Tensor) -> torch.Tensor: ...

    def gather_output(self, site: str, y: torch.Tensor) -> torch.Tensor: ...

    def cross_entropy(
        self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, site: str = LOSS_SITE
    ) -> torch.Tensor: ...

    def context_positions(self, seq: int, device) -> torch.Tensor | None: ...

    def gather_kv(
        self, site: str, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def context_mean(self, loss: torch.Tensor) -> torch.Tensor: ...


def cp_positions(seq: int, cp: int, cp_rank: int) -> list[int]:
    """Global positions cp rank ``cp_rank`` holds: chunks ``cp_rank`` and ``2cp - 1 - cp_rank`` of ``2cp``."""
    if seq % (2 * cp):
        raise ValueError(
            f"context parallelism cuts a sequence of {seq} tokens into 2 * cp = {2 * cp} equal chunks; it does "
            "not divide"
        )
    chunk = seq // (2 * cp)
    late = 2 * cp - 1 - cp_rank
    return list(range(cp_rank * chunk, (cp_rank + 1) * chunk)) + list(range(late * chunk, (late + 1) * chunk))


class LocalOps:
    """The model helpers' Ops for plain local tensors (no collectives: tp = 1), e.g. one pipeline stage
    or a single-process baseline."""

    tp_size = 1
    tp_rank = 0

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def weight(self, use: str) -> torch.Tensor:
        return self.tensors[use]

    def unit_begin(self, unit, x):
        return x

    def unit_end(self, unit, y):
        return y

    def copy(self, site, x):
        return x

    def reduce(self, site, y):
        return y

    def gather_output(self, site, y):
        return y

    def cross_entropy(self, logits, targets, vocab_start, site=LOSS_SITE):
        return F.cross_entropy(logits, targets, reduction="none")

    def context_positions(self, seq, device):
        return None  # the whole sequence, in order

    def gather_kv(self, site, k, v):
        return k, v, None

    def context_mean(self, loss):
        return loss


@dataclass(frozen=True)
class TransformerShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm: str
    activation: str
    position_embedding: str
    compute_dtype: torch.dtype
    experts: ExpertShape | None = None  # mixture-of-experts layers (runtime/experts.py); None: none
    latent: AttentionWidths | None = None  # Multi-head Latent Attention's widths; None: grouped-query attention
    mtp_depths: int = 0  # multi-token prediction depths (blocks num_layers .. num_layers + mtp_depths - 1)
    mtp_loss_scale: float = 0.0  # each depth's loss weight: mtp_loss_scaling_factor / mtp_depths
    # eh_proj split over tp by its outputs (Megatron-Core's ColumnParallelLinear), else whole on every
    # tp rank (torchtitan): the plan's engine decides, as it decided the layout (EngineProfile.mtp_projection_split)
    mtp_projection_split: bool = True
    # the table a depth embeds the tokens ahead with: the last stage's copy of the embedding
    # (mtp_embed.weight; on one stage the embedding's own tensor), or with tied embeddings the output
    # head, which is that weight
    mtp_embedding: str = MTP_EMBEDDING

    @staticmethod
    def from_spec(spec: Spec) -> TransformerShape:
        m = spec.model
        assert isinstance(m, TransformerModel)
        a = attention_widths(m)
        depths = m.mtp_num_layers
        factor = spec.training.mtp_loss_scaling_factor
        factor = MTP_LOSS_SCALING_FACTOR if factor is None else float(factor)
        return TransformerShape(
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=a.kv_heads,
            head_dim=a.qk_head_dim,
            ffn_hidden_size=m.ffn_hidden_size,
            norm=m.norm,
            activation=m.activation,
            position_embedding=m.position_embedding,
            compute_dtype=torch.bfloat16 if spec.training.precision == "bf16" else torch.float32,
            experts=ExpertShape.from_model(m),
            latent=a if a.latent else None,
            mtp_depths=depths,
            mtp_loss_scale=factor / depths if depths else 0.0,
            mtp_projection_split=engine_profile(spec.backend).mtp_projection_split if depths else True,
            mtp_embedding="lm_head.weight" if m.tie_embeddings else MTP_EMBEDDING,
        )


def transformer_loss(ops: Ops, shape: TransformerShape, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one micro-batch (``inputs``, ``targets``: ``[b, s]`` token ids);
    with multi-token prediction its gradient also carries the depths' weighted loss (``_MtpLoss``)."""
    blocks = tuple(range(shape.num_layers + shape.mtp_depths))
    return stage_forward(ops, shape, blocks, first=True, last=True, x=None, inputs=inputs, targets=targets)


def stage_forward(
    ops: Ops,
    shape: TransformerShape,
    layers: tuple[int, ...],
    *,
    first: bool,
    last: bool,
    x: torch.Tensor | None,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """One (virtual pipeline) stage of the transformer: (the embedding), its blocks, (the final norm, the
    multi-token prediction depths, the head and the micro-batch's mean loss). ``layers``: the stage's
    blocks, the depths' among them on the last stage. Returns the residual stream, or the loss on the
    last stage."""
    depths = tuple(i for i in layers if i >= shape.num_layers)
    expected = tuple(range(shape.num_layers, shape.num_layers + shape.mtp_depths)) if last else ()
    if depths != expected:
        raise ValueError(
            f"the multi-token prediction depths are blocks {list(expected) or 'none'} on this stage, but it was "
            f"given {list(depths) or 'none'}: every depth runs on the last stage, after the final norm"
        )
    ids = inputs.t()  # sequence-first
    targets = targets.t()
    seq = ids.shape[0]
    local = ops.context_positions(seq, ids.device)  # None: the whole sequence (cp = 1)
    if local is not None:
        if depths:
            raise ValueError("multi-token prediction reads the tokens ahead of the whole sequence: it runs with cp = 1")
        ids, targets = ids.index_select(0, local), targets.index_select(0, local)
    if first:
        ops.unit_begin("embed", None)
        x = _vocab_lookup(ids, ops.weight("embed.weight"), ops.tp_rank)
        if shape.position_embedding == "learned":
            positions = (torch.arange(seq, device=ids.device) if local is None else local).unsqueeze(1).expand_as(ids)
            x = x + _vocab_lookup(positions, ops.weight("pos_embed.weight"), ops.tp_rank)
        x = ops.reduce("embed", x)
        x = ops.unit_end("embed", x)
    rotary = shape.latent.rope if shape.latent is not None else shape.head_dim
    # MLA turns the rotary part of its heads whatever the model's positions (Megatron-Core's
    # MultiLatentAttention builds its own rotary embedding; learned positions add the table as well)
    turned = shape.position_embedding == "rope" or shape.latent is not None
    rope = _rope_tables(seq, rotary, x.dtype, x.device, local) if turned else None
    for i in layers:
        if i >= shape.num_layers:
            continue  # a multi-token prediction depth: after the final norm
        unit = f"layers.{i}"
        x = ops.unit_begin(unit, x)
        x = ops.unit_end(unit, _block(ops, shape, i, x, rope, local))
    if not last:
        return x
    x = ops.unit_begin("head", x)
    # The final norm's output is what the head and the first depth read: Megatron-Core's
    # TransformerBlock applies final_layernorm before returning (transformer_block.py, "Final layer
    # norm"; with MTP it sits on the stage of the decoder's last layer, has_final_layernorm_in_this_stage),
    # and GPTModel._postprocess hands that output to self.mtp (models/gpt/gpt_model.py).
    h = _norm(ops, shape, x, "final_norm")
    # Each weight is asked for once per micro-batch, however often it is used: a use's gradient is
    # reduced when its backward has run (the last micro-batch's), so the uses share one.
    head = ops.weight("lm_head.weight")
    mtp = None
    if depths:
        # The depths run before the main logits, as in GPTModel._postprocess. Each depth is an FSDP unit
        # of its own (layers.{i}), nested in the head's, which holds the final norm, the output head and
        # the embedding copy every depth reads.
        table = head if shape.mtp_embedding == "lm_head.weight" else ops.weight(shape.mtp_embedding)
        hidden = h
        for k, i in enumerate(depths):
            hidden, ce = _mtp_depth(ops, shape, i, k, hidden, ids, targets, rope, table, head)
            mtp = ce if mtp is None else mtp + ce
        mtp = mtp * shape.mtp_loss_scale
    h = ops.copy("lm_head", h)
    logits = F.linear(h, head).float()
    vocab_local = head.shape[0]
    losses = ops.cross_entropy(logits.reshape(-1, vocab_local), targets.reshape(-1), ops.tp_rank * vocab_local)
    loss = ops.context_mean(losses.mean())
    if mtp is not None:
        loss = _MtpLoss.apply(loss, mtp)
    return ops.unit_end("head", loss)


def _block(
    ops: Ops, shape: TransformerShape, i: int, x: torch.Tensor, rope, local: torch.Tensor | None
) -> torch.Tensor:
    """Block ``i`` on the residual stream ``x``: pre-norm attention, then a pre-norm MLP (or MoE)."""
    unit = f"layers.{i}"
    h = _norm(ops, shape, x, f"{unit}.attn_norm")
    if shape.latent is not None:
        attended = _latent_attention(ops, shape, shape.latent, unit, h, rope, local)
    else:
        attended = _attention(ops, shape, unit, ops.copy(f"{unit}.attn", h), rope, local)
    x = x + ops.reduce(f"{unit}.attn", attended)
    h = ops.copy(f"{unit}.mlp", _norm(ops, shape, x, f"{unit}.mlp_norm"))
    return x + ops.reduce(f"{unit}.mlp", _feed_forward(ops, shape, i, unit, h))


def tokens_ahead(t: torch.Tensor, shift: int) -> torch.Tensor:
    """``t`` (sequence-first, ``[s, ...]``) moved ``shift`` positions left, the last ``shift`` positions 0:
    Megatron-Core's ``roll_tensor(t, shifts=-1)`` (multi_token_prediction.py: ``torch.roll``, then the
    rolled-in position filled with 0) applied ``shift`` times, as depth k = shift - 1 receives the ids,
    labels and loss mask rolled by every depth before it."""
    out = torch.zeros_like(t)
    if shift < t.shape[0]:
        out[: t.shape[0] - shift] = t[shift:]
    return out


def _mtp_depth(
    ops: Ops,
    shape: TransformerShape,
    i: int,
    k: int,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    targets: torch.Tensor,
    rope,
    table: torch.Tensor,
    head: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-token prediction depth ``k`` (block ``i``) on the previous depth's hidden state ``hidden``
    (as this tp rank holds it: its sequence shard under sequence parallelism); ``ids``, ``targets``:
    the micro-batch's whole ``[s, b]``; ``table``: this rank's vocabulary slice of the embedding the
    depth reads (``shape.mtp_embedding``), ``head``: of the output head. Returns the depth's hidden
    state and its mean loss.

    Megatron-Core 0.16 megatron/core/transformer/multi_token_prediction.py,
    ``MultiTokenPredictionLayer``: ``_get_embeddings`` rolls the ids (and position ids) one more
    position left and embeds them with the model's embedding (``embedding=self.embedding``, a
    vocabulary-parallel lookup and its reduce); ``_concat_embeddings`` computes
    ``eh_proj(cat(enorm(embedding), hnorm(hidden)))`` with eh_proj a ColumnParallelLinear
    (``gather_output=False``), then ``gather_from_tensor_model_parallel_region`` and, under sequence
    parallelism, ``scatter_to_sequence_parallel_region``; the transformer layer follows (the
    decoder's last layer's spec), then ``_postprocess``'s final_layernorm. Its rotary embedding is the
    decoder's own ``rotary_pos_emb`` (GPTModel passes it unchanged), so the block's positions are 0 ..
    s - 1 as in the decoder; the rolled position ids reach only the embedding, which adds them for
    learned absolute positions, which Megatron refuses with MTP (and so does this runtime).
    GPTModel._postprocess then gives the depth's hidden state to the shared output layer, rolls the
    labels and the loss mask once more per depth (``roll_tensor``) and takes
    ``sum(loss_mask * loss) / num_tokens``, ``num_tokens`` the rolled mask's sum: the mean over the
    positions that still have a token ahead."""
    unit = f"layers.{i}"
    site = f"{unit}.mtp"
    hidden = ops.unit_begin(unit, hidden)
    ahead = tokens_ahead(ids, k + 1)
    e = ops.reduce(f"{site}.embed", _vocab_lookup(ahead, table, ops.tp_rank))
    joined = torch.cat([_norm(ops, shape, e, f"{site}.enorm"), _norm(ops, shape, hidden, f"{site}.hnorm")], dim=-1)
    projection = ops.weight(f"{site}.eh_proj.weight")
    if shape.mtp_projection_split:
        x = ops.gather_output(f"{site}.eh_proj", F.linear(ops.copy(f"{site}.eh_proj", joined), projection))
    else:  # whole on every tp rank, on the tokens the rank holds (torchtitan's layout)
        x = F.linear(joined, projection)
    x = _block(ops, shape, i, x, rope, None)
    hidden = ops.unit_end(unit, _norm(ops, shape, x, f"{site}.final_norm"))
    logits = F.linear(ops.copy(f"{site}.head", hidden), head).float()
    vocab_local = head.shape[0]
    losses = ops.cross_entropy(
        logits.reshape(-1, vocab_local),
        tokens_ahead(targets, k + 1).reshape(-1),
        ops.tp_rank * vocab_local,
        str(UpdateId.activation(f"{site}.head", "loss")),
    )
    seq, batch = ids.shape
    valid = seq - (k + 1)  # positions whose label is still inside the sequence
    mask = (torch.arange(seq, device=ids.device) < valid).unsqueeze(1).expand(seq, batch).reshape(-1)
    return hidden, (losses * mask.to(losses.dtype)).sum() / (valid * batch)


class _MtpLoss(Function):
    """The main loss, whose backward also starts the depths' weighted loss's: Megatron-Core's
    MTPLossAutoScaler (multi_token_prediction.py) returns the main output unchanged and gives the MTP
    loss the gradient ``main_loss_backward_scale``, which the schedule sets to the main loss's own
    backward scale (pipeline_parallel/schedules.py: ``loss_scale / num_microbatches``), so the gradient
    is that of main + MTP while the value reported is the main loss."""

    @staticmethod
    def forward(ctx, main: torch.Tensor, mtp: torch.Tensor) -> torch.Tensor:
        return main.view_as(main)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad


def _vocab_lookup(ids: torch.Tensor, table: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """Rows of a table split over tp by rows: ids outside this rank's slice contribute zeros."""
    rows = table.shape[0]
    local = ids - tp_rank * rows
    inside = (local >= 0) & (local < rows)
    if bool(inside.all()):
        return F.embedding(local, table)
    return F.embedding(local.clamp(0, rows - 1), table).masked_fill(~inside.unsqueeze(-1), 0.0)


def _norm(ops: Ops, shape: TransformerShape, x: torch.Tensor, prefix: str) -> torch.Tensor:
    w = ops.weight(f"{prefix}.weight")
    xf = x.float()  # normalise in fp32 whatever the compute precision
    if shape.norm == "layernorm":
        b = ops.weight(f"{prefix}.bias")
        return F.layer_norm(xf, (xf.shape[-1],), w.float(), b.float(), NORM_EPS).to(x.dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return (y * w.float()).to(x.dtype)


def _rope_tables(
    seq: int, head_dim: int, dtype: torch.dtype, device, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of the rotary embedding at ``positions`` (default: 0 .. seq - 1)."""
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    at = torch.arange(seq, device=device, dtype=torch.float32) if positions is None else positions.to(torch.float32)
    angles = torch.outer(at, inv)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope  # [s, d/2]; x: [b, heads, s, d]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    s, b, width = t.shape
    return t.view(s, b, width // head_dim, head_dim).permute(1, 2, 0, 3)  # [b, heads, s, d]


def _attention(
    ops: Ops, shape: TransformerShape, unit: str, h: torch.Tensor, rope, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal grouped-query attention; ``positions``: the global positions of ``h``'s tokens under
    context parallelism (K and V of every position are gathered, the mask compares positions)."""
    d = shape.head_dim
    q = _heads(F.linear(h, ops.weight(f"{unit}.attn.q_proj.weight")), d)
    k = _heads(F.linear(h, ops.weight(f"{unit}.attn.k_proj.weight")), d)
    v = _heads(F.linear(h, ops.weight(f"{unit}.attn.v_proj.weight")), d)
    if rope is not None:
        q, k = _rotate(q, rope), _rotate(k, rope)
    # Query heads per KV head, the same on every tp rank; with fewer KV heads than tp ranks a rank
    # holds one KV head (shared with its KV-replica group) and only query heads that use it.
    group = q.shape[1] // k.shape[1]
    k, v, key_positions = ops.gather_kv(f"{unit}.attn", k, v)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if key_positions is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_positions.unsqueeze(0) <= positions.unsqueeze(1))
    s, b = h.shape[0], h.shape[1]
    o = o.permute(2, 0, 1, 3).reshape(s, b, -1)
    return F.linear(o, ops.weight(f"{unit}.attn.o_proj.weight"))


def _latent_attention(
    ops: Ops,
    shape: TransformerShape,
    a: AttentionWidths,
    unit: str,
    h: torch.Tensor,
    rope,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal Multi-head Latent Attention (parameters.AttentionWidths). ``h`` is the normalised input
    as this tp rank holds it (its sequence shard under sequence parallelism): the down projections,
    whole on every tp rank, and the latents' norms run on it, as Megatron-Core's duplicated
    ``linear_q_down_proj``/``linear_kv_down_proj`` do; the latents and the rotary key then cross the
    tensor-parallel boundary together (the block's input gather under sequence parallelism) and the
    up projections make this rank's heads. A head's query and key are its features without positions
    and the rotary ones (the key's shared by every head); its value is ``v_head_dim`` wide."""
    site = f"{unit}.attn"
    kv = F.linear(h, ops.weight(f"{site}.kv_a_proj.weight"))
    parts = [_norm(ops, shape, kv[..., : a.kv_lora], f"{site}.kv_a_norm"), kv[..., a.kv_lora :]]
    if a.q_lora:
        parts.insert(0, _norm(ops, shape, F.linear(h, ops.weight(f"{site}.q_a_proj.weight")), f"{site}.q_a_norm"))
    else:
        parts.insert(0, h)  # queries are projected from the hidden state itself
    gathered = ops.copy(site, torch.cat(parts, dim=-1))
    q_in, kv_latent, k_rope = gathered.split([a.q_lora or a.hidden, a.kv_lora, a.rope], dim=-1)
    nope = a.qk_head_dim - a.rope
    q_weight = ops.weight(f"{site}.q_b_proj.weight" if a.q_lora else f"{site}.q_proj.weight")
    q = _heads(F.linear(q_in, q_weight), a.qk_head_dim)
    q_nope, q_rope = q.split([nope, a.rope], dim=-1)
    k_nope, v = _heads(F.linear(kv_latent, ops.weight(f"{site}.kv_b_proj.weight")), nope + a.v_head_dim).split(
        [nope, a.v_head_dim], dim=-1
    )
    k_rope = _heads(k_rope, a.rope)  # [b, 1, s, rope]: one rotary key for every head
    if rope is not None:
        q_rope, k_rope = _rotate(q_rope, rope), _rotate(k_rope, rope)
    q = torch.cat([q_nope, q_rope], dim=-1)
    k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    # Keys and values cross context parallelism as one tensor: the narrower padded with zeros (a
    # zero feature adds nothing to a score; a zero value feature is cut from the output).
    d = a.kv_head_dim
    q, k, v = (F.pad(t, (0, d - t.shape[-1])) if t.shape[-1] < d else t for t in (q, k, v))
    k, v, key_positions = ops.gather_kv(site, k, v)
    scale = a.qk_head_dim**-0.5
    if key_positions is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        mask = key_positions.unsqueeze(0) <= positions.unsqueeze(1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s, b = gathered.shape[0], gathered.shape[1]
    o = o[..., : a.v_head_dim].permute(2, 0, 1, 3).reshape(s, b, -1)
    return F.linear(o, ops.weight(f"{site}.o_proj.weight"))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu": F.gelu, "relu": F.relu}


def _feed_forward(ops: Ops, shape: TransformerShape, layer: int, unit: str, h: torch.Tensor) -> torch.Tensor:
    experts = shape.experts
    # a multi-token prediction depth's block is of the decoder's last layer's kind (parameters.is_moe_layer)
    if experts is not None and experts.is_moe_layer(min(layer, shape.num_layers - 1)):
        out = moe_mlp(ops, experts, unit, h)
        if experts.shared:
            # The shared expert: the dense MLP's function on every token, split over tp like it (its
            # partial sums join the routed experts' in the layer's reduce); the gate's sigmoid is
            # computed from the whole input on every tp rank, so it scales each partial alike.
            shared = _mlp(ops, shape, f"{unit}.moe.shared", h, suffix="")
            if experts.shared_gate:
                shared = shared * torch.sigmoid(F.linear(h, ops.weight(f"{unit}.moe.shared.gate.weight")))
            out = out + shared
        return out
    return _mlp(ops, shape, unit, h)


def _mlp(ops: Ops, shape: TransformerShape, unit: str, h: torch.Tensor, suffix: str = ".mlp") -> torch.Tensor:
    up = F.linear(h, ops.weight(f"{unit}{suffix}.up_proj.weight"))
    if shape.activation == "swiglu":
        inner = F.silu(F.linear(h, ops.weight(f"{unit}{suffix}.gate_proj.weight"))) * up
    else:
        inner = _ACTIVATIONS[shape.activation](up)
    return F.linear(inner, ops.weight(f"{unit}{suffix}.down_proj.weight"))


def default_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the last dimension for integer targets, mean squared error otherwise."""
    if targets.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(), targets.reshape(-1))
    return F.mse_loss(outputs.float(), targets.float())


def module_loss(ops: Ops, module: torch.nn.Module, names: tuple[str, ...], loss_fn, inputs, targets) -> torch.Tensor:
    """A user's module, called with the plan's parameters in place of its own (one FSDP unit)."""
    from torch.func import functional_call

    ops.unit_begin("module", None)
    weights = {name: ops.weight(name) for name in names}
    outputs = functional_call(module, weights, (inputs,), tie_weights=False, strict=False)
    return ops.unit_end("module", loss_fn(outputs, targets))
