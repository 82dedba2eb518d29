"""Tensor-parallel shapes (T0xx): every dimension a layout splits by tp must split evenly."""

from __future__ import annotations

from math import gcd

from mixle_compile.spec.kinds import Engine
from mixle_compile.verify.logic import all_of, any_of, implies
from mixle_compile.verify.rule import MODULES, TRANSFORMER, Rule, define
from mixle_compile.verify.wording import alternatives, divisors


def _split_hint(what: str, size: int) -> str:
    return f"use a tp that divides {what}={size}: {alternatives(divisors(size))}"


HEADS = define(
    Rule(
        code="T001",
        name="heads-split-by-tp",
        title="tp divides num_heads.",
        docs=(
            "Tensor parallelism gives each rank `num_heads / tp` whole attention heads (the query projection "
            "is column-parallel, the output projection row-parallel), so `num_heads % tp == 0`. The hidden size "
            "itself is split by no layout: column-parallel layers split their output features and row-parallel "
            "layers their input features, which are the heads' and the MLP's dimensions (T004), and the "
            "embedding and output head split the vocabulary (T005)."
        ),
        engine_reference=(
            "Megatron-Core `TransformerConfig`: num_attention_heads must be a multiple of tensor_model_parallel_size; "
            "torchtitan's attention TP plan (ColwiseParallel wq/wk/wv, RowwiseParallel wo)"
        ),
        constraint=lambda v: v.num_heads % v.tp == 0,
        explain=lambda x: f"{x.num_heads} heads cannot be split over tp={x.tp} ranks ({x.num_heads} % {x.tp} != 0)",
        hint=lambda x: _split_hint("num_heads", x.num_heads),
        fields=("tp", "num_heads"),
        families=TRANSFORMER,
    )
)


def _kv_choices(x) -> list[int]:
    return [t for t in divisors(x.devices) if x.num_kv_heads % t == 0 or t % x.num_kv_heads == 0]


KV_HEADS_TORCH = define(
    Rule(
        code="T002",
        name="kv-heads-split-or-replicated",
        title="tp divides num_kv_heads, or num_kv_heads divides tp (KV heads replicated).",
        docs=(
            "With grouped-query attention each tensor-parallel rank needs the key/value heads of its query "
            "heads. Either the KV heads split evenly (`num_kv_heads % tp == 0`) or each KV head is replicated "
            "on `tp / num_kv_heads` ranks (`tp % num_kv_heads == 0`); anything else leaves a query head "
            "without its KV head on some rank."
        ),
        engine_reference=(
            "torch runtime layout: KV heads replicated when tp > num_kv_heads (as vLLM and SGLang do); "
            "Megatron-Core 0.16 megatron/core/transformer/transformer_config.py `__post_init__` (num_query_groups "
            '"must be a multiple or divisor of" tp) and transformer/attention.py (one query group per tp rank '
            "when num_query_groups < tp)"
        ),
        constraint=lambda v: any_of(v.num_kv_heads % v.tp == 0, v.tp % v.num_kv_heads == 0),
        explain=lambda x: f"{x.num_kv_heads} % {x.tp} != 0 and {x.tp} % {x.num_kv_heads} != 0",
        hint=lambda x: (
            f"use a tp that divides or is a multiple of num_kv_heads={x.num_kv_heads}: {alternatives(_kv_choices(x))}"
        ),
        fields=("tp", "num_kv_heads"),
        needs=("num_kv_heads",),  # without it KV heads are the query heads: T001
        families=TRANSFORMER,
        engines=frozenset({Engine.TORCH, Engine.MEGATRON}),
        versions=((Engine.MEGATRON, ">=0.16"),),
    )
)

KV_HEADS_MEGATRON = define(
    Rule(
        code="T003",
        name="kv-heads-split-by-tp",
        title="Megatron before 0.16 and torchtitan: tp divides num_kv_heads (no KV-head replication).",
        docs=(
            "Megatron-Core up to 0.15 splits the query groups (KV heads) over the tensor-parallel ranks and does "
            "not replicate them, so `num_kv_heads % tp == 0` even when `tp` is a multiple of `num_kv_heads` "
            "(0.16 replicates them: T002). torchtitan's attention splits its KV heads over tp the same way."
        ),
        engine_reference=(
            "Megatron-Core 0.12-0.15 megatron/core/transformer/transformer_config.py `__post_init__`: "
            '"num_query_groups must be a multiple of tensor_model_parallel_size"; torchtitan 0.3 '
            "torchtitan/models/common/attention.py (n_kv_heads split over tp)"
        ),
        constraint=lambda v: v.num_kv_heads % v.tp == 0,
        explain=lambda x: (
            f"{x.num_kv_heads} KV heads cannot be split over tp={x.tp} ranks ({x.num_kv_heads} % {x.tp} != 0)"
        ),
        hint=lambda x: _split_hint("num_kv_heads", x.num_kv_heads),
        fields=("tp", "num_kv_heads"),
        needs=("num_kv_heads",),  # without it KV heads are the query heads: T001
        families=TRANSFORMER,
        engines=frozenset({Engine.MEGATRON, Engine.TORCHTITAN}),
        versions=((Engine.MEGATRON, "<0.16"),),
    )
)

FFN = define(
    Rule(
        code="T004",
        name="ffn-split-by-tp",
        title="tp divides ffn_hidden_size (for models with dense MLP layers).",
        docs=(
            "A dense MLP's up (and gate) projection is column-parallel and its down projection row-parallel: "
            "both split the `ffn_hidden_size` dimension over tp. A model whose every layer is a "
            "mixture-of-experts layer (`moe_layer_frequency` 1 from layer 0) has no dense MLP and is not checked "
            "(see T006)."
        ),
        engine_reference="Megatron-Core `ColumnParallelLinear`/`RowParallelLinear` (`divide(output_size, "
        "world_size)`); "
        "torchtitan's MLP TP plan",
        constraint=lambda v: implies(
            any_of(v.num_experts == 0, v.moe_layer_frequency > 1, v.moe_first_layer > 0),
            v.ffn_hidden_size % v.tp == 0,
        ),
        explain=lambda x: (
            f"ffn_hidden_size={x.ffn_hidden_size} cannot be split over tp={x.tp} ranks "
            f"({x.ffn_hidden_size} % {x.tp} != 0)"
        ),
        hint=lambda x: _split_hint("ffn_hidden_size", x.ffn_hidden_size),
        fields=("tp", "ffn_hidden_size", "num_experts", "moe_layer_frequency", "moe_first_layer"),
        families=TRANSFORMER,
    )
)

VOCAB = define(
    Rule(
        code="T005",
        name="vocab-split-by-tp",
        title="torch: tp divides vocab_size.",
        docs=(
            "The torch runtime shards the token embedding and the output head over the vocabulary with "
            "tensor parallelism and needs equal shards. Megatron pads the vocabulary to a multiple of "
            "`128 * tp` itself (`--make-vocab-size-divisible-by`), so its rule set does not check this."
        ),
        engine_reference="torch runtime layout (vocabulary-parallel embedding and head); Megatron-LM "
        "`_vocab_size_with_padding`",
        constraint=lambda v: v.vocab_size % v.tp == 0,
        explain=lambda x: (
            f"vocab_size={x.vocab_size} cannot be split over tp={x.tp} ranks ({x.vocab_size} % {x.tp} != 0)"
        ),
        hint=lambda x: _split_hint("vocab_size", x.vocab_size) + ", or pad the vocabulary",
        fields=("tp", "vocab_size"),
        families=TRANSFORMER,
        engines=frozenset({Engine.TORCH}),
    )
)

EXPERT_FFN = define(
    Rule(
        code="T006",
        name="expert-ffn-split-by-etp",
        title="etp divides the experts' hidden size.",
        docs=(
            "With expert tensor parallelism each expert's MLP is split over `etp` ranks along its hidden "
            "dimension (`moe_ffn_hidden_size`, which defaults to `ffn_hidden_size`)."
        ),
        engine_reference="Megatron-Core expert layers (`divide(ffn_hidden_size, expert_tensor_parallel_size)`)",
        constraint=lambda v: implies(v.num_experts > 0, v.moe_ffn_hidden_size % v.etp == 0),
        explain=lambda x: (
            f"the experts' hidden size {x.moe_ffn_hidden_size} cannot be split over etp={x.etp} ranks "
            f"({x.moe_ffn_hidden_size} % {x.etp} != 0)"
        ),
        hint=lambda x: (
            f"use an etp that divides {x.moe_ffn_hidden_size}: {alternatives(divisors(x.moe_ffn_hidden_size))}"
        ),
        fields=("etp", "moe_ffn_hidden_size", "num_experts"),
        families=TRANSFORMER,
    )
)

SHARED_EXPERT = define(
    Rule(
        code="T008",
        name="shared-expert-split-by-tp",
        title="tp divides the shared expert's hidden size.",
        docs=(
            "A shared expert (`moe_shared_expert_hidden_size`) is a dense MLP in every mixture-of-experts "
            "layer, split over tp like the dense MLP: its up (and gate) projection column-parallel and its down "
            "projection row-parallel, both along its hidden features. It is split over tp, not etp: the "
            "routed experts' split (T006) does not apply to it."
        ),
        engine_reference="Megatron-Core `SharedExpertMLP` (transformer/moe/shared_experts.py: an `MLP` with "
        "`ffn_hidden_size = moe_shared_expert_intermediate_size` on the tensor-parallel group); torchtitan's "
        "shared experts under the dense MLP's TP plan",
        constraint=lambda v: implies(
            all_of(v.num_experts > 0, v.moe_shared_expert_hidden_size > 0),
            v.moe_shared_expert_hidden_size % v.tp == 0,
        ),
        explain=lambda x: (
            f"the shared expert's hidden size {x.moe_shared_expert_hidden_size} cannot be split over tp={x.tp} "
            f"ranks ({x.moe_shared_expert_hidden_size} % {x.tp} != 0)"
        ),
        hint=lambda x: _split_hint("moe_shared_expert_hidden_size", x.moe_shared_expert_hidden_size),
        fields=("tp", "moe_shared_expert_hidden_size", "num_experts"),
        families=TRANSFORMER,
    )
)


def _uneven(x) -> list[str]:
    out = []
    for d, _ in x.symbols.split_dimensions:
        size = x.value_of(d.symbol)
        if size % x.tp:
            out.append(f"{d.parameter} dimension {d.dim} ({size})")
    return out


def _parameter_hint(x) -> str:
    sizes = [x.value_of(d.symbol) for d, _ in x.symbols.split_dimensions]
    common = 0
    for s in sizes:
        common = gcd(common, s)
    return f"use a tp that divides every split dimension: {alternatives(divisors(common or 1))}"


PARAMETERS = define(
    Rule(
        code="T007",
        name="parameter-split-by-tp",
        title="tp divides every dimension a listed parameter's role splits.",
        docs=(
            "For a `modules` model the layout splits `column`, `embedding` and `head` parameters along "
            "dimension 0 and `row` parameters along dimension 1 (torch's `[out, in]` convention), so those "
            "dimensions must be multiples of tp. `norm`, `bias`, `router` and `other` parameters are held "
            "whole; `expert` parameters are split over ep (E004)."
        ),
        engine_reference="torch `ColwiseParallel`/`RowwiseParallel` shard dims 0 and 1 of nn.Linear weights",
        constraint=lambda v: all_of(*[size % v.tp == 0 for _, size in v.split_dimensions]),
        explain=lambda x: f"tp={x.tp} does not divide " + alternatives(_uneven(x), limit=4).replace(" or ", " and "),
        hint=_parameter_hint,
        fields=("tp",),
        families=MODULES,
    )
)
