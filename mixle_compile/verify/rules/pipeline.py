"""Pipeline parallelism (P0xx): stages, virtual stages, schedules, micro-batches, tied weights."""

from __future__ import annotations

from mixle_compile.diagnostics import Severity
from mixle_compile.verify.logic import all_of, implies, larger
from mixle_compile.verify.rule import Rule, define
from mixle_compile.verify.wording import alternatives, divisors, percent

TRANSFORMER = frozenset({"transformer"})
ONE_F_ONE_B = ("1f1b", "interleaved_1f1b")


def _stage_hint(x) -> str:
    fits = [d for d in divisors(x.layers) if d % x.virtual_pipeline_stages == 0 or x.virtual_pipeline_stages == 1]
    return f"use pp * virtual_pipeline_stages dividing num_layers={x.layers}: {alternatives(fits)}"


LAYERS_SPLIT = define(
    Rule(
        code="P001",
        name="layers-split-by-stages",
        title="pp * virtual_pipeline_stages divides num_layers.",
        docs=(
            "Each pipeline stage (each virtual stage, with interleaving) holds the same number of transformer "
            "layers, so `num_layers % (pp * virtual_pipeline_stages) == 0`. Engines that accept uneven "
            "stages do so through an explicit stage layout, which a spec does not state."
        ),
        engine_reference=(
            "Megatron-Core `TransformerConfig`: num_layers must be divisible by the (virtual) pipeline model "
            "parallel size without an explicit layout; torchtitan's pipeline splitting"
        ),
        constraint=lambda v: implies(
            v.pp * v.virtual_pipeline_stages <= v.layers, v.layers % (v.pp * v.virtual_pipeline_stages) == 0
        ),
        explain=lambda x: (
            f"{x.layers} layers cannot be split evenly into pp*virtual_pipeline_stages = "
            f"{x.pp}*{x.virtual_pipeline_stages} = {x.pp * x.virtual_pipeline_stages} stages"
        ),
        hint=_stage_hint,
        fields=("pp", "num_layers", "virtual_pipeline_stages"),
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
            "a modules model without layer indices cannot be pipelined."
        ),
        engine_reference="torch.distributed.pipelining `pipeline()` split points; Megatron-Core pipeline layer assignment",
        constraint=lambda v: v.pp * v.virtual_pipeline_stages <= v.layers,
        explain=lambda x: (
            f"pp*virtual_pipeline_stages = {x.pp}*{x.virtual_pipeline_stages} = {x.pp * x.virtual_pipeline_stages} "
            f"stages for {x.layers} layer{'s' * (x.layers != 1)}"
        ),
        hint=lambda x: f"use at most {x.layers} pipeline stages",
        fields=("pp", "layers", "num_layers", "virtual_pipeline_stages"),
    )
)

TOO_FEW_MICROBATCHES = define(
    Rule(
        code="P003",
        name="too-few-microbatches",
        title="1F1B schedules need at least pp micro-batches.",
        docs=(
            "A one-forward-one-backward schedule (plain or interleaved) fills the pipeline with one micro-batch "
            "per stage before its steady state; with fewer micro-batches than stages it cannot run. GPipe has "
            "no such limit (but see P008)."
        ),
        engine_reference=(
            "torch.distributed.pipelining `Schedule1F1B`: \"Number of microbatches must be greater than or "
            "equal to the number of stages\"; Megatron-Core interleaved schedule (micro-batch group >= pp)"
        ),
        constraint=lambda v: implies(
            all_of(v.pp > 1, v.is_("pipeline_schedule", *ONE_F_ONE_B)), v.microbatches >= v.pp
        ),
        explain=lambda x: f"{x.microbatches} micro-batch{'es' * (x.microbatches != 1)} for pp={x.pp} stages under the {x.pipeline_schedule} schedule",
        hint=lambda x: f"use microbatches >= {x.pp} (and keep global_batch_size consistent, B001), or pipeline_schedule: gpipe",
        fields=("microbatches", "pp", "pipeline_schedule"),
    )
)

INTERLEAVED_GROUPS = define(
    Rule(
        code="P004",
        name="interleaved-microbatch-groups",
        title="Megatron: the interleaved schedule needs microbatches to be a multiple of pp.",
        docs=(
            "Megatron-Core's interleaved 1F1B schedule runs micro-batches in groups of `pp` per virtual stage "
            "(the default `microbatch_group_size_per_vp_stage`) and refuses a last, partial group."
        ),
        engine_reference=(
            "Megatron-Core `forward_backward_pipelining_with_interleaving`: the remainder of the micro-batches "
            "by the group size must be 0 (or at least pp)"
        ),
        constraint=lambda v: implies(
            all_of(v.pp > 1, v.is_("pipeline_schedule", "interleaved_1f1b")), v.microbatches % v.pp == 0
        ),
        explain=lambda x: f"{x.microbatches} micro-batches do not form whole groups of pp={x.pp} ({x.microbatches} % {x.pp} != 0)",
        hint=lambda x: f"use a multiple of {x.pp} micro-batches",
        fields=("microbatches", "pp", "pipeline_schedule"),
        engines=frozenset({"megatron"}),
    )
)


def _rounds(x) -> int:
    return max(1, x.microbatches // x.pp)


INTERLEAVED_ROUNDS = define(
    Rule(
        code="P005",
        name="interleaved-microbatch-rounds",
        title="torch: the interleaved schedule needs microbatches divisible by its rounds.",
        docs=(
            "torch's `ScheduleInterleaved1F1B` runs `rounds = max(1, microbatches // pp)` rounds and needs "
            "`microbatches % rounds == 0` (e.g. pp 4 with 10 micro-batches works, with 9 it does not)."
        ),
        engine_reference="torch.distributed.pipelining `ScheduleInterleaved1F1B.__init__` (number_of_rounds check)",
        constraint=lambda v: implies(
            all_of(v.pp > 1, v.is_("pipeline_schedule", "interleaved_1f1b")),
            v.microbatches % larger(v.microbatches / v.pp, 1) == 0,
        ),
        explain=lambda x: (
            f"{x.microbatches} micro-batches over pp={x.pp} make {_rounds(x)} rounds, and "
            f"{x.microbatches} % {_rounds(x)} != 0"
        ),
        hint=lambda x: f"use a multiple of {_rounds(x)} micro-batches, e.g. {_rounds(x) * x.pp}",
        fields=("microbatches", "pp", "pipeline_schedule"),
        engines=frozenset({"torch"}),
    )
)

VIRTUAL_NEEDS_PIPELINE = define(
    Rule(
        code="P006",
        name="virtual-stages-need-pipeline",
        title="virtual_pipeline_stages > 1 needs pp > 1.",
        docs="Virtual stages interleave several model chunks per pipeline rank; without a pipeline there is nothing to interleave.",
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
        engine_reference="torch.distributed.pipelining `PipelineScheduleSingle` (one stage per rank) vs `ScheduleInterleaved1F1B`",
        constraint=lambda v: implies(
            all_of(v.virtual_pipeline_stages > 1, v.pp > 1), v.is_("pipeline_schedule", "interleaved_1f1b")
        ),
        explain=lambda x: f"virtual_pipeline_stages={x.virtual_pipeline_stages} under the {x.pipeline_schedule} schedule",
        hint=lambda x: "set pipeline_schedule: interleaved_1f1b, or virtual_pipeline_stages: 1",
        fields=("pipeline_schedule", "virtual_pipeline_stages", "pp"),
    )
)


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int) -> float:
    """The share of a step a pipeline rank sits idle: (pp - 1) / (v * m + pp - 1)."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


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
        engine_reference="Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters (bubble (p-1)/m, /v interleaved)",
        constraint=lambda v: implies(v.pp > 1, v.microbatches >= 4 * v.pp),
        explain=lambda x: (
            f"{x.microbatches} micro-batch{'es' * (x.microbatches != 1)} for pp={x.pp} stages leave each rank idle "
            f"for about {percent(bubble_fraction(x.pp, x.microbatches, x.virtual_pipeline_stages))} of every step"
        ),
        hint=lambda x: f"use microbatches >= {4 * x.pp} (fewer accumulation steps keep the global batch), or interleave virtual stages",
        fields=("microbatches", "pp"),
        severity=Severity.warning,
        elastic=False,
    )
)
