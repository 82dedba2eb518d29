"""Backend capabilities (C0xx): what the chosen backend declares it can execute.

The capabilities are the backend's :class:`~mixle_compile.contracts.BackendCapabilities` (for
`torch` and `megatron`, `contracts.BUILTIN_CAPABILITIES`; for a plugin, what it registers), so
these rules follow whatever a backend declares rather than a list kept here.
"""

from __future__ import annotations

from mixle_compile.contracts import ParallelAxis
from mixle_compile.diagnostics import Severity
from mixle_compile.spec.kinds import Engine
from mixle_compile.verify.facts import PRECISIONS
from mixle_compile.verify.logic import all_of, implies, negation, truth
from mixle_compile.verify.rule import EVERY_FAMILY, MODULES, TRANSFORMER, Rule, define
from mixle_compile.verify.wording import alternatives

_AXES = tuple(a.value for a in ParallelAxis)


def _degree(v, axis: str):
    return getattr(v, axis)


def _unexecuted(x) -> list[str]:
    caps = x.facts.capabilities
    return [f"{a}={getattr(x, a)}" for a in _AXES if ParallelAxis(a) not in caps.axes and getattr(x, a) > 1]


AXES = define(
    Rule(
        code="C001",
        name="backend-axes",
        title="Every active parallel axis is one the backend executes.",
        docs=(
            "An axis is active when its degree is above 1. A backend declares the axes it executes "
            "(`BackendCapabilities.axes`); the plan may not ask it for others. torch and megatron execute "
            "every axis; a plugin backend may declare fewer."
        ),
        engine_reference="the backend's declared `BackendCapabilities.axes`",
        constraint=lambda v: all_of(
            *[_degree(v, a) == 1 for a in _AXES if ParallelAxis(a) not in v.facts.capabilities.axes]
        ),
        explain=lambda x: f"backend {x.facts.backend} does not execute the active axes {', '.join(_unexecuted(x))}",
        hint=lambda x: "set those degrees to 1, or choose a backend that executes them",
        fields=_AXES,
        context=("backend",),
        families=EVERY_FAMILY,
    )
)


def _supported(caps) -> list[str]:
    return [p for p in PRECISIONS if p in caps.precisions]


PRECISION = define(
    Rule(
        code="C002",
        name="backend-precision",
        title="training.precision is one the backend supports.",
        docs=(
            "A backend declares the precisions it trains in (`BackendCapabilities.precisions`). The torch "
            "runtime trains in fp32 and bf16 and fits distribution models in fp64 (rule C008); Megatron-Core "
            "also in fp16 (with loss scaling) and fp8 (with Transformer Engine)."
        ),
        engine_reference="the backend's declared `BackendCapabilities.precisions`",
        constraint=lambda v: v.is_("precision", *_supported(v.facts.capabilities)),
        explain=lambda x: (
            f"backend {x.facts.backend} trains in "
            f"{alternatives(_supported(x.facts.capabilities)).replace(' or ', ' and ')}, not {x.precision}"
        ),
        hint=lambda x: (
            "use precision: "
            f"{'bf16' if 'bf16' in _supported(x.facts.capabilities) else _supported(x.facts.capabilities)[0]}"
        ),
        fields=("precision",),
        context=("backend",),
        families=EVERY_FAMILY,
    )
)


def _clashes(x) -> list[str]:
    out = []
    for axes in x.facts.capabilities.incompatible_axis_sets:
        if all(getattr(x, a.value) > 1 for a in axes):
            out.append("{" + ", ".join(sorted(a.value for a in axes)) + "}")
    return out


AXIS_COMBINATION = define(
    Rule(
        code="C003",
        name="backend-axis-combination",
        title="No set of axes the backend cannot combine is active together.",
        docs=(
            "A backend may run each of several axes alone but not all of them at once "
            "(`BackendCapabilities.incompatible_axis_sets`). The plan may not make every axis of such a "
            "set active."
        ),
        engine_reference="the backend's declared `BackendCapabilities.incompatible_axis_sets`",
        constraint=lambda v: all_of(
            *[
                negation(all_of(*[_degree(v, a.value) > 1 for a in axes]))
                for axes in v.facts.capabilities.incompatible_axis_sets
            ]
        ),
        explain=lambda x: f"backend {x.facts.backend} cannot run the axes {' and '.join(_clashes(x))} together",
        hint=lambda x: "set one axis of each listed set to 1",
        fields=_AXES,
        context=("backend",),
        families=EVERY_FAMILY,
    )
)

DISTRIBUTED_OPTIMIZER = define(
    Rule(
        code="C004",
        name="backend-distributed-optimizer",
        title="distributed_optimizer only where the backend supports it.",
        docs="A sharded (distributed) optimizer needs `BackendCapabilities.distributed_optimizer`.",
        engine_reference="the backend's declared `BackendCapabilities.distributed_optimizer`",
        constraint=lambda v: implies(v.distributed_optimizer, truth(v.facts.capabilities.distributed_optimizer)),
        explain=lambda x: f"backend {x.facts.backend} has no distributed optimizer",
        hint=lambda x: "set training.distributed_optimizer: false",
        fields=("distributed_optimizer",),
        context=("backend",),
        families=EVERY_FAMILY,
    )
)


def _elastic_missing(caps) -> list[str]:
    return [name for name in ("elastic_restart", "reshardable_checkpoint") if not getattr(caps, name)]


ELASTIC = define(
    Rule(
        code="C005",
        name="backend-elastic",
        title="An elastic range needs a backend with elastic restart and reshardable checkpoints.",
        docs=(
            "Running at a new world size means restarting the workers and loading the last checkpoint under a "
            "different layout, so an `elastic:` section needs `BackendCapabilities.elastic_restart` and "
            "`reshardable_checkpoint`. The built-in torch and megatron backends declare no elastic restart "
            "today, so on them this rule reports every elastic spec; the elastic proof (D003) still runs."
        ),
        engine_reference="the backend's declared `BackendCapabilities.elastic_restart` and `reshardable_checkpoint`",
        constraint=lambda v: implies(
            v.elastic,
            truth(v.facts.capabilities.elastic_restart and v.facts.capabilities.reshardable_checkpoint),
        ),
        explain=lambda x: (
            f"backend {x.facts.backend} declares no "
            f"{' and no '.join(_elastic_missing(x.facts.capabilities)).replace('_', ' ')}"
        ),
        hint=lambda x: "remove the elastic section, or use a backend that restarts at a new world size",
        fields=("elastic",),
        context=("backend",),
        families=EVERY_FAMILY,
        needs=("elastic_min_world_size",),
        elastic=False,
    )
)


_MODEL_AXES = ("tp", "pp", "cp", "ep", "etp")


def _model_parallel(x) -> list[str]:
    return [f"{a}={getattr(x, a)}" for a in _MODEL_AXES if getattr(x, a) > 1]


MODULES_DATA_PARALLEL = define(
    Rule(
        code="C006",
        name="modules-data-parallel",
        title="torch: a `modules` model is trained with data parallelism only (tp, pp, cp, ep, etp = 1).",
        docs=(
            "A `modules` spec lists your nn.Module's parameters, not how activations flow between them. The "
            "torch backend trains such a module through `prepare(module, plan=...)`, which can shard and "
            "replicate its parameters over the data-parallel axes (DDP, FSDP, HSDP, a distributed optimizer) "
            "without knowing its forward pass. Tensor, pipeline, context and expert parallelism all cut the "
            "forward pass itself (which activation is reduced after which layer, where a stage ends, which "
            "dimension is the sequence, how tokens reach experts), so the plan would have no activation "
            "collectives to execute and every rank would silently compute something else. Describe the model "
            "as a `transformer` to use those axes, or use the megatron backend with a Megatron model."
        ),
        engine_reference="torch backend: `prepare(module, plan=...)` (docs/runtime.md, library API)",
        constraint=lambda v: all_of(*[getattr(v, a) == 1 for a in _MODEL_AXES]),
        explain=lambda x: (
            "the torch backend trains a `modules` model with data parallelism only, but the plan has "
            f"{', '.join(_model_parallel(x))}"
        ),
        hint=lambda x: "set those degrees to 1 and use dp_replicate / dp_shard, or describe the model as a transformer",
        fields=_MODEL_AXES,
        families=MODULES,
        engines=frozenset({Engine.TORCH}),
    )
)


COMPILE_UNUSED = define(
    Rule(
        code="C007",
        name="compile-unused",
        title="Warning: training.compile is read by torchtitan only.",
        docs=(
            "A warning, not an error: `training.compile` states what torchtitan compiles (`compile.enable` and "
            "`compile.components`). The in-tree runtime and Megatron-Core do not apply torch.compile to the model "
            "or the loss, so the setting changes nothing they run, and the memory model prices those engines "
            "uncompiled."
        ),
        engine_reference=(
            "torchtitan torchtitan/config/job_config.py `Compile` (enable, components = [model, loss]); "
            "Megatron-LM has no torch.compile switch for the model"
        ),
        constraint=lambda v: negation(v.compiles),
        explain=lambda x: f"training.compile is set, but backend {x.facts.backend} does not apply torch.compile",
        hint=lambda x: "remove training.compile, or use backend: torchtitan if that is the engine you train with",
        fields=("compiles",),
        families=EVERY_FAMILY,
        engines=frozenset({Engine.TORCH, Engine.MEGATRON}),
        severity=Severity.warning,
        elastic=False,
    )
)


ASYNC_TP_NEEDS_COMPILE = define(
    Rule(
        code="C009",
        name="async-tp-needs-compile",
        title="torchtitan: async tensor parallelism needs the model compiled (compile includes model).",
        docs=(
            "torchtitan's async tensor parallelism is a torch.compile pass (Inductor's micro-pipelined TP, "
            "`_micro_pipeline_tp`) that splits each tensor-parallel all-gather and reduce-scatter into chunks "
            "overlapped with the matrix multiplications beside them, so it exists only in a compiled model: with "
            "tp > 1 torchtitan refuses `enable_async_tensor_parallel` unless `compile.enable` is on and "
            "`compile.components` holds `model`. Up to 0.2 the check runs only with a tensor-parallel mesh "
            "(tp > 1); from 0.3 the flag belongs to `CompileConfig`, which refuses it uncompiled at any tp."
        ),
        engine_reference=(
            "torchtitan v0.2.2 torchtitan/distributed/tensor_parallel.py `maybe_enable_async_tp` (called when "
            "tp is enabled); torchtitan 0.3 torchtitan/config/configs.py `CompileConfig.__post_init__`"
        ),
        constraint=lambda v: implies(
            v.async_tensor_parallel if v.facts.engine.at_least("0.3") else all_of(v.async_tensor_parallel, v.tp > 1),
            v.compiled_model,
        ),
        explain=lambda x: (
            f"training.async_tensor_parallel is on with tp={x.tp}, but training.compile is "
            f"{x.facts.field('compiled_model').shown}: torchtitan's async TP is a torch.compile pass"
        ),
        hint=lambda x: "add model to training.compile (e.g. compile: true), or set async_tensor_parallel: false",
        fields=("async_tensor_parallel", "compiled_model", "tp"),
        engines=frozenset({Engine.TORCHTITAN}),
    )
)


TP_OVERLAP_NEEDS_SEQUENCE_PARALLEL = define(
    Rule(
        code="C010",
        name="tp-comm-overlap-needs-sequence-parallel",
        title="Megatron: tensor-parallel communication overlap needs tp > 1 and sequence parallelism.",
        docs=(
            "Megatron's `--tp-comm-overlap` (Transformer Engine's userbuffers) overlaps the all-gathers and "
            "reduce-scatters of sequence parallelism with the GEMMs beside them, so Megatron asserts "
            "`sequence_parallel` when it is on, after it has already switched sequence parallelism off for "
            "tp = 1: the overlap needs tp > 1 and `sequence_parallel: true`."
        ),
        engine_reference=(
            "Megatron-LM core_v0.16.1 megatron/training/arguments.py `validate_args` (sequence_parallel "
            "disabled when tensor_model_parallel_size == 1; `assert args.sequence_parallel` under tp_comm_overlap)"
        ),
        constraint=lambda v: implies(v.async_tensor_parallel, all_of(v.tp > 1, v.sequence_parallel)),
        explain=lambda x: (
            f"training.async_tensor_parallel is on with tp={x.tp} and sequence_parallel "
            f"{'on' if x.sequence_parallel else 'off'}: Megatron overlaps only sequence-parallel communication"
        ),
        hint=lambda x: "set sequence_parallel: true with tp > 1, or set async_tensor_parallel: false",
        fields=("async_tensor_parallel", "sequence_parallel", "tp"),
        engines=frozenset({Engine.MEGATRON}),
    )
)


ASYNC_TP_NOT_IN_RUNTIME = define(
    Rule(
        code="C011",
        name="async-tp-not-in-runtime",
        title="torch: the in-tree runtime does not overlap tensor-parallel communication.",
        docs=(
            "The in-tree runtime issues each tensor-parallel collective when the plan says and waits for it "
            "(mixle_compile/runtime/tensor_parallel.py); it has no overlapped (asynchronous) tensor "
            "parallelism, so a plan that asks for it would run, and be timed, as something else. Use "
            "`backend: torchtitan` or `megatron` to plan for the engines that overlap it."
        ),
        engine_reference="torch backend: mixle_compile/runtime/tensor_parallel.py (synchronous collectives)",
        constraint=lambda v: negation(v.async_tensor_parallel),
        explain=lambda x: (
            "training.async_tensor_parallel is on, but the torch backend runs tensor parallelism without overlap"
        ),
        hint=lambda x: "set async_tensor_parallel: false, or use backend: torchtitan or megatron",
        fields=("async_tensor_parallel",),
        context=("backend",),
        engines=frozenset({Engine.TORCH}),
    )
)


FP64_DISTRIBUTION_ONLY = define(
    Rule(
        code="C008",
        name="fp64-distribution-only",
        title="training.precision fp64 is for distribution models, fitted by EM in float64.",
        docs=(
            "A distribution model is fitted by EM in float64 (as mixle fits its models), so `fp64` states the "
            "precision its parameters are held and sized in. Neural models are trained in fp32, bf16, fp16 or fp8: "
            "the torch runtime computes in fp32 or bf16 (`compute_dtype`), and none of the engines has a float64 "
            "training mode. The memory rule still prices such a spec (8-byte weights, activations and logits as "
            "in fp32), so every other finding is reported with this one."
        ),
        engine_reference="torch runtime: mixle_compile/runtime/model.py compute_dtype; mixle: every fit is float64",
        constraint=lambda v: negation(v.is_("precision", "fp64")),
        explain=lambda x: (
            f"training.precision fp64 is for distribution models; a {x.facts.family} model trains in fp32 "
            "or a lower precision"
        ),
        hint=lambda x: "use precision: fp32 (or bf16)",
        fields=("precision",),
    )
)


MTP_NEEDS_ROTARY_POSITIONS = define(
    Rule(
        code="C012",
        name="mtp-needs-rotary-positions",
        title="Megatron and the torch runtime: multi-token prediction needs rotary positions.",
        docs=(
            "Megatron-LM refuses `--mtp-num-layers` with a learned absolute position embedding: a multi-token "
            "prediction depth embeds the tokens ahead with the model's embedding and shifts their positions, "
            "which it supports for rotary positions (and none) only. The in-tree torch runtime runs the depths "
            "as Megatron-Core does, with rotary positions: the position table lives with the embedding on the "
            "first stage (its FSDP unit), and the depths run on the last."
        ),
        engine_reference=(
            'Megatron-LM core_v0.16.1 megatron/training/arguments.py `validate_args` ("Multi-Token Prediction '
            '(MTP) is not supported with {position_embedding_type} position embedding type"); torch backend: '
            "mixle_compile/runtime/instructions.py `_refuse_unsupported_mtp`"
        ),
        constraint=lambda v: implies(v.mtp_layers > 0, negation(v.learned_positions)),
        explain=lambda x: (
            f"model.mtp_num_layers is {x.mtp_layers} with learned positions: multi-token prediction runs with "
            "rotary positions only"
        ),
        hint=lambda x: "use position_embedding: rope, or set mtp_num_layers: 0",
        fields=("mtp_layers", "learned_positions"),
        families=TRANSFORMER,
        engines=frozenset({Engine.MEGATRON, Engine.TORCH}),
    )
)


MTP_TORCHTITAN = define(
    Rule(
        code="C013",
        name="mtp-torchtitan-scope",
        title="torchtitan: multi-token prediction in its DeepSeek-V3 model, without pipeline or context parallelism.",
        docs=(
            "torchtitan 0.3 builds multi-token prediction depths only in its DeepSeek-V3 model (`MTPDecoder`, "
            "which `DeepSeekV3Model` inherits; model_registry's `num_mtp_layers`), so the model must have "
            "Multi-head Latent Attention, and refuses them under pipeline and context parallelism "
            '(NotImplementedError: "MTP does not support pipeline parallelism yet", "... context '
            'parallelism yet").'
        ),
        engine_reference=(
            "torchtitan 0.3.0 torchtitan/models/deepseek_v3/mtp.py `MTPDecoder.Config.update_from_config`; "
            "torchtitan/models/deepseek_v3/__init__.py `model_registry(..., num_mtp_layers)`"
        ),
        constraint=lambda v: implies(v.mtp_layers > 0, all_of(v.latent_attention, v.pp == 1, v.cp == 1)),
        explain=lambda x: (
            f"model.mtp_num_layers is {x.mtp_layers} with "
            + (
                "a model without Multi-head Latent Attention: torchtitan builds the depths in its DeepSeek-V3 model"
                if not x.latent_attention
                else f"pp={x.pp} and cp={x.cp}: torchtitan runs multi-token prediction without pipeline or "
                "context parallelism"
            )
        ),
        hint=lambda x: (
            "give the model kv_lora_rank (torchtitan's deepseek_v3), or set mtp_num_layers: 0"
            if not x.latent_attention
            else "set pp and cp to 1 (shard with dp_shard, tp, ep instead), or set mtp_num_layers: 0"
        ),
        fields=("mtp_layers", "latent_attention", "pp", "cp"),
        families=TRANSFORMER,
        engines=frozenset({Engine.TORCHTITAN}),
    )
)


MTP_RUNTIME = define(
    Rule(
        code="C014",
        name="mtp-runtime-without-context-parallelism",
        title="torch: the in-tree runtime runs multi-token prediction without context parallelism.",
        docs=(
            "A multi-token prediction depth reads the token a position ahead of each of its own, which under "
            "context parallelism may sit on another cp rank (Megatron-Core exchanges the chunks' edges, "
            "multi_token_prediction.py `roll_tensor`); the in-tree runtime has no such exchange, so it runs "
            "the depths with cp = 1. Use `backend: megatron` to plan them with context parallelism."
        ),
        engine_reference="torch backend: mixle_compile/runtime/model.py (the depths roll the whole sequence)",
        constraint=lambda v: implies(v.mtp_layers > 0, v.cp == 1),
        explain=lambda x: (
            f"model.mtp_num_layers is {x.mtp_layers} with cp={x.cp}: the torch runtime rolls the tokens ahead "
            "within one rank's sequence"
        ),
        hint=lambda x: "set cp: 1, or plan with backend: megatron",
        fields=("mtp_layers", "cp"),
        families=TRANSFORMER,
        engines=frozenset({Engine.TORCH}),
    )
)
