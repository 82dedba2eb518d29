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
    dense_mlp_split_bytes,
    fsdp_shards,
    gathered_parameter_bytes,
    logits_bytes,
    loss_bytes_per_logit,
    micro_batches_in_flight,
    moe_layer_extra_bytes,
    mtp_depth_bytes,
    optimizer_bytes_per_element,
    pipeline_buffer_bytes,
    reduce_scatter_buffer_bytes,
    reserve_bytes,
    ring_attention_bytes,
    selective_moe_kept,
)
from mixle_compile.parameters import DTYPE_BYTES, moe_layers_in, mtp_is_moe
from mixle_compile.plan.vocabulary import ALL_DATA_AXES, KV_HEAD_AXIS, REPLICATE, expert_data_size
from mixle_compile.schedules import interleaved_group
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
    # What a parameter adds to a stage does not depend on the stage: priced once, summed per stage
    # in the order of ``placed``.
    priced = []
    on_stage: list[list[int]] = [[] for _ in range(plan.pp)]
    for index, p in enumerate(placed):
        layer = p.parameter.layer
        times = count(layer)
        elems = p.local_numel
        if p.layout.optimizer_state is StateLayout.SHARDED and not _data_sharded(p):
            elems = ceil(elems / _data_ranks(p, plan))
        below_fp32 = p.parameter.dtype != "fp32"
        tp_local = _tp_local_bytes(p, plan)
        priced.append(
            (
                p.local_numel * DTYPE_BYTES[p.parameter.dtype] * times,
                elems * optimizer_bytes_per_element(NUMBERS, adam=adam, below_fp32=below_fp32) * times,
                layer,
                tp_local,
                tp_local // DTYPE_BYTES[p.parameter.dtype],
            )
        )
        for stage in runs.on_stages(layer, p.stage):
            on_stage[stage].append(index)
    fsdp = fsdp_shards(dp_shard=plan.dp_shard, cp=plan.cp, over_cp=engine.fsdp_over_cp)
    keeps_stage = plan.pp > 1 and engine.fsdp_keeps_stage_under_pp
    activations = _Activations(spec, plan, split)
    ring = _ring_attention(spec, plan)
    boundary = _boundary(spec, plan)
    out = []
    for stage in range(plan.pp):
        mine = on_stage[stage]
        if plan.pp == 1:  # a tied pair on one stage is one tensor
            seen: set[str] = set()
            unique = []
            for index in mine:
                group = placed[index].parameter.shared_group
                if group is None or group not in seen:
                    unique.append(index)
                    if group is not None:
                        seen.add(group)
            mine = unique
        params = sum(priced[index][0] for index in mine)
        grads = params
        state = 0
        for index in mine:
            state += priced[index][1]
        units: dict[object, int] = {}  # a layer, or (None) the embedding and head
        unit_elements: dict[object, int] = {}
        for index in mine:
            _, _, layer, tp_local, tp_elements = priced[index]
            units[layer] = units.get(layer, 0) + tp_local
            unit_elements[layer] = unit_elements.get(layer, 0) + tp_elements
        gathered = gathered_parameter_bytes(
            NUMBERS,
            fsdp=fsdp,
            largest_unit_bytes=max(units.values(), default=0),
            keeps_stage=keeps_stage,
            stage_bytes=sum(nbytes * count(unit) for unit, nbytes in units.items()),
            stage_elements=sum(elements * count(unit) for unit, elements in unit_elements.items()),
        )
        stored, recompute, loss, in_flight = activations.on(stage)
        buffers = _pipeline_buffers(spec, plan, stage, in_flight, boundary)
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
            transient += ring
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


def _boundary(spec: Spec, plan: ParallelPlan) -> float | None:
    """The bytes of one activation a pipeline stage passes on (memory_model.boundary_bytes); None
    where the runtime keeps no pipeline receive buffers."""
    model = spec.model
    t = spec.training
    engine = engine_profile(spec.backend)
    if plan.pp == 1 or not engine.pipeline_receive_buffers or not isinstance(model, TransformerModel):
        return None
    return boundary_bytes(
        NUMBERS,
        seq_len=t.seq_len or 1,
        cp=plan.cp,
        micro_batch_size=t.micro_batch_size,
        hidden_size=model.hidden_size,
        tp=plan.tp,
        sequence_parallel=t.sequence_parallel,
        fp32=t.precision == "fp32",
    )


def _pipeline_buffers(spec: Spec, plan: ParallelPlan, stage: int, in_flight: float, boundary: float | None) -> int:
    """The receive buffers of torch's pipelining runtime on pipeline rank `stage`, which holds the
    model stages stage, stage + pp, ... (memory_model.pipeline_buffer_bytes); ``boundary``: what
    :func:`_boundary` gives (None: no buffers)."""
    if boundary is None:
        return 0
    t = spec.training
    engine = engine_profile(spec.backend)
    virtual = t.virtual_pipeline_stages if t.pipeline_schedule == "interleaved_1f1b" else 1
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


class _Activations:
    """Stored activations, the recompute working set and the loss's bytes of one stage's rank, and
    the micro-batches it keeps in flight (:meth:`on`); what a layer holds is the same on every
    stage, and is priced once."""

    def __init__(self, spec: Spec, plan: ParallelPlan, split: LayerSplit | None) -> None:
        self.spec, self.plan, self.split = spec, plan, split
        model = spec.model
        t = spec.training
        if not isinstance(model, TransformerModel):
            return  # a modules spec lists parameters only; how activations flow is not known
        self.shape = dict(seq_len=t.seq_len or 1, cp=plan.cp, micro_batch_size=t.micro_batch_size, tp=plan.tp)
        engine = self.engine = engine_profile(spec.backend)

        def layer(full: bool, selective: bool) -> float:
            return activation_bytes_per_layer(
                NUMBERS,
                **self.shape,
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
                recomputed_modules=engine.selective_modules(t.recompute_modules),
                latent_replicated=not engine.latent_projections_on_shards,
                **activation_widths(model),
            )

        self.per_layer = layer(t.activation_checkpointing == "full", t.activation_checkpointing == "selective")
        # the layer being recomputed holds all of it once more
        self.recomputed = layer(False, False) - self.per_layer
        self.moe: tuple[float, float] | None = None  # moe_extra, found on the first stage with an MoE layer

    def on(self, stage: int) -> tuple[int, int, int, float]:
        spec, plan, split = self.spec, self.plan, self.split
        model = spec.model
        t = spec.training
        if not isinstance(model, TransformerModel):
            return 0, 0, 0, 0
        per_layer, recomputed = self.per_layer, self.recomputed
        layers_here = split.layers_on_stage(stage) if split is not None else model.num_layers
        ranges = ((0, model.num_layers),) if split is None else split.ranges_on_stage(stage)
        moe_here = sum(
            moe_layers_in(
                start,
                end - start,
                num_experts=model.num_experts,
                frequency=model.moe_layer_frequency,
                start=model.moe_first_layer,
            )
            for start, end in ranges
        )
        # the multi-token prediction depths (the last stage's): a block of the last layer's kind each,
        # their own tensors beside it, and one more set of logits each while the losses run
        depths = split.mtp_on_stage(stage) if split is not None else model.mtp_num_layers
        layers_here += depths
        moe_here += depths if mtp_is_moe(model) else 0
        if moe_here:
            if self.moe is None:
                self.moe = moe_extra(spec, plan)
            extra, kept_extra = self.moe
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
            group=interleaved_group(
                engine_profile(spec.backend).schedules, plan.pp, plan.microbatches, t.microbatch_group_size
            ),
        )
        if depths:
            per_layer_total += depths * mtp_depth_bytes(
                NUMBERS,
                **self.shape,
                hidden_size=model.hidden_size,
                sequence_parallel=t.sequence_parallel,
                fp32=t.precision == "fp32",
            )
        stored = per_layer_total * in_flight
        loss = 0
        if stage == plan.pp - 1:
            per_logit = loss_bytes_per_logit(
                NUMBERS,
                implementation=self.engine.loss_implementation(
                    compiled="loss" in t.compiled, tensor_parallel=plan.tp > 1
                ),
                fp32=t.precision == "fp32",
            )
            loss = logits_bytes(NUMBERS, **self.shape, vocab_size=model.vocab_size, bytes_per_logit=per_logit)
            loss *= 1 + model.mtp_num_layers  # each depth's logits live until the backward (gpt_model.py)
        return int(stored), int(recomputed if layers_here else 0), int(loss), in_flight


def moe_extra(spec: Spec, plan: ParallelPlan) -> tuple[float, float]:
    """An MoE layer's bytes beyond a dense layer's (memory_model.moe_layer_extra_bytes), per
    micro-batch, and the part of them checkpointing keeps: all of it without checkpointing and
    under Megatron's selective checkpointing, less what its ``recompute_modules`` discard of the
    block (``moe_act``, ``shared_experts``; none of it for ``moe``, the block recomputed whole;
    with ``mlp`` the dense share it replaces, discarded from every layer's count, is the block's
    to keep); none under full checkpointing, and none under op-level selective checkpointing,
    whose saved matmul outputs already count the routed tokens' widest MLP (activation_widths)."""
    model, t = spec.model, spec.training
    engine = engine_profile(spec.backend)
    modules = engine.selective_modules(t.recompute_modules)
    extra = _moe_block(spec, plan, engine, frozenset())
    if t.activation_checkpointing == "none":
        return extra, extra
    if t.activation_checkpointing == "full" or engine.op_level_selective:
        return extra, 0.0
    return extra, selective_moe_kept(
        modules,
        lambda m: _moe_block(spec, plan, engine, m),
        lambda: dense_mlp_split_bytes(
            NUMBERS,
            seq_len=t.seq_len or 1,
            cp=plan.cp,
            micro_batch_size=t.micro_batch_size,
            tp=plan.tp,
            dense_ffn_width=model.ffn_hidden_size,
            gated=model.activation == "swiglu",
            fp32=t.precision == "fp32",
        ),
    )


def _moe_block(spec: Spec, plan: ParallelPlan, engine, modules: frozenset[str]) -> float:
    """memory_model.moe_layer_extra_bytes of the spec's MoE layer (``modules``: what selective
    checkpointing runs again of it)."""
    model, t = spec.model, spec.training
    return moe_layer_extra_bytes(
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
        recomputed_modules=modules,
        **expert_shape(model),
    )


def traffic(updates: tuple[PlannedUpdate, ...], runs: LayerRuns = EACH_BLOCK) -> tuple[TrafficEntry, ...]:
    """Per-step bytes sent by each rank of a stage, per (axes, collective); ``runs``: an update of a
    run's first block (lower/runs.py) counts as often as the run holds blocks, on every stage the
    run repeats on.

    The sum is exact: the bytes entering each (axes, collective, group size) are added as integers
    and priced once with the ring's fraction (:func:`mixle_compile.step_time.ring_fraction`), so the
    figure does not depend on the order of the updates or on how they are counted."""
    # Summed per stages alike first (a run repeating on several stages adds the same to each).
    alike: dict[tuple[range, tuple[str, ...], str, int], int] = {}
    for u in updates:
        key = (runs.on_stages(u.layer, u.stage), tuple(u.update.mesh_axes), u.update.collective._value_, u.group_size)
        alike[key] = alike.get(key, 0) + u.payload_bytes * u.occurrences_per_step * runs.count(u.layer)
    entering: dict[tuple[int, tuple[str, ...], str], dict[int, int]] = {}  # per entry: group size -> bytes
    for (stages, axes, kind, size), nbytes in alike.items():
        for stage in stages:
            sizes = entering.setdefault((stage, axes, kind), {})
            sizes[size] = sizes.get(size, 0) + nbytes
    fractions: dict[tuple[str, int], Fraction] = {}
    out = []
    for (stage, axes, kind), sizes in sorted(entering.items()):
        numerator, denominator = 0, 1  # the exact sum, over a common denominator
        for size, nbytes in sizes.items():
            part = fractions.get((kind, size))
            if part is None:
                part = fractions[kind, size] = ring_fraction(kind, size)
            numerator = numerator * part.denominator + part.numerator * nbytes * denominator
            denominator *= part.denominator
        out.append(TrafficEntry(stage, axes, kind, _rounded(numerator, denominator)))
    return tuple(out)


def _rounded(numerator: int, denominator: int) -> int:
    """``round(Fraction(numerator, denominator))`` for a positive denominator: to the nearest integer,
    halves to the even one."""
    whole, rest = divmod(numerator, denominator)
    if 2 * rest > denominator or (2 * rest == denominator and whole % 2):
        whole += 1
    return whole
