"""Device memory (R0xx): what one rank holds must fit on its device."""

from __future__ import annotations

from mixle_compile.verify.facts import format_bytes
from mixle_compile.verify.logic import larger, real, smaller, when
from mixle_compile.verify.memory import CATEGORIES
from mixle_compile.verify.rule import Rule, define

MOMENT_BYTES = 8  # Adam(W): two fp32 moments per element
MASTER_BYTES = 4  # an fp32 master copy of every parameter stored below fp32


def per_rank_bytes(v) -> dict[str, object]:
    """The heaviest rank's bytes, as Z3 real terms: weights, gradients, optimizer state, activations."""
    fp = v.facts.footprint
    element_bytes = when(v.is_("precision", "fp32"), 4, when(v.is_("precision", "fp8"), 1, 2))
    below_fp32 = v.is_("precision", "bf16", "fp16", "fp8")
    moment_bytes = when(v.is_("optimizer", "sgd"), 0, MOMENT_BYTES)

    # Layers on the heaviest rank: its v virtual stages of ceil(layers / (pp * v)) layers each; a
    # stage of c consecutive layers holds at most ceil(c / k) mixture-of-experts layers and at most
    # c - floor(c / k) dense ones (k = moe_layer_frequency).
    virtual = when(v.pp == 1, 1, v.virtual_pipeline_stages)  # without a pipeline there are no virtual stages
    stages = v.pp * virtual
    chunk = (v.layers + stages - 1) / stages
    k = fp.moe_layer_frequency
    copies = {
        "every_layer": virtual * chunk,
        "dense_layer": virtual * (chunk - chunk / k),
        "moe_layer": virtual * ((chunk + k - 1) / k),
    }

    # How many ranks share one copy of each category: the model-parallel split times the data-parallel
    # sharding (FSDP over dp_shard x cp; experts over the dp_shard x cp x tp ranks left after ep x etp).
    expert_ranks = v.ep * v.etp
    split = {
        "tensor_parallel": real(v.tp * v.dp_shard * v.cp),
        "replicated": real(v.dp_shard * v.cp),
        "expert": real(expert_ranks) * larger(real(v.dp_shard * v.cp * v.tp) / real(expert_ranks), 1),
    }
    optimizer_split = when(v.distributed_optimizer, real(v.dp_replicate), real(1))

    def weight_bytes(share) -> object:
        return share.precision_elements * element_bytes + share.fixed_bytes

    def state_bytes(share) -> object:
        master = when(below_fp32, share.precision_elements, 0) + share.fixed_low_precision_elements
        return moment_bytes * share.elements + MASTER_BYTES * master

    def held(place_counts, measure, extra_split) -> object:
        total = real(0)
        for place, count in place_counts:
            for category in CATEGORIES:
                share = fp.share(place, category)
                if share.elements:
                    total = total + real(count * measure(share)) / (split[category] * extra_split)
        return total

    def stage_bytes(measure, extra_split) -> object:
        layers = held(copies.items(), measure, extra_split)
        first = held([("first_stage", 1)], measure, extra_split)
        last = held([("last_stage", 1)], measure, extra_split)
        tied = held([("tied_copy", 1)], measure, extra_split)
        # One stage holds both ends (a tied pair once); otherwise the heavier end is the bound.
        return layers + when(v.pp == 1, first + last - tied, larger(first, last))

    weights = stage_bytes(weight_bytes, real(1))
    optimizer = stage_bytes(state_bytes, optimizer_split)
    return {
        "weights": weights,
        "gradients": weights,  # gradients are held in the parameters' dtype
        "optimizer state": optimizer,
        "activations": activation_bytes(v, copies["every_layer"]),
    }


def activation_bytes(v, layers_on_rank) -> object:
    """Activations kept for the backward pass (Korthikanti et al. 2022, per layer, 16-bit)."""
    fp = v.facts.footprint
    if v.facts.family != "transformer":
        return real(0)  # a modules spec lists parameters only; its activations are unknown
    s = real(v.seq_len) / real(v.cp)
    b = real(v.micro_batch_size)
    t = real(v.tp)
    sbh = s * b * fp.hidden_size
    scores = 5 * fp.num_heads * s * s * b  # attention softmax and dropout
    split_all = when(v.sequence_parallel, 34 * sbh / t, sbh * (10 + 24 / t))
    per_layer = when(
        v.is_("activation_checkpointing", "full"),
        when(v.sequence_parallel, 2 * sbh / t, 2 * sbh),
        when(v.is_("activation_checkpointing", "selective"), split_all, split_all + scores / t),
    )
    scale = when(v.is_("precision", "fp32"), 2, 1)
    pp, mb = v.pp, v.microbatches
    interleaving = 1 + real(pp - 1) / real(pp * v.virtual_pipeline_stages)  # only read when pp > 1
    in_flight = when(
        pp == 1,
        real(1),
        when(
            v.is_("pipeline_schedule", "gpipe"),
            real(mb),
            when(v.is_("pipeline_schedule", "1f1b"), real(smaller(mb, pp)), real(smaller(mb, pp)) * interleaving),
        ),
    )
    return in_flight * real(layers_on_rank) * per_layer * scale


def _total(x) -> float:
    return sum(float(x.eval(term)) for term in _terms(x).values())


def _terms(x) -> dict:
    cached = x.cache.get("memory")
    if cached is None:
        cached = x.cache["memory"] = per_rank_bytes(x.symbols)
    return cached


def _explain(x) -> str:
    parts = ", ".join(f"{name} {format_bytes(float(x.eval(term)))}" for name, term in _terms(x).items())
    return f"the heaviest rank needs about {format_bytes(_total(x))} ({parts}), more than the {format_bytes(x.device_memory)} of a device"


def _hint(x) -> str:
    terms = {name: float(x.eval(term)) for name, term in _terms(x).items()}
    ideas = []
    if terms["optimizer state"] >= max(terms.values()) / 2 and not x.distributed_optimizer and x.dp_replicate > 1:
        ideas.append("training.distributed_optimizer: true")
    if terms["activations"] >= max(terms.values()) / 2 and x.activation_checkpointing != "full":
        ideas.append("activation_checkpointing: full" if x.activation_checkpointing == "selective" else "activation_checkpointing: selective")
    ideas.append("more sharding (dp_shard, tp, pp), more devices, or --suggest for the nearest plan that fits")
    return "try " + "; ".join(ideas)


DEVICE_MEMORY = define(
    Rule(
        code="R001",
        name="device-memory",
        title="The heaviest rank's parameters, gradients, optimizer state and activations fit in device memory.",
        docs=(
            "An estimate of the heaviest rank, stated so that it can be checked by hand:\n\n"
            "* **Weights**: each parameter's elements times its dtype's bytes, divided by the ranks that share "
            "one copy: tp for column, row, embedding and head weights, ep * etp for experts, and the FSDP "
            "sharding over dp_shard * cp (experts: over the dp_shard * cp * tp ranks left after ep * etp). "
            "The heaviest pipeline rank holds `v` virtual stages of `c = ceil(layers / (pp * v))` layers "
            "(v = 1 without a pipeline), the embedding on the first stage and the output head and final norm on "
            "the last (both on one stage when pp = 1, a tied pair counted once; otherwise the heavier end). A "
            "transformer stage counts what every layer holds (attention, norms) for each layer, plus at most "
            "`v * ceil(c / k)` mixture-of-experts and `v * (c - floor(c / k))` dense MLPs (every k-th layer is "
            "a mixture-of-experts layer); a `modules` stage counts each layer as the largest amount of each "
            "kind (by category and dtype) that any of its layers holds. The estimate is therefore an upper "
            "bound where layers differ.\n"
            "* **Gradients**: as many bytes as the weights.\n"
            "* **Optimizer state**: Adam/AdamW keep two fp32 moments per element (8 bytes), plus a 4-byte fp32 "
            "master copy of every element stored below fp32; SGD keeps only the master copies. With "
            "`distributed_optimizer` the state is also sharded over dp_replicate.\n"
            "* **Activations** (transformers): per layer, per micro-batch, the formulas of Korthikanti et al. "
            "(2022) in 16-bit: `s*b*h*(10 + 24/t) + 5*a*s^2*b/t` without sequence parallelism, `34*s*b*h/t + "
            "5*a*s^2*b/t` with it; selective checkpointing drops the `5*a*s^2*b` term; full checkpointing keeps "
            "only the layer input (`2*s*b*h`, /t with sequence parallelism). `s` is seq_len / cp, fp32 doubles "
            "it. The first stage holds `min(microbatches, pp)` micro-batches in flight under 1F1B (times "
            "`1 + (pp-1)/(pp*v)` interleaved), all of them under GPipe, one without a pipeline.\n\n"
            "The smallest device of a heterogeneous list bounds the plan. A `modules` spec lists parameters "
            "only, so its activations are not counted. Specs of the `distribution` family are not checked "
            "here: their memory is decided by the decomposition, which places each component."
        ),
        engine_reference=(
            "Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models (2022); "
            "Rajbhandari et al., ZeRO (2020) for optimizer-state bytes"
        ),
        constraint=lambda v: sum(per_rank_bytes(v).values(), real(0)) <= real(v.device_memory),
        explain=_explain,
        hint=_hint,
        fields=("device_memory", "tp", "dp_shard", "pp", "cp", "micro_batch_size", "activation_checkpointing"),
    )
)
