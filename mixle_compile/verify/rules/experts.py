"""Expert parallelism (E0xx): how mixture-of-experts layers spread over the ranks.

The engines disagree here, which is why each has a rule set of its own. The in-tree torch runtime
and torchtitan carve the expert groups out of the data x context (x tensor) ranks and so need `etp`
to be 1 or `tp` (torchtitan 0.3 has no etp at all); Megatron-Core builds a separate expert grid of
`etp x ep x expert-data-parallel x pp` ranks over the whole world.
"""

from __future__ import annotations

from mixle_compile.spec.kinds import NEURAL, Engine
from mixle_compile.verify.logic import all_of, any_of, implies, negation
from mixle_compile.verify.rule import EVERY_FAMILY, Rule, define
from mixle_compile.verify.wording import alternatives, divisors

EXPERT_TENSOR_PARALLEL = define(
    Rule(
        code="E001",
        name="expert-tensor-parallel-size",
        title="etp is 1 or equal to tp.",
        docs=(
            "In torch's layout an expert's weights are either whole on each expert rank (`etp: 1`) or split "
            "exactly like the dense layers (`etp` equal to `tp`), because the expert groups are cut from the "
            "same ranks as the tensor-parallel groups. Any other value (e.g. `etp: 3` with `tp: 2`) has no "
            "process group to run on."
        ),
        engine_reference=(
            'torchtitan 0.2 torchtitan/distributed/parallel_dims.py `ParallelDims._validate`: "Currently we only '
            'support ETP=TP or ETP=1" (0.3 has no etp: E010)'
        ),
        constraint=lambda v: any_of(v.etp == 1, v.etp == v.tp),
        explain=lambda x: f"etp={x.etp} is neither 1 nor tp={x.tp}",
        hint=lambda x: f"use etp: 1 (experts split only over ep) or etp: {x.tp} (experts split like the dense layers)",
        fields=("etp", "tp"),
        engines=frozenset({Engine.TORCH, Engine.TORCHTITAN}),
    )
)


def _domain_explain(x) -> str:
    if x.etp == x.tp:
        size = x.dp_shard * x.cp
        return (
            f"with etp = tp = {x.tp}, experts spread over dp_shard*cp = {x.dp_shard}*{x.cp} = {size} ranks, "
            f"and {size} % ep={x.ep} != 0"
        )
    size = x.dp_shard * x.cp * x.tp
    return (
        f"with etp = 1, experts spread over dp_shard*cp*tp = {x.dp_shard}*{x.cp}*{x.tp} = {size} ranks, and "
        f"{size} % ep={x.ep} != 0"
    )


def _domain_hint(x) -> str:
    size = x.dp_shard * x.cp * (x.tp if x.etp != x.tp else 1)
    return f"use an ep that divides {size}: {alternatives(divisors(size))}"


EXPERT_PARALLEL_DOMAIN = define(
    Rule(
        code="E002",
        name="expert-parallel-domain",
        title="ep divides the ranks the experts are spread over.",
        docs=(
            "torch spreads the experts over the data-parallel shard and context-parallel ranks, and also over "
            "the tensor-parallel ranks when each expert is whole (`etp: 1`). So with `etp` equal to `tp`, "
            "`(dp_shard * cp) % ep == 0`; with `etp: 1`, `(dp_shard * cp * tp) % ep == 0`. This is not the "
            "data-parallel size: `tp: 8, ep: 8` on 8 devices is valid with `etp: 1`."
        ),
        engine_reference="torchtitan `ParallelDims._validate` (ep divides dp_shard*cp, or dp_shard*cp*tp when etp == "
        "1)",
        constraint=lambda v: all_of(
            implies(v.etp == v.tp, (v.dp_shard * v.cp) % v.ep == 0),
            implies(v.etp == 1, (v.dp_shard * v.cp * v.tp) % v.ep == 0),
        ),
        explain=_domain_explain,
        hint=_domain_hint,
        fields=("ep", "dp_shard", "cp", "tp", "etp"),
        engines=frozenset({Engine.TORCH}),
    )
)

EXPERT_GRID = define(
    Rule(
        code="E003",
        name="expert-grid",
        title="The world size is a multiple of etp * ep * pp.",
        docs=(
            "Megatron-Core lays the expert layers out on their own grid of "
            "`etp x ep x expert-data-parallel x pp` ranks covering the whole world, so the number of devices "
            "must be a multiple of `etp * ep * pp`. Unlike torch's layout, `etp` may differ from `tp` and `ep` "
            "may span tensor-parallel ranks."
        ),
        engine_reference=(
            "Megatron-Core `parallel_state.initialize_model_parallel`: world size must be divisible by "
            "expert_tensor_parallel_size * expert_model_parallel_size * pipeline_model_parallel_size"
        ),
        constraint=lambda v: v.devices % (v.etp * v.ep * v.pp) == 0,
        explain=lambda x: (
            f"{x.devices} devices is not a multiple of etp*ep*pp = {x.etp}*{x.ep}*{x.pp} = {x.etp * x.ep * x.pp}"
        ),
        hint=lambda x: f"choose etp*ep*pp dividing {x.devices}",
        fields=("ep", "etp", "pp", "devices"),
        engines=frozenset({Engine.MEGATRON}),
    )
)

EXPERTS_SPLIT = define(
    Rule(
        code="E004",
        name="experts-split-by-ep",
        title="ep divides the number of experts.",
        docs="Each expert-parallel rank holds `num_experts / ep` whole experts, so `num_experts % ep == 0`.",
        engine_reference="Megatron-LM `validate_args`: num_experts must be a multiple of expert_model_parallel_size; "
        "torchtitan's expert sharding",
        constraint=lambda v: implies(v.num_experts > 0, v.num_experts % v.ep == 0),
        explain=lambda x: (
            f"{x.num_experts} experts cannot be split evenly over ep={x.ep} ranks ({x.num_experts} % {x.ep} != 0)"
        ),
        hint=lambda x: f"use an ep that divides {x.num_experts}: {alternatives(divisors(x.num_experts))}",
        fields=("ep", "num_experts"),
    )
)

EXPERT_PARALLEL_NEEDS_EXPERTS = define(
    Rule(
        code="E005",
        name="expert-parallel-needs-experts",
        title="ep > 1 needs a model with experts.",
        docs=(
            "Expert parallelism splits mixture-of-experts layers; a dense model (or a distribution model) has "
            "nothing for it to split, and the ranks it names would sit idle or duplicate work."
        ),
        engine_reference="Megatron-LM `validate_args`: num_experts must be set to use expert model parallelism",
        constraint=lambda v: implies(v.ep > 1, v.num_experts > 0),
        explain=lambda x: f"ep={x.ep} but the model has no experts",
        hint=lambda x: "use ep: 1, or give the model experts (`num_experts`)",
        fields=("ep", "num_experts"),
        families=EVERY_FAMILY,
    )
)

MOE_NEEDS_SEQUENCE_PARALLEL = define(
    Rule(
        code="E006",
        name="moe-tensor-parallel-needs-sequence-parallel",
        title="Megatron: mixture-of-experts layers with tp > 1 need sequence_parallel.",
        docs=(
            "Megatron-Core's MoE layer refuses to train with tensor parallelism and without sequence "
            'parallelism, whatever ep is (`MoELayer.forward` raises "During training, performance may degrade '
            'if MoE and tensor parallelism are enabled without also enabling sequence parallelism"), in every '
            "version modelled (0.12-0.16). Up to 0.14, `ModelParallelConfig` also refuses ep > 1 with tp > 1 "
            "without it; from 0.15 that check only warns, so the MoE layer is what stops training."
        ),
        engine_reference=(
            "Megatron-Core 0.12-0.16 megatron/core/transformer/moe/moe_layer.py `MoELayer.forward`; "
            "megatron/core/model_parallel_config.py `__post_init__` (raises up to 0.14, warns from 0.15)"
        ),
        constraint=lambda v: implies(all_of(v.num_experts > 0, v.tp > 1), v.sequence_parallel),
        explain=lambda x: f"{x.num_experts} experts per MoE layer with tp={x.tp} run without sequence parallelism",
        hint=lambda x: "set training.sequence_parallel: true",
        fields=("sequence_parallel", "num_experts", "tp", "ep"),
        engines=frozenset({Engine.MEGATRON}),
        families=NEURAL,
    )
)


MOE_TENSOR_PARALLEL_TORCH = define(
    Rule(
        code="E007",
        name="moe-tensor-parallel-sequence-parallel-torch",
        title="torch: mixture-of-experts layers with tp > 1 need sequence_parallel.",
        docs=(
            "With tensor parallelism the torch backend routes each token on exactly one tensor-parallel rank: "
            "the one whose sequence shard holds it, so the tokens must be sequence shards when they reach the "
            "router. Without sequence parallelism every tp rank holds every token, and the router and experts "
            "would either compute each token tp times or leave the router's gradient summed over only part of "
            "the ranks. Megatron-Core asks the same when experts meet tensor parallelism (E006)."
        ),
        engine_reference=(
            "torch backend: runtime/experts.py routes sequence shards; Megatron-Core "
            "`ModelParallelConfig.__post_init__` "
            "requires sequence parallelism with expert and tensor parallelism"
        ),
        constraint=lambda v: implies(all_of(v.num_experts > 0, v.tp > 1), v.sequence_parallel),
        explain=lambda x: f"the model has mixture-of-experts layers and tp={x.tp} runs without sequence parallelism",
        hint=lambda x: "set training.sequence_parallel: true",
        fields=("sequence_parallel", "tp", "num_experts"),
        engines=frozenset({Engine.TORCH}),
    )
)


def _expert_ranks(v):
    """Ranks one expert layer's experts spread over, whole: ep * expert-data = world / (etp * pp)."""
    return v.world / (v.etp * v.pp)


EXPERTS_SHARDED_WHOLE = define(
    Rule(
        code="E008",
        name="experts-sharded-whole-torch",
        title="torch: under FSDP, num_experts is a multiple of world / (etp * pp).",
        docs=(
            "Under FSDP (dp_shard > 1) the torch backend shards expert weights like torchtitan does: whole "
            "experts, first over the expert-parallel ranks and then over the expert-data-parallel ranks "
            "(`world / (etp * ep * pp)`), so together over `world / (etp * pp)` ranks. When the experts do not "
            "divide evenly the plan would have to cut each expert's hidden features instead, a layout the torch "
            "runtime does not execute."
        ),
        engine_reference="torchtitan `parallelize_moe`: experts are FSDP-sharded on the expert dimension over the "
        "expert-data mesh",
        # (a world smaller than etp * pp, which the mesh rules refuse, leaves no rank to share out over: a
        # remainder by zero, which the solver would be free to choose, is not asked)
        constraint=lambda v: implies(
            all_of(v.num_experts > 0, v.dp_shard > 1, _expert_ranks(v) > 0), v.num_experts % _expert_ranks(v) == 0
        ),
        explain=lambda x: (
            f"under FSDP {x.num_experts} experts cannot be shared out whole over world / (etp * pp) = "
            f"{x.world} / ({x.etp} * {x.pp}) = {x.world // (x.etp * x.pp)} ranks"
        ),
        hint=lambda x: (
            f"use a multiple of {x.world // (x.etp * x.pp)} experts, dp_shard: 1 (no FSDP), or fewer "
            "ranks per expert layer"
        ),
        fields=("num_experts", "dp_shard", "dp_replicate", "tp", "cp", "etp"),
        engines=frozenset({Engine.TORCH}),
    )
)


TORCHTITAN_EXPERT_MESH = define(
    Rule(
        code="E009",
        name="torchtitan-expert-mesh",
        title="torchtitan: ep * etp divides dp_shard * cp * tp.",
        docs=(
            "torchtitan cuts its expert mesh `[pp, dp_replicate, efsdp, ep(, etp)]` out of the dense mesh, with "
            "`efsdp = dp_shard * cp * tp // (ep * etp)`; when `ep * etp` does not divide `dp_shard * cp * tp` the "
            "mesh cannot be unflattened and the trainer fails at start. (Megatron cuts experts from the whole "
            "grid instead: E003.)"
        ),
        engine_reference=(
            "torchtitan 0.3 torchtitan/distributed/parallel_dims.py `build_mesh` (`efsdp = fsdp * tp // ep`); "
            "0.2 the same with `// (etp * ep)`"
        ),
        constraint=lambda v: (v.dp_shard * v.cp * v.tp) % (v.ep * v.etp) == 0,
        explain=lambda x: (
            f"ep*etp = {x.ep}*{x.etp} = {x.ep * x.etp} does not divide dp_shard*cp*tp = "
            f"{x.dp_shard}*{x.cp}*{x.tp} = {x.dp_shard * x.cp * x.tp}"
        ),
        hint=lambda x: f"use an ep that divides {x.dp_shard * x.cp * x.tp // x.etp}",
        fields=("ep", "etp", "dp_shard", "cp", "tp"),
        engines=frozenset({Engine.TORCHTITAN}),
        families=NEURAL,
    )
)

TORCHTITAN_NO_ETP = define(
    Rule(
        code="E010",
        name="torchtitan-no-expert-tensor-parallel",
        title="torchtitan 0.3: etp = 1 (its mesh has no expert tensor-parallel axis).",
        docs=(
            "torchtitan 0.3's `ParallelDims` has no `etp` degree: with ep > 1 experts are split over ep only and "
            "the tensor-parallel ranks split the tokens; with ep = 1 experts are split over tp like the dense "
            "layers. Earlier releases (0.2) had `expert_tensor_parallel_degree` (E001)."
        ),
        engine_reference="torchtitan 0.3 torchtitan/distributed/parallel_dims.py `ParallelDims` (dp_replicate, "
        "dp_shard, "
        "cp, tp, pp, ep)",
        constraint=lambda v: v.etp == 1,
        explain=lambda x: f"etp={x.etp}, but torchtitan 0.3 has no expert tensor parallelism",
        hint=lambda x: 'set etp: 1, or name backend: {name: torchtitan, version: "0.2"}',
        fields=("etp",),
        engines=frozenset({Engine.TORCHTITAN}),
        versions=((Engine.TORCHTITAN, ">=0.3"),),
        families=NEURAL,
    )
)

DROPLESS_ONLY = define(
    Rule(
        code="E011",
        name="expert-capacity-dropless-engine",
        title="expert_capacity_factor only on an engine that caps an expert's tokens (Megatron-Core).",
        docs=(
            "A capacity factor caps the tokens each expert takes at that multiple of its even share and drops "
            "the rest (Megatron-Core's `moe_expert_capacity_factor`, with `moe_pad_expert_input_to_capacity` "
            "padding up to it). torchtitan and the in-tree runtime route every token to its experts (dropless), "
            "so a spec that states a capacity describes a run they would not do, and its memory would be "
            "priced for tokens they do not cap."
        ),
        engine_reference=(
            "Megatron-Core transformer_config.py `moe_expert_capacity_factor` (None: no token dropped) and "
            "token_dispatcher.py `get_capacity`; torchtitan 0.3 models/common/moe.py `TokenChoiceTopKRouter` "
            "(every token to its top-k experts, no capacity); runtime/experts.py (no capacity limit)"
        ),
        constraint=lambda v: negation(v.expert_capacity),
        explain=lambda x: f"{x.facts.backend} routes every token to its experts and has no capacity factor",
        hint=lambda x: "remove model.expert_capacity_factor (dropless routing), or use backend: megatron",
        fields=("expert_capacity",),
        engines=frozenset({Engine.TORCH, Engine.TORCHTITAN}),
        needs=("expert_capacity",),
        families=NEURAL,
    )
)


FLEX_DISPATCH_NOT_IN_RUNTIME = define(
    Rule(
        code="E012",
        name="flex-dispatcher-not-in-runtime",
        title="torch: the in-tree runtime exchanges one copy of a token per routed expert (no flex dispatcher).",
        docs=(
            "`training.expert_dispatcher: flex` states a dispatcher that sends a token once to each rank of its "
            "node holding one of its experts and once to each other node holding one (DeepEP, HybridEP): "
            "Megatron-Core's flex token dispatcher and torchtitan's DeepEP/HybridEP expert-parallel "
            "communication backends. The in-tree runtime exchanges tokens with `all_to_all_single`, one copy "
            "per routed expert, so a plan that states flex would run, and be measured, as something else."
        ),
        engine_reference=(
            "torch backend: mixle_compile/runtime/experts.py (all_to_all per routed expert); Megatron-Core "
            "transformer_config.py `moe_token_dispatcher_type='flex'`, `moe_flex_dispatcher_backend`; torchtitan "
            "`parallelism.expert_parallel_comm_backend` ('deepep'), 0.3 models/common/config_utils.py "
            "`make_token_dispatcher_config` ('deepep', 'hybridep')"
        ),
        constraint=lambda v: negation(v.flex_dispatch),
        explain=lambda x: (
            "training.expert_dispatcher is flex, but the in-tree runtime sends one copy per routed expert"
        ),
        hint=lambda x: "set training.expert_dispatcher: all_to_all, or use backend: megatron or torchtitan",
        fields=("flex_dispatch",),
        context=("backend",),
        engines=frozenset({Engine.TORCH}),
        needs=("flex_dispatch",),
        families=NEURAL,
    )
)
