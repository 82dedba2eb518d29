"""Parameter layouts: where every parameter lives, derived from its role and the mesh.

A layout states, per mesh axis, whether a parameter is sharded (on which dimension) or
replicated, in global coordinates (the global shape is kept; a shard is a slice of it), which
pipeline stage owns it, and where its optimizer state lives. The rules, in the order they apply:

- tp: the dimension the parameter list names (`Parameter.tp_dim`: column-parallel output
  features, row-parallel input features, the vocabulary of embeddings and the head, an expert's
  hidden features when etp = tp); everything else is replicated over tp. With fewer KV heads than
  tp ranks (grouped-query attention, tp a multiple of num_kv_heads), the KV projections are
  neither: tp factors into the KV head a rank holds (`tp_kv_head`, coordinate tp_rank // r, with
  r = tp / num_kv_heads) and the r ranks sharing it (`tp_kv_replica<r>`, tp_rank % r), and the
  weight is sharded by head over the first and replicated over the second, as Megatron does.
- ep: expert weights are split by expert (dimension 0) over the expert-parallel group.
- data: dense parameters are sharded on dimension 0 over dp_shard (and over cp, which FSDP folds
  into its shard group, as torchtitan does) when dp_shard > 1; replicated over dp_replicate (HSDP).
  Expert parameters live in the expert-data domain `edp` instead (world / (etp * ep * pp) ranks),
  sharded over it when dp_shard > 1: by whole experts (dimension 0) when each ep rank's experts
  split evenly over edp, else on their hidden dimension.
- pp: a parameter belongs to the stage that holds its layer; the embedding to the first stage,
  the final norm and head to the last.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from math import ceil, prod

from mixle_compile.contracts import ParallelPlan, ParameterLayout, StateLayout
from mixle_compile.layer_split import LayerSplit, split_layers
from mixle_compile.memory_model import fsdp_shards
from mixle_compile.parameters import MTP_EMBEDDING, Parameter
from mixle_compile.plan.vocabulary import (
    EXPERT_DATA,
    KV_HEAD_AXIS,
    REPLICATE,
    Axis,
    Shard,
    expert_data_size,
    kv_replica_axis,
    kv_replica_size,
    shard_dim,
)

# The names of the axes and communication domains used in layouts and updates (`edp`, `tied`, the
# KV head and its replicas) are the plan's vocabulary (plan/vocabulary.py).
_KV_PROJECTIONS = (".attn.k_proj.weight", ".attn.k_proj.bias", ".attn.v_proj.weight", ".attn.v_proj.bias")


def is_kv_projection(name: str) -> bool:
    return name.endswith(_KV_PROJECTIONS)


def kv_replicas(num_kv_heads: int | None, tp: int) -> int:
    """tp ranks holding each KV head: tp / num_kv_heads when there are fewer heads than ranks, else 1."""
    if not num_kv_heads or num_kv_heads >= tp:
        return 1
    if tp % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide tp={tp} to replicate KV heads over tp (rule T002)")
    return tp // num_kv_heads


@dataclass(frozen=True)
class PlacedParameter:
    parameter: Parameter
    layout: ParameterLayout
    stage: int  # pipeline stage that holds it
    chunk: int  # virtual pipeline chunk on that stage
    local_shape: tuple[int, ...]  # the largest shard a rank holds
    owner: int | None = None  # tp coordinate of the only rank holding it (a unit of a model cut)
    kv_replicas: int = 1  # tp ranks holding the same slice (a KV head shared by r ranks); 1 otherwise

    @property
    def name(self) -> str:
        return self.parameter.name

    @property
    def is_expert(self) -> bool:
        return self.parameter.role == "expert"

    @property
    def local_numel(self) -> int:
        return prod(self.local_shape)

    @property
    def kv_replica_axis(self) -> str | None:
        """The tp sub-axis over which this parameter is replicated, for a replicated KV head."""
        return next((a for a, _ in self.layout.placements if kv_replica_size(a) is not None), None)


def model_parallel_splits(placed: PlacedParameter, plan: ParallelPlan) -> tuple[tuple[int, int], ...]:
    """``(dim, pieces)`` for every model-parallel split of a parameter (tp, ep, a KV head over tp)."""
    out = []
    for axis, placement in placed.layout.placements:
        dim = shard_dim(placement)
        if dim is None:
            continue
        if axis in (Axis.TP, Axis.EP):
            out.append((dim, plan.size(axis)))
        elif axis == KV_HEAD_AXIS:
            out.append((dim, plan.tp // placed.kv_replicas))
    return tuple(out)


def place_parameters(
    params: tuple[Parameter, ...],
    plan: ParallelPlan,
    *,
    num_layers: int,
    virtual_stages: int = 1,
    distributed_optimizer: bool = False,
    num_kv_heads: int | None = None,
    fsdp_over_cp: bool = False,
    layer_split: LayerSplit | None = None,
) -> tuple[PlacedParameter, ...]:
    """A layout for every parameter (see the module docstring for the rules).

    ``num_kv_heads`` (a transformer's) decides whether the KV projections are replicated over tp."""
    replicas = kv_replicas(num_kv_heads, plan.tp)
    if layer_split is None:  # a modules model, or a caller without a spec: the balanced split
        # blocks beyond num_layers are a transformer's multi-token prediction depths (on the last stage)
        beyond = max((p.layer + 1 - num_layers for p in params if p.layer is not None), default=0)
        layer_split = split_layers(max(num_layers, 1), plan.pp, virtual_stages, None, "torch", max(beyond, 0))
    last_stage, last_chunk = plan.pp - 1, virtual_stages - 1
    out = []
    # A block's parameter is laid out by its shape, role, dtype, tp dimension and tying, never by its
    # name or block: each kind is laid out once and the others take its layout under their names.
    laid: dict[tuple, PlacedParameter] = {}
    for p in params:
        key = None
        if p.layer is not None:
            stage, chunk = layer_split.location(p.layer)
            key = (p.shape, p.role, p.dtype, p.tp_dim, p.shared_group, is_kv_projection(p.name))
            hit = laid.get(key)
            if hit is not None:
                out.append(
                    dataclasses.replace(hit, parameter=p, layout=_named(hit.layout, p.name), stage=stage, chunk=chunk)
                )
                continue
        elif p.role in ("head",) or p.name.startswith("final_norm") or p.name == MTP_EMBEDDING:
            stage, chunk = last_stage, last_chunk
        else:
            stage, chunk = 0, 0
        placements: list[tuple[str, str]] = []
        local = list(p.shape)
        fsdp = fsdp_shards(dp_shard=plan.dp_shard, cp=plan.cp, over_cp=fsdp_over_cp)
        shared_head = replicas if replicas > 1 and p.tp_dim is not None and is_kv_projection(p.name) else 1
        if p.role == "expert":
            if plan.ep > 1 and p.shape:
                placements.append((Axis.EP, str(Shard(0))))
                local[0] = ceil(local[0] / plan.ep)
            if plan.tp > 1:
                over_tp = p.tp_dim is not None and plan.etp == plan.tp
                placements.append((Axis.TP, str(Shard(p.tp_dim) if over_tp else REPLICATE)))
                if over_tp:
                    local[p.tp_dim] = local[p.tp_dim] // plan.tp
            edp = expert_data_size(plan)
            if edp > 1:
                # Whole experts per shard when the ep-local experts split evenly over edp (as
                # torchtitan shards them), else the hidden dimension.
                data_dim = 1 if len(p.shape) > 1 and p.shape[0] % (plan.ep * edp) else 0
                if fsdp:
                    placements.append((EXPERT_DATA, str(Shard(data_dim))))
                    local[data_dim] = ceil(local[data_dim] / edp)
                else:
                    placements.append((EXPERT_DATA, str(REPLICATE)))
        else:
            if shared_head > 1:
                # Head tp_rank // r of num_kv_heads, the same on the r ranks of a KV-replica group.
                placements.append((KV_HEAD_AXIS, str(Shard(p.tp_dim))))
                placements.append((kv_replica_axis(shared_head), str(REPLICATE)))
                local[p.tp_dim] = local[p.tp_dim] // (plan.tp // shared_head)
            elif plan.tp > 1:
                placements.append((Axis.TP, str(Shard(p.tp_dim) if p.tp_dim is not None else REPLICATE)))
                if p.tp_dim is not None:
                    local[p.tp_dim] = local[p.tp_dim] // plan.tp
            if plan.dp_replicate > 1:
                placements.append((Axis.DP_REPLICATE, str(REPLICATE)))
            for axis in (Axis.DP_SHARD, Axis.CP):
                degree = plan.size(axis)
                if degree > 1:
                    if fsdp and p.shape:
                        placements.append((axis, str(Shard(0))))
                        local[0] = ceil(local[0] / degree)
                    else:
                        placements.append((axis, str(REPLICATE)))
        layout = ParameterLayout(
            logical_id=p.name,
            global_shape=p.shape,
            placements=tuple(placements),
            shared_group=p.shared_group if plan.pp > 1 else None,
            optimizer_state=_optimizer_state(p, plan, fsdp, distributed_optimizer),
        )
        out.append(PlacedParameter(p, layout, stage, chunk, tuple(max(1, d) for d in local), kv_replicas=shared_head))
        if key is not None:
            laid[key] = out[-1]
    return tuple(out)


def _named(layout: ParameterLayout, name: str) -> ParameterLayout:
    """``layout`` (valid) as the layout of the parameter ``name``: an unchecked copy (a name is a
    valid logical id), since ParameterLayout's validation dominates laying out many blocks."""
    copy = object.__new__(ParameterLayout)
    copy.__dict__.update(layout.__dict__)
    copy.__dict__["logical_id"] = name
    return copy


def _optimizer_state(p: Parameter, plan: ParallelPlan, fsdp: bool, distributed_optimizer: bool) -> StateLayout:
    data_ranks = expert_data_size(plan) if p.role == "expert" else plan.data_parallel_size * plan.cp
    if (fsdp or distributed_optimizer) and data_ranks > 1:
        return StateLayout.SHARDED
    if p.role == "expert" and plan.ep > 1:
        return StateLayout.EXPERT_LOCAL
    if plan.pp > 1:
        return StateLayout.PIPELINE_LOCAL
    return StateLayout.REPLICATED
