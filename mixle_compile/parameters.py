"""The parameters of a neural model, derived in one place from the spec.

A `transformer` spec's parameters follow from its sizes; a `modules` spec lists them. Everything
downstream (graph sizing, the verifier's memory rule, layouts, the runtime) reads this list, so a
parameter's name, shape and role are decided here and nowhere else.

Shapes follow torch's convention for linear layers, ``[out_features, in_features]``: a
column-parallel layer splits dimension 0, a row-parallel layer dimension 1; embeddings are
``[vocab, hidden]`` and split over the vocabulary (dimension 0). Expert weights carry the expert
index as dimension 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

from mixle_compile.memory_model import stored_dtype
from mixle_compile.spec.models import ModulesModel, Spec, TransformerModel

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp64": 8}

TIED_EMBEDDING_GROUP = "tied_embedding"
#: The last pipeline stage's copy of the embedding that multi-token prediction reads (untied models).
MTP_EMBEDDING = "mtp_embed.weight"


@dataclass(frozen=True)
class Parameter:
    name: str
    shape: tuple[int, ...]
    role: str  # embedding, column, row, norm, expert, router, head, bias, latent (MLA's down projections), other
    dtype: str
    layer: int | None = None  # transformer block index; None outside the blocks
    shared_group: str | None = None  # tied parameters (one logical tensor held in several places)
    tp_dim: int | None = None  # the dimension tensor parallelism splits; None: replicated over tp

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def model_parameters(spec: Spec, layers: Iterable[int] | None = None) -> tuple[Parameter, ...]:
    """Every parameter of a neural spec, in module order. A distribution spec has none here.

    ``layers``: a transformer's blocks to list (in increasing order; every block when None), as the
    lowering lists one block of each run of blocks that lower alike (lower/runs.py)."""
    model = spec.model
    if isinstance(model, TransformerModel):
        split = True
        if model.mtp_num_layers:
            from mixle_compile.engines import engine_profile

            split = engine_profile(spec.backend).mtp_projection_split
        return transformer_parameters(
            model, stored_dtype(spec.training.precision), spec.training.seq_len, layers, mtp_projection_split=split
        )
    if isinstance(model, ModulesModel):
        return tuple(
            Parameter(
                name=p.name,
                shape=tuple(p.shape),
                role=p.role,
                dtype=p.dtype or stored_dtype(spec.training.precision),
                layer=p.layer,
                shared_group=p.shared_group,
                tp_dim=role_tp_dim(p.role, len(p.shape)),
            )
            for p in model.parameters
        )
    return ()


# Megatron's layout: column-parallel layers split their output features, row-parallel layers their
# input features, embeddings and the output head their vocabulary.
_ROLE_TP_DIM = {"column": 0, "row": 1, "embedding": 0, "head": 0}


def role_tp_dim(role: str, ndim: int) -> int | None:
    dim = _ROLE_TP_DIM.get(role)
    return dim if dim is not None and dim < ndim else None


@dataclass(frozen=True)
class AttentionWidths:
    """One layer's attention, per token: its heads and widths, the same for (grouped-query) multi-head
    attention and for Multi-head Latent Attention (MLA: DeepSeek-V2/V3, Megatron-Core's
    ``MLASelfAttention`` in megatron/core/transformer/multi_latent_attention.py). MLA projects the
    hidden state down to a query latent (``q_lora_rank``; none: one query projection), a key/value
    latent (``kv_lora_rank``) and one rotary key part shared by every head (``qk_rope_head_dim``),
    normalises the latents and projects them up per head: queries and keys of ``qk_nope_head_dim +
    qk_rope_head_dim`` features, values of ``v_head_dim``. The down projections are held whole by
    every tensor-parallel rank (Megatron's ``TELinear`` with ``parallel_mode="duplicated"``) and the
    up projections split by head like q, k, v."""

    hidden: int
    heads: int
    kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    q_lora: int = 0  # MLA's query latent (0: none)
    kv_lora: int = 0  # MLA's key/value latent (0: not MLA)
    rope: int = 0  # MLA's rotary key part

    @property
    def latent(self) -> bool:
        return self.kv_lora > 0

    @property
    def q(self) -> int:
        return self.heads * self.qk_head_dim

    @property
    def k(self) -> int:
        return self.kv_heads * self.qk_head_dim

    @property
    def v(self) -> int:
        return self.kv_heads * self.v_head_dim

    @property
    def out(self) -> int:
        """The attention output's width, the output projection's input."""
        return self.heads * self.v_head_dim

    @property
    def kv_head_dim(self) -> int:
        """The head size keys and values are exchanged at (one tensor under context parallelism): the
        larger of the two, the other padded with zeros (MLA's values are narrower than its keys)."""
        return max(self.qk_head_dim, self.v_head_dim)

    @property
    def down(self) -> int:
        """MLA's down projections' output width (query latent, key/value latent, rotary key); 0 without."""
        return self.q_lora + self.kv_lora + self.rope if self.latent else 0

    @property
    def gathered(self) -> int:
        """The width the column-parallel projections read, all-gathered over tp under sequence
        parallelism: the hidden state, or under MLA the latents and the rotary key (the hidden state in
        place of the query latent where queries are projected directly)."""
        if not self.latent:
            return self.hidden
        return (self.q_lora or self.hidden) + self.kv_lora + self.rope

    def projections(self) -> tuple[tuple[int, int, bool], ...]:
        """The linear projections of the attention's input, ``(input width, output width, split over
        tp)``: q, k, v as one; under MLA the down projections (whole on every tp rank), then the up
        projections (and the direct query projection) split by head."""
        if not self.latent:
            return ((self.hidden, self.q + self.k + self.v, True),)
        down = self.kv_lora + self.rope + self.q_lora
        up = [(self.kv_lora, self.k - self.heads * self.rope + self.v, True)]
        up.append((self.q_lora, self.q, True) if self.q_lora else (self.hidden, self.q, True))
        return ((self.hidden, down, False), *up)


@dataclass(frozen=True)
class Matmul:
    """One matrix multiplication of a block, per token: ``inner`` by ``out`` features."""

    name: str
    inner: float
    out: float
    split: bool  # its output split over tp (column-parallel); else whole on every tp rank
    gathered: bool = False  # reads the attention's input as tensor parallelism gathers it


def block_matmuls(a: AttentionWidths, ffn: float, matrices: int) -> list[Matmul]:
    """A block's matrix multiplications in the order its forward runs them: q, k, v and o
    (torchtitan/models/common/attention.py), or MLA's wq_a, wq_b (or wq), wkv_a, wkv_b and wo
    (torchtitan/models/deepseek_v3/model.py, ``Attention.forward``), then the MLP's w1, w3, w2
    (``w2(silu(w1(x)) * w3(x))``; w1, w2 without a gate). The output projections' outputs are
    partial sums, whole on every tp rank."""
    h = a.hidden
    if a.latent:
        attention = []
        if a.q_lora:
            attention += [Matmul("wq_a", h, a.q_lora, False), Matmul("wq_b", a.q_lora, a.q, True, True)]
        else:
            attention += [Matmul("wq", h, a.q, True, True)]
        nope_v = a.heads * (a.qk_head_dim - a.rope + a.v_head_dim)
        attention += [Matmul("wkv_a", h, a.kv_lora + a.rope, False), Matmul("wkv_b", a.kv_lora, nope_v, True, True)]
    else:
        attention = [Matmul("q", h, a.q, True, True), Matmul("k", h, a.k, True, True), Matmul("v", h, a.v, True, True)]
    mlp = [Matmul("w1", h, ffn, True)] + ([Matmul("w3", h, ffn, True)] if matrices == 3 else [])
    return [*attention, Matmul("o", a.out, h, False), *mlp, Matmul("w2", ffn, h, False)]


def _field_reader(model: Any) -> Callable[..., Any]:
    """``get(field, default)`` over a transformer given as its spec model or as a mapping of its fields."""
    return model.get if isinstance(model, Mapping) else lambda key, default=None: getattr(model, key, default)


def attention_widths(model: Any) -> AttentionWidths:
    """:class:`AttentionWidths` of a transformer (its spec model or the same fields as a mapping)."""
    get = _field_reader(model)
    h, heads = get("hidden_size"), get("num_heads")
    kv_lora = get("kv_lora_rank")
    if kv_lora:
        rope = get("qk_rope_head_dim") or 0
        qk = (get("qk_nope_head_dim") or 0) + rope
        return AttentionWidths(h, heads, heads, qk, get("v_head_dim") or qk, get("q_lora_rank") or 0, kv_lora, rope)
    d = get("head_dim") or h // heads
    return AttentionWidths(h, heads, get("num_kv_heads") or heads, d, d)


def is_moe_layer(model: TransformerModel, layer: int) -> bool:
    """Layers f, f + k, f + 2k, ... are mixture-of-experts layers (f = ``moe_first_layer``, k =
    ``moe_layer_frequency``; Megatron's integer ``--moe-layer-freq`` k is f = 0). A multi-token
    prediction block (index ``num_layers`` and above, :func:`is_mtp_layer`) is of the last layer's kind."""
    return moe_layer_at(
        min(layer, model.num_layers - 1),
        num_experts=model.num_experts,
        frequency=model.moe_layer_frequency,
        first=model.moe_first_layer,
    )


def is_mtp_layer(model: Any, layer: int | None) -> bool:
    """Whether block ``layer`` is a multi-token prediction depth's: they follow the decoder's layers,
    depth k at index ``num_layers + k``."""
    get = _field_reader(model)
    return layer is not None and layer >= get("num_layers")


def mtp_depths(model: Any) -> int:
    """How many multi-token prediction depths a transformer (spec model or mapping) has."""
    get = _field_reader(model)
    return get("mtp_num_layers") or 0


def mtp_is_moe(model: Any) -> bool:
    """Whether a multi-token prediction block is a mixture-of-experts block: the decoder's last
    layer's kind (Megatron-Core's get_gpt_mtp_block_spec_for_backend takes ``layer_specs[-1]``;
    torchtitan's _build_mtp_layers the last decoder layer's config)."""
    get = _field_reader(model)
    return moe_layer_at(
        get("num_layers") - 1,
        num_experts=get("num_experts", 0) or 0,
        frequency=get("moe_layer_frequency", 1) or 1,
        first=get("moe_first_layer", 0) or 0,
    )


def moe_layer_at(layer: int, *, num_experts: int, frequency: int, first: int = 0) -> bool:
    """:func:`is_moe_layer` from the model's fields (a model written as a mapping)."""
    return num_experts > 0 and layer >= first and (layer - first) % frequency == 0


def layer_kinds_model(model: TransformerModel, keep: int) -> TransformerModel:
    """The model cut to ``keep`` layers (at most) that show each kind of layer it has: an MoE layer 0
    and a dense layer 1 where it has both (whatever its ``moe_first_layer`` and frequency), every
    layer an MoE one where all are. Layers of one kind hold the same tensors, so figures taken per
    layer of a kind are read from it."""
    if model.num_layers <= keep:
        return model
    update: dict = {"num_layers": keep}
    if model.num_experts:
        both = model.moe_layer_frequency > 1 or model.moe_first_layer > 0
        update.update(moe_layer_frequency=2 if both else 1, moe_first_layer=0)
        if both and keep > 1 and model.mtp_num_layers and mtp_is_moe(model):
            # the last layer keeps its kind: a multi-token prediction block takes it (mtp_is_moe)
            update.update(moe_layer_frequency=1, moe_first_layer=keep - 1)
    return model.model_copy(update=update)


def moe_spacing_of(indices, layers: int) -> tuple[int, int] | None:
    """``(moe_first_layer, moe_layer_frequency)`` that make exactly the layers in ``indices`` MoE layers
    (:func:`moe_layer_at`; indices outside ``0 .. layers - 1`` name no layer), found without a list as
    long as the model: None where there is none, or they are not evenly spaced after the dense ones."""
    chosen = sorted({i for i in indices if 0 <= i < layers})
    if not chosen:
        return None
    first = chosen[0]
    frequency = chosen[1] - chosen[0] if len(chosen) > 1 else layers - first
    even = all(b - a == frequency for a, b in zip(chosen, chosen[1:], strict=False))
    return (first, frequency) if even and len(chosen) == len(range(first, layers, frequency)) else None


def same_kind_until(model: TransformerModel, first: int, end: int) -> int:
    """The end of the run of layers from ``first`` (before ``end``) that are all MoE layers or all
    dense (:func:`is_moe_layer`), found by the rule's arithmetic rather than layer by layer: every
    layer is dense without experts; the dense layers before the first MoE layer run to it; after it,
    with frequency 1 every layer is an MoE layer; otherwise an MoE layer stands alone and dense
    layers run to the next MoE layer."""
    frequency, start = model.moe_layer_frequency, model.moe_first_layer
    if model.num_experts <= 0:
        return end
    if first < start:
        return min(end, start)
    if frequency == 1:
        return end
    offset = first - start
    if offset % frequency == 0:
        return min(end, first + 1)
    return min(end, start + (offset // frequency + 1) * frequency)


def moe_layers_in(first: int, count: int, *, num_experts: int, frequency: int, start: int = 0) -> int:
    """How many of the layers ``first .. first + count - 1`` are MoE layers (:func:`moe_layer_at`:
    every ``frequency``-th from layer ``start``): the multiples of ``frequency`` in that range, counted
    from ``start``."""
    if num_experts <= 0 or count <= 0:
        return 0
    low, high = max(first, start) - start, first + count - start  # relative to the first MoE layer
    if high <= low:
        return 0
    return -(-high // frequency) - -(-low // frequency)


def transformer_parameters(
    model: TransformerModel,
    dtype: str,
    seq_len: int | None = None,
    layers: Iterable[int] | None = None,
    *,
    mtp_projection_split: bool = True,
) -> tuple[Parameter, ...]:
    """A transformer's parameters in module order: the embedding, the blocks, the final norm, the
    multi-token prediction depths (:func:`is_mtp_layer`), the output head. ``layers``: the blocks to
    list (decoder and multi-token prediction blocks by index, increasing); every block when None.
    ``mtp_projection_split``: a depth's projection is split over tp (EngineProfile.mtp_projection_split),
    else whole on every tp rank."""
    h, v = model.hidden_size, model.vocab_size
    a = attention_widths(model)
    gated = model.activation == "swiglu"
    tied = TIED_EMBEDDING_GROUP if model.tie_embeddings else None
    depths = model.mtp_num_layers
    out: list[Parameter] = []

    def add(
        name: str,
        shape: tuple[int, ...],
        role: str,
        layer: int | None = None,
        group: str | None = None,
        tp_dim: int | None = None,
    ) -> None:
        if tp_dim is None:
            tp_dim = role_tp_dim(role, len(shape))
        out.append(Parameter(name, shape, role, dtype, layer, group, tp_dim))

    def norm(name: str, layer: int | None) -> None:
        add(f"{name}.weight", (h,), "norm", layer)
        if model.norm == "layernorm":
            add(f"{name}.bias", (h,), "bias", layer)

    def block(i: int) -> None:
        p = f"layers.{i}"
        norm(f"{p}.attn_norm", i)
        if a.latent:
            _latent_attention(add, a, p, i, layernorm=model.norm == "layernorm")
        else:
            add(f"{p}.attn.q_proj.weight", (a.q, h), "column", i)
            add(f"{p}.attn.k_proj.weight", (a.k, h), "column", i)
            add(f"{p}.attn.v_proj.weight", (a.v, h), "column", i)
        add(f"{p}.attn.o_proj.weight", (h, a.out), "row", i)
        norm(f"{p}.mlp_norm", i)
        if is_moe_layer(model, i):
            e, f = model.num_experts, model.moe_ffn_hidden_size or model.ffn_hidden_size
            add(f"{p}.moe.router.weight", (e, h), "router", i)
            # Expert tensor parallelism (etp = tp) splits each expert's hidden features.
            if gated:
                add(f"{p}.moe.experts.gate_proj", (e, f, h), "expert", i, tp_dim=1)
            add(f"{p}.moe.experts.up_proj", (e, f, h), "expert", i, tp_dim=1)
            add(f"{p}.moe.experts.down_proj", (e, h, f), "expert", i, tp_dim=2)
            shared = model.moe_shared_expert_hidden_size
            if shared:
                # The shared expert is a dense MLP every token passes through, split over tp like one
                # (Megatron's SharedExpertMLP is an MLP on the tensor-parallel group; torchtitan's
                # shared_experts a FeedForward under the dense layers' plan).
                if gated:
                    add(f"{p}.moe.shared.gate_proj.weight", (shared, h), "column", i)
                add(f"{p}.moe.shared.up_proj.weight", (shared, h), "column", i)
                add(f"{p}.moe.shared.down_proj.weight", (h, shared), "row", i)
                if model.moe_shared_expert_gate:
                    # held whole by every tp rank, like the router (Megatron: gate_weight [1, hidden]).
                    add(f"{p}.moe.shared.gate.weight", (1, h), "router", i)
        else:
            f = model.ffn_hidden_size
            if gated:
                add(f"{p}.mlp.gate_proj.weight", (f, h), "column", i)
            add(f"{p}.mlp.up_proj.weight", (f, h), "column", i)
            add(f"{p}.mlp.down_proj.weight", (h, f), "row", i)

    def mtp_block(i: int) -> None:
        # Megatron-Core's MultiTokenPredictionLayer (megatron/core/transformer/multi_token_prediction.py):
        # enorm (the embedding of the tokens ahead), hnorm (the previous depth's hidden state), eh_proj
        # (a ColumnParallelLinear of [embedding, hidden] -> hidden, no bias), a transformer layer of the
        # decoder's last layer's spec, and final_layernorm before the shared output head; torchtitan's
        # MTPTransformerBlock (models/deepseek_v3/mtp.py) has the same tensors (mtp_norm for the last).
        p = f"layers.{i}.mtp"
        norm(f"{p}.enorm", i)
        norm(f"{p}.hnorm", i)
        add(f"{p}.eh_proj.weight", (h, 2 * h), "column" if mtp_projection_split else "latent", i)
        block(i)
        norm(f"{p}.final_norm", i)

    add("embed.weight", (v, h), "embedding", None, tied or (TIED_EMBEDDING_GROUP if depths else None))
    if model.position_embedding == "learned":
        add("pos_embed.weight", (model.positions(seq_len) or 1, h), "embedding")
    listed = tuple(range(model.num_layers + depths) if layers is None else layers)
    for i in listed:
        if i < model.num_layers:
            block(i)
    norm("final_norm", None)
    for i in listed:
        if i >= model.num_layers:
            mtp_block(i)
    add("lm_head.weight", (v, h), "head", None, tied)
    if depths and not tied:
        # A multi-token prediction depth embeds the tokens ahead with the model's embedding: on the last
        # pipeline stage Megatron-Core keeps a copy of it tied to the first stage's
        # (LanguageModule.setup_embeddings_and_output_layer: "maintain duplicated embedding weights in mtp
        # process stage"; finalize_model_grads all-reduces their gradients); on one stage it is the same
        # tensor. With tied embeddings the output head on the last stage is that copy already.
        add(MTP_EMBEDDING, (v, h), "embedding", None, TIED_EMBEDDING_GROUP)
    return tuple(out)


def _latent_attention(add: Callable[..., None], a: AttentionWidths, p: str, i: int, *, layernorm: bool) -> None:
    """MLA's parameters (:class:`AttentionWidths`). Its down projections and the latents' norms are
    held whole by every tp rank (role ``latent`` and ``norm``); the up projections split by head: each
    head's rows are its features together ([nope, rope] for queries, [nope, value] for the key/value
    up projection, as HF's DeepSeek-V3 lays them out), so a tp shard is whole heads."""

    def latent_norm(name: str, width: int) -> None:
        add(f"{p}.attn.{name}.weight", (width,), "norm", i)
        if layernorm:
            add(f"{p}.attn.{name}.bias", (width,), "bias", i)

    if a.q_lora:
        add(f"{p}.attn.q_a_proj.weight", (a.q_lora, a.hidden), "latent", i)
        latent_norm("q_a_norm", a.q_lora)
        add(f"{p}.attn.q_b_proj.weight", (a.q, a.q_lora), "column", i)
    else:
        add(f"{p}.attn.q_proj.weight", (a.q, a.hidden), "column", i)
    add(f"{p}.attn.kv_a_proj.weight", (a.kv_lora + a.rope, a.hidden), "latent", i)
    latent_norm("kv_a_norm", a.kv_lora)
    add(f"{p}.attn.kv_b_proj.weight", (a.heads * (a.qk_head_dim - a.rope + a.v_head_dim), a.kv_lora), "column", i)


def unique_parameter_bytes(params: tuple[Parameter, ...]) -> int:
    """Bytes of the distinct logical tensors: a tied group counts once."""
    seen: set[str] = set()
    total = 0
    for p in params:
        if p.shared_group is not None:
            if p.shared_group in seen:
                continue
            seen.add(p.shared_group)
        total += p.bytes
    return total
