"""Distributed updates: every collective a step performs, derived from the layouts.

Gradients: a local gradient is a partial sum on every axis whose placement holds the parameter
whole (or sharded for storage only) while the data differs between the ranks of that axis. It is
reduced exactly once over exactly those axes: an all_reduce over the tied group first (on whole
gradients, before any reduce-scatter), an all_reduce over tp for tp-replicated parameters under
sequence parallelism, an all_reduce over the KV-replica group for a KV head replicated on several
tp ranks (each rank's query heads contribute their part of its gradient), then a reduce_scatter
over the axes where the state is sharded followed by an all_reduce over the axes where it is
replicated. The data reduction divides by the data-parallel size (the loss is a mean over the
global batch), for experts too. Tied parameters on one stage are one tensor, reduced once: the
gradients of all their uses add up locally first.

Activations: TP all_reduce after row-parallel layers (reduce_scatter, and all_gather before
column-parallel layers, under sequence parallelism), each with its conjugate in the backward; the
vocabulary-parallel embedding's all_reduce (reduce_scatter under sequence parallelism, with an
all_gather of its gradient); the vocabulary-parallel head's input-gradient all_reduce (all_gather
of its input and reduce_scatter of that gradient under sequence parallelism) and the all_gather of
each vocabulary shard's log-sum-exp and target logit for the cross entropy; CP all_gather of K and
V, EP all_to_all of tokens out and back, PP p2p of activations and their gradients between
adjacent stages. FSDP all_gathers parameters before use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mixle_compile.contracts import CollectiveKind, DistributedUpdate, ParallelPlan, PayloadKind, StateLayout
from mixle_compile.engines import EngineProfile, engine_profile
from mixle_compile.lower.layouts import PlacedParameter, model_parallel_splits
from mixle_compile.parameters import DTYPE_BYTES, attention_widths, is_moe_layer, is_mtp_layer
from mixle_compile.plan.ops import unchecked_copy
from mixle_compile.plan.vocabulary import (
    ALL_DATA_AXES,
    EXPERT_DATA,
    REPLICATE,
    TIED_GROUP,
    Axis,
    UpdateId,
    expert_data_size,
    kv_replica_size,
    shard_dim,
)
from mixle_compile.spec.models import Spec, TransformerModel
from mixle_compile.step_time import ring_bytes


@dataclass(frozen=True)
class PlannedUpdate:
    """A DistributedUpdate with what the schedule and the traffic model need to place it."""

    update: DistributedUpdate
    tensor: str  # the parameter, or the activation site
    phase: str  # "forward", "backward", "gradient" (after backward), "parameter" (after the step)
    stage: int  # pipeline stage issuing it
    payload_bytes: int  # S: the full logical size of what enters the collective on each rank
    group_size: int  # ranks in the collective's group
    occurrences_per_step: int
    gradient_divisor: int = 1  # the reduced sum is divided by this (1: a plain sum)
    layer: int | None = None  # the transformer block (or listed layer) it belongs to; None outside them

    @property
    def bytes_per_rank_per_step(self) -> float:
        """Ring cost per rank (:func:`mixle_compile.step_time.ring_bytes`) times the occurrences per step."""
        bytes_in = ring_bytes(self.update.collective._value_, self.group_size, self.payload_bytes)
        return bytes_in * self.occurrences_per_step


def group_size(axes: tuple[str, ...], plan: ParallelPlan) -> int:
    size = 1
    for axis in axes:
        size *= domain_size(axis, plan)
    return size


def domain_size(axis: str, plan: ParallelPlan) -> int:
    if axis == EXPERT_DATA:
        return expert_data_size(plan)
    if axis == TIED_GROUP:
        return 2
    replicas = kv_replica_size(axis)
    if replicas is not None:
        return replicas
    return plan.size(axis)


def _grad_update(
    node: str,
    collective: CollectiveKind,
    axes: tuple[str, ...],
    layout: StateLayout,
    notes: str,
    payload=PayloadKind.GRADIENT,
) -> DistributedUpdate:
    return DistributedUpdate(
        node_id=node,
        payload=payload,
        collective=collective,
        mesh_axes=axes,
        state_layout=layout,
        notes=(notes,) if notes else (),
        contract_exact=True,  # sums (reduced in fp32) and copies: exact in exact arithmetic
    )


def gradient_updates(
    placed: tuple[PlacedParameter, ...],
    plan: ParallelPlan,
    *,
    sequence_parallel: bool,
    distributed_optimizer: bool,
    microbatches_per_step: int,
) -> list[PlannedUpdate]:
    """Gradient reductions and FSDP parameter gathers, derived from each layout's placements."""
    data_differs = {*ALL_DATA_AXES} | ({Axis.TP} if sequence_parallel else set())
    sizes: dict[tuple[str, ...], int] = {}

    def sized(axes: tuple[str, ...]) -> int:  # group_size of a handful of axis sets, asked often
        size = sizes.get(axes)
        if size is None:
            size = sizes[axes] = group_size(axes, plan)
        return size

    out: list[PlannedUpdate] = []
    dp = plan.data_parallel_size
    tied_seen: set[str] = set()
    # A parameter's updates follow from its shape, dtype, role and layout; its name, stage and layer
    # only name and place them. So the blocks of a model, which repeat the same parameters stage
    # after stage, are derived once per kind of parameter and renamed (a tied parameter, whose
    # updates depend on the others of its group, is always derived).
    derived: dict[tuple, tuple[str, list[PlannedUpdate]]] = {}
    for pp_ in placed:
        name, layout, stage, layer = pp_.name, pp_.layout, pp_.stage, pp_.parameter.layer
        key = None
        # (the parameter's group, not its layout's: on one stage a layout names no tied group, yet its
        # members after the first are folded into the first; multi-token prediction's copy of the
        # embedding has the embedding's shape and role, so it would otherwise take its updates)
        if pp_.parameter.shared_group is None:
            p = pp_.parameter
            key = (p.shape, p.numel, p.dtype, p.role, layout.placements, layout.optimizer_state, pp_.kv_replicas)
            hit = derived.get(key)
            if hit is not None:
                out.extend(_renamed(u, hit[0], name, stage, layer) for u in hit[1])
                continue
        start = len(out)
        grad_bytes = pp_.parameter.numel * 4  # gradients are reduced in fp32
        # Tied parameters on one stage are one tensor: its uses' gradients add up locally and are
        # reduced once, as the first member's (the others list no gradient update of their own).
        group = pp_.parameter.shared_group
        folded = plan.pp == 1 and group is not None and group in tied_seen
        if group is not None:
            tied_seen.add(group)
        grads: list[PlannedUpdate] = []
        data = [(a, p) for a, p in layout.placements if a in data_differs and a != Axis.TP]
        if pp_.is_expert and not data and dp > 1:
            # Every token of the ep group reaches its expert, so the gradient is already summed over
            # the data ranks but must still be divided by the data degree (torchtitan #1551): the
            # expert-data reduction runs over its single rank and carries the divisor.
            data = [(EXPERT_DATA, str(REPLICATE))]
        sharded = [a for a, p in data if shard_dim(p) is not None]
        replicated = [a for a, p in data if shard_dim(p) is None]
        # A distributed optimizer shards replicated state for the step: reduce-scatter, then gather.
        if distributed_optimizer and not sharded and replicated:
            sharded, replicated = replicated, []
            scatter_then_gather = True
        else:
            scatter_then_gather = False
        local_full = _tp_local(pp_, plan, grad_bytes)
        # FSDP reduces sharded gradients every accumulation micro-step; replicated ones once. A tied
        # weight's copies live on different pipeline stages, which finish an accumulation window at
        # different points of their programs: their whole gradients accumulate over the step (FSDP's
        # no-sync accumulation) and meet once, after both stages' last backward.
        per_step = (
            plan.gradient_accumulation_steps
            if sharded and not scatter_then_gather and layout.shared_group is None
            else 1
        )
        # The whole tp-local gradient as a rank holds it (padded to equal data shards when the state
        # is sharded), which is what an all_reduce before the data reduction takes in.
        whole_local = _padded_bytes(pp_, plan, 4, sized(tuple(sharded))) if sharded else local_full
        if layout.shared_group is not None:
            # One collective with one participant per stage: both name it after the tied group; it
            # takes the whole (padded) gradient buffer, before any reduce-scatter.
            grads.append(
                PlannedUpdate(
                    _grad_update(
                        str(UpdateId.gradient(layout.shared_group, "tied")),
                        CollectiveKind.ALL_REDUCE,
                        (TIED_GROUP,),
                        layout.optimizer_state,
                        f"tied weight {layout.shared_group!r}: sum the first and last stage's whole gradients "
                        "before any reduce-scatter",
                    ),
                    name,
                    "gradient",
                    stage,
                    whole_local,
                    2,
                    per_step,
                    layer=layer,
                )
            )
        if Axis.TP in data_differs and dict(layout.placements).get(Axis.TP) == str(REPLICATE) and not pp_.is_expert:
            # As often as the data reduction it precedes: under FSDP the whole gradient exists only
            # until that accumulation step's reduce-scatter.
            grads.append(
                PlannedUpdate(
                    _grad_update(
                        str(UpdateId.gradient(name, "tp")),
                        CollectiveKind.ALL_REDUCE,
                        (Axis.TP,),
                        layout.optimizer_state,
                        "tp-replicated parameter whose inputs are sequence shards under sequence parallelism",
                    ),
                    name,
                    "gradient",
                    stage,
                    whole_local,
                    plan.tp,
                    per_step,
                    layer=layer,
                )
            )
        kv_axis = pp_.kv_replica_axis
        if kv_axis is not None:
            # Before the data reduction and as often: its evidence is the complete gradient of the head.
            grads.append(
                PlannedUpdate(
                    _grad_update(
                        str(UpdateId.gradient(name, "kv")),
                        CollectiveKind.ALL_REDUCE,
                        (kv_axis,),
                        layout.optimizer_state,
                        f"KV head shared by {pp_.kv_replicas} tp ranks: each holds the part of its gradient "
                        "that its own query heads contribute",
                    ),
                    name,
                    "gradient",
                    stage,
                    whole_local,
                    pp_.kv_replicas,
                    per_step,
                    layer=layer,
                )
            )
        if sharded:
            axes = tuple(sharded)
            grads.append(
                PlannedUpdate(
                    _grad_update(
                        str(UpdateId.gradient(name, "scatter")),
                        CollectiveKind.REDUCE_SCATTER,
                        axes,
                        StateLayout.SHARDED,
                        f"divide by the data-parallel size {dp}"
                        if not replicated
                        else "partial sum; the all_reduce that follows divides",
                    ),
                    name,
                    "gradient",
                    stage,
                    _padded_bytes(pp_, plan, 4, sized(axes)),
                    sized(axes),
                    per_step,
                    gradient_divisor=1 if replicated else dp,
                    layer=layer,
                )
            )
        if replicated:
            axes = tuple(replicated)
            # After a reduce-scatter it reduces the (padded) shard.
            payload = _padded_bytes(pp_, plan, 4, sized(tuple(sharded)), shard=True) if sharded else local_full
            grads.append(
                PlannedUpdate(
                    _grad_update(
                        str(UpdateId.gradient(name, "reduce")),
                        CollectiveKind.ALL_REDUCE,
                        axes,
                        layout.optimizer_state,
                        f"divide by the data-parallel size {dp}",
                    ),
                    name,
                    "gradient",
                    stage,
                    payload,
                    sized(axes),
                    per_step,
                    gradient_divisor=dp,
                    layer=layer,
                )
            )
        if not folded:
            out.extend(grads)
        param_bytes = (
            _padded_bytes(pp_, plan, DTYPE_BYTES[pp_.parameter.dtype], sized(tuple(sharded))) if sharded else 0
        )
        if scatter_then_gather:
            if not folded:  # a tied tensor's updated shards are gathered once, for all its uses
                axes = tuple(sharded)
                out.append(
                    PlannedUpdate(
                        _grad_update(
                            str(UpdateId.gather(name)),
                            CollectiveKind.ALL_GATHER,
                            axes,
                            StateLayout.SHARDED,
                            "distributed optimizer: gather the updated shards",
                            payload=PayloadKind.PARAMETER,
                        ),
                        name,
                        "parameter",
                        stage,
                        param_bytes,
                        sized(axes),
                        1,
                        layer=layer,
                    )
                )
        elif sharded:
            axes = tuple(sharded)
            for phase in ("forward", "backward"):
                out.append(
                    PlannedUpdate(
                        _grad_update(
                            str(UpdateId.gather(name, phase)),
                            CollectiveKind.ALL_GATHER,
                            axes,
                            StateLayout.SHARDED,
                            f"FSDP: gather the parameter before its {phase} use",
                            payload=PayloadKind.PARAMETER,
                        ),
                        name,
                        phase,
                        stage,
                        param_bytes,
                        sized(axes),
                        microbatches_per_step,
                        layer=layer,
                    )
                )
        if key is not None:
            derived[key] = (name, out[start:])
    return out


def _renamed(u: PlannedUpdate, old: str, new: str, stage: int, layer: int | None) -> PlannedUpdate:
    """Update ``u`` of the parameter or site ``old`` as the same update of ``new`` (of the same
    kind) on ``stage``: its id and tensor, which begin with ``old``, begin with ``new`` instead
    (``old:grad/scatter`` -> ``new:grad/scatter``; ``layers.3.`` -> ``layers.9.``), the rest as
    derived. The update was validated when it was made and a new subject keeps its id valid, so the
    copy skips DistributedUpdate's validation, which dominates planning many parameters."""
    update = unchecked_copy(u.update, node_id=new + u.update.node_id[len(old) :])
    return unchecked_copy(u, update=update, tensor=new + u.tensor[len(old) :], stage=stage, layer=layer)


def _recomputed(
    block: list[PlannedUpdate],
    engine: EngineProfile,
    checkpointing: str,
    modules: frozenset[str],
    moe: bool,
    up_gather: tuple[int, int] | None = None,
) -> list[PlannedUpdate]:
    """The forward collectives of ``block`` (one transformer block's updates; ``moe``: an MoE
    layer's) that activation checkpointing issues again in the backward
    (:meth:`EngineProfile.recomputes`, ``modules`` what selective checkpointing recomputes), as
    backward updates of their own (``layers.0.attn:in/recompute``): the same group, bytes and count.
    ``up_gather`` = (its width, the gather's): MLA's up projections, recomputed alone
    (Megatron's ``mla_up_proj``), gather their column-parallel inputs again, the latents without the
    rotary key (multi_latent_attention.py ``qkv_up_proj_and_rope_apply``)."""
    out = []
    for u in block:
        if u.phase != "forward":
            continue
        uid = UpdateId.parse(u.update.node_id)
        site = uid.subject.rsplit(".", 1)[-1]
        module = "core_attn" if uid.kind == "kv" else "attn" if site == "attn" else "moe" if moe else "mlp"
        nbytes = u.payload_bytes
        if not engine.recomputes(checkpointing, u.update.collective.value, module, modules):
            gathers_latents = (site, uid.kind, u.update.collective.value) == ("attn", "in", "all_gather")
            if up_gather is None or not gathers_latents:
                continue
            if not engine.recomputes(checkpointing, "all_gather", "mla_up_proj", modules):
                continue
            nbytes = u.payload_bytes * up_gather[0] // up_gather[1]
        out.append(
            _issued_again(
                u, f"activation checkpointing ({checkpointing}): the recomputed forward issues {uid} again", nbytes
            )
        )
    return out


def _issued_again(u: PlannedUpdate, note: str, nbytes: int | None = None) -> PlannedUpdate:
    """Forward collective ``u`` issued again by a recomputed forward, in the backward: the same group,
    count and (unless ``nbytes``) bytes, named ``SITE:KIND/recompute``."""
    d = u.update
    update = DistributedUpdate(
        node_id=str(UpdateId.parse(d.node_id).recomputed()),
        payload=d.payload,
        collective=d.collective,
        mesh_axes=d.mesh_axes,
        state_layout=d.state_layout,
        notes=(note,),
        contract_exact=d.contract_exact,
    )
    return PlannedUpdate(
        update,
        u.tensor,
        "backward",
        u.stage,
        u.payload_bytes if nbytes is None else nbytes,
        u.group_size,
        u.occurrences_per_step,
        layer=u.layer,
    )


def _embedding_updates(
    add: Callable[..., PlannedUpdate], site: str, stage: int, sp: bool, hidden_bytes: int, layer: int | None = None
) -> None:
    """A vocabulary-parallel embedding's output over tp: each rank holds a slice of the vocabulary, so
    the rows are summed (all_reduce), or under sequence parallelism summed and scattered over the
    sequence (reduce_scatter, whose backward gathers)."""
    if sp:
        add(
            UpdateId.activation(site, "out"),
            CollectiveKind.REDUCE_SCATTER,
            (Axis.TP,),
            "forward",
            stage,
            hidden_bytes,
            StateLayout.SHARDED,
            "vocabulary-parallel embedding: sum the vocabulary slices and scatter the sequence",
            layer=layer,
        )
        add(
            UpdateId.activation(site, "out", backward=True),
            CollectiveKind.ALL_GATHER,
            (Axis.TP,),
            "backward",
            stage,
            hidden_bytes,
            StateLayout.REPLICATED,
            "conjugate of the embedding's reduce_scatter",
            layer=layer,
        )
    else:
        add(
            UpdateId.activation(site, "out"),
            CollectiveKind.ALL_REDUCE,
            (Axis.TP,),
            "forward",
            stage,
            hidden_bytes,
            StateLayout.REPLICATED,
            "vocabulary-parallel embedding: each rank holds a slice of the vocabulary",
            layer=layer,
        )


def _head_updates(
    add: Callable[..., PlannedUpdate],
    site: str,
    stage: int,
    sp: bool,
    hidden_bytes: int,
    loss_bytes: int,
    layer: int | None = None,
) -> None:
    """A vocabulary-parallel output head's collectives over tp: its input gathered over the sequence
    under sequence parallelism (and its gradient reduce-scattered), else its input gradients summed;
    then the cross entropy's gather of one fp32 (log-sum-exp, target logit) pair per token from each
    vocabulary shard, after which every rank combines them into the same loss and the backward needs
    no communication."""
    if sp:
        add(
            UpdateId.activation(site, "in"),
            CollectiveKind.ALL_GATHER,
            (Axis.TP,),
            "forward",
            stage,
            hidden_bytes,
            StateLayout.REPLICATED,
            "sequence parallel: gather the sequence before the vocabulary-parallel head",
            layer=layer,
        )
        add(
            UpdateId.activation(site, "in", backward=True),
            CollectiveKind.REDUCE_SCATTER,
            (Axis.TP,),
            "backward",
            stage,
            hidden_bytes,
            StateLayout.SHARDED,
            "conjugate of the head's input all_gather",
            layer=layer,
        )
    else:
        add(
            UpdateId.activation(site, "in", backward=True),
            CollectiveKind.ALL_REDUCE,
            (Axis.TP,),
            "backward",
            stage,
            hidden_bytes,
            StateLayout.REPLICATED,
            "sum the input gradients of the vocabulary-parallel head",
            layer=layer,
        )
    add(
        UpdateId.activation(site, "loss"),
        CollectiveKind.ALL_GATHER,
        (Axis.TP,),
        "forward",
        stage,
        loss_bytes,
        StateLayout.REPLICATED,
        "vocabulary-parallel cross entropy: gather each shard's log-sum-exp and target logit",
        layer=layer,
    )


def _mtp_updates(
    add: Callable[..., PlannedUpdate],
    out: list[PlannedUpdate],
    i: int,
    stage: int,
    plan: ParallelPlan,
    engine: EngineProfile,
    sp: bool,
    hidden_bytes: int,
    tokens: int,
    checkpointing: str,
) -> None:
    """A multi-token prediction depth's tensor-parallel collectives beside its block (block ``i``, on
    the last stage), per micro-batch, listed through ``add`` (activation_updates'): the
    vocabulary-parallel embedding of the tokens ahead (as the model's embedding), the projection of
    [embedding, hidden] where the engine splits it (EngineProfile.mtp_projection_split: Megatron-Core's
    ColumnParallelLinear gathers the sequence under sequence parallelism, then
    ``gather_from_tensor_model_parallel_region`` its output features and
    ``scatter_to_sequence_parallel_region``, whose backward gathers), and the depth's own logits through
    the shared vocabulary-parallel head and loss (as the model's). Full checkpointing runs the
    projection again (``MultiTokenPredictionLayer._checkpointed_forward`` wraps it with the block),
    appended to ``out`` (the list ``add`` appends to)."""
    if plan.tp == 1:
        return
    site = f"layers.{i}.mtp"
    _embedding_updates(add, f"{site}.embed", stage, sp, hidden_bytes, layer=i)
    if engine.mtp_projection_split:
        proj, joined = f"{site}.eh_proj", 2 * hidden_bytes  # [embedding, hidden state] per token
        forward = []
        if sp:
            forward.append(
                add(
                    UpdateId.activation(proj, "in"),
                    CollectiveKind.ALL_GATHER,
                    (Axis.TP,),
                    "forward",
                    stage,
                    joined,
                    StateLayout.REPLICATED,
                    "sequence parallel: gather the sequence before the column-parallel projection",
                    layer=i,
                )
            )
            add(
                UpdateId.activation(proj, "in", backward=True),
                CollectiveKind.REDUCE_SCATTER,
                (Axis.TP,),
                "backward",
                stage,
                joined,
                StateLayout.SHARDED,
                "conjugate of the input all_gather",
                layer=i,
            )
        else:
            add(
                UpdateId.activation(proj, "in", backward=True),
                CollectiveKind.ALL_REDUCE,
                (Axis.TP,),
                "backward",
                stage,
                joined,
                StateLayout.REPLICATED,
                "sum the input gradients of the column-parallel projection",
                layer=i,
            )
        forward.append(
            add(
                UpdateId.activation(proj, "out"),
                CollectiveKind.ALL_GATHER,
                (Axis.TP,),
                "forward",
                stage,
                hidden_bytes,
                StateLayout.REPLICATED,
                "gather the projection's output features (gather_from_tensor_model_parallel_region)",
                layer=i,
            )
        )
        if sp:
            add(
                UpdateId.activation(proj, "out", backward=True),
                CollectiveKind.ALL_GATHER,
                (Axis.TP,),
                "backward",
                stage,
                hidden_bytes,
                StateLayout.REPLICATED,
                "conjugate of scattering the projection's output over the sequence",
                layer=i,
            )
        if checkpointing == "full" and engine.recomputes("full", "all_gather", "mtp"):
            for u in forward:
                uid = UpdateId.parse(u.update.node_id)
                out.append(
                    _issued_again(u, f"activation checkpointing (full): the recomputed depth issues {uid} again")
                )
    _head_updates(add, f"{site}.head", stage, sp, hidden_bytes, plan.tp * 2 * tokens * 4, layer=i)


def _block_updates(out: list[PlannedUpdate], start: int, block: int) -> list[PlannedUpdate]:
    """The updates of block ``block`` listed from ``start`` on (they end where another block's
    or the pipeline's begin)."""
    found = []
    for u in out[start:]:
        if u.layer != block:
            break
        found.append(u)
    return found


def _padded_bytes(
    pp_: PlacedParameter, plan: ParallelPlan, elem_bytes: int, shards: int, *, shard: bool = False
) -> int:
    """Bytes of the tp-local tensor split into ``shards`` equal data shards (the last one padded, as
    FSDP pads): the whole padded tensor, which an all_gather outputs and a reduce_scatter takes in,
    or one shard."""
    dims = list(pp_.parameter.shape) or [1]
    for d, pieces in model_parallel_splits(pp_, plan):
        dims[d] //= pieces
    data = [shard_dim(p) for a, p in pp_.layout.placements if a in ALL_DATA_AXES]
    dim = next((d for d in data if d is not None), 0)
    per = -(-dims[dim] // shards)
    dims[dim] = per if shard else per * shards
    size = elem_bytes
    for d in dims:
        size *= d
    return size


def _tp_local(pp_: PlacedParameter, plan: ParallelPlan, nbytes: int) -> int:
    """Bytes of the tp (and ep) shard: data-parallel collectives move the model-parallel shard."""
    factor = 1
    for _, pieces in model_parallel_splits(pp_, plan):
        factor *= pieces
    return nbytes // factor


def activation_updates(
    spec: Spec, plan: ParallelPlan, stage_of: dict[int, int], layers: Iterable[int] | None = None
) -> list[PlannedUpdate]:
    """Per-layer activation collectives of a transformer (per micro-batch); ``layers``: the blocks to
    list (every block when None), as :func:`mixle_compile.parameters.model_parameters` takes them."""
    model = spec.model
    if not isinstance(model, TransformerModel):
        return []
    t = spec.training
    act_bytes_per = 4 if t.precision == "fp32" else 2
    seq = (t.seq_len or 1) // plan.cp
    tokens = t.micro_batch_size * seq
    hidden_bytes = tokens * model.hidden_size * act_bytes_per
    mb = plan.microbatches * plan.gradient_accumulation_steps
    sp = t.sequence_parallel
    out: list[PlannedUpdate] = []

    def add(
        node: UpdateId,
        collective: CollectiveKind,
        axes: tuple[str, ...],
        phase: str,
        stage: int,
        nbytes: int,
        layout: StateLayout,
        notes: str,
        payload=PayloadKind.ACTIVATION,
        times: int = 1,
        layer: int | None = None,
    ) -> PlannedUpdate:
        out.append(
            PlannedUpdate(
                DistributedUpdate(
                    node_id=str(node),
                    payload=payload,
                    collective=collective,
                    mesh_axes=axes,
                    state_layout=layout,
                    notes=(notes,) if notes else (),
                    contract_exact=True,
                ),
                node.subject,
                phase,
                stage,
                nbytes,
                group_size(axes, plan),
                mb * times,
                layer=layer,
            )
        )
        return out[-1]

    last = plan.pp - 1
    if plan.tp > 1:
        _embedding_updates(add, "embed", 0, sp, hidden_bytes)
        _head_updates(add, "lm_head", last, sp, hidden_bytes, plan.tp * 2 * tokens * 4)
    engine = engine_profile(spec.backend)
    # K and V of the KV heads a tp rank holds: its share, or the one head it shares with others
    # (MLA's values at their own head size, or padded to the keys' where the engine pads them).
    a = attention_widths(model)
    key_and_value = 2 * a.kv_head_dim if engine.pads_values_to_key_heads else a.qk_head_dim + a.v_head_dim
    kv_bytes = tokens * max(a.kv_heads // plan.tp, 1) * key_and_value * act_bytes_per // 2
    # What the attention's column-parallel projections read: the hidden state, or MLA's latents where
    # the engine projects them down on the sequence shard.
    attn_in = a.gathered if engine.latent_projections_on_shards else a.hidden
    up_gather = (a.gathered - a.rope, a.gathered) if a.latent and engine.latent_projections_on_shards else None
    block_in_bytes = {"attn": tokens * attn_in * act_bytes_per, "mlp": hidden_bytes}
    # A block's collectives follow from its kind (dense or mixture-of-experts); its index and stage
    # only name and place them: the first block of each kind is planned, the others renamed.
    first_of: dict[tuple[bool, bool], tuple[int, int]] = {}  # kind -> (its first block, where its updates start)
    # The kinds differ where experts are exchanged (ep > 1), or where selective checkpointing runs a
    # dense MLP and an MoE block again differently (Megatron's recompute_modules "mlp" and "moe").
    modules = engine.selective_modules(t.recompute_modules)
    kinds_differ = plan.ep > 1 or (
        t.activation_checkpointing == "selective" and ("mlp" in modules) != ("moe" in modules)
    )
    for i in range(model.num_layers + model.mtp_num_layers) if layers is None else layers:
        stage = stage_of.get(i, 0)
        moe = kinds_differ and is_moe_layer(model, i)
        # a multi-token prediction depth's block adds its own collectives (_mtp_updates): a kind apart
        kind = (is_mtp_layer(model, i), moe)
        seen = first_of.get(kind)
        if seen is not None:
            first, start = seen
            end = start + len(_block_updates(out, start, first))
            out.extend(_renamed(u, f"layers.{first}.", f"layers.{i}.", stage, i) for u in out[start:end])
            continue
        first_of[kind] = (i, len(out))
        for block in ("attn", "mlp"):
            if plan.tp > 1:
                if sp:
                    add(
                        UpdateId.activation(f"layers.{i}.{block}", "in"),
                        CollectiveKind.ALL_GATHER,
                        (Axis.TP,),
                        "forward",
                        stage,
                        block_in_bytes[block],
                        StateLayout.REPLICATED,
                        "sequence parallel: gather the sequence before the column-parallel layer",
                        layer=i,
                    )
                    add(
                        UpdateId.activation(f"layers.{i}.{block}", "out"),
                        CollectiveKind.REDUCE_SCATTER,
                        (Axis.TP,),
                        "forward",
                        stage,
                        hidden_bytes,
                        StateLayout.SHARDED,
                        "sequence parallel: reduce and scatter the row-parallel output over the sequence",
                        layer=i,
                    )
                    add(
                        UpdateId.activation(f"layers.{i}.{block}", "in", backward=True),
                        CollectiveKind.REDUCE_SCATTER,
                        (Axis.TP,),
                        "backward",
                        stage,
                        block_in_bytes[block],
                        StateLayout.SHARDED,
                        "conjugate of the input all_gather",
                        layer=i,
                    )
                    add(
                        UpdateId.activation(f"layers.{i}.{block}", "out", backward=True),
                        CollectiveKind.ALL_GATHER,
                        (Axis.TP,),
                        "backward",
                        stage,
                        hidden_bytes,
                        StateLayout.REPLICATED,
                        "conjugate of the output reduce_scatter",
                        layer=i,
                    )
                else:
                    add(
                        UpdateId.activation(f"layers.{i}.{block}", "out"),
                        CollectiveKind.ALL_REDUCE,
                        (Axis.TP,),
                        "forward",
                        stage,
                        hidden_bytes,
                        StateLayout.REPLICATED,
                        "sum the row-parallel partial outputs",
                        layer=i,
                    )
                    add(
                        UpdateId.activation(f"layers.{i}.{block}", "in", backward=True),
                        CollectiveKind.ALL_REDUCE,
                        (Axis.TP,),
                        "backward",
                        stage,
                        block_in_bytes[block],
                        StateLayout.REPLICATED,
                        "sum the input gradients of the column-parallel layer",
                        layer=i,
                    )
        if plan.cp > 1:
            add(
                UpdateId.activation(f"layers.{i}.attn", "kv"),
                CollectiveKind.ALL_GATHER,
                (Axis.CP,),
                "forward",
                stage,
                2 * kv_bytes * plan.cp,
                StateLayout.REPLICATED,
                "context parallel: gather K and V of every sequence chunk",
                payload=PayloadKind.KV_BLOCK,
                layer=i,
            )
            add(
                UpdateId.activation(f"layers.{i}.attn", "kv", backward=True),
                CollectiveKind.REDUCE_SCATTER,
                (Axis.CP,),
                "backward",
                stage,
                2 * kv_bytes * plan.cp,
                StateLayout.SHARDED,
                "context parallel: return the K and V gradients to their chunks",
                payload=PayloadKind.KV_BLOCK,
                layer=i,
            )
        if moe and plan.ep > 1:
            # Under sequence parallelism each tp rank routes its own sequence shard when experts are
            # whole on it (etp = 1); split over tp (etp = tp), every tp rank routes all the gathered
            # tokens, each computing its slice of their experts' features.
            routed = hidden_bytes * (model.experts_per_token or 1) // (plan.tp if sp and plan.etp == 1 else 1)
            for phase, what in (
                ("forward", "dispatch"),
                ("forward", "combine"),
                ("backward", "dispatch"),
                ("backward", "combine"),
            ):
                add(
                    UpdateId.activation(f"layers.{i}.moe", what, backward=phase == "backward"),
                    CollectiveKind.ALL_TO_ALL,
                    (Axis.EP,),
                    phase,
                    stage,
                    routed,
                    StateLayout.EXPERT_LOCAL,
                    "expert parallel: tokens to their experts' ranks and back",
                    payload=PayloadKind.TOKEN,
                    layer=i,
                )
        if t.activation_checkpointing != "none":
            out.extend(
                _recomputed(out[first_of[kind][1] :], engine, t.activation_checkpointing, modules, moe, up_gather)
            )
        if kind[0]:
            _mtp_updates(add, out, i, stage, plan, engine, sp, hidden_bytes, tokens, t.activation_checkpointing)
    if plan.pp > 1:
        boundary_bytes = hidden_bytes // (plan.tp if sp else 1)
        # Virtual stage w hands over to w + 1 on stage (w + 1) % pp: with interleaving the last stage
        # also sends to the first (chunk c to chunk c + 1), and a pair of stages carries one
        # transfer per micro-batch for every virtual boundary between them.
        chunks = max(1, t.virtual_pipeline_stages)
        boundaries: dict[int, int] = {}
        for w in range(plan.pp * chunks - 1):
            boundaries[w % plan.pp] = boundaries.get(w % plan.pp, 0) + 1
        # The first pair of stages' transfers are planned; every other pair's are the same transfers
        # between other stages (renamed and moved, as a block's updates are).
        planned: tuple[PlannedUpdate, PlannedUpdate] | None = None
        for s in range(plan.pp):
            if s not in boundaries:
                continue
            n = (s + 1) % plan.pp
            ahead, back = UpdateId.transfer(s, n), UpdateId.transfer(n, s, backward=True)
            if planned is not None:
                for u, node, stage in zip(planned, (ahead, back), (s, n), strict=True):
                    update = unchecked_copy(u.update, node_id=str(node))
                    out.append(
                        unchecked_copy(
                            u, update=update, tensor=node.subject, stage=stage, occurrences_per_step=mb * boundaries[s]
                        )
                    )
                continue
            add(
                ahead,
                CollectiveKind.P2P,
                (Axis.PP,),
                "forward",
                s,
                boundary_bytes,
                StateLayout.PIPELINE_LOCAL,
                "pipeline: activation to the next stage",
                times=boundaries[s],
            )
            add(
                back,
                CollectiveKind.P2P,
                (Axis.PP,),
                "backward",
                n,
                boundary_bytes,
                StateLayout.PIPELINE_LOCAL,
                "pipeline: activation gradient to the previous stage",
                times=boundaries[s],
            )
            planned = (out[-2], out[-1])
    return out
