"""A spec as a torchtitan 0.3 config-registry function: a Python module whose function returns
``Trainer.Config``, written as torchtitan 0.3.0's own ``torchtitan/models/*/config_registry.py`` are.

Classes and fields are torchtitan 0.3.0's: ``Trainer.Config`` (torchtitan/trainer.py: ``model_spec``,
``optimizer``, ``training``, ``parallelism``, ``activation_checkpoint``, ``compile``, ``debug``),
``TrainingConfig``, ``ParallelismConfig``, ``CompileConfig`` and ``DebugConfig``
(torchtitan/config/configs.py), ``default_adamw(lr=...)`` (torchtitan/components/optimizer/optimizer.py),
``SelectiveAC.Config`` / ``FullAC.Config`` or ``None`` for no checkpointing
(torchtitan/distributed/activation_checkpoint.py, ``ActivationCheckpointingConfig``), and a model
from its family's ``model_registry(flavor)`` (torchtitan/models/llama3/__init__.py, .../qwen3/__init__.py).
``check --torchtitan module:function`` reads the function back
(:mod:`mixle_compile.importers.torchtitan_registry`). The device count and memory go in the preset
comment the importer reads, inside the function (the importer reads the function's source).
"""

from __future__ import annotations

import re

from mixle_compile.export import Exported, ExportRefused, memory_text
from mixle_compile.export.torchtitan import PRECISION, SCHEDULES, _flavor_of, layers_per_stage, mtp_refusals
from mixle_compile.spec.models import Spec

# The model families with a model_registry in torchtitan 0.3.0 that the flavor table sizes, and the
# flavors each registers (llama3_configs in torchtitan/models/llama3/__init__.py, qwen3_configs in
# torchtitan/models/qwen3/__init__.py). Llama 4 has no 0.3 registry.
REGISTRIES = {
    "llama3": ("torchtitan.models.llama3", ("debugmodel", "1B", "3B", "8B", "70B", "405B")),
    "qwen3": (
        "torchtitan.models.qwen3",
        ("debugmodel", "debugmodel_moe", "0.6B", "1.7B", "4B", "8B", "14B", "32B", "30B-A3B", "235B-A22B"),
    ),
}


def function_name(stem: str) -> str:
    name = re.sub(r"\W", "_", stem) or "config"
    return name if name[0].isalpha() or name[0] == "_" else f"config_{name}"


def torchtitan_python_files(spec: Spec, stem: str) -> Exported:
    t, m = spec.training, spec.mesh
    reasons: list[tuple[str, str]] = []
    reasons += mtp_refusals(spec, "the 0.3 config function written here")
    flavor = _flavor_of(spec, without_mtp=True)
    if flavor is None or flavor[0] not in REGISTRIES or flavor[1] not in REGISTRIES[flavor[0]][1]:
        shown = (
            "not a published flavor" if flavor is None else f"{flavor[0]}/{flavor[1]}, which has no 0.3 registry entry"
        )
        reasons.append(
            (
                "model",
                "torchtitan 0.3's config functions take the model from a family's model_registry(flavor); "
                "this model is "
                f"{shown} "
                "(export to the 0.2 TOML, which carries an HF config.json)",
            )
        )
    if m.pp == 1 and m.microbatches > 1:
        reasons.append(
            (
                "mesh.microbatches",
                "torchtitan splits a batch into micro-batches only under a pipeline; use gradient_accumulation_steps",
            )
        )
    if m.etp != 1:
        reasons.append(("mesh.etp", "torchtitan 0.3's ParallelismConfig has no expert tensor-parallel degree"))
    if t.expert_dispatcher == "flex":
        reasons.append(
            (
                "training.expert_dispatcher",
                "torchtitan 0.3 picks DeepEP or HybridEP in the model's registry entry (its moe_comm_backend), "
                "which the exported config function takes as published (export to the 0.2 TOML, which says it)",
            )
        )
    if t.sequence_parallel and m.tp == 1:
        reasons.append(("training.sequence_parallel", "sequence parallelism needs tp > 1"))
    if t.distributed_optimizer:
        reasons.append(
            ("training.distributed_optimizer", "torchtitan has no separate distributed optimizer (FSDP shards it)")
        )
    if t.precision not in ("bf16", "fp32"):
        reasons.append(
            (
                "training.precision",
                f"{t.precision}: written are bfloat16 and float32 (TrainingConfig.mixed_precision_param)",
            )
        )
    if t.optimizer != "adamw":
        reasons.append(("training.optimizer", f"{t.optimizer}: written is default_adamw"))
    if t.pipeline_layers is not None or t.attention is not None:
        reasons.append(
            (
                "training.pipeline_layers" if t.pipeline_layers is not None else "training.attention",
                "not a field of torchtitan's Trainer.Config; remove it to export",
            )
        )
    per_stage = layers_per_stage(spec, reasons)
    if reasons:
        raise ExportRefused("torchtitan", reasons)
    module = REGISTRIES[flavor[0]][0]
    res = spec.resources
    kind = f"{res.kind.upper()} " if res.kind else ""
    training = [
        f"local_batch_size={t.micro_batch_size * m.microbatches}",
        f"global_batch_size={t.global_batch_size}",
        f"seq_len={t.seq_len}",
        f"steps={t.steps}",
        f"mixed_precision_param={PRECISION[t.precision]!r}",
    ]
    parallelism = [
        f"data_parallel_replicate_degree={m.dp_replicate}",
        f"data_parallel_shard_degree={-1 if m.dp_shard == 'auto' else m.dp_shard}",
        f"tensor_parallel_degree={m.tp}",
        f"pipeline_parallel_degree={m.pp}",
        f"context_parallel_degree={m.cp}",
        f"expert_parallel_degree={m.ep}",
    ]
    if m.tp > 1 and not t.sequence_parallel:
        parallelism.append("enable_sequence_parallel=False")
    if m.pp > 1:
        parallelism += [
            f"pipeline_parallel_schedule={SCHEDULES[t.pipeline_schedule]!r}",
            f"pipeline_parallel_microbatch_size={t.micro_batch_size}",
        ]
        if per_stage is not None:
            parallelism.append(f"pipeline_parallel_layers_per_stage={per_stage}")
    ac = {"selective": "SelectiveAC.Config()", "full": "FullAC.Config()", "none": "None"}[t.activation_checkpointing]
    compiled = list(t.compiled)
    compile_args = ["enable=True", f"components={compiled!r}"] if compiled else ["enable=False"]
    if t.async_tensor_parallel:  # 0.3 holds the flag in CompileConfig (torchtitan/config/configs.py)
        compile_args.append("enable_async_tensor_parallel=True")
    compile_ = f"CompileConfig({', '.join(compile_args)})"

    def call(cls: str, args: list[str]) -> str:
        inner = "".join(f"            {a},\n" for a in args)
        return f"{cls}(\n{inner}        )"

    name = function_name(stem)
    ac_import = (
        sorted({"SelectiveAC" if t.activation_checkpointing == "selective" else "FullAC"}) if ac != "None" else []
    )
    lines = [
        f'"""A torchtitan 0.3 config function ({name}), written by mixle-compile export --to torchtitan '
        "--torchtitan-version 0.3.",
        "",
        f"Check it with: mixle-compile check --torchtitan MODULE:{name}",
        '"""',
        "",
        "from torchtitan.components.optimizer import default_adamw",
        "from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig",
        *([f"from torchtitan.distributed.activation_checkpoint import {', '.join(ac_import)}"] if ac_import else []),
        f"from {module} import model_registry",
        "from torchtitan.trainer import Trainer",
        "",
        "",
        f"def {name}() -> Trainer.Config:",
        f"    # NOTE: this config is a preset for {res.devices} {kind}GPUs (with {memory_text(res.memory)} memory).",
        "    return Trainer.Config(",
        f"        model_spec=model_registry({flavor[1]!r}),",
        f"        optimizer=default_adamw(lr={t.learning_rate!r}),",
        f"        training={call('TrainingConfig', training)},",
        f"        parallelism={call('ParallelismConfig', parallelism)},",
        f"        activation_checkpoint={ac},",
        f"        compile={compile_},",
        f"        debug=DebugConfig(seed={t.seed}),",
        "    )",
        "",
    ]
    main = f"{stem}.py"
    return Exported("torchtitan", {main: "\n".join(lines)}, main)
