"""The plan artifact's schema, as code (schemas/plan.schema.json is generated from it).

Every section forbids unknown fields, so a plan written by a newer compiler, or edited by hand
with a typo, is refused instead of half-read.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from mixle_compile.plan.layers import unfold

# 2: stage programs stated with their repetition (lower/compact.py); 3: their collectives as updates;
# 4: runs of layers that repeat over consecutive stages folded into one group (plan/layers.py)
FORMAT_VERSION = 4

#: An update's notes are one string in the plan: the notes of its DistributedUpdate joined by this.
NOTES_SEPARATOR = "\n"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlanMesh(_Section):
    degrees: dict[str, int] = Field(
        description="ParallelPlan.as_dict(): degrees, micro-batching, world and data-parallel size"
    )
    names: list[str] = Field(description="physical mesh dimensions, outermost first")
    shape: list[int]
    order: str = Field(description="rank order of the axes, innermost first (Megatron style)")


class GridDimEntry(_Section):
    axis: str
    size: int
    stride: int


class GridEntry(_Section):
    name: str
    dims: list[GridDimEntry]


class GroupRuleEntry(_Section):
    name: str
    grid: str
    axes: list[str]
    size: int
    num_groups: int
    dims: list[list[int]] = Field(description="(stride, length) pairs generating a group from its base rank")
    base_dims: list[list[int]] = Field(description="(stride, length) pairs enumerating the base ranks of the groups")


class PlanGroups(_Section):
    """The rank-group rules, symbolic: concrete ranks follow from (base rank, dims)."""

    order: str
    world_size: int
    dense: GridEntry
    expert: GridEntry
    rules: list[GroupRuleEntry] = Field(description="in the one global creation order")


class PlanParameter(_Section):
    logical_id: str
    global_shape: list[int]
    placements: list[list[str]] = Field(description="(mesh axis, 'replicate' | 'shard(dim)') pairs")
    shared_group: str | None
    optimizer_state: str
    role: str
    dtype: str
    layer: int | None
    stage: int
    chunk: int
    local_shape: list[int]
    owner: int | None = Field(
        description="tp coordinate of the only rank holding it (a unit of a model cut); null: every rank of "
        "its placements"
    )


class PlanUpdate(_Section):
    node_id: str
    payload: str
    collective: str
    mesh_axes: list[str]
    state_layout: str
    exact: bool
    notes: str
    contract_exact: bool
    determinism_observed: bool | None
    maximum_absolute_error: float | None
    maximum_relative_error: float | None
    numerics_evidence_id: str | None
    numerics_sample_count: int
    tensor: str
    phase: str
    stage: int
    payload_bytes: int
    group_size: int
    occurrences_per_step: int
    gradient_divisor: int

    def update_fields(self) -> dict[str, Any]:
        """The fields of the ``DistributedUpdate`` this entry records, its notes as a tuple."""
        from mixle_compile.contracts import DistributedUpdate

        data = {name: getattr(self, name) for name in DistributedUpdate.__dataclass_fields__}
        data["notes"] = tuple(self.notes.split(NOTES_SEPARATOR)) if self.notes else ()
        return data


class PlanOp(_Section):
    kind: str
    stage: int
    chunk: int = 0
    microbatch: int | None = None
    name: str = ""
    group: str | None = None
    tag: str = ""
    peer: int | None = None
    peer_chunk: int | None = None
    batch: int | None = None
    bytes: int = 0


class PlanParameterLayers(_Section):
    """A run of consecutive layers whose entries repeat, on one stage or on consecutive stages: its
    first layer's entries (plan/layers.py)."""

    layers: int = Field(description="how many consecutive layers, from the entries' own layer")
    stages: int = Field(1, description="on how many consecutive stages the run repeats (written when above 1)")
    entries: list[PlanParameter]


class PlanUpdateLayers(_Section):
    """A run of consecutive layers whose updates repeat, on one stage or on consecutive stages: its
    first layer's updates (plan/layers.py)."""

    layers: int = Field(description="how many consecutive layers, from the entries' own layer")
    stages: int = Field(1, description="on how many consecutive stages the run repeats (written when above 1)")
    entries: list[PlanUpdate]


class PlanLoop(_Section):
    repeat: int = Field(description="times the ops are issued")
    microbatch_step: int = Field(description="added to each op's micro-batch per repetition")
    batch_step: int = Field(description="added to each op's batch per repetition")
    ops: list[PlanOp]


def _unfolded(data: Any, keys: tuple[str, ...]) -> Any:
    """Folded layer groups (plan/layers.py) expanded before validation: readers see every entry."""
    if isinstance(data, dict) and any(isinstance(data.get(k), list) for k in keys):
        data = dict(data)
        for key in keys:
            if isinstance(data.get(key), list):
                data[key] = unfold(data[key])
    return data


class PlanStageProgram(_Section):
    """One stage's program stated once with its repetition, its collectives placed from the plan's
    updates; the runtime expands it (plan/programs.py plan_programs)."""

    stage: int
    runs: int = Field(description="the body runs this many times back to back")
    run_microbatches: int = Field(description="added to micro-batch numbers per run")
    run_batches: int = Field(description="added to batch numbers per run")
    optimizer: bool = Field(description="an optimizer op after the last run")
    body: list[PlanLoop | PlanOp] = Field(description="one run's compute and point-to-point ops (loops folded)")


class ScheduleVerdict(_Section):
    ok: bool
    problems: list[str]
    ranks_checked: int
    representatives: bool
    note: str


class PlanSchedule(_Section):
    pipeline: str
    virtual_stages: int
    micro_steps: int = Field(description="micro-batches per optimizer step: microbatches x gradient accumulation")
    bubble_fraction: float
    collectives: Literal["by_phase", "in_body"] = Field(
        description="where the programs' collectives are: by_phase, the plan's updates, each issued where its "
        "phase says (forward: before every forward; backward: after every backward; gradient: after the last "
        "backward, occurrences_per_step times in a row; parameter: after the optimizer, as often), in the "
        "order of `updates`; in_body, in each program's body"
    )
    stages: list[PlanStageProgram] = Field(
        description="the program of each pipeline stage; every rank of a stage runs it"
    )
    sends: Literal["buffered", "rendezvous"] = Field(
        default="rendezvous",
        description="how the check modelled point-to-point sends: buffered (awaited at the end of the step, as torch's "
        "pipelining runtime and the in-tree runtime do) or rendezvous (a send waits for its receive, "
        "Megatron's batches)",
    )
    check: ScheduleVerdict


class StageMemoryEntry(_Section):
    stage: int
    parameters: int
    gathered_parameters: int = Field(
        description="FSDP's unsharded parameters in flight (or the whole stage, where kept)"
    )
    gradients: int
    optimizer_state: int
    activations: int = Field(description="stored for the backward pass: per layer, times the micro-batches in flight")
    recompute: int = Field(default=0, description="the working set of the layer being recomputed under checkpointing")
    loss: int = Field(default=0, description="the last stage's logits and the loss's buffers")
    buffers: int = Field(
        default=0,
        description="pipeline receive buffers, FSDP's reduce-scatter copy and ring attention's backward buffers",
    )
    reserve: int = Field(default=0, description="the caching allocator's reserve beyond live tensors")
    total: int


class TrafficEntryModel(_Section):
    stage: int
    axes: list[str]
    collective: str
    bytes_per_rank_per_step: int


class PlanDiagnostic(_Section):
    code: str
    severity: Literal["error", "warning"]
    message: str
    hint: str
    line: int
    column: int
    fields: list[str]


class PlanVerdict(_Section):
    ok: bool
    errors: int
    warnings: int
    diagnostics: list[PlanDiagnostic]
    reductions_exactly_once: bool
    reduction_problems: list[str]


class PlanDocument(_Section):
    format_version: int
    compiler_version: str
    spec_digest: str = Field(description="sha256 of the canonical JSON of the validated spec")
    content_digest: str = Field(description="sha256 of the canonical JSON of this document without this field")
    spec: dict[str, Any] = Field(description="the validated spec, so that a plan runs without its source file")
    mesh: PlanMesh
    groups: PlanGroups
    parameters: list[PlanParameter | PlanParameterLayers] = Field(
        description="repeating layers folded (plan/layers.py); loading unfolds them"
    )
    updates: list[PlanUpdate | PlanUpdateLayers] = Field(
        description="repeating layers folded (plan/layers.py); loading unfolds them"
    )
    schedule: PlanSchedule | None
    decomposition: dict[str, Any] | None = Field(description="the model cut for distribution models")
    memory: list[StageMemoryEntry]
    traffic: list[TrafficEntryModel]
    verdict: PlanVerdict
    _text: str | None = PrivateAttr(default=None)  # the bytes it was loaded from (plan/artifact.py written_text)

    @model_validator(mode="before")
    @classmethod
    def _layers(cls, data: Any) -> Any:
        return _unfolded(data, ("parameters", "updates"))
