"""The spec's values as the verifier sees them: frozen, plain Python, no solver.

Every value a rule reads is a :class:`Field`: a symbol name (what the rule calls it), the spec
path it comes from (what a person is pointed at), its value and how to show it. Values that the
spec leaves out take the defaults the spec defines, so the verifier reasons about the plan that
would actually run.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from mixle_compile.contracts import BackendCapabilities
from mixle_compile.engines import EngineProfile, engine_profile
from mixle_compile.layer_split import engine_rule
from mixle_compile.spec.kinds import Family
from mixle_compile.spec.models import (
    AUTO,
    DistributionModel,
    ModulesModel,
    Spec,
    TrainingSpec,
    TransformerModel,
    is_auto,
)
from mixle_compile.spec.source import Path_, dotted
from mixle_compile.verify.memory import ParameterFootprint, parameter_footprint


def _choices(name: str) -> tuple[str, ...]:
    return tuple(typing.get_args(TrainingSpec.model_fields[name].annotation))


# Enumerations become integers in the encoding: the index into these tuples.
PRECISIONS = _choices("precision")
OPTIMIZERS = _choices("optimizer")
SCHEDULES = _choices("pipeline_schedule")
CHECKPOINTING = _choices("activation_checkpointing")
ENUMS: dict[str, tuple[str, ...]] = {
    "precision": PRECISIONS,
    "optimizer": OPTIMIZERS,
    "pipeline_schedule": SCHEDULES,
    "activation_checkpointing": CHECKPOINTING,
}

# Parameter roles whose tensor-parallel split dimension the layouts divide by tp
# (torch convention [out, in]: column and vocabulary-parallel split dim 0, row splits dim 1).
TP_SPLIT_DIM = {"column": 0, "embedding": 0, "head": 0, "row": 1}


@dataclass(frozen=True)
class Field:
    """One value a rule can read.

    ``kind`` is ``int``, ``bool`` or the name of an enumeration in :data:`ENUMS`.
    """

    symbol: str
    path: Path_
    value: int | bool
    kind: str = "int"
    shown: str = ""  # how a person reads the value when it is not the plain number

    @property
    def dotted(self) -> str:
        return dotted(self.path)

    def display(self) -> str:
        if self.shown:
            return self.shown
        if self.kind == "bool":
            return "true" if self.value else "false"
        if self.kind in ENUMS:
            return ENUMS[self.kind][int(self.value)]
        return str(self.value)


@dataclass(frozen=True)
class ElasticRange:
    min_world_size: int
    max_world_size: int
    multiple_of: int

    def world_sizes(self) -> range:
        first = -(-self.min_world_size // self.multiple_of) * self.multiple_of
        return range(first, self.max_world_size + 1, self.multiple_of)


@dataclass(frozen=True)
class SplitDimension:
    """A dimension of a listed (``modules``) parameter that the layout divides by tp."""

    symbol: str
    path: Path_  # the parameter's shape
    parameter: str
    role: str
    dim: int
    size: int


@dataclass(frozen=True)
class PlanFacts:
    """Everything the rules need to know about one spec."""

    family: str
    backend: str  # normalised backend name
    capabilities: BackendCapabilities
    engine: EngineProfile
    fields: tuple[Field, ...]
    dp_shard_auto: bool
    elastic: ElasticRange | None
    footprint: ParameterFootprint | None  # neural families only
    split_dimensions: tuple[SplitDimension, ...] = ()  # modules only
    layer_split: str = "balanced"  # how layers split over stages: even, balanced, torchtitan or listed
    pipeline_layers: tuple[int, ...] | None = None  # the listed split, per virtual stage
    # what selective checkpointing runs again (EngineProfile.selective_modules: Megatron's recompute_modules)
    selective_modules: frozenset[str] = frozenset({"core_attn"})

    def field(self, symbol: str) -> Field:
        return self._by_symbol[symbol]

    def has(self, symbol: str) -> bool:
        return symbol in self._by_symbol

    def value(self, symbol: str) -> Any:
        return self._by_symbol[symbol].value

    @cached_property
    def _by_symbol(self) -> dict[str, Field]:
        return {f.symbol: f for f in self.fields}


def plan_facts(spec: Spec) -> PlanFacts:
    """Read a validated spec (one whose own consistency checks passed)."""
    from mixle_compile.contracts import BUILTIN_CAPABILITIES, get_training_backend

    mesh, training, resources = spec.mesh, spec.training, spec.resources
    fields: list[Field] = []

    def add(symbol: str, path: Path_, value: Any, kind: str = "int", shown: str = "") -> None:
        fields.append(Field(symbol, path, value, kind, shown))

    auto = is_auto(mesh.dp_shard)
    for name in ("dp_replicate", "tp", "pp", "cp", "ep", "etp", "microbatches", "gradient_accumulation_steps"):
        add(name, ("mesh", name), getattr(mesh, name))
    if not auto:
        add("dp_shard", ("mesh", "dp_shard"), mesh.dp_shard)
    add("dp_shard_auto", ("mesh", "dp_shard"), auto, "bool", AUTO if auto else str(mesh.dp_shard))

    add("devices", ("resources", "devices"), resources.device_count)
    if isinstance(resources.devices, int):
        add("device_memory", ("resources", "memory"), int(resources.memory), shown=format_bytes(int(resources.memory)))
    else:
        smallest = min(range(len(resources.devices)), key=lambda i: resources.devices[i].memory)
        memory = int(resources.devices[smallest].memory)
        add("device_memory", ("resources", "devices", smallest, "memory"), memory, shown=format_bytes(memory))

    for name in ("global_batch_size", "micro_batch_size", "virtual_pipeline_stages"):
        add(name, ("training", name), getattr(training, name))
    if training.seq_len is not None:
        add("seq_len", ("training", "seq_len"), training.seq_len)
    group = training.microbatch_group_size  # Megatron's interleaved group; 0: its default, pp
    add("microbatch_group", ("training", "microbatch_group_size"), group or 0, shown="pp" if group is None else "")
    for name in ("sequence_parallel", "distributed_optimizer"):
        add(name, ("training", name), getattr(training, name), "bool")
    for name, choices in ENUMS.items():
        add(name, ("training", name), choices.index(getattr(training, name)), name)
    engine = engine_profile(spec.backend)
    listed = isinstance(training.pipeline_layers, list)
    # A modules model's layers are placed by the balanced split (the lowering has no engine rule for it).
    default_rule = engine_rule(engine.name) if isinstance(spec.model, TransformerModel) else "balanced"
    split_rule = "listed" if listed else training.pipeline_layers or default_rule
    add("listed_split", ("training", "pipeline_layers"), listed, "bool", "a list" if listed else split_rule)
    add("even_split", ("training", "pipeline_layers"), split_rule == "even", "bool", split_rule)
    if listed:
        counts = training.pipeline_layers
        add("pipeline_layers_stages", ("training", "pipeline_layers"), len(counts), shown=f"{len(counts)} stages")
        add("pipeline_layers_total", ("training", "pipeline_layers"), sum(counts), shown=f"{sum(counts)} layers")
    attention = training.attention or engine.default_attention
    add(
        "eager_attention",
        ("training", "attention"),
        attention == "eager",
        "bool",
        attention if training.attention else f"{attention} (the engine's default)",
    )

    compiled = training.compiled
    shown = ", ".join(compiled) or "off"
    add("compiles", ("training", "compile"), bool(compiled), "bool", shown)
    add("compiled_loss", ("training", "compile"), "loss" in compiled, "bool", shown)
    add("compiled_model", ("training", "compile"), "model" in compiled, "bool", shown)
    add("async_tensor_parallel", ("training", "async_tensor_parallel"), training.async_tensor_parallel, "bool")

    elastic = None
    add("elastic", ("elastic",), spec.elastic is not None, "bool", "set" if spec.elastic is not None else "absent")
    if spec.elastic is not None:
        e = spec.elastic
        elastic = ElasticRange(e.min_world_size, e.max_world_size, e.multiple_of)
        for name in ("min_world_size", "max_world_size", "multiple_of"):
            add(f"elastic_{name}", ("elastic", name), getattr(e, name))

    model = spec.model
    split: tuple[SplitDimension, ...] = ()
    footprint = None
    if isinstance(model, TransformerModel):
        family = Family.TRANSFORMER
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "ffn_hidden_size",
            "num_experts",
            "moe_layer_frequency",
        ):
            add(name, ("model", name), getattr(model, name))
        if model.num_kv_heads is not None:
            add("num_kv_heads", ("model", "num_kv_heads"), model.num_kv_heads)
        if model.moe_ffn_hidden_size is not None:
            add("moe_ffn_hidden_size", ("model", "moe_ffn_hidden_size"), model.moe_ffn_hidden_size)
        if model.moe_first_layer:
            add("moe_first_layer", ("model", "moe_first_layer"), model.moe_first_layer)
        if model.moe_shared_expert_hidden_size is not None:
            add(
                "moe_shared_expert_hidden_size",
                ("model", "moe_shared_expert_hidden_size"),
                model.moe_shared_expert_hidden_size,
            )
        add("tie_embeddings", ("model", "tie_embeddings"), model.tie_embeddings, "bool")
        add("mtp_layers", ("model", "mtp_num_layers"), model.mtp_num_layers)
        latent = model.latent_attention
        add("latent_attention", ("model", "kv_lora_rank"), latent, "bool", "MLA" if latent else "not set")
        learned = model.position_embedding == "learned"
        add("learned_positions", ("model", "position_embedding"), learned, "bool", model.position_embedding)
        if model.max_position_embeddings is not None:
            add("max_position_embeddings", ("model", "max_position_embeddings"), model.max_position_embeddings)
        capacity = model.expert_capacity_factor
        add(
            "expert_capacity",
            ("model", "expert_capacity_factor"),
            capacity is not None,
            "bool",
            "dropless" if capacity is None else f"{capacity:g}",
        )
        dispatcher = spec.training.expert_dispatcher
        add("flex_dispatch", ("training", "expert_dispatcher"), dispatcher == "flex", "bool", dispatcher)
        overlap = spec.training.overlap_pipeline_transfers
        add(
            "overlap_pipeline",
            ("training", "overlap_pipeline_transfers"),
            overlap is not None,
            "bool",
            "the engine's default" if overlap is None else str(overlap).lower(),
        )
        footprint = parameter_footprint(spec)
    elif isinstance(model, ModulesModel):
        family = Family.MODULES
        dims = []
        for i, p in enumerate(model.parameters):
            dim = TP_SPLIT_DIM.get(p.role)
            if dim is not None and dim < len(p.shape):
                symbol = f"model.parameters[{i}].shape[{dim}]"
                dims.append(
                    SplitDimension(symbol, ("model", "parameters", i, "shape"), p.name, p.role, dim, p.shape[dim])
                )
                add(symbol, ("model", "parameters", i, "shape"), p.shape[dim], shown=str(list(p.shape)))
        split = tuple(dims)
        experts = [(i, p) for i, p in enumerate(model.parameters) if p.role == "expert"]
        if experts:
            i, p = experts[0]
            add("num_experts", ("model", "parameters", i, "shape"), p.shape[0], shown=str(list(p.shape)))
        # As the lowering counts them: layer indices run 0..max; parameters without one form a
        # single block (so a model that names no layers is one layer, never zero).
        indices = [p.layer for p in model.parameters if p.layer is not None]
        layers = max(indices) + 1 if indices else 1
        add("layers", ("model", "parameters"), layers, shown=f"{layers} layer{'s' * (layers != 1)}")
        footprint = parameter_footprint(spec)
    else:
        assert isinstance(model, DistributionModel)
        family = Family.DISTRIBUTION

    backend = engine.name
    capabilities = BUILTIN_CAPABILITIES.get(backend) or get_training_backend(backend).capabilities
    return PlanFacts(
        family=family,
        backend=backend,
        capabilities=capabilities,
        engine=engine,
        fields=tuple(fields),
        dp_shard_auto=auto,
        elastic=elastic,
        footprint=footprint,
        split_dimensions=split,
        layer_split=split_rule,
        pipeline_layers=tuple(training.pipeline_layers) if listed else None,
        selective_modules=engine.selective_modules(training.recompute_modules),
    )


def format_bytes(n: int | float) -> str:
    """A byte count in binary units, as a person writes it: 80GiB, 1.5GiB, 512MiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{int(n)}B"
