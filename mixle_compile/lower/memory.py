"""Per-rank memory by kind, and per-step traffic per axis and collective.

Memory: bytes per rank, per pipeline stage (ranks of one stage hold the same amounts), priced
parameter by parameter with the formulas of :mod:`mixle_compile.memory_model` (the verifier's
memory rule bounds the heaviest rank with the same formulas). State the layout shards is divided
by the ranks it is sharded over. A stage's activations are those of its own layers times the
micro-batches it keeps in flight under the plan's schedule; the last stage adds the logits.

Traffic: each update's ring cost per rank times its occurrences per step (see
`PlannedUpdate.bytes_per_rank_per_step`), summed per (axes, collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import ceil

from mixle_compile.contracts import ParallelPlan, StateLayout
from mixle_compile.engines import engine_profile
from mixle_compile.layer_split import LayerSplit
from mixle_compile.lower.layouts import PlacedParameter
from mixle_compile.lower.runs import EACH_BLOCK, LayerRuns
from mixle_compile.lower.updates import PlannedUpdate
from mixle_compile.memory_model import (
    MEMORY_KINDS,
    NUMBERS,
    activation_bytes_per_layer,
    after_loss_bytes,
    boundary_bytes,
    fsdp_shards,
    gathered_parameter_bytes,
    logits_bytes,
    loss_bytes_per_logit,
    micro_batches_in_flight,
    moe_layer_extra_bytes,
    optimizer_bytes_per_element,
    pipeline_buffer_bytes,
    reduce_scatter_buffer_bytes,
    reserve_bytes,
    ring_attention_bytes,
)
from mixle_compile.parameters import DTYPE_BYTES, moe_layers_in
from mixle_compile.plan.vocabulary import ALL_DATA_AXES, KV_HEAD_AXIS, REPLICATE, expert_data_size
from mixle_compile.schedules import NUMBERS as SCHEDULE_NUMBERS
from mixle_compile.schedules import microbatches_per_round
from mixle_compile.spec.models import Spec, TransformerModel
from mixle_compile.step_time import ring_fraction
from mixle_compile.verify.memory import activation_widths, attention_widths, expert_shape


@dataclass(frozen=True)
class StageMemory:
    stage: int
    parameters: int
    gathered_parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # stored for the backward pass: per layer, times the micro-batches in flight
    recompute: int = 0  # the working set of the layer being recomputed under checkpointing
    loss: int = 0  # the last stage's logits and the loss's buffers
    buffers: int = 0  # pipeline receive buffers, the FSDP reduce-scatter copy and ring attention's buffers
    reserve: int = 0  # the caching allocator's reserve beyond live tensors

    @property
    def total(self) -> int:
        return sum(getattr(self, kind) for kind in MEMORY_KINDS)

    def as_dict(self) -> dict:
        return {"stage": self.stage, **{k: getattr(self, k) for k in MEMORY_KINDS}, "total": self.total}


@dataclass(frozen=True)
class TrafficEntry:
    stage: int  # the ranks of this pipeline stage each move these bytes
    axes: tuple[str, ...]
    collective: str
    bytes_per_rank_per_step: int

    def as_dict(self) -> dict:
        return {
            "stage": self.stage,
            "axes": list(self.axes),
            "collective": self.collective,
            "bytes_per_rank_per_step": self.bytes_per_rank_per_step,
        }


def stage_memory(
    spec: Spec,
    plan: ParallelPlan,
    placed: tuple[PlacedParameter, ...],
    split: LayerSplit | None = None,
    runs: LayerRuns = EACH_BLOCK,
) -> tuple[StageMemory, ...]:
    """Memory per stage; ``runs``: ``placed`` lists one block of each run of blocks that lower alike
    (lower/runs.py), which counts as often as its run holds blocks, on every stage it repeats on."""
    count = runs.count
    t = spec.training
    adam = t.optimizer in ("adam", "adamw")
    engine = engine_profile(spec.backend)
    out = []
    for stage in range(plan.pp):
        mine = [p for p in placed if stage in runs.on_stages(p.parameter.layer, p.stage)]
        if plan.pp == 1:  # a tied pair on one stage is one tensor
            seen: set[str] = set()
            unique = []
            for p in mine:
                group = p.parameter.shared_group
                if group is None or group not in seen:
                    unique.append(p)
                    if group is not None:
                        seen.add(group)
            mine = unique
        params = sum(p.local_numel * DTYPE_BYTES[p.parameter.dtype] * count(p.parameter.layer) for p in mine)
        grads = params
        state = 0
        for p in mine:
            elems = p.local_numel
            if p.layout.optimizer_state is StateLayout.SHARDED and not _data_sharded(p):
                elems = ceil(elems / _data_ranks(p, plan))
            state += (
                elems
                * optimizer_bytes_per_element(NUMBERS, adam=adam, below_fp32=p.parameter.dtype != "fp32")
                * count(p.parameter.layer)
            )
        units: dict[object, int] = {}  # a layer, or (None) the embedding and head
        unit_elements: dict[object, int] = {}
        for p in mine:
            units[p.parameter.layer] = units.get(p.parameter.layer, 0) + _tp_local_bytes(p, plan)
            unit_elements[p.parameter.layer] = (
                unit_elements.get(p.parameter.layer, 0) + _tp_local_bytes(p, plan) // DTYPE_BYTES[p.parameter.dtype]
            )
        fsdp = fsdp_shards(dp_shard=plan.dp_shard, cp=plan.cp, over_cp=engine.fsdp_over_cp)
        keeps_stage = plan.pp > 1 and engine.fsdp_keeps_stage_under_pp
        gathered = gathered_parameter_bytes(
            NUMBERS,
            fsdp=fsdp,
            largest_unit_bytes=max(units.values(), default=0),
            keeps_stage=keeps_stage,
            stage_bytes=sum(nbytes * count(unit) for unit, nbytes in units.items()),
            stage_elements=sum(elements * count(unit) for unit, elements in unit_elements.items()),
        )
        stored, recompute, loss, in_flight = _activation_bytes(spec, plan, stage, split)
        buffers = _pipeline_buffers(spec, plan, stage, in_flight)
        layers = [unit for unit in units if unit is not None]
        transient = 0.0  # what a layer's backward needs for a while, once the loss's buffers are freed
        if engine.fsdp_reduce_scatter_copy and layers:
            # a layer's gradients are reduced while earlier layers' activations are still held; the
            # embedding and head (the root unit) after the last layer's backward, when none are
            largest = max(layers, key=lambda unit: units[unit])
            transient += reduce_scatter_buffer_bytes(
                NUMBERS,
                fsdp=fsdp,
                unit_elements=unit_elements[largest],
                unit_bytes=units[largest],
                accumulated=keeps_stage,
            )
        if layers:
            transient += _ring_attention(spec, plan)
        buffers += int(after_loss_bytes(NUMBERS, transient, loss))
        live = params + gathered + grads + state + stored + recompute + loss + buffers
        out.append(
            StageMemory(
                stage,
                params,
                gathered,
                grads,
                state,
                stored,
                recompute,
                loss,
                buffers,
                int(reserve_bytes(NUMBERS, live)),
            )
        )
    return tuple(out)


def _data_sharded(p: PlacedParameter) -> bool:
    return any(axis in ALL_DATA_AXES and placement != "replicate" for axis, placement in p.layout.placements)


def _data_ranks(p: PlacedParameter, plan: ParallelPlan) -> int:
    return expert_data_size(plan) if p.is_expert else plan.data_parallel_size * plan.cp


def _tp_local_bytes(p: PlacedParameter, plan: ParallelPlan) -> int:
    nbytes = p.parameter.bytes
    for axis, placement in p.layout.placements:
        if axis in ("tp", "ep") and placement != "replicate":
            nbytes //= plan.size(axis)
        elif axis == KV_HEAD_AXIS and placement != str(REPLICATE):  # one KV head of several, shared over tp
            nbytes //= plan.tp // p.kv_replicas
    return nbytes


def _pipeline_buffers(spec: Spec, plan: ParallelPlan, stage: int, in_flight: float) -> int:
    """The receive buffers of torch's pipelining runtime on pipeline rank `stage`, which holds the
    model stages stage, stage + pp, ... (memory_model.pipeline_buffer_bytes)."""
    model = spec.model
    t = spec.training
    engine = engine_profile(spec.backend)
    if plan.pp == 1 or not engine.pipeline_receive_buffers or not isinstance(model, TransformerModel):
        return 0
    virtual = t.virtual_pipeline_stages if t.pipeline_schedule == "interleaved_1f1b" else 1
    boundary = boundary_bytes(
        NUMBERS,
        seq_len=t.seq_len or 1,
        cp=plan.cp,
        micro_batch_size=t.micro_batch_size,
        hidden_size=model.hidden_size,
        tp=plan.tp,
        sequence_parallel=t.sequence_parallel,
        fp32=t.precision == "fp32",
    )
    return int(
        pipeline_buffer_bytes(
            NUMBERS,
            boundary=boundary,
            microbatches=engine.schedule_microbatches(plan.microbatches, plan.gradient_accumulation_steps),
            activation_stages=virtual - (stage == 0),
            gradient_stages=virtual - (stage == plan.pp - 1),
            # one stage per rank: the micro-batches in flight keep their received input as the first
            # layer's stored input; with several, the count per stage is not tracked, none is subtracted
            saved_inputs=in_flight if virtual == 1 and stage > 0 else 0,
        )
    )


def _ring_attention(spec: Spec, plan: ParallelPlan) -> float:
    """Ring attention's backward buffers in one layer (memory_model.ring_attention_bytes)."""
    model = spec.model
    engine = engine_profile(spec.backend)
    if plan.cp == 1 or not engine.ring_attention or not isinstance(model, TransformerModel):
        return 0.0
    t = spec.training
    widths = attention_widths(model, repeated_keys=engine.repeats_key_heads)
    return ring_attention_bytes(
        NUMBERS,
        seq_len=t.seq_len or 1,
        cp=plan.cp,
        micro_batch_size=t.micro_batch_size,
        tp=plan.tp,
        fp32=t.precision == "fp32",
        **widths,
    )


def _activation_bytes(
    spec: Spec, plan: ParallelPlan, stage: int, split: LayerSplit | None
) -> tuple[int, int, int, float]:
    """Stored activations, the recompute working set and the loss's bytes of one stage's rank, and
    the micro-batches it keeps in flight."""
    model = spec.model
    t = spec.training
    if not isinstance(model, TransformerModel):
        return 0, 0, 0, 0  # a modules spec lists parameters only; how activations flow is not known
    shape = dict(seq_len=t.seq_len or 1, cp=plan.cp, micro_batch_size=t.micro_batch_size, tp=plan.tp)
    engine = engine_profile(spec.backend)

    def layer(full: bool, selective: bool) -> float:
        return activation_bytes_per_layer(
            NUMBERS,
            **shape,
            hidden_size=model.hidden_size,
            num_heads=model.num_heads,
            sequence_parallel=t.sequence_parallel,
            full_recompute=full,
            selective_recompute=selective,
            fp32=t.precision == "fp32",
            eager_attention=(t.attention or engine.default_attention) == "eager",
            op_level_selective=engine.op_level_selective,
            fp8_saved_inputs=engine.fp8_saves_quantized_inputs and t.precision == "fp8",
            gated=model.activation == "swiglu",
            **activation_widths(model),
        )

    per_layer = layer(t.activation_checkpointing == "full", t.activation_checkpointing == "selective")
    recomputed = layer(False, False) - per_layer  # the layer being recomputed holds all of it once more
    layers_here = split.layers_on_stage(stage) if split is not None else model.num_layers
    ranges = ((0, model.num_layers),) if split is None else split.ranges_on_stage(stage)
    moe_here = sum(
        moe_layers_in(start, end - start, num_experts=model.num_experts, frequency=model.moe_layer_frequency)
        for start, end in ranges
    )
    if moe_here:
        extra, kept_extra = moe_extra(spec, plan)
        per_layer_total = per_layer * layers_here + kept_extra * moe_here
        recomputed += extra - kept_extra  # an MoE layer being recomputed is the heaviest one
    else:
        per_layer_total = per_layer * layers_here
    in_flight = micro_batches_in_flight(
        NUMBERS,
        pp=plan.pp,
        stage=stage,
        microbatches=plan.microbatches,
        gpipe=t.pipeline_schedule == "gpipe",
        interleaved=t.pipeline_schedule == "interleaved_1f1b" and t.virtual_pipeline_stages > 1,
        virtual_stages=t.virtual_pipeline_stages,
        group=microbatches_per_round(SCHEDULE_NUMBERS, plan.pp, plan.microbatches),
    )
    stored = per_layer_total * in_flight
    loss = 0
    if stage == plan.pp - 1:
        per_logit = loss_bytes_per_logit(
            NUMBERS,
            implementation=engine.loss_implementation(compiled="loss" in t.compiled, tensor_parallel=plan.tp > 1),
            fp32=t.precision == "fp32",
        )
        loss = logits_bytes(NUMBERS, **shape, vocab_size=model.vocab_size, bytes_per_logit=per_logit)
    return int(stored), int(recomputed if layers_here else 0), int(loss), in_flight


def moe_extra(spec: Spec, plan: ParallelPlan) -> tuple[float, float]:
    """An MoE layer's bytes beyond a dense layer's (memory_model.moe_layer_extra_bytes), per
    micro-batch, and the part of them checkpointing keeps: all of it without checkpointing and
    under selective checkpointing that recomputes attention's core only (Megatron's
    ``core_attn``); none under full checkpointing, and none under op-level selective
    checkpointing, whose saved matmul outputs already count the routed tokens' widest MLP
    (activation_widths)."""
    model, t = spec.model, spec.training
    engine = engine_profile(spec.backend)
    extra = moe_layer_extra_bytes(
        NUMBERS,
        seq_len=t.seq_len or 1,
        cp=plan.cp,
        micro_batch_size=t.micro_batch_size,
        hidden_size=model.hidden_size,
        tp=plan.tp,
        etp=plan.etp,
        sequence_parallel=t.sequence_parallel,
        saved=engine.moe_saved(model.activation),
        fp32=t.precision == "fp32",
        dense_ffn_width=model.ffn_hidden_size,
        gated=model.activation == "swiglu",
        fp8_saved_inputs=engine.fp8_saves_quantized_inputs and t.precision == "fp8",
        **expert_shape(model),
    )
    keeps = t.activation_checkpointing == "none" or (
        t.activation_checkpointing == "selective" and not engine.op_level_selective
    )
    return extra, extra if keeps else 0.0


def traffic(updates: tuple[PlannedUpdate, ...], runs: LayerRuns = EACH_BLOCK) -> tuple[TrafficEntry, ...]:
    """Per-step bytes sent by each rank of a stage, per (axes, collective); ``runs``: an update of a
    run's first block (lower/runs.py) counts as often as the run holds blocks, on every stage the
    run repeats on.

    The sum is exact: the bytes entering each (axes, collective, group size) are added as integers
    and priced once with the ring's fraction (:func:`mixle_compile.step_time.ring_fraction`), so the
    figure does not depend on the order of the updates or on how they are counted."""
    entering: dict[tuple[int, tuple[str, ...], str, int], int] = {}
    for u in updates:
        times = u.occurrences_per_step * runs.count(u.layer)
        for stage in runs.on_stages(u.layer, u.stage):
            key = (stage, tuple(u.update.mesh_axes), u.update.collective._value_, u.group_size)
            entering[key] = entering.get(key, 0) + u.payload_bytes * times
    totals: dict[tuple[int, tuple[str, ...], str], Fraction] = {}
    for (stage, axes, kind, size), nbytes in entering.items():
        totals[stage, axes, kind] = totals.get((stage, axes, kind), Fraction(0)) + ring_fraction(kind, size) * nbytes
    return tuple(TrafficEntry(stage, axes, kind, round(v)) for (stage, axes, kind), v in sorted(totals.items()))
