"""Device memory (R0xx): what one rank holds must fit on its device."""

from __future__ import annotations

from mixle_compile.diagnostics import Severity
from mixle_compile.memory_model import (
    ALLOCATOR_RESERVE,
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
from mixle_compile.schedules import ScheduleFamily, microbatches_per_round
from mixle_compile.spec.kinds import Engine, Family
from mixle_compile.verify import logic
from mixle_compile.verify.facts import format_bytes
from mixle_compile.verify.logic import TERMS, all_of, larger, negation, real, smaller, when
from mixle_compile.verify.memory import CATEGORIES
from mixle_compile.verify.rule import Rule, define


def interleaved_group_of(v) -> object:
    """The micro-batches an interleaved stage runs on one chunk before the next: Megatron's
    ``microbatch_group_size_per_vp_stage`` (training.microbatch_group_size, 0 among the facts when left
    to its default, pp), torch's :func:`~mixle_compile.schedules.microbatches_per_round`."""
    if v.facts.engine.schedules == ScheduleFamily.MEGATRON:
        return when(v.microbatch_group == 0, v.pp, v.microbatch_group)
    return microbatches_per_round(TERMS, v.pp, v.microbatches)


def per_rank_bytes(v) -> dict[str, object]:
    """The heaviest rank's bytes, as Z3 real terms, under the memory model of
    :mod:`mixle_compile.memory_model` (the one the lowering prices plans with). Read with values
    (:class:`mixle_compile.verify.symbols.Symbols` with ``values``), computed once for R001 and R002."""
    memo = vars(v).get("memo")  # not through a reading wrapper, which notes every attribute read
    if memo is None:
        return _per_rank_bytes(v)
    hit = memo.get("per_rank_bytes")
    if hit is None:
        hit = memo["per_rank_bytes"] = _per_rank_bytes(v)
    return hit


def _per_rank_bytes(v) -> dict[str, object]:
    fp = v.facts.footprint
    # fp8 runs store bf16 weights (memory_model.stored_dtype); fp64 (refused for neural models by C008)
    # is priced with 8-byte weights and, like fp32, full-width activations and logits.
    element_bytes = when(v.is_("precision", "fp32"), 4, when(v.is_("precision", "fp64"), 8, 2))
    below_fp32 = v.is_("precision", "bf16", "fp16", "fp8")
    adam = v.is_("optimizer", "adam", "adamw")

    # Layers on the heaviest rank: its v virtual stages of ceil(layers / (pp * v)) layers each; a
    # stage of c consecutive layers holds at most ceil(c / k) mixture-of-experts layers and at most
    # c - floor(c / k) dense ones (k = moe_layer_frequency), or, with f dense layers before the first
    # MoE layer (moe_first_layer), at most min(c, c - floor(c / k) + f).
    virtual = when(v.pp == 1, 1, v.virtual_pipeline_stages)  # without a pipeline there are no virtual stages
    stages = v.pp * virtual
    k, first = fp.moe_layer_frequency, fp.moe_first_layer
    listed = v.facts.pipeline_layers
    if listed is not None:
        # A listed split (P010 holds it to the mesh): the largest counts any one rank holds.
        pp = v.facts.value("pp")
        ranks = [listed[s::pp] for s in range(pp)]  # virtual stage c * pp + s is on rank s

        def counts_of(r):
            return {
                "every_layer": sum(r),
                "dense_layer": sum(min(c, c - c // k + first) for c in r),
                "moe_layer": sum(-(-c // k) for c in r),
            }

        per_rank = [counts_of(r) for r in ranks]
        copies = {kind: max(c[kind] for c in per_rank) for kind in per_rank[0]}
        last_copies = per_rank[-1]  # the last rank's own (it also holds the multi-token prediction depths)
    else:
        # The largest virtual stage: ceil(layers / stages) under even and balanced splits;
        # torchtitan splits layers + 2 slots (the embedding and the output count as one each).
        slots = when(v.pp > 1, v.layers + 2, v.layers) if v.facts.layer_split == Engine.TORCHTITAN else v.layers
        chunk = (slots + stages - 1) / stages
        copies = {
            "every_layer": virtual * chunk,
            "dense_layer": virtual * (smaller(chunk, chunk - chunk / k + first) if first else chunk - chunk / k),
            "moe_layer": virtual * ((chunk + k - 1) / k),
        }
        last_copies = copies

    # How many ranks share one copy of each category, as the layouts place them: the model-parallel
    # split (tp; experts ep * etp), times, under FSDP (dp_shard > 1), the data-parallel sharding
    # (dp_shard * cp; experts: the whole expert-data domain, world / (ep * etp * pp)).
    fsdp = fsdp_shards(dp_shard=v.dp_shard, cp=v.cp, over_cp=v.facts.engine.fsdp_over_cp)
    expert_data = real(v.data_parallel * v.cp * v.tp) / real(v.ep * v.etp)
    model_split = {"tensor_parallel": real(v.tp), "replicated": real(1), "expert": real(v.ep * v.etp)}
    data_split = {
        "tensor_parallel": when(fsdp, real(v.dp_shard * v.cp), real(1)),
        "replicated": when(fsdp, real(v.dp_shard * v.cp), real(1)),
        "expert": when(fsdp, expert_data, real(1)),
    }
    # A distributed optimizer without FSDP shards the state over all data ranks.
    state_split = {
        "tensor_parallel": when(all_of(v.distributed_optimizer, negation(fsdp)), real(v.data_parallel * v.cp), real(1)),
        "expert": when(all_of(v.distributed_optimizer, negation(fsdp)), expert_data, real(1)),
    }
    state_split["replicated"] = state_split["tensor_parallel"]

    def weight_bytes(share) -> object:
        return share.precision_elements * element_bytes + share.fixed_bytes

    def state_bytes(share) -> object:
        full_precision = share.elements - share.fixed_low_precision_elements - share.precision_elements
        return (
            optimizer_bytes_per_element(TERMS, adam=adam, below_fp32=below_fp32) * share.precision_elements
            + optimizer_bytes_per_element(TERMS, adam=adam, below_fp32=True) * share.fixed_low_precision_elements
            + optimizer_bytes_per_element(TERMS, adam=adam, below_fp32=False) * full_precision
        )

    def held(place_counts, measure, split) -> object:
        total = real(0)
        for place, count in place_counts:
            for category in CATEGORIES:
                share = fp.share(place, category)
                if share.elements:
                    total = total + real(count * measure(share)) / split(category)
        return total

    def end_parts(measure, split) -> tuple[object, object, object]:
        """The first stage's tensors, the last stage's, and the tied copy one stage holds once."""
        return tuple(held([(place, 1)], measure, split) for place in ("first_stage", "last_stage", "tied_copy"))

    def ends(measure, split) -> object:
        first, last, tied = end_parts(measure, split)
        # One stage holds both ends (a tied pair once); otherwise the heavier end is the bound.
        return when(v.pp == 1, first + last - tied, larger(first, last))

    def stage_bytes(measure, split) -> object:
        if not fp.mtp_depths:
            return held(copies.items(), measure, split) + ends(measure, split)
        # The multi-token prediction depths are the last rank's: under a pipeline the bound is the heavier
        # of the rank with the most layers (and the first stage's tensors) and the last rank with its own
        # layers, its end of the model and the depths.
        depths = held([("mtp_layers", 1)], measure, split)
        first, last, tied = end_parts(measure, split)
        layers = held(copies.items(), measure, split)
        return when(
            v.pp == 1,
            layers + first + last - tied + depths,
            larger(layers + first, held(last_copies.items(), measure, split) + last + depths),
        )

    local = lambda category: model_split[category] * data_split[category]  # noqa: E731
    weights = stage_bytes(weight_bytes, local)
    optimizer = stage_bytes(state_bytes, lambda category: local(category) * state_split[category])

    # Under FSDP the largest unit (a layer, or the embedding and head) is gathered, two at once.
    unsharded = lambda category: model_split[category]  # noqa: E731
    layer_unit = held([("every_layer", 1)], weight_bytes, unsharded) + larger(
        held([("dense_layer", 1)], weight_bytes, unsharded), held([("moe_layer", 1)], weight_bytes, unsharded)
    )
    keeps_stage = v.pp > 1 if v.facts.engine.fsdp_keeps_stage_under_pp else False
    largest_unit = larger(layer_unit, ends(weight_bytes, unsharded))
    if fp.mtp_depths:  # each depth is a unit of its own (as a layer is)
        largest_unit = larger(largest_unit, held([("mtp_layers", 1)], weight_bytes, unsharded) / real(fp.mtp_depths))
    gathered = gathered_parameter_bytes(
        TERMS,
        fsdp=fsdp,
        largest_unit_bytes=largest_unit,
        keeps_stage=keeps_stage,
        stage_bytes=stage_bytes(weight_bytes, unsharded),
        stage_elements=stage_bytes(lambda share: share.elements, unsharded),
    )
    terms = {
        "weights": weights,
        "gathered weights": gathered,
        "gradients": weights,  # gradients are held in the parameters' dtype
        "optimizer state": optimizer,
        **activation_bytes(
            v, copies["every_layer"], copies["moe_layer"], last_copies["every_layer"], last_copies["moe_layer"]
        ),
    }
    buffers = pipeline_buffers(v)
    transient = ring_attention(v)  # what a layer's backward needs for a while
    has_transient = v.facts.engine.ring_attention and v.facts.family == Family.TRANSFORMER
    if v.facts.engine.fsdp_reduce_scatter_copy:
        has_transient = True

        def elements(share):
            return share.elements

        # the largest layer: the embedding and head are reduced after the last layer's backward,
        # when no activations are held (lower/memory.py prices the same unit)
        def unit(measure):
            return held([("every_layer", 1)], measure, unsharded) + larger(
                held([("dense_layer", 1)], measure, unsharded), held([("moe_layer", 1)], measure, unsharded)
            )

        transient = transient + reduce_scatter_buffer_bytes(
            TERMS,
            fsdp=fsdp,
            unit_elements=unit(elements),
            unit_bytes=unit(weight_bytes),
            accumulated=keeps_stage,
        )
    if has_transient:  # (a minimum over nothing would only burden the solver)
        # under a pipeline the stages without the loss run their backward with nothing freed before
        freed = when(v.pp == 1, terms["logits and loss"], real(0))
        buffers = buffers + after_loss_bytes(TERMS, transient, freed)
    terms["communication buffers"] = buffers
    terms["allocator reserve"] = reserve_bytes(TERMS, sum(terms.values(), real(0)))
    return terms


def ring_attention(v) -> object:
    """Ring attention's backward buffers in one layer under context parallelism
    (memory_model.ring_attention_bytes), on engines that run it."""
    fp = v.facts.footprint
    engine = v.facts.engine
    if v.facts.family != Family.TRANSFORMER or not engine.ring_attention:
        return real(0)
    return ring_attention_bytes(
        TERMS,
        seq_len=v.seq_len,
        cp=v.cp,
        micro_batch_size=v.micro_batch_size,
        query_width=fp.query_width,
        key_width=fp.query_width if engine.repeats_key_heads else fp.kv_width,
        tp=v.tp,
        head_dim=0 if engine.repeats_key_heads else fp.head_dim,
        fp32=v.is_("precision", "fp32", "fp64"),
    )


def pipeline_buffers(v) -> object:
    """The most receive buffers torch's pipelining runtime holds on one pipeline rank
    (memory_model.pipeline_buffer_bytes): with v > 1 stages per rank, a middle rank's v stages each
    receive both kinds (2v - 1 kinds on either end rank, and on both ranks of a two-rank
    pipeline); with one, rank pp - 2 receives gradients for all m micro-batches and activations
    for those not in flight, m - min(m, 2), under 1F1B, and GPipe keeps every received input as a
    stored one."""
    fp = v.facts.footprint
    if v.facts.family != Family.TRANSFORMER or not v.facts.engine.pipeline_receive_buffers:
        return real(0)
    boundary = boundary_bytes(
        TERMS,
        seq_len=v.seq_len,
        cp=v.cp,
        micro_batch_size=v.micro_batch_size,
        hidden_size=fp.hidden_size,
        tp=v.tp,
        sequence_parallel=v.sequence_parallel,
        fp32=v.is_("precision", "fp32"),
    )
    m = v.facts.engine.schedule_microbatches(v.microbatches, v.gradient_accumulation_steps)
    virtual = v.virtual_pipeline_stages
    interleaved = all_of(v.is_("pipeline_schedule", "interleaved_1f1b"), virtual > 1)
    several = pipeline_buffer_bytes(
        TERMS,
        boundary=boundary,
        microbatches=m,
        activation_stages=virtual,
        gradient_stages=when(v.pp > 2, virtual, virtual - 1),
    )
    one = pipeline_buffer_bytes(
        TERMS,
        boundary=boundary,
        microbatches=m,
        activation_stages=when(v.pp > 2, 1, 0),
        gradient_stages=1,
        saved_inputs=when(v.pp > 2, logic.smaller(m, 2), 0),
    )
    gpipe = pipeline_buffer_bytes(TERMS, boundary=boundary, microbatches=m, activation_stages=0, gradient_stages=1)
    return when(v.pp == 1, real(0), when(interleaved, several, when(v.is_("pipeline_schedule", "gpipe"), gpipe, one)))


def moe_extra(v) -> tuple[object, object]:
    """An MoE layer's bytes beyond a dense one's and the part checkpointing keeps
    (lower/memory.py ``moe_extra`` states when)."""
    fp = v.facts.footprint
    engine = v.facts.engine
    modules = v.facts.selective_modules
    extra = _moe_block(v, frozenset())
    if engine.op_level_selective:
        return extra, when(v.is_("activation_checkpointing", "none"), extra, real(0))
    selective = selective_moe_kept(
        modules,
        lambda m: _moe_block(v, m),
        lambda: dense_mlp_split_bytes(
            TERMS,
            seq_len=v.seq_len,
            cp=v.cp,
            micro_batch_size=v.micro_batch_size,
            tp=v.tp,
            dense_ffn_width=fp.dense_ffn_width,
            gated=fp.activation == "swiglu",
            fp32=v.is_("precision", "fp32", "fp64"),
        ),
        nothing=real(0),
    )
    kept = when(
        v.is_("activation_checkpointing", "none"),
        extra,
        when(v.is_("activation_checkpointing", "selective"), selective, real(0)),
    )
    return extra, kept


def _moe_block(v, modules: frozenset[str]):
    """:func:`memory_model.moe_layer_extra_bytes` of the spec's MoE layer (``modules``: what selective
    checkpointing runs again of it)."""
    fp = v.facts.footprint
    engine = v.facts.engine
    return moe_layer_extra_bytes(
        TERMS,
        seq_len=v.seq_len,
        cp=v.cp,
        micro_batch_size=v.micro_batch_size,
        hidden_size=fp.hidden_size,
        tp=v.tp,
        etp=v.etp,
        sequence_parallel=v.sequence_parallel,
        experts_per_token=fp.experts_per_token,
        num_experts=fp.num_experts,
        expert_width=fp.expert_width,
        shared_width=fp.shared_width,
        capacity_factor=fp.capacity_factor,
        saved=engine.moe_saved(fp.activation),
        fp32=v.is_("precision", "fp32", "fp64"),
        dense_ffn_width=fp.dense_ffn_width,
        gated=fp.activation == "swiglu",
        fp8_saved_inputs=v.is_("precision", "fp8") if engine.fp8_saves_quantized_inputs else False,
        recomputed_modules=modules,
    )


def activation_bytes(
    v, layers_on_rank, moe_layers_on_rank=0, layers_on_last=None, moe_layers_on_last=None
) -> dict[str, object]:
    """Activations kept for the backward pass on the first stage (which keeps the most micro-batches
    in flight), the recompute working set, and the last stage's logits with the loss's buffers: a
    bound on any one stage. ``moe_layers_on_rank`` bounds the MoE layers of any one rank;
    ``layers_on_last`` and ``moe_layers_on_last`` the last rank's, which also holds the multi-token
    prediction depths (the bound is then the heavier of the first rank and the last)."""
    fp = v.facts.footprint
    if v.facts.family != Family.TRANSFORMER:
        # a modules spec lists parameters only; its activations are unknown
        return {"activations": real(0), "recompute working set": real(0), "logits and loss": real(0)}
    shape = dict(seq_len=v.seq_len, cp=v.cp, micro_batch_size=v.micro_batch_size, tp=v.tp)

    def layer(full, selective):
        return activation_bytes_per_layer(
            TERMS,
            **shape,
            hidden_size=fp.hidden_size,
            num_heads=fp.num_heads,
            sequence_parallel=v.sequence_parallel,
            full_recompute=full,
            selective_recompute=selective,
            fp32=v.is_("precision", "fp32", "fp64"),
            eager_attention=v.eager_attention,
            op_level_selective=v.facts.engine.op_level_selective,
            query_width=fp.query_width,
            kv_width=fp.kv_width,
            ffn_width=fp.ffn_width,
            fp8_saved_inputs=v.is_("precision", "fp8") if v.facts.engine.fp8_saves_quantized_inputs else False,
            dense_ffn_width=fp.dense_ffn_width,
            gated=fp.activation == "swiglu",
            attention_width=fp.attention_width,
            latent_width=fp.latent_width,
            op_saved_split=fp.op_saved_split,
            op_saved_whole=fp.op_saved_whole,
            up_projection_width=fp.up_projection_width,
            recomputed_modules=v.facts.selective_modules,
            latent_replicated=not v.facts.engine.latent_projections_on_shards,
        )

    per_layer = layer(v.is_("activation_checkpointing", "full"), v.is_("activation_checkpointing", "selective"))
    recomputed = layer(False, False) - per_layer  # the layer being recomputed holds all of it once more
    stored = real(layers_on_rank) * per_layer
    stored_last = real(layers_on_rank if layers_on_last is None else layers_on_last) * per_layer
    kept_extra = real(0)
    if fp.num_experts > 0:  # (only then: the solver carries no term that is always zero)
        extra, kept_extra = moe_extra(v)
        stored = stored + real(moe_layers_on_rank) * kept_extra
        last_moe = moe_layers_on_rank if moe_layers_on_last is None else moe_layers_on_last
        stored_last = stored_last + real(last_moe) * kept_extra
        recomputed = recomputed + extra - kept_extra

    def in_flight_on(stage) -> object:
        return micro_batches_in_flight(
            TERMS,
            pp=v.pp,
            stage=stage,
            microbatches=v.microbatches,
            gpipe=v.is_("pipeline_schedule", "gpipe"),
            interleaved=all_of(v.is_("pipeline_schedule", "interleaved_1f1b"), v.virtual_pipeline_stages > 1),
            virtual_stages=v.virtual_pipeline_stages,
            group=interleaved_group_of(v),
        )

    in_flight = in_flight_on(0)
    depths = fp.mtp_depths
    activations = in_flight * stored
    if depths:
        # The multi-token prediction depths sit on the last stage, beside its own layers, with its
        # micro-batches in flight: the heavier of the first rank and the last (one rank without a pipeline).
        depth = per_layer + (kept_extra if fp.mtp_moe else real(0))
        depth = depth + mtp_depth_bytes(
            TERMS,
            **shape,
            hidden_size=fp.hidden_size,
            sequence_parallel=v.sequence_parallel,
            fp32=v.is_("precision", "fp32", "fp64"),
        )
        last = in_flight_on(v.pp - 1) * (stored_last + real(depths) * depth)
        activations = when(v.pp == 1, in_flight * (stored + real(depths) * depth), larger(activations, last))
    fp32 = v.is_("precision", "fp32", "fp64")
    engine = v.facts.engine

    def per_logit_when(compiled: bool) -> object:
        alone, split = (engine.loss_implementation(compiled=compiled, tensor_parallel=tp) for tp in (False, True))
        bytes_alone = loss_bytes_per_logit(TERMS, implementation=alone, fp32=fp32)
        if split == alone:  # only then does tp bear on the bytes per logit
            return bytes_alone
        return when(v.tp > 1, loss_bytes_per_logit(TERMS, implementation=split, fp32=fp32), bytes_alone)

    per_logit = per_logit_when(False)
    if engine.loss_implementation(compiled=True, tensor_parallel=False) != engine.loss_implementation(
        compiled=False, tensor_parallel=False
    ):
        per_logit = when(v.compiled_loss, per_logit_when(True), per_logit)  # only then does training.compile bear on it
    logits = logits_bytes(TERMS, **shape, vocab_size=fp.vocab_size, bytes_per_logit=per_logit)
    if depths:
        logits = logits * real(1 + depths)  # each depth's logits live until the backward (gpt_model.py)
    return {
        "activations": activations,
        "recompute working set": recomputed,
        "logits and loss": logits,
    }


RESERVE = "allocator reserve"


def live_bytes(terms: dict) -> object:
    """The live tensors of the heaviest rank: every term but the allocator's reserve."""
    return sum((term for name, term in terms.items() if name != RESERVE), real(0))


def _fits_with_reserve_or_not_at_all(terms: dict, device: object) -> object:
    """R002 holds unless the live tensors fit and the reserve beside them does not (when they do
    not fit, R001 says so)."""
    live = live_bytes(terms)
    return logic.any_of(live > device, live + terms[RESERVE] <= device)


def _terms(x) -> dict:
    cached = x.cache.get("memory")
    if cached is None:
        cached = x.cache["memory"] = per_rank_bytes(x.symbols)
    return cached


def dominant_terms(values: dict[str, float]) -> list[str]:
    """The largest terms that together make up at least half of the total, largest first."""
    total = sum(values.values())
    chosen, covered = [], 0.0
    for name, value in sorted(values.items(), key=lambda item: -item[1]):
        if covered >= total / 2 or value <= 0:
            break
        chosen.append(name)
        covered += value
    return chosen


def _values(x) -> tuple[dict[str, float], str]:
    """The terms' values, and the dominant live terms with their shares of the live bytes."""
    values = {name: float(x.eval(term)) for name, term in _terms(x).items()}
    live = {name: value for name, value in values.items() if name != RESERVE}
    total = sum(live.values())
    dominant = " and ".join(f"{name} ({live[name] / total:.0%})" for name in dominant_terms(live)) if total else ""
    return values, dominant


def _explain(x) -> str:
    values, dominant = _values(x)
    live = sum(value for name, value in values.items() if name != RESERVE)
    parts = ", ".join(f"{name} {format_bytes(value)}" for name, value in values.items() if name != RESERVE)
    return (
        f"the heaviest rank's live tensors need about {format_bytes(live)}, more than the "
        f"{format_bytes(x.device_memory)} of a device; "
        f"mostly {dominant} ({parts}; the caching allocator usually reserves {format_bytes(values[RESERVE])} more)"
    )


def _explain_reserve(x) -> str:
    values, dominant = _values(x)
    live = sum(value for name, value in values.items() if name != RESERVE)
    return (
        f"the heaviest rank's live tensors ({format_bytes(live)}, mostly {dominant}) fit the "
        f"{format_bytes(x.device_memory)} of a device, but not with the {format_bytes(values[RESERVE])} the "
        f"caching allocator usually reserves beyond them ({format_bytes(live + values[RESERVE])} in all): the "
        "step runs only while the allocator gives cached blocks back and retries allocations, which slows it "
        "and can still fail on fragmentation"
    )


def _hint(x) -> str:
    terms = {name: float(x.eval(term)) for name, term in _terms(x).items()}
    ideas = []
    if terms["optimizer state"] >= max(terms.values()) / 2 and not x.distributed_optimizer and x.dp_replicate > 1:
        ideas.append("training.distributed_optimizer: true")
    if terms["activations"] >= max(terms.values()) / 2 and x.activation_checkpointing != "full":
        ideas.append(
            "activation_checkpointing: full"
            if x.activation_checkpointing == "selective"
            else "activation_checkpointing: selective"
        )
    ideas.append("more sharding (dp_shard, tp, pp), more devices, or --suggest for the nearest plan that fits")
    return "try " + "; ".join(ideas)


MEMORY_FIELDS = ("device_memory", "tp", "dp_shard", "pp", "cp", "micro_batch_size", "activation_checkpointing")

DEVICE_MEMORY = define(
    Rule(
        code="R001",
        name="device-memory",
        title=(
            "The heaviest rank's live tensors (parameters, gradients, optimizer state, activations, loss, "
            "buffers) fit in device memory."
        ),
        docs=(
            "A bound on the heaviest rank under the memory model the lowering prices plans with "
            "(`mixle_compile/memory_model.py`; `explain PLAN` shows the lowering's exact figures per stage, "
            "which never exceed this bound), stated so that it can be checked by hand:\n\n"
            "* **Weights**: each parameter's elements times its dtype's bytes, divided by the ranks that share "
            "one copy: tp for column, row, embedding and head weights, ep * etp for experts, and under FSDP "
            "(dp_shard > 1) the sharding over dp_shard * cp (experts: over the whole expert-data domain, "
            "world / (ep * etp * pp)). "
            "The heaviest pipeline rank holds `v` virtual stages of `c = ceil(layers / (pp * v))` layers "
            "(v = 1 without a pipeline), the embedding on the first stage and the output head and final norm on "
            "the last (both on one stage when pp = 1, a tied pair counted once; otherwise the heavier end). A "
            "transformer stage counts what every layer holds (attention, norms) for each layer, plus at most "
            "`v * ceil(c / k)` mixture-of-experts and `v * min(c, c - floor(c / k) + f)` dense MLPs (every k-th "
            "layer is a mixture-of-experts layer from layer f, `moe_first_layer`); a `modules` stage counts "
            "each layer as the largest amount of each kind (by category and dtype) that any of its layers "
            "holds.\n"
            "* **Gathered weights**: under FSDP, the unsharded (tensor-parallel-local) weights of two units at "
            "once (the one computing and the one prefetched), a unit being a layer or the embedding and head. "
            "FSDP shards over dp_shard (torch, megatron) or dp_shard * cp (torchtitan). On torchtitan under a "
            "pipeline, the whole stage stays gathered and its unsharded gradients accumulate in fp32 (4 bytes "
            "per element) until the step's last backward (torchtitan's reshard-after-forward default is `not "
            "pp`; torch's `PipelineStage` runs its backwards without resharding or gradient sync).\n"
            "* **Gradients**: as many bytes as the weights.\n"
            "* **Optimizer state**: Adam/AdamW keep two fp32 moments per element (8 bytes), plus a 4-byte fp32 "
            "master copy of every element stored below fp32; SGD keeps only the master copies. Sharded like the "
            "weights; with `distributed_optimizer` and no FSDP, sharded over all data-parallel ranks "
            "(dp_replicate * cp; experts the expert-data domain).\n"
            "* **Activations** (transformers): per layer, per micro-batch, the formulas of Korthikanti et al. "
            "(2022) in 16-bit: `s*b*h*(10 + 24/t)` without sequence parallelism, `34*s*b*h/t` with it, plus the "
            "stored attention scores `5*a*s^2*b/t` only with `attention: eager` (every engine's default kernel "
            "is fused and stores none); a transformer's count is taken tensor by tensor from its widths, which "
            "gives those formulas for GPT-3's shapes and drops the dropout masks of gated (Llama-family) blocks, "
            "and under fp8 on Megatron the linears' saved inputs are their one-byte fp8 copies (docs/memory.md); "
            "selective checkpointing recomputes attention (torch, megatron) or, on "
            "torchtitan, keeps the outputs of every odd-numbered matmul, attention's output and the "
            "sequence-parallel reduce-scatters (its op-level policy); full checkpointing keeps only the layer "
            "input (`2*s*b*h`, /t with sequence parallelism). With checkpointing the layer being recomputed "
            "holds its whole activations once more. `s` is seq_len / cp, fp32 doubles it. The first stage holds "
            "`min(microbatches, pp)` micro-batches in flight under 1F1B (times `1 + (pp-1)/(pp*v)` "
            "interleaved), all of them under GPipe, one without a pipeline.\n"
            "* **Recompute working set**: with checkpointing, the layer being recomputed holds its whole "
            "activations once more (a layer without checkpointing minus what checkpointing kept).\n"
            "* **Logits and loss**: the logits of one micro-batch at the start of the loss's backward, "
            "`s*b*vocab/t` logits at the bytes the engine's cross-entropy holds per logit: 12 where fp32 logits "
            "and two fp32 tensors of their size are live (torchtitan eager, the in-tree runtime), 16 under "
            "torchtitan's loss parallelism (tp > 1: torch's `loss_parallel` backward), twice the "
            "training dtype where torchtitan compiles the loss (`training.compile` with `loss`), 4 plus the "
            "training dtype under Megatron-Core's in-place vocab-parallel cross-entropy.\n"
            "* **Communication buffers**: on torchtitan under a pipeline, the receive buffers of torch's "
            "pipelining runtime (one per micro-batch for activations and for gradients); under FSDP, the "
            "reduce-scatter of the largest layer's gradients through a flat fp32 copy; under context "
            "parallelism, ring attention's backward: the keys and values of the whole context group "
            "all-gathered, fp32 gradient accumulators and the key/value gradients passed round the ring. "
            "The last two run during a layer's backward, after the loss's buffers are freed, so only their "
            "excess over those counts where one stage holds the loss.\n"
            "* **Allocator reserve** (not part of this rule's sum; R002 warns when it does not fit): what the "
            f"caching allocator usually holds beyond live tensors, {ALLOCATOR_RESERVE:.1%} of them "
            "(`memory_model.ALLOCATOR_RESERVE`, calibrated on torchtitan's published peaks, which are "
            "reserved bytes: docs/memory.md). The allocator gives it back under pressure, so the rule "
            "compares the live tensors with the device.\n\n"
            "The message names the live terms that make up at least half of their total.\n\n"
            "Where layers differ, or with a pipeline (the first stage's activations and the last stage's logits "
            "are added together), the bound is above the exact figure; rounding of uneven shards may put it "
            "below by a fraction of a percent. "
            "The smallest device of a heterogeneous list bounds the plan. A `modules` spec lists parameters "
            "only, so its activations are not counted. Specs of the `distribution` family are not checked "
            "here: their memory is decided by the decomposition, which places each component."
        ),
        engine_reference=(
            "Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models (2022); "
            "Rajbhandari et al., ZeRO (2020) for optimizer-state bytes; torchtitan "
            "torchtitan/distributed/activation_checkpoint.py (op-level selective policy), fsdp.py "
            "(reshard_after_forward under pp), components/loss.py (compiled loss), tools/metrics.py (reserved peak); "
            "Megatron-Core tensor_parallel/cross_entropy.py; torch 2.13 torch/distributed/pipelining/stage.py "
            "(backward_maybe_with_nosync)"
        ),
        constraint=lambda v: live_bytes(per_rank_bytes(v)) <= real(v.device_memory),
        explain=_explain,
        hint=_hint,
        fields=MEMORY_FIELDS,
    )
)


ALLOCATOR_HEADROOM = define(
    Rule(
        code="R002",
        name="allocator-headroom",
        title="Warning: the heaviest rank fits only if the caching allocator gives up its usual reserve.",
        docs=(
            "A warning, not an error: R001 holds (the live tensors fit), but not with what the caching "
            f"allocator usually reserves beyond them ({ALLOCATOR_RESERVE:.1%} of the live bytes, "
            "`memory_model.ALLOCATOR_RESERVE`, the same figure `explain` adds to each rank). The reserve "
            "is not lost memory: when an allocation fails, torch's caching allocator releases its cached "
            "blocks and retries (torchtitan counts these and logs `N CUDA memory allocation retries`), so "
            "such a plan runs, but each retry synchronises the device and fragmentation can still make an "
            "allocation fail. Warnings do not change the exit status."
        ),
        engine_reference=(
            "torch c10/cuda/CUDACachingAllocator.cpp (on a failed cudaMalloc, release cached blocks and retry; "
            "`num_alloc_retries`); torchtitan components/metrics.py (the allocation-retries warning)"
        ),
        constraint=lambda v: _fits_with_reserve_or_not_at_all(per_rank_bytes(v), real(v.device_memory)),
        explain=_explain_reserve,
        hint=lambda x: "for headroom, the remedies of R001: " + _hint(x).removeprefix("try "),
        fields=MEMORY_FIELDS,
        severity=Severity.warning,
        elastic=False,
        minimal_conflict=False,
    )
)
