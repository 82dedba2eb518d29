"""The plan, read as instructions: what each rank holds and which collectives it issues.

Torch-free on purpose: `run` refuses a plan it cannot execute (an axis this runtime does not
implement yet, a model whose sizes tensor parallelism cannot split) before torch is imported and
before any process is started.

Every collective the runtime issues is one of the plan's updates, looked up here by node id; the
parameter instructions say, per parameter, how its state is held:

- ``replicated``: the whole (tensor-parallel-local) tensor on every data rank; gradients reduced
  with the plan's all_reduce(s) once per optimizer step;
- ``fsdp``: a dimension-0 shard over the data axes the layout shards; all_gather before every
  forward and backward use, reduce_scatter of the gradient every accumulation step;
- ``zero``: replicated for compute, sharded for the optimizer (a distributed optimizer): the
  gradient is reduce-scattered once per step and the updated shards are all-gathered back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from mixle_compile.contracts import ParallelPlan
from mixle_compile.heap import full_collections_paused
from mixle_compile.parameters import MTP_EMBEDDING, attention_widths
from mixle_compile.plan.artifact import plan_spec
from mixle_compile.plan.document import PlanDocument
from mixle_compile.plan.vocabulary import (
    ALL_DATA_AXES,
    BACKWARD,
    KV_HEAD_AXIS,
    RECOMPUTE,
    REPLICATE,
    TIED_GROUP,
    Axis,
    Placement,
    PlacementError,
    Shard,
    UpdateId,
    UpdateIdError,
    expert_data_size,
    kv_replica_size,
    rule_name,
)
from mixle_compile.runtime.errors import RuntimeRefusal
from mixle_compile.spec.models import ModulesModel, Spec, TransformerModel

# The activation sites the transformer executes (see runtime/model.py), by block, with the kinds of
# collective each issues (every one also as its backward conjugate); a planned update outside these
# and the parameters' own updates is one this runtime does not implement.
_EXECUTED_SITES = {
    "embed": ("in", "out", "loss"),
    "lm_head": ("in", "out", "loss"),
    "attn": ("in", "out", "loss", "kv"),
    "mlp": ("in", "out", "loss"),
    "moe": ("dispatch", "combine"),
    # a multi-token prediction depth's (model.py ``_mtp_depth``, lower/updates.py ``_mtp_updates``): the
    # embedding of the tokens ahead, the projection's input and gathered output, its head and loss
    "mtp.embed": ("out",),
    "mtp.eh_proj": ("in", "out"),
    "mtp.head": ("in", "loss"),
}
_LAYER_BLOCK = re.compile(r"layers\.\d+\.(attn|mlp|moe|mtp\.embed|mtp\.eh_proj|mtp\.head)")


@dataclass(frozen=True)
class Collective:
    """One planned DistributedUpdate, as the runtime executes it."""

    node_id: str
    collective: str  # all_reduce, reduce_scatter, all_gather, ...
    axes: tuple[str, ...]
    rule: str  # the group rule its axes name (see lower/groups.py)
    phase: str
    stage: int
    tensor: str
    payload_bytes: int
    group_size: int
    occurrences_per_step: int
    divisor: int
    # Every stage whose ranks issue it: one update may be listed once per stage, as the tied
    # embedding's all_reduce is (by the embedding on the first stage and the head on the last).
    stages: tuple[int, ...] = ()

    @classmethod
    def of_update(cls, u, **fields) -> Collective:
        """The collective a plan's update states (``u``: an entry of the plan's ``updates``)."""
        return cls(
            node_id=u.node_id,
            collective=u.collective,
            axes=tuple(u.mesh_axes),
            rule=rule_name(u.mesh_axes) if u.mesh_axes else "",
            phase=u.phase,
            stage=u.stage,
            tensor=u.tensor,
            payload_bytes=u.payload_bytes,
            group_size=u.group_size,
            occurrences_per_step=u.occurrences_per_step,
            divisor=u.gradient_divisor,
            **fields,
        )


@dataclass(frozen=True)
class ParamInstruction:
    name: str
    role: str
    layer: int | None
    global_shape: tuple[int, ...]
    dtype: str
    tp_dim: int | None  # the dimension tp splits; None: replicated over tp
    mode: str  # replicated | fsdp | zero
    shard_axes: tuple[str, ...]  # data axes of the dimension-0 shard (fsdp, zero)
    tied_to: str | None  # the parameter whose tensor this one is (tied weights on one stage)
    gradient: tuple[Collective, ...]  # the gradient's reductions, in plan order
    gathers: Mapping[str, Collective]  # phase -> parameter all_gather
    reduce_every_accumulation: bool  # False: once per optimizer step
    # tp ranks holding the same slice: a KV head shared by r ranks (tp_dim is then split into
    # tp / r pieces, rank t holding piece t // r); 1: every tp rank its own slice
    tp_replicas: int = 1
    ep_dim: int | None = None  # the dimension expert parallelism splits (experts); None: not split
    # The uses whose gradients this parameter's reductions sum, this one first: the copies of a tied
    # weight on different pipeline stages (started equal, kept equal by the plan's all_reduce of their
    # whole gradients over the tied group; the first copy is the weight itself), or, on the first use
    # of a tensor tied on one stage, every use (the others are ``folded`` into it).
    tied_uses: tuple[str, ...] = ()

    @property
    def copy_of(self) -> str | None:
        """The weight this parameter is a copy of on another pipeline stage (None: it is no copy)."""
        return self.tied_uses[0] if self.tied_uses and self.tied_uses[0] != self.name else None

    @property
    def canonical(self) -> str:
        """The one logical tensor this parameter is (itself, the one it is tied to, or the one it copies)."""
        return self.tied_to or self.copy_of or self.name

    @property
    def tensor_owner(self) -> str:
        """The parameter whose tensor this rank's use reads (a tie on one stage shares one tensor)."""
        return self.tied_to or self.name

    @property
    def folded(self) -> bool:
        """A use of a tensor tied on one stage whose gradient is added to the first use's and reduced
        with it (the plan lists no reduction of its own)."""
        return self.tied_to is not None and not self.gradient


@dataclass(frozen=True)
class Instructions:
    plan: ParallelPlan
    spec: Spec
    content_digest: str
    family: str
    precision: str
    optimizer: str
    learning_rate: float
    seed: int
    steps: int
    micro_batch_size: int
    seq_len: int | None
    global_batch_size: int
    sequence_parallel: bool
    params: tuple[ParamInstruction, ...]
    collectives: Mapping[str, Collective]
    activation_sites: tuple[str, ...]  # node ids of the planned activation collectives

    @property
    def micro_steps(self) -> int:
        return self.plan.microbatches * self.plan.gradient_accumulation_steps

    def param(self, name: str) -> ParamInstruction:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


def plan_of(doc: PlanDocument) -> ParallelPlan:
    return ParallelPlan.from_dict(doc.mesh.degrees)


def read_instructions(doc: PlanDocument) -> Instructions:
    """The plan as instructions; raises RuntimeRefusal naming what this runtime cannot execute.

    With pp > 1 the stage-boundary transfers are accepted too (runtime/pipeline_plan.py refuses the
    rest of what the pipeline runtime does not execute). Read with full collections paused, as a
    spec is compiled (mixle_compile/heap.py): the reading makes an object or more per update and
    no cycles, and full collections over them grew faster than the plan."""
    with full_collections_paused():
        return _read(doc)


def _read(doc: PlanDocument) -> Instructions:
    _refuse_unverified(doc)
    spec = plan_spec(doc)
    plan = plan_of(doc)
    _refuse_unsupported(spec, plan)
    collectives = _read_collectives(doc)
    params = _read_params(doc, spec, plan, collectives)
    params = _fold_ties(params)
    _check_tied_layouts(params)
    _check_mtp_params(spec, plan, params)
    t = spec.training
    return Instructions(
        plan=plan,
        spec=spec,
        content_digest=doc.content_digest,
        family=spec.model.family,
        precision=t.precision,
        optimizer=t.optimizer,
        learning_rate=t.learning_rate,
        seed=t.seed,
        steps=t.steps,
        micro_batch_size=t.micro_batch_size,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        sequence_parallel=bool(t.sequence_parallel and plan.tp > 1),
        params=tuple(params),
        collectives=MappingProxyType(collectives),
        activation_sites=_activation_sites(collectives, {p.name for p in params}, plan),
    )


def _refuse_unverified(doc: PlanDocument) -> None:
    if not doc.verdict.ok:
        first = (
            doc.verdict.diagnostics[0].message
            if doc.verdict.diagnostics
            else "; ".join(doc.verdict.reduction_problems[:1]) or "its schedule check failed"
        )
        raise RuntimeRefusal(
            f"the plan did not verify ({doc.verdict.errors} error(s); first: {first}); fix the spec and "
            "recompile instead of running it"
        )


def _read_collectives(doc: PlanDocument) -> dict[str, Collective]:
    """Every planned update by node id; one listed again (another stage's participant) is one
    collective issued on several stages."""
    collectives: dict[str, Collective] = {}
    for u in doc.updates:
        c = Collective.of_update(u, stages=(u.stage,))
        seen = collectives.get(u.node_id)
        if seen is not None:
            if (seen.collective, seen.axes, seen.payload_bytes, seen.occurrences_per_step, seen.divisor) != (
                c.collective,
                c.axes,
                c.payload_bytes,
                c.occurrences_per_step,
                c.divisor,
            ):
                raise RuntimeRefusal(
                    f"the plan lists the update {u.node_id!r} twice with different collectives or sizes; recompile it"
                )
            c = replace(seen, stages=tuple(sorted({*seen.stages, u.stage})))
        collectives[u.node_id] = c
    return collectives


def _read_params(
    doc: PlanDocument, spec: Spec, plan: ParallelPlan, collectives: Mapping[str, Collective]
) -> list[ParamInstruction]:
    ties = _ties(spec, plan)
    copies = _stage_copies(spec, plan)
    names = {p.logical_id for p in doc.parameters}
    # The updates of each tensor, indexed once: scanning every update for every parameter made
    # reading a plan quadratic in the model.
    by_tensor: dict[str, list] = {}
    for u in doc.updates:
        by_tensor.setdefault(u.tensor, []).append(u)
    params = []
    for p in doc.parameters:
        mine = by_tensor.get(p.logical_id, ())
        gradient = tuple(collectives[u.node_id] for u in mine if u.payload == "gradient")
        gathers = {
            u.phase: collectives[u.node_id] for u in mine if u.payload == "parameter" and u.collective == "all_gather"
        }
        placements = _placements(p.logical_id, p.placements)
        tp_dim = placements.get(Axis.TP, REPLICATE).dim
        tp_replicas = _kv_replicas(p.logical_id, placements, plan, tuple(p.global_shape), gradient)
        if tp_replicas > 1:
            tp_dim = placements[KV_HEAD_AXIS].dim
        mode, shard_axes = _holding(p.logical_id, placements, gradient, gathers)
        every_accumulation = _reduces_every_accumulation(p.logical_id, gradient, plan)
        tied_to = ties.get(p.logical_id)
        if tied_to is not None and tied_to not in names:
            raise RuntimeRefusal(f"parameter {p.logical_id!r} is tied to {tied_to!r}, which the plan does not list")
        group = copies.get(p.logical_id, ())
        if group:
            _check_tied_sync(p.logical_id, group, names, gradient)
        params.append(
            ParamInstruction(
                name=p.logical_id,
                role=p.role,
                layer=p.layer,
                global_shape=tuple(p.global_shape),
                dtype=p.dtype,
                tp_dim=tp_dim,
                mode=mode,
                shard_axes=shard_axes,
                tied_to=tied_to,
                gradient=gradient,
                gathers=MappingProxyType(gathers),
                reduce_every_accumulation=every_accumulation,
                tp_replicas=tp_replicas,
                ep_dim=placements.get(Axis.EP, REPLICATE).dim,
                tied_uses=group,
            )
        )
    return params


def _placements(name: str, entries) -> dict[str, Placement]:
    """A parameter's (mesh axis, placement) pairs, read."""
    try:
        return {axis: Placement.parse(placement) for axis, placement in entries}
    except PlacementError as e:
        raise RuntimeRefusal(f"parameter {name!r}: {e}; recompile the plan") from None


def _holding(
    name: str, placements: Mapping[str, Placement], gradient: tuple[Collective, ...], gathers: Mapping[str, Collective]
) -> tuple[str, tuple[str, ...]]:
    """How the parameter's state is held (replicated, fsdp or zero) and the data axes of its shard."""
    shard_axes = tuple(a for a in ALL_DATA_AXES if placements.get(a, REPLICATE).dim is not None)
    if "parameter" in gathers:
        scatter = [u for u in gradient if u.collective == "reduce_scatter"]
        return "zero", scatter[0].axes if scatter else ()
    if not shard_axes:
        return "replicated", shard_axes
    if any(placements[a] != Shard(0) for a in shard_axes):
        raise RuntimeRefusal(
            f"parameter {name!r} is sharded on a dimension other than 0 over the data axes; this runtime "
            "shards dimension 0 only"
        )
    missing = {"forward", "backward"} - set(gathers)
    if missing:
        raise RuntimeRefusal(
            f"the plan shards {name!r} over {', '.join(shard_axes)} but declares no parameter all_gather for "
            f"its {' and '.join(sorted(missing))} use"
        )
    return "fsdp", shard_axes


def _reduces_every_accumulation(name: str, gradient: tuple[Collective, ...], plan: ParallelPlan) -> bool:
    """Whether the gradient is reduced at every accumulation step (else once per optimizer step)."""
    frequencies = {u.occurrences_per_step for u in gradient}
    if len(frequencies) > 1:
        raise RuntimeRefusal(
            f"the plan reduces the gradient of {name!r} at different frequencies ({sorted(frequencies)} times "
            "per step); "
            "a gradient chain must run as one unit, so this plan cannot be replayed"
        )
    gas = plan.gradient_accumulation_steps
    return bool(gradient) and gas > 1 and frequencies == {gas}


def _fold_ties(params: list[ParamInstruction]) -> list[ParamInstruction]:
    """One tensor on this stage: the plan reduces (and, with a distributed optimizer, gathers) it
    once, as its first member, whose reductions then carry the other uses' gradients too."""
    params = list(params)
    index = {p.name: i for i, p in enumerate(params)}
    for i, p in enumerate(params):
        if p.folded:
            j = index[p.tied_to]
            q = params[j]
            params[i] = replace(p, mode=q.mode, shard_axes=q.shard_axes)
            params[j] = replace(q, tied_uses=(*(q.tied_uses or (q.name,)), p.name))
    return params


def _check_tied_layouts(params: list[ParamInstruction]) -> None:
    by_name = {p.name: p for p in params}
    for p in params:
        if p.canonical != p.name:
            q = by_name[p.canonical]
            if (q.mode, q.global_shape, q.tp_dim, q.tp_replicas, q.shard_axes) != (
                p.mode,
                p.global_shape,
                p.tp_dim,
                p.tp_replicas,
                p.shard_axes,
            ):
                raise RuntimeRefusal(
                    f"tied parameters {q.name!r} and {p.name!r} are laid out differently; tied weights are one "
                    "tensor and need one layout"
                )


def _activation_sites(
    collectives: Mapping[str, Collective], param_tensors: set[str], plan: ParallelPlan
) -> tuple[str, ...]:
    """The node ids of the planned activation collectives; refuses one this runtime does not execute."""
    sites = []
    for node_id, c in collectives.items():
        if c.tensor in param_tensors:
            continue
        if _recomputed(node_id):
            raise RuntimeRefusal(
                f"the plan declares the collective {node_id!r} ({c.collective} over {', '.join(c.axes)}), which "
                "activation checkpointing issues again where the recomputed forward runs; this runtime keeps "
                "every activation and recomputes nothing, so it never issues it: compile with "
                "activation_checkpointing: none (or backend: torch, whose plans issue nothing again)"
            )
        if not _executed(node_id, plan):
            raise RuntimeRefusal(
                f"the plan declares the collective {node_id!r} ({c.collective} over {', '.join(c.axes)}), "
                "which this runtime does not execute"
            )
        sites.append(node_id)
    return tuple(sites)


def _recomputed(node_id: str) -> bool:
    """Whether ``node_id`` is an activation collective that activation checkpointing issues again."""
    try:
        return UpdateId.parse(node_id).step == RECOMPUTE
    except UpdateIdError:
        return False


def _executed(node_id: str, plan: ParallelPlan) -> bool:
    """Whether the update ``node_id`` is an activation collective the transformer executes, or (with
    pp > 1) a stage-boundary transfer of runtime/pipeline.py."""
    try:
        uid = UpdateId.parse(node_id)
    except UpdateIdError:
        return False
    if uid.step not in (None, BACKWARD):
        return False
    if uid.stages is not None:
        return plan.pp > 1
    layer = _LAYER_BLOCK.fullmatch(uid.subject)
    block = layer.group(1) if layer else uid.subject
    return uid.kind in _EXECUTED_SITES.get(block, ())


def _kv_replicas(
    name: str,
    placements: Mapping[str, Placement],
    plan: ParallelPlan,
    shape: tuple[int, ...],
    gradient: tuple[Collective, ...],
) -> int:
    """tp ranks sharing the parameter's slice (a replicated KV head, lower/layouts.py), checked against
    the plan's reductions: its gradient must be summed over the ranks sharing it."""
    replica_axes = [(a, kv_replica_size(a)) for a in placements if kv_replica_size(a) is not None]
    head = placements.get(KV_HEAD_AXIS)
    if not replica_axes and head is None:
        return 1
    if len(replica_axes) != 1 or head is None or head.dim is None or Axis.TP in placements:
        written = {axis: str(placement) for axis, placement in placements.items()}
        raise RuntimeRefusal(
            f"parameter {name!r} has the placements {written}; a KV head shared over tp is placed as "
            f"{KV_HEAD_AXIS}: shard(dim) with one tp_kv_replica<r>: replicate, and nothing else on tp"
        )
    axis, replicas = replica_axes[0]
    dim = head.dim
    if plan.tp % replicas or dim >= len(shape) or shape[dim] % (plan.tp // replicas):
        raise RuntimeRefusal(
            f"parameter {name!r}: {replicas} tp ranks per KV head do not split tp={plan.tp} and its shape "
            f"{list(shape)} evenly"
        )
    if not any(c.collective == "all_reduce" and c.rule == axis for c in gradient):
        raise RuntimeRefusal(
            f"the plan shares {name!r} over {replicas} tp ranks ({axis}) but never sums its gradient over them; "
            "each rank holds only its own query heads' part of it, so training would diverge between them: "
            "recompile the spec"
        )
    return replicas


def _ties(spec: Spec, plan: ParallelPlan) -> dict[str, str]:
    """Tied parameters on one stage are one tensor: member -> the first parameter of its group."""
    model = spec.model
    if isinstance(model, TransformerModel):
        if plan.pp > 1:
            return {}
        if model.tie_embeddings:
            return {"lm_head.weight": "embed.weight"}
        # multi-token prediction's copy of the embedding is, on one stage, the embedding itself
        return {MTP_EMBEDDING: "embed.weight"} if model.mtp_num_layers else {}
    if isinstance(model, ModulesModel):
        first: dict[str, str] = {}
        out = {}
        for p in model.parameters:
            if p.shared_group is None:
                continue
            if p.shared_group in first:
                out[p.name] = first[p.shared_group]
            else:
                first[p.shared_group] = p.name
        return out
    return {}


def _stage_copies(spec: Spec, plan: ParallelPlan) -> dict[str, tuple[str, ...]]:
    """Tied embeddings under a pipeline: the embedding on the first stage and the head on the last are
    two copies of one weight; each member -> every copy, the embedding first. Untied, a model with
    multi-token prediction keeps a copy of the embedding on the last stage for its depths
    (``mtp_embed.weight``; Megatron-Core's LanguageModule.setup_embeddings_and_output_layer, "maintain
    duplicated embedding weights in mtp process stage", whose gradients finalize_model_grads sums)."""
    model = spec.model
    if isinstance(model, TransformerModel) and plan.pp > 1:
        if model.tie_embeddings:
            group = ("embed.weight", "lm_head.weight")
        elif model.mtp_num_layers:
            group = ("embed.weight", MTP_EMBEDDING)
        else:
            return {}
        return {name: group for name in group}
    return {}


def _check_tied_sync(name: str, group: tuple[str, ...], names: set[str], gradient: tuple[Collective, ...]) -> None:
    """A copy of a tied weight must first sum its whole gradient with the other stage's copy."""
    missing = [g for g in group if g not in names]
    if missing:
        raise RuntimeRefusal(
            f"parameter {name!r} is tied to {', '.join(map(repr, missing))}, which the plan does not list"
        )
    if not gradient or gradient[0].axes != (TIED_GROUP,) or gradient[0].collective != "all_reduce":
        raise RuntimeRefusal(
            f"the plan keeps {name!r} on one pipeline stage as a copy of the tied weight "
            f"{' and '.join(map(repr, group))}, but its "
            f"gradient does not start with an all_reduce over the {TIED_GROUP!r} group; the copies would drift "
            "apart: recompile the spec"
        )


def _refuse_unsupported(spec: Spec, plan: ParallelPlan) -> None:
    model = spec.model
    if not isinstance(model, (TransformerModel, ModulesModel)):
        raise RuntimeRefusal(
            "the torch runtime executes neural models (families transformer and modules); this plan's model "
            f"is a {model.family!r} model"
        )
    if plan.pp > 1 and isinstance(model, ModulesModel):
        raise RuntimeRefusal(
            f"pipeline parallelism (pp={plan.pp}) is executed for transformer models only; compile the spec with pp: 1"
        )
    t = spec.training
    if spec.training.precision not in ("fp32", "bf16"):
        raise RuntimeRefusal(
            f"training.precision {t.precision!r} is not executed by the torch runtime; use fp32 or bf16"
        )
    per_step = t.micro_batch_size * plan.microbatches * plan.gradient_accumulation_steps * plan.data_parallel_size
    if t.global_batch_size != per_step:
        raise RuntimeRefusal(
            f"training.global_batch_size={t.global_batch_size} differs from micro_batch_size * microbatches * "
            f"gradient_accumulation_steps * data-parallel size = {t.micro_batch_size} * {plan.microbatches} * "
            f"{plan.gradient_accumulation_steps} * {plan.data_parallel_size} = {per_step}; set "
            f"global_batch_size: {per_step}"
        )
    if isinstance(model, ModulesModel):
        if plan.tp > 1:
            raise RuntimeRefusal(
                "a `modules` model declares its parameters but not how activations flow between them, so the plan has "
                "no tensor-parallel activation collectives to replay; run it with tp: 1 (data parallelism, FSDP, HSDP)"
            )
        if plan.cp > 1:
            raise RuntimeRefusal(
                "a `modules` model does not say which of its dimensions is the sequence, so context parallelism cannot "
                f"split it (the plan has cp={plan.cp}); run it with cp: 1"
            )
        if any(p.role == "expert" for p in model.parameters):
            raise RuntimeRefusal(
                "a `modules` model's expert parameters are not executed: the runtime cannot know how your "
                "module routes "
                "tokens to them; mixture-of-experts layers are executed for transformer models (model.num_experts)"
            )
        return
    if model.num_experts:
        _refuse_unsupported_experts(model, plan, t)
    if model.mtp_num_layers:
        _refuse_unsupported_mtp(model, plan, t)
    tp = plan.tp
    widths = attention_widths(model)
    # rotary positions turn pairs of features: a head's, or MLA's rotary part
    rotary = ("model.qk_rope_head_dim", widths.rope) if widths.latent else ("the head size", widths.qk_head_dim)
    kv = widths.kv_heads
    if kv % tp and tp % kv:
        raise RuntimeRefusal(
            f"model.num_kv_heads={kv} neither splits over tp={tp} nor divides it, so tensor parallelism can "
            "neither split "
            "the KV heads nor replicate each on tp / num_kv_heads ranks; choose tp dividing it or a multiple of it"
        )
    checks = [
        ("model.num_heads", model.num_heads),
        ("model.vocab_size", model.vocab_size),
        ("model.ffn_hidden_size", model.ffn_hidden_size),
    ]
    if model.position_embedding == "learned":
        # the position table splits over tp like the vocabulary (runtime/model.py)
        named = "model.max_position_embeddings" if model.max_position_embeddings else "training.seq_len"
        checks.append((named, model.positions(t.seq_len) or 1))
    for name, value in checks:
        if value % tp:
            raise RuntimeRefusal(
                f"{name}={value} is not divisible by tp={tp}, so tensor parallelism cannot split it evenly; "
                "choose tp dividing it"
            )
    if rotary[1] % 2 and model.position_embedding == "rope":
        raise RuntimeRefusal(
            f"rotary position embeddings need an even number of features, but {rotary[0]} is {rotary[1]}"
        )
    cp = plan.cp
    if cp > 1 and (t.seq_len or 1) % (2 * cp):
        raise RuntimeRefusal(
            f"context parallelism cuts training.seq_len={t.seq_len} into 2 * cp = {2 * cp} equal chunks; "
            f"choose a multiple of {2 * cp}"
        )
    if t.sequence_parallel and tp > 1 and ((t.seq_len or 1) // cp) % tp:
        raise RuntimeRefusal(
            f"sequence parallelism splits each rank's {(t.seq_len or 1) // cp} tokens "
            f"(training.seq_len={t.seq_len} over cp={cp}) "
            f"over tp={tp}; choose a seq_len that makes them a multiple of {tp}"
        )


def _refuse_unsupported_experts(model: TransformerModel, plan: ParallelPlan, t) -> None:
    """What the mixture-of-experts layers (runtime/experts.py) do not execute."""
    experts, k = model.num_experts, model.experts_per_token or 1
    if not 1 <= k <= experts:
        raise RuntimeRefusal(f"model.experts_per_token={k} must be between 1 and num_experts={experts}")
    if plan.etp not in (1, plan.tp):
        raise RuntimeRefusal(
            f"etp={plan.etp}: this runtime splits experts over all of tp (etp = tp) or not at all (etp = 1); "
            f"set etp to 1 or {plan.tp}"
        )
    if plan.tp > 1 and not t.sequence_parallel:
        raise RuntimeRefusal(
            f"mixture-of-experts layers with tp={plan.tp} need sequence parallelism, as in Megatron: the "
            "router's gradient is "
            "summed over tp only when its inputs are sequence shards; set training.sequence_parallel: true"
        )
    hidden = model.moe_ffn_hidden_size or model.ffn_hidden_size
    if plan.etp > 1 and hidden % plan.etp:
        raise RuntimeRefusal(
            f"model.moe_ffn_hidden_size={hidden} is not divisible by etp={plan.etp}; choose etp dividing it"
        )
    edp = expert_data_size(plan)
    if plan.dp_shard > 1 and edp > 1 and experts % (plan.ep * edp):
        raise RuntimeRefusal(
            f"under FSDP the plan shards each expert's hidden features over the {edp} expert-data ranks, because "
            f"num_experts={experts} does not split evenly over ep * edp = {plan.ep} * {edp}; this runtime shards whole "
            f"experts only: choose num_experts a multiple of {plan.ep * edp}"
        )
    if plan.ep > 1 and experts % plan.ep:
        raise RuntimeRefusal(f"model.num_experts={experts} is not divisible by ep={plan.ep}; choose ep dividing it")


def _refuse_unsupported_mtp(model: TransformerModel, plan: ParallelPlan, t) -> None:
    """What the multi-token prediction depths (runtime/model.py ``_mtp_depth``) do not execute."""
    depths = model.mtp_num_layers
    if plan.cp > 1:
        raise RuntimeRefusal(
            f"model.mtp_num_layers={depths} with cp={plan.cp}: a depth reads the token ahead of each of its "
            "positions, which under context parallelism may sit on another cp rank, and this runtime rolls the "
            "tokens within one rank's sequence (Megatron-Core exchanges the chunks' edges, "
            "multi_token_prediction.py roll_tensor; the torch rule set refuses it as C014); compile with cp: 1"
        )
    if model.position_embedding == "learned":
        raise RuntimeRefusal(
            f"model.mtp_num_layers={depths} with learned positions: a depth embeds the tokens ahead with their "
            "own positions, and the position table lives with the embedding on the first stage, where its "
            "FSDP unit has ended; this runtime runs multi-token prediction with rotary positions, as Megatron "
            "does (arguments.py validate_args); set model.position_embedding: rope"
        )
    if (t.seq_len or 1) <= depths:
        raise RuntimeRefusal(
            f"training.seq_len={t.seq_len} leaves no token {depths + 1} positions ahead for the last of the "
            f"model.mtp_num_layers={depths} depths, whose loss would average over no position; choose a seq_len "
            f"above {depths}"
        )


def _check_mtp_params(spec: Spec, plan: ParallelPlan, params: list[ParamInstruction]) -> None:
    """The parameters the depths read must be the plan's, laid out as the model splits them."""
    model = spec.model
    if not isinstance(model, TransformerModel) or not model.mtp_num_layers:
        return
    from mixle_compile.engines import engine_profile

    by_name = {p.name: p for p in params}
    depths = range(model.num_layers, model.num_layers + model.mtp_num_layers)
    needed = [f"layers.{i}.mtp.{w}.weight" for i in depths for w in ("enorm", "hnorm", "eh_proj", "final_norm")]
    if not model.tie_embeddings:
        needed.append(MTP_EMBEDDING)
    missing = [n for n in needed if n not in by_name]
    if missing:
        raise RuntimeRefusal(
            f"the model has model.mtp_num_layers={model.mtp_num_layers} but the plan does not list "
            f"{', '.join(map(repr, missing[:4]))}{' ...' if len(missing) > 4 else ''}; recompile the spec"
        )
    split = engine_profile(spec.backend).mtp_projection_split
    for i in depths:
        p = by_name[f"layers.{i}.mtp.eh_proj.weight"]
        if plan.tp > 1 and p.tp_dim != (0 if split else None):
            laid = "whole on every tp rank" if p.tp_dim is None else f"split on dimension {p.tp_dim}"
            raise RuntimeRefusal(
                f"the plan lays {p.name!r} out {laid}, "
                f"but backend {spec.backend} {'splits it over tp by its outputs' if split else 'keeps it whole'} "
                "(EngineProfile.mtp_projection_split); recompile the spec"
            )
