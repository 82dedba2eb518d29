"""Parameter layouts: where every parameter lives, derived from its role and the mesh.

A layout states, per mesh axis, whether a parameter is sharded (on which dimension) or
replicated, in global coordinates (the global shape is kept; a shard is a slice of it), which
pipeline stage owns it, and where its optimizer state lives. The rules, in the order they apply:

- tp: the dimension the parameter list names (`Parameter.tp_dim`: column-parallel output
  features, row-parallel input features, the vocabulary of embeddings and the head, an expert's
  hidden features when etp = tp); everything else is replicated over tp.
- ep: expert weights are split by expert (dimension 0) over the expert-parallel group.
- data: dense parameters are sharded on dimension 0 over dp_shard (and over cp, which FSDP folds
  into its shard group, as torchtitan does) when dp_shard > 1; replicated over dp_replicate (HSDP).
  Expert parameters live in the expert-data domain `edp` instead (world / (etp * ep * pp) ranks),
  sharded over it on their hidden dimension when dp_shard > 1.
- pp: a parameter belongs to the stage that holds its layer; the embedding to the first stage,
  the final norm and head to the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, prod

from mixle_compile.contracts import ParallelPlan, ParameterLayout, StateLayout
from mixle_compile.parameters import Parameter

# Names of the communication domains used in layouts and updates. Physical mesh axes keep their
# ParallelPlan names; `edp` (expert data parallel) and `tied` (first and last pipeline stage,
# for tied embeddings) are groups cut from the same ranks.
DATA_AXES = ("dp_replicate", "dp_shard", "cp")
EXPERT_DATA = "edp"
TIED_GROUP = "tied"


@dataclass(frozen=True)
class PlacedParameter:
    parameter: Parameter
    layout: ParameterLayout
    stage: int  # pipeline stage that holds it
    chunk: int  # virtual pipeline chunk on that stage
    local_shape: tuple[int, ...]  # the largest shard a rank holds
    owner: int | None = None  # tp coordinate of the only rank holding it (a unit of a model cut)

    @property
    def name(self) -> str:
        return self.parameter.name

    @property
    def is_expert(self) -> bool:
        return self.parameter.role == "expert"

    @property
    def local_numel(self) -> int:
        return prod(self.local_shape)


def expert_data_size(plan: ParallelPlan) -> int:
    return plan.world_size // (plan.etp * plan.ep * plan.pp)


def stage_of_layer(layer: int, num_layers: int, pp: int, virtual_stages: int = 1) -> tuple[int, int]:
    """(stage, chunk) holding `layer`: layers are split evenly over pp * virtual_stages model
    chunks, and chunk c of stage s is virtual stage c * pp + s (Megatron's interleaving)."""
    chunks = pp * virtual_stages
    per_chunk, extra = divmod(num_layers, chunks)
    # Balanced split when not divisible: the first `extra` virtual stages take one more layer.
    boundary = extra * (per_chunk + 1)
    virtual = layer // (per_chunk + 1) if layer < boundary else extra + (layer - boundary) // max(per_chunk, 1)
    virtual = min(virtual, chunks - 1)
    return virtual % pp, virtual // pp


def place_parameters(
    params: tuple[Parameter, ...],
    plan: ParallelPlan,
    *,
    num_layers: int,
    virtual_stages: int = 1,
    distributed_optimizer: bool = False,
) -> tuple[PlacedParameter, ...]:
    """A layout for every parameter (see the module docstring for the rules)."""
    last_stage, last_chunk = plan.pp - 1, virtual_stages - 1
    out = []
    for p in params:
        if p.layer is not None:
            stage, chunk = stage_of_layer(p.layer, max(num_layers, 1), plan.pp, virtual_stages)
        elif p.role in ("head",) or p.name.startswith("final_norm"):
            stage, chunk = last_stage, last_chunk
        else:
            stage, chunk = 0, 0
        placements: list[tuple[str, str]] = []
        local = list(p.shape)
        fsdp = plan.dp_shard > 1
        if p.role == "expert":
            if plan.ep > 1 and p.shape:
                placements.append(("ep", "shard(0)"))
                local[0] = ceil(local[0] / plan.ep)
            if plan.tp > 1:
                split = p.tp_dim is not None and plan.etp == plan.tp
                placements.append(("tp", f"shard({p.tp_dim})" if split else "replicate"))
                if split:
                    local[p.tp_dim] = local[p.tp_dim] // plan.tp
            edp = expert_data_size(plan)
            if edp > 1:
                data_dim = 1 if len(p.shape) > 1 else 0
                if fsdp:
                    placements.append((EXPERT_DATA, f"shard({data_dim})"))
                    local[data_dim] = ceil(local[data_dim] / edp)
                else:
                    placements.append((EXPERT_DATA, "replicate"))
        else:
            if plan.tp > 1:
                placements.append(("tp", f"shard({p.tp_dim})" if p.tp_dim is not None else "replicate"))
                if p.tp_dim is not None:
                    local[p.tp_dim] = local[p.tp_dim] // plan.tp
            if plan.dp_replicate > 1:
                placements.append(("dp_replicate", "replicate"))
            for axis in ("dp_shard", "cp"):
                degree = plan.size(axis)
                if degree > 1:
                    if fsdp and p.shape:
                        placements.append((axis, "shard(0)"))
                        local[0] = ceil(local[0] / degree)
                    else:
                        placements.append((axis, "replicate"))
        layout = ParameterLayout(
            logical_id=p.name,
            global_shape=p.shape,
            placements=tuple(placements),
            shared_group=p.shared_group if plan.pp > 1 else None,
            optimizer_state=_optimizer_state(p, plan, fsdp, distributed_optimizer),
        )
        out.append(PlacedParameter(p, layout, stage, chunk, tuple(max(1, d) for d in local)))
    return tuple(out)


def _optimizer_state(p: Parameter, plan: ParallelPlan, fsdp: bool, distributed_optimizer: bool) -> StateLayout:
    data_ranks = expert_data_size(plan) if p.role == "expert" else plan.data_parallel_size * plan.cp
    if (fsdp or distributed_optimizer) and data_ranks > 1:
        return StateLayout.sharded
    if p.role == "expert" and plan.ep > 1:
        return StateLayout.expert_local
    if plan.pp > 1:
        return StateLayout.pipeline_local
    return StateLayout.replicated
