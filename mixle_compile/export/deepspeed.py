"""A spec as a DeepSpeed JSON config, with the model as an HF ``config.json`` beside it.

The keys are those :mod:`mixle_compile.importers.deepspeed` reads back: the three batch sizes
(DeepSpeed's identity ``train_batch_size = micro * accumulation * dp``), the ZeRO stage (3 for
``dp_shard``, 1 for a distributed optimizer over replicated parameters, 0 otherwise), bf16/fp16 and
the optimizer. The number of steps and the seed are the training script's (not written). A DeepSpeed
JSON names no tensor, pipeline, context or expert degree (those are set in
the model's code), so a spec with any of them is refused.
"""

from __future__ import annotations

import json

from mixle_compile.export import Exported, ExportRefused
from mixle_compile.export.hf import hf_config, hf_config_text
from mixle_compile.spec.models import Spec, parallel_plan


def deepspeed_files(spec: Spec, stem: str) -> Exported:
    t, mesh = spec.training, spec.mesh
    plan = parallel_plan(spec)
    reasons = [
        (f"mesh.{axis}", f"{axis}={getattr(mesh, axis)}: a DeepSpeed JSON config has no {axis} degree")
        for axis in ("tp", "pp", "cp", "ep", "etp")
        if getattr(mesh, axis) != 1
    ]
    if mesh.microbatches != 1:
        reasons.append(
            ("mesh.microbatches", "without a pipeline DeepSpeed accumulates: use gradient_accumulation_steps")
        )
    if plan.dp_replicate > 1 and plan.dp_shard > 1:
        reasons.append(
            ("mesh.dp_replicate", "DeepSpeed's ZeRO partitions over all data ranks (no replicate x shard mesh)")
        )
    if plan.dp_shard > 1 and t.distributed_optimizer:
        reasons.append(("training.distributed_optimizer", "ZeRO-3 (dp_shard) partitions the optimizer state already"))
    if t.activation_checkpointing != "none":
        reasons.append(
            (
                "training.activation_checkpointing",
                "DeepSpeed's JSON configures checkpointing, but the model's "
                "code turns it on: the config cannot say it is on",
            )
        )
    if t.precision == "fp8":
        reasons.append(("training.precision", "fp8 is not a DeepSpeed JSON precision"))
    if t.async_tensor_parallel:
        reasons.append(("training.async_tensor_parallel", "a DeepSpeed JSON config has no tensor-parallel overlap"))
    if t.pipeline_layers is not None or t.attention is not None:
        reasons.append(
            (
                "training.attention" if t.attention is not None else "training.pipeline_layers",
                "not a DeepSpeed config key; remove it to export",
            )
        )
    if t.mtp_loss_scaling_factor is not None:
        # the model's MTP layers are the HF config's num_nextn_predict_layers (DeepSeek-V3); the weight of their
        # loss is the training script's
        reasons.append(
            (
                "training.mtp_loss_scaling_factor",
                "neither a DeepSpeed JSON nor an HF config.json has a multi-token prediction loss weight (the "
                "training script sets it); remove it, or export to megatron (--mtp-loss-scaling-factor)",
            )
        )
    config, why = hf_config(spec.model, spec.training.seq_len)
    if config is None:
        reasons.append(("model", why))
    if reasons:
        raise ExportRefused("deepspeed", reasons)
    stage = 3 if plan.dp_shard > 1 else (1 if t.distributed_optimizer else 0)
    data = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": mesh.gradient_accumulation_steps,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16"},
        "optimizer": {
            "type": {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}[t.optimizer],
            "params": {"lr": t.learning_rate},
        },
    }
    main = f"{stem}.json"
    return Exported(
        "deepspeed", {main: json.dumps(data, indent=2) + "\n", f"{stem}.model.json": hf_config_text(config)}, main
    )
