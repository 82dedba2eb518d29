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

from mixle_compile.parameters import AttentionWidths, attention_widths
from mixle_compile.runtime.experts import ExpertShape, moe_mlp
from mixle_compile.spec.models import Spec, TransformerModel

NORM_EPS = 1e-5
ROPE_THETA = 10000.0


class Ops(Protocol):
    tp_size: int
    tp_rank: int

    def weight(self, use: str) -> torch.Tensor: ...

    def unit_begin(self, unit: str, x: torch.Tensor | None) -> torch.Tensor | None: ...

    def unit_end(self, unit: str, y: torch.Tensor) -> torch.Tensor: ...

    def copy(self, site: str, x: torch.Tensor) -> torch.Tensor: ...

    def reduce(self, site: str, y: torch.Tensor) -> torch.Tensor: ...

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> torch.Tensor: ...

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

    def cross_entropy(self, logits, targets, vocab_start):
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

    @staticmethod
    def from_spec(spec: Spec) -> TransformerShape:
        m = spec.model
        assert isinstance(m, TransformerModel)
        a = attention_widths(m)
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
        )


def transformer_loss(ops: Ops, shape: TransformerShape, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one micro-batch (``inputs``, ``targets``: ``[b, s]`` token ids)."""
    return stage_forward(
        ops, shape, tuple(range(shape.num_layers)), first=True, last=True, x=None, inputs=inputs, targets=targets
    )


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
    head and the micro-batch's mean loss). Returns the residual stream, or the loss on the last stage."""
    ids = inputs.t()  # sequence-first
    targets = targets.t()
    seq = ids.shape[0]
    local = ops.context_positions(seq, ids.device)  # None: the whole sequence (cp = 1)
    if local is not None:
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
    rope = _rope_tables(seq, rotary, x.dtype, x.device, local) if shape.position_embedding == "rope" else None
    for i in layers:
        unit = f"layers.{i}"
        x = ops.unit_begin(unit, x)
        h = _norm(ops, shape, x, f"{unit}.attn_norm")
        if shape.latent is not None:
            attended = _latent_attention(ops, shape, shape.latent, unit, h, rope, local)
        else:
            attended = _attention(ops, shape, unit, ops.copy(f"{unit}.attn", h), rope, local)
        x = x + ops.reduce(f"{unit}.attn", attended)
        h = ops.copy(f"{unit}.mlp", _norm(ops, shape, x, f"{unit}.mlp_norm"))
        x = x + ops.reduce(f"{unit}.mlp", _feed_forward(ops, shape, i, unit, h))
        x = ops.unit_end(unit, x)
    if not last:
        return x
    x = ops.unit_begin("head", x)
    h = ops.copy("lm_head", _norm(ops, shape, x, "final_norm"))
    head = ops.weight("lm_head.weight")
    logits = F.linear(h, head).float()
    vocab_local = head.shape[0]
    losses = ops.cross_entropy(logits.reshape(-1, vocab_local), targets.reshape(-1), ops.tp_rank * vocab_local)
    return ops.unit_end("head", ops.context_mean(losses.mean()))


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
    if experts is not None and experts.is_moe_layer(layer):
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
