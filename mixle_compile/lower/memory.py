"""Per-rank memory by kind, and per-step traffic per axis and collective.

Memory (bytes per rank, per pipeline stage; ranks of one stage hold the same amounts):

- parameters: each parameter's local shard in its dtype;
- gathered_parameters: under FSDP, the unsharded (tp-local) parameters of two layers in flight
  (the one computing and the one prefetched);
- gradients: one per local parameter element, in the parameter dtype;
- optimizer_state: adam/adamw keep two fp32 moments (8 bytes per element), sgd none, and
  low-precision training adds an fp32 master copy (4 bytes); state the layout shards is divided
  by the ranks it is sharded over;
- activations: the standard per-layer estimate of Korthikanti et al. (2022), in bytes for 16-bit
  activations, s*b*h*(10 + 24/t + 5*a*s/(h*t)) without sequence parallelism and
  s*b*h/t*(34 + 5*a*s/h) with it; selective recomputation drops the attention-score term
  (5*a*s/h), full recomputation keeps only the layer input (2*s*b*h/t); s is the local sequence
  (seq_len / cp); fp32 doubles it. A stage holds the activations of the micro-batches in flight:
  all of them under gpipe, min(microbatches, pp - stage) under 1f1b, and that times
  (1 + (pp - 1) / (pp * v)) under interleaved 1f1b. The last stage adds the fp32 logits of one
  micro-batch.

Traffic: each update's ring cost per rank times its occurrences per step (see
`PlannedUpdate.bytes_per_rank_per_step`), summed per (axes, collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from mixle_compile.contracts import ParallelPlan, StateLayout
from mixle_compile.lower.layouts import PlacedParameter, expert_data_size, stage_of_layer
from mixle_compile.lower.updates import PlannedUpdate
from mixle_compile.parameters import DTYPE_BYTES
from mixle_compile.spec.models import Spec, TransformerModel

MEMORY_KINDS = ("parameters", "gathered_parameters", "gradients", "optimizer_state", "activations")


@dataclass(frozen=True)
class StageMemory:
    stage: int
    parameters: int
    gathered_parameters: int
    gradients: int
    optimizer_state: int
    activations: int

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


def stage_memory(spec: Spec, plan: ParallelPlan, placed: tuple[PlacedParameter, ...]) -> tuple[StageMemory, ...]:
    t = spec.training
    adam = t.optimizer in ("adam", "adamw")
    out = []
    for stage in range(plan.pp):
        mine = [p for p in placed if p.stage == stage]
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
        params = sum(p.local_numel * DTYPE_BYTES[p.parameter.dtype] for p in mine)
        grads = params
        state_per_elem = (8 if adam else 0) + (4 if t.precision != "fp32" else 0)
        state = 0
        for p in mine:
            elems = p.local_numel
            if p.layout.optimizer_state is StateLayout.sharded and not _data_sharded(p):
                elems = ceil(elems / _data_ranks(p, plan))
            state += elems * state_per_elem
        gathered = 0
        if plan.dp_shard > 1:
            per_layer: dict[object, int] = {}
            for p in mine:
                per_layer[p.parameter.layer] = per_layer.get(p.parameter.layer, 0) + _tp_local_bytes(p, plan)
            gathered = 2 * max(per_layer.values(), default=0)
        out.append(StageMemory(stage, params, gathered, grads, state, _activation_bytes(spec, plan, stage)))
    return tuple(out)


def _data_sharded(p: PlacedParameter) -> bool:
    return any(axis in ("dp_shard", "cp", "dp_replicate", "edp") and placement != "replicate" for axis, placement in p.layout.placements)


def _data_ranks(p: PlacedParameter, plan: ParallelPlan) -> int:
    return expert_data_size(plan) if p.is_expert else plan.data_parallel_size * plan.cp


def _tp_local_bytes(p: PlacedParameter, plan: ParallelPlan) -> int:
    nbytes = p.parameter.bytes
    for axis, placement in p.layout.placements:
        if axis in ("tp", "ep") and placement != "replicate":
            nbytes //= plan.size(axis)
    return nbytes


def _activation_bytes(spec: Spec, plan: ParallelPlan, stage: int) -> int:
    model = spec.model
    t = spec.training
    if not isinstance(model, TransformerModel):
        return 0
    s = (t.seq_len or 1) / plan.cp
    b, h, a, tp = t.micro_batch_size, model.hidden_size, model.num_heads, plan.tp
    if t.activation_checkpointing == "full":
        per_layer = 2 * s * b * h / (tp if t.sequence_parallel else 1)
    else:
        scores = 0 if t.activation_checkpointing == "selective" else 5 * a * s / h
        if t.sequence_parallel:
            per_layer = s * b * h / tp * (34 + scores)
        else:
            per_layer = s * b * h * (10 + 24 / tp + scores / tp)
    if t.precision == "fp32":
        per_layer *= 2
    layers_here = sum(1 for i in range(model.num_layers) if stage_of_layer(i, model.num_layers, plan.pp, t.virtual_pipeline_stages)[0] == stage)
    m = plan.microbatches
    if t.pipeline_schedule == "gpipe" or plan.pp == 1:
        in_flight = float(m)
    else:
        in_flight = float(min(m, plan.pp - stage))
        if t.pipeline_schedule == "interleaved_1f1b" and t.virtual_pipeline_stages > 1:
            in_flight *= 1 + (plan.pp - 1) / (plan.pp * t.virtual_pipeline_stages)
    total = per_layer * layers_here * in_flight
    if stage == plan.pp - 1:
        total += s * b * model.vocab_size / tp * 4
    return int(total)


def traffic(updates: tuple[PlannedUpdate, ...]) -> tuple[TrafficEntry, ...]:
    """Per-step bytes sent by each rank of a stage, per (axes, collective)."""
    totals: dict[tuple[int, tuple[str, ...], str], float] = {}
    for u in updates:
        key = (u.stage, tuple(u.update.mesh_axes), u.update.collective.value)
        totals[key] = totals.get(key, 0.0) + u.bytes_per_rank_per_step
    return tuple(TrafficEntry(stage, axes, kind, int(round(v))) for (stage, axes, kind), v in sorted(totals.items()))
