"""A spec as a torchtitan job TOML (torchtitan's JobConfig before its config registry: the 0.2 era).

Every key written is one :mod:`mixle_compile.importers.torchtitan` reads back with the meaning it
has in torchtitan (see that module for the engine sources). The device count and memory go in the
preset comment torchtitan's own configs carry (``# NOTE: this toml config is a preset for 64 A100
GPUs.``), which the importer reads.
"""

from __future__ import annotations

from mixle_compile.export import Exported, ExportRefused, memory_text
from mixle_compile.export.hf import hf_config, hf_config_text
from mixle_compile.importers import flavors
from mixle_compile.spec.models import Spec, TransformerModel

SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved_1f1b": "Interleaved1F1B"}
PRECISION = {"bf16": "bfloat16", "fp32": "float32"}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\\\", "\\\\\\\\").replace('"', '\\\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def _flavor_of(spec: Spec, *, without_mtp: bool = False) -> tuple[str, str] | None:
    """The published flavor the spec's model is (``without_mtp``: leaving its multi-token prediction layers
    aside, for an exporter that refuses them by their own field)."""
    model = spec.model.model_dump(exclude_none=True)
    if without_mtp:
        model.pop("mtp_num_layers", None)
    for name, table in flavors.FLAVORS.items():
        for flavor_name, entry in table.items():
            ref = dict(entry.model)
            if _same_model(ref, model):
                return name, flavor_name
    return None


def _same_model(a: dict, b: dict) -> bool:
    return TransformerModel.model_validate(a) == TransformerModel.model_validate(b)


def layers_per_stage(spec: Spec, reasons: list) -> int | None:
    """torchtitan's ``pipeline_parallel_layers_per_stage`` for the spec's virtual stages (None where
    its default of one stage per rank, or two for multi-stage schedules, gives them), adding to
    ``reasons`` what torchtitan cannot set. Its split counts the embedding and the output as one
    layer each (layer_split.py)."""
    m, t = spec.mesh, spec.training
    if m.pp == 1:
        return None
    single = t.pipeline_schedule in ("1f1b", "gpipe")
    if single and t.virtual_pipeline_stages != 1:
        reasons.append(("training.virtual_pipeline_stages", f"{t.pipeline_schedule} runs one stage per rank"))
    if single or t.virtual_pipeline_stages == 2:
        return None
    total, stages = spec.model.num_layers + 2, m.pp * t.virtual_pipeline_stages
    if total % stages:
        reasons.append(
            (
                "training.virtual_pipeline_stages",
                f"torchtitan sets {stages} stages only through pipeline_parallel_layers_per_stage, and "
                f"{spec.model.num_layers} layers + embedding + output do not divide into {stages}",
            )
        )
        return None
    return total // stages


def fqns_per_stage(spec: Spec) -> list[list[str]]:
    """The spec's split (a list, or ``even``) as torchtitan's ``module_fqns_per_model_part``: each
    virtual stage's ``layers.N`` in model order, the embedding on the first and the final norm and
    output on the last (distributed/pipeline_parallel.py, pipeline_module_split)."""
    from mixle_compile.layer_split import split_layers

    m, t = spec.mesh, spec.training
    split = split_layers(spec.model.num_layers, m.pp, t.virtual_pipeline_stages, t.pipeline_layers, "torchtitan")
    starts = split.starts()
    out = [[f"layers.{k}" for k in range(starts[i], starts[i + 1])] for i in range(len(split.counts))]
    out[0].insert(0, "tok_embeddings")
    out[-1] += ["norm", "output"]
    return out


def mtp_refusals(spec: Spec, written: str) -> list[tuple[str, str]]:
    """Multi-token prediction, which neither torchtitan export can write. The 0.2-era job TOML (JobConfig at
    238fa99) has no such setting and no model of that torchtitan builds MTP layers. torchtitan 0.3.0 builds
    them only in its deepseek_v3 model, ``model_registry(flavor, num_mtp_layers=N)`` trained with
    ``MTPLoss.Config(mtp_scale=...)`` (torchtitan/models/deepseek_v3/__init__.py, mtp.py), and the 0.3
    export writes the llama3 and qwen3 registries only (export/torchtitan_python.py, REGISTRIES)."""
    model, factor = spec.model, spec.training.mtp_loss_scaling_factor
    layers = model.mtp_num_layers if isinstance(model, TransformerModel) else 0
    how = "export to megatron (--mtp-num-layers, --mtp-loss-scaling-factor)"
    reasons = []
    if layers:
        reasons.append(
            (
                "model.mtp_num_layers",
                f"{written} cannot say the model's multi-token prediction layers ({layers}): torchtitan 0.3.0 "
                "builds them only in its deepseek_v3 model_registry(flavor, num_mtp_layers=N), which this export "
                f"does not write; {how}, or set model.mtp_num_layers: 0",
            )
        )
    if factor is not None:
        reasons.append(
            (
                "training.mtp_loss_scaling_factor",
                f"{written} has no multi-token prediction loss weight (torchtitan 0.3.0's MTPLoss.Config.mtp_scale); "
                + (how if layers else "the model has no MTP layers for it to weigh: remove it"),
            )
        )
    return reasons


def torchtitan_files(spec: Spec, stem: str) -> Exported:
    t, m = spec.training, spec.mesh
    reasons: list[tuple[str, str]] = []
    if m.pp == 1 and m.microbatches > 1:
        reasons.append(
            (
                "mesh.microbatches",
                "torchtitan splits a batch into micro-batches only under a pipeline; use gradient_accumulation_steps",
            )
        )
    if t.sequence_parallel != (m.tp > 1):
        reasons.append(("training.sequence_parallel", "torchtitan 0.2 runs sequence parallelism exactly when tp > 1"))
    if t.distributed_optimizer:
        reasons.append(
            ("training.distributed_optimizer", "torchtitan has no separate distributed optimizer (FSDP shards it)")
        )
    if t.precision not in ("bf16", "fp32", "fp8"):
        reasons.append(
            ("training.precision", f"{t.precision}: torchtitan trains in bfloat16, float32 or with float8 linears")
        )
    if t.optimizer == "sgd":
        reasons.append(("training.optimizer", "sgd: torchtitan's job config builds Adam or AdamW"))
    if t.attention is not None:
        reasons.append(("training.attention", "not a key of torchtitan's job TOML; remove it to export"))
    reasons += mtp_refusals(spec, "torchtitan's job TOML (0.2)")
    # A split the spec states is written as the modules of each stage (module_fqns_per_model_part, which
    # the importer reads back); otherwise torchtitan's own split, sized by its layers per stage.
    listed = fqns_per_stage(spec) if t.pipeline_layers is not None and m.pp > 1 else None
    if listed is not None and t.pipeline_schedule in ("1f1b", "gpipe") and t.virtual_pipeline_stages != 1:
        reasons.append(("training.virtual_pipeline_stages", f"{t.pipeline_schedule} runs one stage per rank"))
    stages_key = layers_per_stage(spec, reasons) if listed is None else None
    if reasons:
        raise ExportRefused("torchtitan", reasons)
    files: dict[str, str] = {}
    flavor = _flavor_of(spec)
    if flavor is None and isinstance(spec.model, TransformerModel) and spec.model.latent_attention:
        # a model outside the flavor tables is written as llama3 with an HF config beside it, and
        # torchtitan's llama3 has no Multi-head Latent Attention
        raise ExportRefused(
            "torchtitan",
            [
                (
                    "model.kv_lora_rank",
                    "Multi-head Latent Attention is torchtitan's deepseek_v3 model, built from its published "
                    "flavors only, and this model is none of them; export it to hf or megatron",
                )
            ],
        )
    if flavor is None:
        config, why = hf_config(spec.model, spec.training.seq_len)
        if config is None:
            raise ExportRefused("torchtitan", [("model", f"not a published torchtitan flavor, and {why}")])
        files[f"{stem}.hf/config.json"] = hf_config_text(config)
        flavor = ("llama3", "custom")
    res = spec.resources
    kind = f"{res.kind.upper()} " if res.kind else ""
    lines = [
        f"# NOTE: this toml config is a preset for {res.devices} {kind}GPUs (with {memory_text(res.memory)} memory).",
        "# Written by mixle-compile export --to torchtitan.",
        "",
        "[model]",
        f"name = {_toml_value(flavor[0])}",
        f"flavor = {_toml_value(flavor[1])}",
    ]
    if f"{stem}.hf/config.json" in files:
        lines.append(f"hf_assets_path = {_toml_value(f'./{stem}.hf')}")
    if t.precision == "fp8":
        lines.append('converters = ["float8"]')
    lines += [
        "",
        "[optimizer]",
        f"name = {_toml_value('AdamW' if t.optimizer == 'adamw' else 'Adam')}",
        f"lr = {t.learning_rate!r}",
        "",
        "[training]",
    ]
    local = t.micro_batch_size * m.microbatches
    lines += [
        f"local_batch_size = {local}",
        f"global_batch_size = {t.global_batch_size}",
        f"seq_len = {t.seq_len}",
        f"steps = {t.steps}",
    ]
    if t.precision != "fp8":
        lines.append(f"mixed_precision_param = {_toml_value(PRECISION[t.precision])}")
    lines += [
        "",
        "[parallelism]",
        f"data_parallel_replicate_degree = {m.dp_replicate}",
        f"data_parallel_shard_degree = {-1 if m.dp_shard == 'auto' else m.dp_shard}",
        f"tensor_parallel_degree = {m.tp}",
        f"pipeline_parallel_degree = {m.pp}",
        f"context_parallel_degree = {m.cp}",
        f"expert_parallel_degree = {m.ep}",
        f"expert_tensor_parallel_degree = {m.etp}",
    ]
    if t.async_tensor_parallel:
        lines.append("enable_async_tensor_parallel = true")
    if t.expert_dispatcher == "flex":
        lines.append('expert_parallel_comm_backend = "deepep"')
    if m.pp > 1:
        lines += [
            f"pipeline_parallel_schedule = {_toml_value(SCHEDULES[t.pipeline_schedule])}",
            f"pipeline_parallel_microbatch_size = {t.micro_batch_size}",
        ]
        if stages_key is not None:
            lines.append(f"pipeline_parallel_layers_per_stage = {stages_key}")
        if listed is not None:
            lines.append(f"module_fqns_per_model_part = {_toml_value(listed)}")
    lines += ["", "[activation_checkpoint]", f"mode = {_toml_value(t.activation_checkpointing)}"]
    if t.compiled:
        lines += ["", "[compile]", "enable = true", f"components = {_toml_value(list(t.compiled))}"]
    lines += ["", "[debug]", f"seed = {t.seed}", ""]
    main = f"{stem}.toml"
    return Exported("torchtitan", {main: "\n".join(lines), **files}, main)
