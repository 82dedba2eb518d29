"""Pipeline parallelism (P0xx): stages, virtual stages, schedules, micro-batches, tied weights."""

from __future__ import annotations

from mixle_compile.diagnostics import Severity
from mixle_compile.schedules import applies, bubble_fraction, requirement
from mixle_compile.spec.kinds import Engine
from mixle_compile.verify.logic import TERMS, all_of, implies, negation, when
from mixle_compile.verify.rule import TRANSFORMER, Rule, define
from mixle_compile.verify.rules.memory import interleaved_group_of
from mixle_compile.verify.wording import alternatives, divisors, percent


def _stage_hint(x) -> str:
    fits = [d for d in divisors(x.layers) if d % x.virtual_pipeline_stages == 0 or x.virtual_pipeline_stages == 1]
    return f"use pp * virtual_pipeline_stages dividing num_layers={x.layers}: {alternatives(fits)}"


LAYERS_SPLIT = define(
    Rule(
        code="P001",
        name="layers-split-by-stages",
        title="An even layer split: pp * virtual_pipeline_stages divides num_layers.",
        docs=(
            "Under an even split every pipeline stage (every virtual stage, with interleaving) holds the same "
            "number of transformer layers, so `num_layers % (pp * virtual_pipeline_stages) == 0`. The split is "
            "even on Megatron by default (its uneven splits, `decoder_first_pipeline_num_layers`, "
            "`account_for_embedding_in_pipeline_split` or a `pipeline_model_parallel_layout`, are stated as a "
            "`training.pipeline_layers` list) and wherever `pipeline_layers: even` asks for it. torch's and "
            "torchtitan's default splits are uneven (see docs/spec.md)."
        ),
        engine_reference=(
            "Megatron-Core 0.16 megatron/core/transformer/transformer_config.py `__post_init__`: num_layers "
            "should be divisible by pipeline_model_parallel_size (and by vp per rank) without an uneven layout"
        ),
        constraint=lambda v: implies(
            all_of(v.even_split, v.pp * v.virtual_pipeline_stages <= v.layers),
            v.layers % (v.pp * v.virtual_pipeline_stages) == 0,
        ),
        explain=lambda x: (
            f"{x.layers} layers cannot be split evenly into pp*virtual_pipeline_stages = "
            f"{x.pp}*{x.virtual_pipeline_stages} = {x.pp * x.virtual_pipeline_stages} stages"
        ),
        hint=_stage_hint,
        fields=("pp", "num_layers", "virtual_pipeline_stages", "even_split"),
        families=TRANSFORMER,
    )
)

STAGES_EXCEED_LAYERS = define(
    Rule(
        code="P002",
        name="stages-exceed-layers",
        title="There are no more (virtual) pipeline stages than layers.",
        docs=(
            "Every (virtual) pipeline stage needs at least one layer: `pp * virtual_pipeline_stages <= "
            "layers`. For a `modules` model the layers are the distinct `layer` indices of its parameters; "
            "a modules model without layer indices cannot be pipelined. torchtitan counts the embedding and the "
            "output as one layer each, so it takes up to `layers + 2` stages; a listed `pipeline_layers` may "
            "leave a stage without layers (P010 checks the list)."
        ),
        engine_reference="torch.distributed.pipelining `pipeline()` split points; Megatron-Core pipeline layer "
        "assignment",
        # torchtitan splits layers + 2 slots (the embedding and the output count as one layer each),
        # so its stages may outnumber the layers by two (torchtitan/distributed/pipeline_parallel.py).
        constraint=lambda v: implies(
            negation(v.listed_split),
            v.pp * v.virtual_pipeline_stages <= v.layers + 2 * (v.facts.layer_split == Engine.TORCHTITAN),
        ),
        explain=lambda x: (
            f"pp*virtual_pipeline_stages = {x.pp}*{x.virtual_pipeline_stages} = {x.pp * x.virtual_pipeline_stages} "
            f"stages for {x.layers} layer{'s' * (x.layers != 1)}"
        ),
        hint=lambda x: f"use at most {x.layers} pipeline stages",
        fields=("pp", "layers", "num_layers", "virtual_pipeline_stages"),
    )
)


def _schedule_microbatches(v):
    return v.facts.engine.schedule_microbatches(v.microbatches, v.gradient_accumulation_steps)


def _numbers_microbatches(x) -> int:
    return x.facts.engine.schedule_microbatches(x.microbatches, x.gradient_accumulation_steps)


def _schedule_rule(code: str, name: str, title: str, docs: str, engines: frozenset[str]) -> Rule:
    """A rule stated by :mod:`mixle_compile.schedules`, the requirement the builder checks too."""
    req = requirement(code)
    return define(
        Rule(
            code=code,
            name=name,
            title=title,
            docs=docs,
            engine_reference=req.source,
            constraint=lambda v: implies(
                applies(
                    TERMS,
                    req,
                    pp=v.pp,
                    virtual_stages=v.virtual_pipeline_stages,
                    chosen=lambda s: v.is_("pipeline_schedule", s),
                ),
                req.holds(TERMS, v.pp, _schedule_microbatches(v), interleaved_group_of(v)),
            ),
            explain=lambda x: req.broken(x.pp, _numbers_microbatches(x), x.microbatch_group or x.pp),
            hint=lambda x: (
                req.fix(x.pp, _numbers_microbatches(x), x.microbatch_group or x.pp)
                + " (keep global_batch_size consistent, B001)"
            ),
            fields=(
                "microbatches",
                "pp",
                "pipeline_schedule",
                "gradient_accumulation_steps",
                "virtual_pipeline_stages",
                *(("microbatch_group",) if code == "P004" else ()),
            ),
            engines=engines,
        )
    )


_COUNTED = (
    " The micro-batches counted are those one run of the schedule takes: `microbatches * "
    "gradient_accumulation_steps` on torch (the in-tree runtime runs one schedule per optimizer step) "
    "and megatron (every micro-batch of the step), `microbatches` on torchtitan (one run per "
    "accumulation step)."
)

TORCH_SCHEDULES = frozenset({Engine.TORCH, Engine.TORCHTITAN})

TOO_FEW_MICROBATCHES = _schedule_rule(
    "P003",
    "too-few-microbatches",
    "torch: the 1F1B schedule needs at least pp micro-batches.",
    (
        "torch's `Schedule1F1B` refuses fewer micro-batches than stages. Its interleaved schedule accepts "
        "them (P005), GPipe has no limit (but see P008), and Megatron's non-interleaved 1F1B warms up "
        "`min(pp - rank - 1, m)` micro-batches and takes any number." + _COUNTED
    ),
    TORCH_SCHEDULES,
)

INTERLEAVED_GROUPS = _schedule_rule(
    "P004",
    "interleaved-microbatch-groups",
    "Megatron: the interleaved schedule needs microbatches to be a multiple of pp.",
    (
        "Megatron-Core's interleaved 1F1B schedule runs micro-batches in groups of "
        "`microbatch_group_size_per_vp_stage` (default pp) per virtual stage, needs the group between pp and "
        "the micro-batch count, and refuses a last group smaller than pp: with the default group, "
        "`m % pp == 0`. It interleaves only with virtual stages; with one it runs 1F1B." + _COUNTED
    ),
    frozenset({Engine.MEGATRON}),
)

INTERLEAVED_ROUNDS = _schedule_rule(
    "P005",
    "interleaved-microbatch-rounds",
    "torch: the interleaved schedule needs microbatches divisible by its rounds.",
    (
        "torch's `ScheduleInterleaved1F1B` runs `rounds = max(1, m // pp)` rounds of `m // rounds` "
        "micro-batches and needs `m % rounds == 0` (pp 4 with 10 micro-batches works, with 9 it does not; "
        "fewer micro-batches than stages work)." + _COUNTED
    ),
    TORCH_SCHEDULES,
)


VIRTUAL_NEEDS_PIPELINE = define(
    Rule(
        code="P006",
        name="virtual-stages-need-pipeline",
        title="virtual_pipeline_stages > 1 needs pp > 1.",
        docs="Virtual stages interleave several model chunks per pipeline rank; without a pipeline there is "
        "nothing to interleave.",
        engine_reference="Megatron-LM `validate_args`: virtual pipeline parallelism needs pipeline parallelism",
        constraint=lambda v: implies(v.virtual_pipeline_stages > 1, v.pp > 1),
        explain=lambda x: f"virtual_pipeline_stages={x.virtual_pipeline_stages} with pp=1",
        hint=lambda x: "set virtual_pipeline_stages: 1, or use pp > 1",
        fields=("virtual_pipeline_stages", "pp"),
    )
)

VIRTUAL_NEEDS_INTERLEAVING = define(
    Rule(
        code="P007",
        name="virtual-stages-need-interleaved-schedule",
        title="virtual_pipeline_stages > 1 needs pipeline_schedule: interleaved_1f1b.",
        docs=(
            "Only the interleaved schedule runs several stages per rank; GPipe and plain 1F1B run exactly one, "
            "so the other chunks would never be scheduled."
        ),
        engine_reference="torch.distributed.pipelining `PipelineScheduleSingle` (one stage per rank) vs "
        "`ScheduleInterleaved1F1B`",
        constraint=lambda v: implies(
            all_of(v.virtual_pipeline_stages > 1, v.pp > 1), v.is_("pipeline_schedule", "interleaved_1f1b")
        ),
        explain=lambda x: (
            f"virtual_pipeline_stages={x.virtual_pipeline_stages} under the {x.pipeline_schedule} schedule"
        ),
        hint=lambda x: "set pipeline_schedule: interleaved_1f1b, or virtual_pipeline_stages: 1",
        fields=("pipeline_schedule", "virtual_pipeline_stages", "pp"),
    )
)


BUBBLE = define(
    Rule(
        code="P008",
        name="pipeline-bubble",
        title="Warning: fewer than 4 * pp micro-batches leave a large pipeline bubble.",
        docs=(
            "A warning, not an error: the plan runs, but slowly. With `m` micro-batches, `pp` stages and `v` "
            "virtual stages each rank idles for about `(pp - 1) / (v * m + pp - 1)` of every step (the "
            "pipeline bubble). Below `4 * pp` micro-batches that share is large; the message states it. "
            "Warnings do not change the exit status."
        ),
        engine_reference="Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters (bubble "
        "(p-1)/m, /v interleaved)",
        constraint=lambda v: implies(v.pp > 1, v.microbatches >= 4 * v.pp),
        explain=lambda x: (
            f"{x.microbatches} micro-batch{'es' * (x.microbatches != 1)} for pp={x.pp} stages leave each rank idle "
            f"for about {percent(bubble_fraction(x.pp, x.microbatches, x.virtual_pipeline_stages))} of every step"
        ),
        hint=lambda x: (
            f"use microbatches >= {4 * x.pp} (fewer accumulation steps keep the global batch), or "
            "interleave virtual stages"
        ),
        fields=("microbatches", "pp"),
        severity=Severity.warning,
        elastic=False,
    )
)


LISTED_SPLIT = define(
    Rule(
        code="P010",
        name="listed-layer-split",
        title="A listed pipeline_layers names every (virtual) stage and every layer.",
        docs=(
            "`training.pipeline_layers: [n0, n1, ...]` gives the transformer layers of each virtual stage in "
            "model order (virtual stage `c * pp + s` is chunk `c` of stage `s`): one entry per stage, "
            "`pp * virtual_pipeline_stages` entries, adding up to the model's layers. A stage may hold none "
            "(Megatron's `account_for_embedding_in_pipeline_split` gives the first and last stage one layer "
            "fewer, down to zero)."
        ),
        engine_reference=(
            "Megatron-Core 0.16 megatron/core/transformer/pipeline_parallel_layer_layout.py (one entry per "
            "virtual stage, in virtual-stage order); torchtitan `module_fqns_per_model_part`"
        ),
        constraint=lambda v: all_of(
            v.pipeline_layers_stages == v.pp * when(v.pp == 1, 1, v.virtual_pipeline_stages),
            v.pipeline_layers_total == v.layers,
        ),
        explain=lambda x: (
            f"pipeline_layers lists {x.pipeline_layers_stages} stages holding {x.pipeline_layers_total} layers, "
            f"for pp*virtual_pipeline_stages = {x.pp}*{x.virtual_pipeline_stages if x.pp > 1 else 1} stages and "
            f"{x.layers} layers"
        ),
        hint=lambda x: (
            "list one layer count per (virtual) stage, adding up to the model's layers, or remove pipeline_layers"
        ),
        fields=(
            "pipeline_layers_stages",
            "pipeline_layers_total",
            "pp",
            "virtual_pipeline_stages",
            "layers",
            "num_layers",
        ),
        needs=("pipeline_layers_stages",),
    )
)


TORCHTITAN_TIED_PIPELINE = define(
    Rule(
        code="P011",
        name="torchtitan-tied-embeddings-need-one-stage",
        title="torchtitan: tied embeddings need pp = 1.",
        docs=(
            "torchtitan refuses to pipeline a model whose output head shares the input embedding: the two "
            "would land on different stages. (The in-tree runtime and Megatron sum the two copies' gradients "
            "over the tied group instead.)"
        ),
        engine_reference=(
            'torchtitan 0.3 torchtitan/models/common/decoder.py: "Weight tying is not supported with Pipeline '
            'Parallel."; 0.2 models/qwen3 `init_weights` (both modules on one stage)'
        ),
        constraint=lambda v: implies(v.tie_embeddings, v.pp == 1),
        explain=lambda x: f"tied embeddings with pp={x.pp}",
        hint=lambda x: "set pp: 1, or model.tie_embeddings: false",
        fields=("tie_embeddings", "pp"),
        families=TRANSFORMER,
        engines=frozenset({Engine.TORCHTITAN}),
    )
)


PIPELINE_OVERLAP_IS_MEGATRONS = define(
    Rule(
        code="P012",
        name="pipeline-overlap-is-megatrons",
        title="torch, torchtitan: overlap_pipeline_transfers is Megatron's switch; torch's pipelining has none.",
        docs=(
            "`training.overlap_pipeline_transfers` states Megatron's `overlap_p2p_comm`: whether its interleaved "
            "schedule runs a stage's sends and receives to its pipeline neighbours beside its compute (on from "
            "Megatron-LM's arguments, off from Megatron-Core's `ModelParallelConfig`). torch's pipelining "
            "runtime, which torchtitan and the in-tree runtime schedule with, has no such switch: its "
            "single-stage schedules wait for each receive before the step that needs it, and its multi-stage "
            "runtime posts a receive where its lowered schedule places it. A value here would state a setting "
            "the engine cannot be given; leave the field out (the step-time model prices these transfers "
            "exposed)."
        ),
        engine_reference=(
            "torch/distributed/pipelining/schedules.py (Schedule1F1B waits on its receives; "
            "_PipelineScheduleRuntime posts RECV_F/RECV_B actions); Megatron-Core model_parallel_config.py "
            "`overlap_p2p_comm`, megatron/training/arguments.py `--no-overlap-p2p-communication`"
        ),
        constraint=lambda v: negation(v.overlap_pipeline),
        explain=lambda x: "training.overlap_pipeline_transfers is set, but torch's pipelining has no such switch",
        hint=lambda x: "remove training.overlap_pipeline_transfers, or use backend: megatron",
        fields=("overlap_pipeline",),
        context=("backend",),
        engines=frozenset({Engine.TORCH, Engine.TORCHTITAN}),
        needs=("overlap_pipeline",),
        families=TRANSFORMER,
    )
)


TWO_STAGE_GROUPS = define(
    Rule(
        code="P014",
        name="two-stage-interleaved-groups",
        title="megatron: an interleaved micro-batch group above pp on two pipeline stages is not modelled.",
        docs=(
            "With two pipeline stages, each rank's activations and gradients both go to the other rank, and "
            "under a micro-batch group above pp (`training.microbatch_group_size`) Megatron's interleaved "
            "schedule sends a stage's activations several micro-batches ahead of the gradients it owes the "
            "same rank. Megatron runs it with `overlap_p2p_comm` (which validate_args requires for two "
            "interleaved stages), pairing its asynchronous sends and prefetched receives as they are "
            "posted; this tool's schedule model pairs one batched call per step in issue order, cannot "
            "prove those pairings, and so refuses the plan rather than emit a schedule it has not checked. "
            "The default group (pp) and any group on three or more stages are checked."
        ),
        engine_reference=(
            "Megatron-Core 0.16 megatron/core/pipeline_parallel/schedules.py "
            "(forward_backward_pipelining_with_interleaving: fwd/bwd_recv_buffer_size = group - pp + 1); "
            "megatron/training/arguments.py (two interleaved stages need overlap_p2p_comm)"
        ),
        constraint=lambda v: negation(
            all_of(
                v.pp == 2,
                v.is_("pipeline_schedule", "interleaved_1f1b"),
                v.virtual_pipeline_stages > 1,
                v.microbatch_group > v.pp,
            )
        ),
        explain=lambda x: (
            f"training.microbatch_group_size={x.microbatch_group} above pp=2 under the interleaved schedule: the "
            "order in which the two ranks' activations and gradients pair is not modelled"
        ),
        hint=lambda x: "leave microbatch_group_size out (pp), or use three or more pipeline stages",
        fields=("microbatch_group", "pp", "pipeline_schedule", "virtual_pipeline_stages"),
        engines=frozenset({Engine.MEGATRON}),
    )
)


MICROBATCH_GROUP_IS_MEGATRONS = define(
    Rule(
        code="P013",
        name="microbatch-group-is-megatrons",
        title="torch, torchtitan: microbatch_group_size is Megatron's setting; torch's pipelining has none.",
        docs=(
            "`training.microbatch_group_size` states Megatron's `microbatch_group_size_per_vp_stage`: how many "
            "micro-batches its interleaved schedule runs on one virtual stage before the next (default pp). "
            "torch's `ScheduleInterleaved1F1B`, which torchtitan and the in-tree runtime run, derives its "
            "rounds from the micro-batches and the stages (`microbatches_per_round`, P005) and takes no such "
            "setting: leave the field out."
        ),
        engine_reference=(
            "torch/distributed/pipelining/schedules.py ScheduleInterleaved1F1B (number_of_rounds, "
            "microbatches_per_round); Megatron-Core model_parallel_config.py microbatch_group_size_per_vp_stage"
        ),
        constraint=lambda v: v.microbatch_group == 0,
        explain=lambda x: (
            f"training.microbatch_group_size={x.microbatch_group} is set, but torch's pipelining has no such setting"
        ),
        hint=lambda x: "remove training.microbatch_group_size, or use backend: megatron",
        fields=("microbatch_group",),
        context=("backend",),
        engines=frozenset({Engine.TORCH, Engine.TORCHTITAN}),
    )
)
