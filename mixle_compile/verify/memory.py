"""How much of the model's parameters one rank can hold, summarised for the memory rule.

The parameter list itself comes from :mod:`mixle_compile.parameters` (the one place shapes are
derived); this module only sorts it into the amounts the memory rule needs:

* by **category**, which decides how the layouts split a parameter: ``tensor_parallel``
  (column, row, embedding and head weights, divided by tp), ``replicated`` (norms, biases,
  routers and anything else, held whole by every tensor-parallel rank) and ``expert`` (divided
  by ep * etp);
* by **place**, which decides which pipeline stage holds it: every transformer layer
  (``every_layer``), only dense layers (``dense_layer``), only mixture-of-experts layers
  (``moe_layer``), the first stage (embeddings), the last stage (final norm and output head), and
  ``tied_copy``: a tied parameter counted a second time, which a single stage holds only once.

Amounts are kept per dtype origin so that the rule can price them under any precision: elements
stored in ``training.precision`` and elements whose parameter names its own dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from mixle_compile.parameters import (
    DTYPE_BYTES,
    MTP_EMBEDDING,
    block_matmuls,
    is_moe_layer,
    is_mtp_layer,
    layer_kinds_model,
    model_parameters,
    mtp_is_moe,
)
from mixle_compile.parameters import attention_widths as layer_attention
from mixle_compile.spec.models import ModulesModel, Spec, TransformerModel

CATEGORIES = ("tensor_parallel", "replicated", "expert")

_CATEGORY_OF_ROLE = {
    "column": "tensor_parallel",
    "row": "tensor_parallel",
    "embedding": "tensor_parallel",
    "head": "tensor_parallel",
    "expert": "expert",
}


@dataclass(frozen=True)
class Share:
    """An amount of parameters: elements, split by where their dtype comes from."""

    precision_elements: int = 0  # stored in training.precision
    fixed_elements: int = 0  # stored in a dtype the parameter names itself
    fixed_bytes: int = 0
    fixed_low_precision_elements: int = 0  # fixed-dtype elements below fp32 (need an fp32 master copy)

    def __add__(self, other: Share) -> Share:
        return Share(
            self.precision_elements + other.precision_elements,
            self.fixed_elements + other.fixed_elements,
            self.fixed_bytes + other.fixed_bytes,
            self.fixed_low_precision_elements + other.fixed_low_precision_elements,
        )

    def at_least(self, other: Share) -> Share:
        """Component-wise maximum (an upper bound of both)."""
        return Share(*(max(a, b) for a, b in zip(self._tuple(), other._tuple(), strict=True)))

    def at_most(self, other: Share) -> Share:
        return Share(*(min(a, b) for a, b in zip(self._tuple(), other._tuple(), strict=True)))

    def minus(self, other: Share) -> Share:
        return Share(*(a - b for a, b in zip(self._tuple(), other._tuple(), strict=True)))

    @property
    def elements(self) -> int:
        return self.precision_elements + self.fixed_elements

    def _tuple(self) -> tuple[int, int, int, int]:
        return (self.precision_elements, self.fixed_elements, self.fixed_bytes, self.fixed_low_precision_elements)


ZERO = Share()


@dataclass(frozen=True)
class ParameterFootprint:
    shares: Mapping[tuple[str, str], Share] = field(default_factory=dict)  # (place, category) -> amount
    moe_layer_frequency: int = 1  # every k-th layer is a mixture-of-experts layer
    moe_first_layer: int = 0  # ... from this one; the layers before it are dense
    hidden_size: int = 0  # transformers only (activation memory)
    num_heads: int = 0
    vocab_size: int = 0
    query_width: int = 0  # num_heads * head_dim
    kv_width: int = 0  # num_kv_heads * head_dim
    head_dim: int = 0
    ffn_width: int = 0  # the widest MLP per token: ffn_hidden_size, or experts_per_token * the experts' size
    dense_ffn_width: int = 0  # a dense MLP's width: ffn_hidden_size
    attention_width: int = 0  # queries, keys, values and attention output (0: query_width * 2 + kv_width * 2)
    latent_width: int = 0  # what MLA keeps beside the hidden-wide inputs (memory_model.activation_bytes_per_layer)
    op_saved_split: int = 0  # what torchtitan's op-level checkpointing saves, split over tp
    op_saved_whole: int = 0  # ... and whole on every tp rank
    up_projection_width: int = 0  # MLA's up projections' outputs (queries, keys, values); 0 without MLA
    # mixture-of-experts layers (memory_model.moe_layer_extra_bytes): see expert_shape
    num_experts: int = 0
    experts_per_token: int = 0
    expert_width: int = 0
    shared_width: int = 0  # a shared expert's features (0: none)
    capacity_factor: float = 1.0
    activation: str = "swiglu"
    mtp_depths: int = 0  # multi-token prediction depths on the last stage (each a block of the last layer's kind)
    mtp_moe: bool = False  # ... a mixture-of-experts block

    def share(self, place: str, category: str) -> Share:
        return self.shares.get((place, category), ZERO)


def _share_of(elements: int, dtype: str | None) -> Share:
    if dtype is None:
        return Share(precision_elements=elements)
    return Share(
        fixed_elements=elements,
        fixed_bytes=elements * DTYPE_BYTES[dtype],
        fixed_low_precision_elements=elements if dtype != "fp32" else 0,
    )


def parameter_footprint(spec: Spec) -> ParameterFootprint:
    """Sort a neural spec's parameters into the (place, category) amounts above."""
    model = spec.model
    # A transformer's layers are of two kinds, dense and mixture-of-experts (layers f, f + k, f + 2k,
    # ... with f = moe_first_layer, k = moe_layer_frequency), and layers of one kind hold the same
    # tensors: two layers show both kinds, so the footprint never lists a million layers' parameters.
    # kinds_of says which of the listed layers are MoE layers.
    kinds_of = layer_kinds_model(model, 2) if isinstance(model, TransformerModel) else model
    if kinds_of is not model:
        spec = spec.model_copy(update={"model": kinds_of})
    params = model_parameters(spec)
    if isinstance(model, ModulesModel):
        own_dtypes = [p.dtype for p in model.parameters]
    else:
        own_dtypes = [None] * len(params)

    per_layer: dict[int, dict[str, Share]] = {}
    shares: dict[tuple[str, str], Share] = {}
    seen_groups: set[str] = set()

    def add(place: str, category: str, amount: Share) -> None:
        shares[(place, category)] = shares.get((place, category), ZERO) + amount

    for p, own in zip(params, own_dtypes, strict=True):
        category = _CATEGORY_OF_ROLE.get(p.role, "replicated")
        amount = _share_of(p.numel, own)
        if p.layer is not None and not (isinstance(model, TransformerModel) and is_mtp_layer(kinds_of, p.layer)):
            layer = per_layer.setdefault(p.layer, {})
            layer[category] = layer.get(category, ZERO) + amount
            continue
        if p.layer is not None:  # a multi-token prediction depth's: the last stage holds every depth
            add("mtp_layers", category, amount)
            continue
        # the multi-token prediction depths' copy of the embedding is the last stage's
        place = "first_stage" if p.role == "embedding" and p.name != MTP_EMBEDDING else "last_stage"
        add(place, category, amount)
        if p.shared_group is not None:
            if p.shared_group in seen_groups:
                add("tied_copy", category, amount)
            seen_groups.add(p.shared_group)

    if isinstance(model, TransformerModel):
        moe = {i for i in per_layer if is_moe_layer(kinds_of, i)}
        dense = set(per_layer) - moe
        # What every layer holds (attention, norms) and what only dense or only MoE layers add.
        for category in CATEGORIES:
            amounts = [per_layer[i].get(category, ZERO) for i in sorted(per_layer)]
            common = amounts[0] if amounts else ZERO
            for a in amounts[1:]:
                common = common.at_most(a)
            add("every_layer", category, common)
            for place, layers in (("dense_layer", dense), ("moe_layer", moe)):
                extra = ZERO
                for i in layers:
                    extra = extra.at_least(per_layer[i].get(category, ZERO).minus(common))
                if extra != ZERO:
                    add(place, category, extra)
        return ParameterFootprint(
            MappingProxyType({k: v for k, v in shares.items() if v != ZERO}),
            moe_layer_frequency=model.moe_layer_frequency if model.num_experts > 0 else 1,
            moe_first_layer=model.moe_first_layer if model.num_experts > 0 else 0,
            hidden_size=model.hidden_size,
            num_heads=model.num_heads,
            vocab_size=model.vocab_size,
            head_dim=layer_attention(model).qk_head_dim,
            **activation_widths(model),
            **expert_shape(model),
            activation=model.activation,
            mtp_depths=model.mtp_num_layers,
            mtp_moe=mtp_is_moe(model),
        )

    # A listed model: layers may differ, so a stage is bounded by its heaviest layer.
    for category in CATEGORIES:
        heaviest = ZERO
        for layer in per_layer.values():
            heaviest = heaviest.at_least(layer.get(category, ZERO))
        if heaviest != ZERO:
            add("every_layer", category, heaviest)
    return ParameterFootprint(MappingProxyType({k: v for k, v in shares.items() if v != ZERO}))


def attention_widths(model, *, repeated_keys: bool) -> dict[str, int]:
    """The widths ring attention exchanges (memory_model.ring_attention_bytes): the query's, the
    keys' as the kernel sees them (the query's where the engine repeats key heads) and a head's
    (0 with repeated heads, which tp always divides, so no floor is needed)."""
    a = layer_attention(model)
    return {
        "query_width": a.q,
        "key_width": a.q if repeated_keys else a.k,
        "head_dim": 0 if repeated_keys else a.qk_head_dim,
    }


def activation_widths(model) -> dict[str, int]:
    """The per-token widths op-level selective checkpointing and fp8's saved inputs keep (see memory_model)."""
    a = layer_attention(model)
    ffn = model.ffn_hidden_size
    if model.num_experts > 0:
        routed = (model.experts_per_token or 1) * (model.moe_ffn_hidden_size or model.ffn_hidden_size)
        ffn = max(ffn, routed + (model.moe_shared_expert_hidden_size or 0))
    # torchtitan's op-level policy saves the odd-numbered matmuls' outputs and attention's
    saved = block_matmuls(a, ffn, 3 if model.activation == "swiglu" else 2)[::2]
    return {
        "query_width": a.q,
        "kv_width": a.k,
        "ffn_width": ffn,
        # a dense MLP's width (a model with experts: its dense layers')
        "dense_ffn_width": model.ffn_hidden_size,
        "attention_width": a.q + a.k + a.v + a.out,
        "latent_width": a.down + a.q_lora + a.kv_lora,
        "op_saved_split": int(sum(m.out for m in saved if m.split)) + a.out,
        "op_saved_whole": int(sum(m.out for m in saved if not m.split)),
        "up_projection_width": a.q + a.k + a.v if a.latent else 0,
    }


def expert_shape(model) -> dict:
    """What a mixture-of-experts layer's block keeps depends on (memory_model.moe_layer_extra_bytes):
    the experts, the top-k, an expert's hidden features, and the capacity factor (1, the even
    share, for dropless routing)."""
    return {
        "num_experts": model.num_experts,
        "experts_per_token": model.experts_per_token or 1,
        "expert_width": model.moe_ffn_hidden_size or model.ffn_hidden_size,
        "shared_width": model.moe_shared_expert_hidden_size or 0,
        "capacity_factor": model.expert_capacity_factor or 1.0,
    }
