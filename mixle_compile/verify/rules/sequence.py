"""Sequence splitting (Q0xx): context parallelism and sequence parallelism."""

from __future__ import annotations

from mixle_compile.diagnostics import Severity
from mixle_compile.spec.kinds import Engine
from mixle_compile.verify.logic import all_of, implies, negation, when
from mixle_compile.verify.rule import TRANSFORMER, Rule, define

CONTEXT_PARALLEL = define(
    Rule(
        code="Q001",
        name="context-parallel-seq-len",
        title="cp > 1 needs seq_len divisible by 2 * cp.",
        docs=(
            "Context parallelism splits each sequence over `cp` ranks. For causal attention the sequence is "
            "cut into `2 * cp` chunks and each rank takes one early and one late chunk so that all ranks do "
            "equal work (load balancing), so `seq_len % (2 * cp) == 0`."
        ),
        engine_reference=(
            "Megatron-LM `validate_args`: seq_length must be divisible by 2 * context_parallel_size; "
            "torch `context_parallel` round-robin load balancing"
        ),
        constraint=lambda v: implies(v.cp > 1, v.seq_len % (2 * v.cp) == 0),
        explain=lambda x: (
            f"seq_len={x.seq_len} cannot be cut into 2*cp = {2 * x.cp} equal chunks ({x.seq_len} % {2 * x.cp} != 0)"
        ),
        hint=lambda x: f"use a seq_len that is a multiple of {2 * x.cp}, or a cp whose double divides {x.seq_len}",
        fields=("cp", "seq_len"),
        needs=("seq_len",),
    )
)

SEQUENCE_PARALLEL_NEEDS_TP = define(
    Rule(
        code="Q002",
        name="sequence-parallel-needs-tp",
        title="sequence_parallel needs tp > 1.",
        docs=(
            "Sequence parallelism splits the activations outside attention and the MLP (norms, dropout) over "
            "the tensor-parallel ranks; with `tp: 1` there are no such ranks."
        ),
        engine_reference=(
            'Megatron-Core 0.16 megatron/core/model_parallel_config.py `__post_init__`: "Cannot use sequence '
            'parallelism without tensor parallelism"; the in-tree runtime splits sequences over tp ranks only'
        ),
        constraint=lambda v: implies(v.sequence_parallel, v.tp > 1),
        explain=lambda x: "sequence_parallel is on with tp=1",
        hint=lambda x: "set training.sequence_parallel: false, or use tp > 1",
        fields=("sequence_parallel", "tp"),
        engines=frozenset({Engine.TORCH, Engine.MEGATRON}),
        entries=frozenset({"core"}),
    )
)

SEQUENCE_PARALLEL_TURNED_OFF = define(
    Rule(
        code="Q004",
        name="sequence-parallel-turned-off",
        title="Warning: Megatron-LM turns sequence_parallel off when tp = 1.",
        docs=(
            "A warning, not an error: Megatron-LM's argument validation disables sequence parallelism when "
            'tensor parallelism is off ("Disabling sequence parallelism because tensor model parallelism is '
            "disabled\"), so `--sequence-parallel` at tp 1 runs, as Megatron-LM's own example scripts do. "
            "Megatron-Core's config classes, built directly (`entry: core`), refuse it instead (Q002). "
            "torchtitan applies sequence parallelism only inside its tensor-parallel plan, so it ignores it."
        ),
        engine_reference="Megatron-LM megatron/training/arguments.py `validate_args` (sequence_parallel with tp == 1)",
        constraint=lambda v: implies(v.sequence_parallel, v.tp > 1),
        explain=lambda x: "sequence_parallel is on with tp=1; Megatron-LM turns it off",
        hint=lambda x: "set training.sequence_parallel: false to say what runs",
        fields=("sequence_parallel", "tp"),
        engines=frozenset({Engine.MEGATRON}),
        entries=frozenset({"arguments"}),
        severity=Severity.warning,
        elastic=False,
    )
)

SEQUENCE_PARALLEL_SPLIT = define(
    Rule(
        code="Q003",
        name="sequence-parallel-seq-len",
        title="sequence_parallel needs seq_len divisible by tp * cp.",
        docs=(
            "With sequence parallelism each tensor-parallel rank holds `1/tp` of its context-parallel rank's "
            "`seq_len / cp` tokens, so `seq_len % (tp * cp) == 0` (with `cp: 1`, `seq_len % tp == 0`)."
        ),
        engine_reference="Megatron-Core sequence-parallel scatter (`tensor_shape[0] // tp` after `// cp`); torch "
        "`SequenceParallel` style",
        constraint=lambda v: implies(all_of(v.sequence_parallel, v.tp > 1), v.seq_len % (v.tp * v.cp) == 0),
        explain=lambda x: (
            f"seq_len={x.seq_len} cannot be split over tp*cp = {x.tp}*{x.cp} = {x.tp * x.cp} ranks "
            f"({x.seq_len} % {x.tp * x.cp} != 0)"
        ),
        hint=lambda x: f"use a seq_len that is a multiple of {x.tp * x.cp}, or turn sequence_parallel off",
        fields=("sequence_parallel", "seq_len", "tp", "cp"),
        needs=("seq_len",),
        engines=frozenset({Engine.TORCH, Engine.MEGATRON}),  # torchtitan's own divisor: Q005
    )
)


def _titan_divisor(v):
    """torchtitan's seq_len divisor: 0.2 `ParallelDims.seq_len_divisor` = tp * 2 * cp always;
    0.3 `trainer.py`: (tp with sequence parallelism, else 1) * (2 * cp when cp > 1, else 1)."""
    if v.facts.engine.at_least("0.3"):
        return when(all_of(v.sequence_parallel, v.tp > 1), v.tp, 1) * when(v.cp > 1, 2 * v.cp, 1)
    return v.tp * 2 * v.cp


def _titan_divisor_value(x) -> int:
    if x.facts.engine.at_least("0.3"):
        return (x.tp if x.sequence_parallel and x.tp > 1 else 1) * (2 * x.cp if x.cp > 1 else 1)
    return x.tp * 2 * x.cp


TORCHTITAN_SEQ_LEN = define(
    Rule(
        code="Q005",
        name="torchtitan-seq-len-divisor",
        title="torchtitan: seq_len divisible by its sequence divisor (tp and 2 * cp).",
        docs=(
            "torchtitan splits each sequence over the tensor-parallel ranks (sequence parallelism) and into "
            "`2 * cp` load-balanced chunks, and refuses a seq_len that does not divide. 0.2 asserts "
            "`seq_len % (tp * 2 * cp) == 0` in every model's `parallelize` (even at tp = cp = 1, where it is "
            "`% 2`); 0.3's trainer uses `(tp if sequence parallel else 1) * (2 * cp if cp > 1 else 1)`."
        ),
        engine_reference=(
            "torchtitan 0.2 torchtitan/distributed/parallel_dims.py `seq_len_divisor`, "
            "models/llama3/infra/parallelize.py; torchtitan 0.3 torchtitan/trainer.py (seq_len_divisor check)"
        ),
        constraint=lambda v: v.seq_len % _titan_divisor(v) == 0,
        explain=lambda x: f"seq_len={x.seq_len} is not a multiple of torchtitan's divisor {_titan_divisor_value(x)}",
        hint=lambda x: f"use a seq_len that is a multiple of {_titan_divisor_value(x)}",
        fields=("seq_len", "tp", "cp", "sequence_parallel"),
        needs=("seq_len",),
        engines=frozenset({Engine.TORCHTITAN}),
    )
)


MEGATRON_CP_ATTENTION = define(
    Rule(
        code="Q006",
        name="megatron-context-parallel-fused-attention",
        title="Megatron: cp > 1 needs a fused attention kernel (flash), not eager attention.",
        docs=(
            "Megatron-Core runs context parallelism inside Transformer Engine's attention, with its flash or "
            "fused (cuDNN) backend: TE turns its unfused backend off when context parallelism is on, and "
            "Megatron-Core's own `DotProductAttention` (`--transformer-impl local`) refuses any "
            "`context_parallel_size` but 1. With `training.attention: eager` (the score matrix materialised, "
            "as the unfused kernels do) there is no kernel left to run `cp > 1`."
        ),
        engine_reference=(
            'Megatron-Core 0.16 megatron/core/transformer/dot_product_attention.py `__init__` ("Context '
            'parallelism is only supported by TEDotProductAttention!"); Transformer Engine '
            "transformer_engine/pytorch/attention/dot_product_attention/utils.py `get_attention_backend` "
            '("Disabling UnfusedDotProductAttention as it does not support context parallelism")'
        ),
        constraint=lambda v: implies(v.cp > 1, negation(v.eager_attention)),
        explain=lambda x: f"cp={x.cp} with eager attention: Megatron runs context parallelism only in fused kernels",
        hint=lambda x: "set training.attention: flash (Transformer Engine's fused attention), or use cp: 1",
        fields=("cp", "eager_attention"),
        engines=frozenset({Engine.MEGATRON}),
    )
)


LEARNED_POSITIONS = define(
    Rule(
        code="Q007",
        name="seq-len-within-learned-positions",
        title="seq_len <= max_position_embeddings with learned positions.",
        docs=(
            "A learned absolute position embedding is a table with one row per position, "
            "`model.max_position_embeddings` rows (HF GPT-2's `n_positions`). A sequence longer than the table "
            "looks up rows that do not exist: an index error on the first step (a device-side assert on a GPU). "
            "Rotary positions have no table and no such limit."
        ),
        engine_reference=(
            "transformers models/gpt2/modeling_gpt2.py `GPT2Model.__init__` (`wpe = nn.Embedding("
            "config.max_position_embeddings, embed_dim)`, `max_position_embeddings` mapped to `n_positions`); "
            "Megatron-Core 0.16 megatron/core/models/common/embeddings/language_model_embedding.py "
            "(learned_absolute: an `Embedding` of `max_sequence_length` rows, GPTModel's max_position_embeddings)"
        ),
        constraint=lambda v: implies(v.learned_positions, v.seq_len <= v.max_position_embeddings),
        explain=lambda x: (
            f"seq_len={x.seq_len} needs positions 0..{x.seq_len - 1}, but the learned position table has "
            f"{x.max_position_embeddings} rows"
        ),
        hint=lambda x: (
            f"use a seq_len of at most {x.max_position_embeddings}, or a model whose max_position_embeddings is at "
            f"least {x.seq_len} (a learned table is trained for its length: it cannot simply be extended)"
        ),
        fields=("seq_len", "max_position_embeddings", "learned_positions"),
        needs=("seq_len", "max_position_embeddings"),
        families=TRANSFORMER,
    )
)

MEGATRON_MAX_POSITIONS = define(
    Rule(
        code="Q008",
        name="megatron-seq-len-within-max-positions",
        title="Megatron: seq_len <= max_position_embeddings, whatever the position embedding.",
        docs=(
            "Megatron-LM's argument validation asserts `max_position_embeddings >= seq_length` for every model, "
            "rotary ones included, before anything is built. "
            "`model.max_position_embeddings` is read from `--max-position-embeddings`."
        ),
        engine_reference=(
            'Megatron-LM megatron/training/arguments.py `validate_args` ("max_position_embeddings (...) must be '
            'greater than or equal to seq_length (...)")'
        ),
        constraint=lambda v: v.seq_len <= v.max_position_embeddings,
        explain=lambda x: (
            f"seq_len={x.seq_len} is longer than max_position_embeddings={x.max_position_embeddings}, which "
            "Megatron-LM refuses at start-up"
        ),
        hint=lambda x: f"set --max-position-embeddings (model.max_position_embeddings) to at least {x.seq_len}",
        fields=("seq_len", "max_position_embeddings"),
        needs=("seq_len", "max_position_embeddings"),
        engines=frozenset({Engine.MEGATRON}),
        families=TRANSFORMER,
    )
)
