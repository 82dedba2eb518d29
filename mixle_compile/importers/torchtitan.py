"""A torchtitan job config (TOML, the format before torchtitan's config registry) as a spec for
``backend: {name: torchtitan, version: "0.2"}``.

Field names and defaults are torchtitan's ``JobConfig`` (torchtitan/config/job_config.py at
238fa9953e4aec2a62582121564273d7cbb1e9f1); the derived numbers are the trainer's:

* ``data_parallel_shard_degree = -1`` takes the devices the other degrees leave
  (``ParallelDims._validate``, torchtitan/distributed/parallel_dims.py);
* ``training.global_batch_size`` (-1 by default) is ``local_batch_size * dp_replicate * dp_shard``,
  and gradient accumulation is ``global / (local * dp)`` (torchtitan/train.py);
* under a pipeline, ``local_batch_size`` is cut into micro-batches of
  ``pipeline_parallel_microbatch_size`` (default 1), and a multi-stage schedule runs 2 stages per rank
  unless ``pipeline_parallel_layers_per_stage`` sets ``ceil((layers + first_stage_less_layers +
  last_stage_less_layers) / layers_per_stage)`` stages (torchtitan/distributed/pipeline_parallel.py).

A flavor's sizes come from :mod:`.flavors` (torchtitan's published flavors) or from an HF
config.json: ``--model config.json``, or ``hf_assets_path`` naming a directory that holds one.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from mixle_compile.importers import codes, flavors
from mixle_compile.importers.builder import TOP, ImportOptions, SpecBuilder, resources
from mixle_compile.importers.toml_source import read_toml
from mixle_compile.spec.source import Position, SourceDocument

#: The [parallelism] keys the importer reads, in the order a config states them.
PARALLELISM_KEYS = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
    "expert_tensor_parallel_degree",
    "pipeline_parallel_schedule",
    "pipeline_parallel_microbatch_size",
    "pipeline_parallel_layers_per_stage",
    "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers",
    "enable_async_tensor_parallel",
    "enable_sequence_parallel",
    "module_fqns_per_model_part",
    "pipeline_parallel_split_points",
)
READ = {
    "model": {"name", "flavor", "hf_assets_path", "converters", "tokenizer_path"},
    "training": {
        "local_batch_size",
        "batch_size",
        "global_batch_size",
        "seq_len",
        "steps",
        "mixed_precision_param",
        "seed",
        "compile",
    },
    "parallelism": {*PARALLELISM_KEYS, "expert_parallel_comm_backend"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "optimizer": {"name", "lr"},
    "float8": {"enable_float8_linear"},
    "compile": {"enable", "components", "enable_async_tensor_parallel"},
}
# Before torchtitan moved them to [parallelism] (early 2025), the degrees sat in [training] and the
# pipeline and context degrees in [experimental], with the number of micro-batches
# (`pipeline_parallel_microbatches`, default: one per stage) instead of their size.
PARALLEL_KEYS = READ["parallelism"] | {"pipeline_parallel_microbatches"}
# The first configs (March 2024) named the tensor-parallel degree `sequence_parallel_degree`.
READ["training"] = READ["training"] | PARALLEL_KEYS | {"sequence_parallel_degree"}
READ["experimental"] = PARALLEL_KEYS
# Tables and keys with no bearing on the plan's sizes, memory or communication: read quietly.
QUIET_TABLES = {
    "job",
    "profiling",
    "metrics",
    "checkpoint",
    "lr_scheduler",
    "validation",
    "comm",
    "mx",
    "quantize",
    "fault_tolerance",
    "memory_estimation",
    "debug",
}
QUIET_KEYS = {
    "training": {
        "max_norm",
        "dataset",
        "dataset_path",
        "warmup_steps",
        "gc_freq",
        "deterministic",
        "mixed_precision_reduce",
        "enable_cpu_offload",
        "gc_debug",
        "debug_moe_force_load_balance",
        "tensorboard",
        "dataloader",
    },
    "parallelism": {
        "fsdp_reshard_after_forward",
        "disable_loss_parallel",
        "enable_compiled_autograd",
        "context_parallel_rotate_method",
        "pipeline_parallel_schedule_csv",
        "expert_parallel_comm_backend",
    },
    "model": {"print_after_conversion", "print_model", "hf_assets_path", "norm_type"},
    "float8": {
        "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp",
        "force_recompute_fp8_weight_in_bwd",
        "scaling_type_input",
        "scaling_type_weight",
        "scaling_type_grad_output",
        "recipe_name",
        "filter_fqns",
        "emulate",
    },
    "experimental": {"enable_compiled_autograd", "custom_args_module", "custom_import", "custom_model_path"},
    "compile": {"backend"},
    "optimizer": {"eps", "weight_decay", "beta1", "beta2", "implementation", "early_step_in_backward"},
    "activation_checkpoint": {
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "preserve_rng_state",
        "determinism_check",
        "early_stop",
        "debug",
    },
}
#: Keys only a torchtitan 0.3 Trainer.Config gives (torchtitan_registry.trainer_config_tables fills them):
#: the model's multi-token prediction layers and MTPLoss's weight. A job TOML has neither.
PYTHON_READ = {"model": {"num_mtp_layers"}, "loss": {"mtp_scale"}}
SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved_1f1b"}
SINGLE_STAGE = {"1F1B", "GPipe"}
PRECISIONS = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
_PRESET = re.compile(
    r"preset for (\d+) (?:([A-Za-z0-9][A-Za-z0-9-]*) )?GPUs(?: \(with ([0-9.]+\s*[KMGT]i?B|\d+) memory\))?", re.I
)
GPU_MEMORY = {"a100": "80GiB", "h100": "80GiB", "h200": "141GB", "b200": "180GB", "mi300x": "192GB"}


def read_torchtitan_toml(text: str, name: str, base: Path, options: ImportOptions) -> tuple[SourceDocument, list]:
    return import_job(read_toml(text, name), text, base, options, version="0.2")


def import_job(
    src: SourceDocument,
    text: str,
    base: Path,
    options: ImportOptions,
    *,
    version: str,
    source_format: str = "torchtitan",
    model: tuple[dict, dict] | None = None,
) -> tuple[SourceDocument, list]:
    """A job's tables (TOML's, or a config-registry function's Trainer.Config read as tables) as a spec.

    ``text`` is searched for torchtitan's preset comment; ``version`` is the backend version the spec names;
    ``model`` (sizes, origins) is a model read off torchtitan's own model config, instead of the flavor table.
    """
    data: dict = src.data
    name = src.file
    # a config function's findings that name no field are at its `def` (document_for), a TOML's at 1:1
    b = SpecBuilder(name, source_format, top=src.values.get((), TOP))
    for path in (*src.keys, *src.values):
        if len(path) == 2:
            b.doc.engine_keys[f"{path[0]}.{path[1]}"] = src.values.get(path) or src.keys[path]

    def get(table: str, key: str, default: Any = None) -> Any:
        if table == "parallelism":
            table = _parallel_table(data, key)
        section = data.get(table)
        return section.get(key, default) if isinstance(section, dict) else default

    def at(*path: str) -> Position | None:
        if path and path[0] == "parallelism" and len(path) == 2:
            path = (_parallel_table(data, path[1]), path[1])
        return src.values.get(tuple(path)) or src.keys.get(tuple(path))

    def integer(table: str, key: str, default: int, *, minimum: int = 1, allow: tuple = ()) -> int:
        v = get(table, key, default)
        if v in allow:
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            b.refuse(
                f"`{table}.{key}` must be an integer >= {minimum}, got {v!r}", at(table, key), "write a whole number"
            )
            return default
        return v

    python = source_format == "torchtitan-python"
    _unmodelled(b, data, lambda *path: src.keys.get(tuple(path)), PYTHON_READ if python else {})
    if model is not None and options.model is None:  # sizes read off the engine's own model config
        sizes, origins = model
        for field_name, v in sizes.items():
            b.set(("model", field_name), v, at=at("model", "flavor"), origin=origins.get(field_name))
    else:
        _model(b, data, base, options, at, get)
    if b.failed:
        return b.result()

    # ---- mesh (ParallelDims)
    rep = integer("parallelism", "data_parallel_replicate_degree", 1)
    shard = integer("parallelism", "data_parallel_shard_degree", -1, allow=(-1,))
    tp_key = "tensor_parallel_degree"
    if get("parallelism", tp_key) is None and get("training", OLD_TP_KEY) is not None:
        # torchtitan's name for the tensor-parallel degree until April 2024: train.py passed it to
        # ParallelDims as `sp`, whose plan is the Colwise/RowwiseParallel one (parallelize_llama.py).
        tp_key = OLD_TP_KEY
    tp = integer("parallelism", tp_key, 1)
    pp = integer("parallelism", "pipeline_parallel_degree", 1)
    cp = integer("parallelism", "context_parallel_degree", 1)
    ep = integer("parallelism", "expert_parallel_degree", 1)
    etp = integer("parallelism", "expert_tensor_parallel_degree", 1)
    devices, devices_at, origin, memory = _preset(text, options, b)
    if devices is None and shard != -1:
        devices, origin = rep * shard * tp * pp * cp, "the product of the parallel degrees"
    devices = resources(
        b,
        options,
        devices,
        devices_at,
        origin,
        what="a torchtitan job config",
        memory=memory,
        memory_origin=origin if memory else None,
        divisor=rep * tp * pp * cp,
    )
    for key, path, v in (
        ("data_parallel_replicate_degree", "dp_replicate", rep),
        (tp_key, "tp", tp),
        ("pipeline_parallel_degree", "pp", pp),
        ("context_parallel_degree", "cp", cp),
        ("expert_parallel_degree", "ep", ep),
        ("expert_tensor_parallel_degree", "etp", etp),
    ):
        given = at("parallelism", key)
        b.set(
            ("mesh", path),
            v,
            at=given,
            origin=f"{_parallel_table(data, key)}.{key}" + ("" if given else f" (default {v})"),
        )
    if shard == -1:
        b.set(
            ("mesh", "dp_shard"),
            "auto",
            at=at("parallelism", "data_parallel_shard_degree"),
            origin="parallelism.data_parallel_shard_degree = -1 (the devices the other degrees leave)",
        )
        others = rep * tp * pp * cp
        dp_shard = devices // others if devices % others == 0 else None
    else:
        b.set(
            ("mesh", "dp_shard"),
            shard,
            at=at("parallelism", "data_parallel_shard_degree"),
            origin="parallelism.data_parallel_shard_degree",
        )
        dp_shard = shard
    if dp_shard is None:
        b.refuse(
            f"data_parallel_shard_degree = -1 takes the devices the other degrees leave, but {devices} "
            "devices are not a "
            f"multiple of replicate * tp * pp * cp = {rep * tp * pp * cp}",
            at("parallelism", "data_parallel_shard_degree"),
            f"run on a multiple of {rep * tp * pp * cp} devices (`--devices`), or change the degrees",
        )
        return b.result()

    # ---- batch (train.py: global -1 = local * dp; accumulation = global / (local * dp))
    local_key = "local_batch_size" if get("training", "local_batch_size") is not None else "batch_size"
    local = integer("training", local_key, 8)
    dp = rep * dp_shard
    gbs = get("training", "global_batch_size", -1)
    if gbs == -1 or gbs is None:
        gbs, gbs_origin, gbs_at = (
            local * dp,
            f"training.{local_key} * dp (global_batch_size -1)",
            at("training", local_key),
        )
    else:
        gbs = integer("training", "global_batch_size", local * dp)
        gbs_origin, gbs_at = "training.global_batch_size", at("training", "global_batch_size")
    if gbs % (local * dp):
        b.refuse(
            f"training.global_batch_size {gbs} is not a multiple of local_batch_size {local} * dp {dp}",
            at("training", "global_batch_size"),
            "torchtitan asserts global = local * dp * accumulation steps",
        )
        return b.result()
    b.set(("training", "global_batch_size"), gbs, at=gbs_at, origin=gbs_origin)
    b.set(
        ("mesh", "gradient_accumulation_steps"),
        gbs // (local * dp),
        at=gbs_at,
        origin="global_batch_size / (local_batch_size * dp)",
    )
    schedule = get("parallelism", "pipeline_parallel_schedule", "1F1B")
    if pp > 1:
        micro = integer("parallelism", "pipeline_parallel_microbatch_size", 1)
        count = get("parallelism", "pipeline_parallel_microbatches")
        older = _parallel_table(data, "pipeline_parallel_degree") == "experimental"
        if count is not None or older:
            # The older trainer: n micro-batches (default: one per stage in all), each local / n.
            _schedule(b, schedule, pp, get, at)
            stages = pp * (b.get(("training", "virtual_pipeline_stages")) or 1)
            count = integer("parallelism", "pipeline_parallel_microbatches", stages) if count is not None else stages
            if local % count:
                b.refuse(
                    f"training.{local_key} {local} does not split into {count} micro-batches",
                    at("training", local_key),
                    "make the local batch a multiple of the number of micro-batches",
                )
                return b.result()
            b.set(
                ("training", "micro_batch_size"),
                local // count,
                at=at("training", local_key),
                origin=f"training.{local_key} / micro-batches",
            )
            b.set(
                ("mesh", "microbatches"),
                count,
                at=at("parallelism", "pipeline_parallel_microbatches") or at("training", local_key),
                origin="pipeline_parallel_microbatches (default: one per stage)",
            )
            micro = None
        if micro is not None and local % micro:
            b.refuse(
                f"training.{local_key} {local} is not divisible by pipeline_parallel_microbatch_size {micro}",
                at("parallelism", "pipeline_parallel_microbatch_size"),
                "torchtitan refuses a batch that does not split",
            )
            return b.result()
        if micro is not None:
            b.set(
                ("training", "micro_batch_size"),
                micro,
                at=at("parallelism", "pipeline_parallel_microbatch_size"),
                origin="parallelism.pipeline_parallel_microbatch_size",
            )
            b.set(
                ("mesh", "microbatches"),
                local // micro,
                at=at("training", local_key),
                origin=f"training.{local_key} / pipeline_parallel_microbatch_size",
            )
            _schedule(b, schedule, pp, get, at)
    else:
        b.set(("training", "micro_batch_size"), local, at=at("training", local_key), origin=f"training.{local_key}")
    # ---- the rest of training
    # Until 0.3 torchtitan always shards activations along the sequence between TP regions (SequenceParallel
    # on the norms, models/llama3/infra/parallelize.py apply_tp); 0.3 has ParallelismConfig.enable_sequence_parallel
    # (default True, torchtitan/config/configs.py).
    sp = get("parallelism", "enable_sequence_parallel", True)
    b.set(
        ("training", "sequence_parallel"),
        tp > 1 and sp is not False,
        at=at("parallelism", "tensor_parallel_degree"),
        origin="parallelism.tensor_parallel_degree > 1 (torchtitan's TP plan is sequence-parallel)",
    )
    seq = get("training", "seq_len", 2048)
    if options.seq_len is not None:
        seq = options.seq_len
    b.set(("training", "seq_len"), seq, at=at("training", "seq_len"), origin="training.seq_len")
    converters = get("model", "converters", []) or []
    if isinstance(converters, str):
        # config_manager's string_list: a comma-separated string is the list it names.
        converters = [c.strip() for c in converters.split(",") if c.strip()]
    if any("float8" in str(c) for c in converters):
        b.set(("training", "precision"), "fp8", at=at("model", "converters"), origin="model.converters (float8)")
    elif get("float8", "enable_float8_linear") is True:
        b.set(
            ("training", "precision"),
            "fp8",
            at=at("float8", "enable_float8_linear"),
            origin="float8.enable_float8_linear",
        )
    else:
        param = get("training", "mixed_precision_param", "bfloat16")
        b.set(
            ("training", "precision"),
            PRECISIONS.get(param, "bf16"),
            at=at("training", "mixed_precision_param"),
            origin="training.mixed_precision_param"
            + ("" if at("training", "mixed_precision_param") else " (default bfloat16)"),
        )
    mode = get("activation_checkpoint", "mode", "selective")
    if mode not in ("none", "selective", "full", "memory_budget"):
        b.refuse(
            f"`activation_checkpoint.mode` {mode!r} is not one of none, selective, full",
            at("activation_checkpoint", "mode"),
        )
    elif mode == "memory_budget":
        b.unmodelled(
            'activation_checkpoint.mode = "memory_budget"',
            at("activation_checkpoint", "mode"),
            "the compiler's budgeted recomputation is not modelled; priced as selective",
        )
        mode = "selective"
    b.set(
        ("training", "activation_checkpointing"),
        mode,
        at=at("activation_checkpoint", "mode"),
        origin="activation_checkpoint.mode",
    )
    # torch.compile: `[compile] enable` and `components` (default [model, loss], torchtitan/config/job_config.py
    # Compile); the older layout's `[training] compile` compiled the model and, from torchtitan bbb1b61
    # (April 2025), the loss too (components/loss.py build_cross_entropy_loss).
    if get("compile", "enable") is not None:
        enabled = get("compile", "enable") is True
        components = get("compile", "components", ["model", "loss"])
        if enabled and isinstance(components, list) and all(c in ("model", "loss") for c in components):
            value = True if sorted(set(components)) == ["loss", "model"] else sorted(set(components))
        else:
            value = False
        b.set(
            ("training", "compile"),
            value if enabled else False,
            at=at("compile", "enable"),
            origin="compile.enable, compile.components",
        )
    elif get("training", "compile") is not None:
        b.set(
            ("training", "compile"),
            get("training", "compile") is True,
            at=at("training", "compile"),
            origin="training.compile",
        )
    # Async TP: `[parallelism] enable_async_tensor_parallel` (`[experimental]` before early 2025); 0.3
    # moved it to CompileConfig (torchtitan/config/configs.py), the flag being a torch.compile pass.
    for table in ("parallelism", "compile"):
        if get(table, "enable_async_tensor_parallel") is not None:
            b.set(
                ("training", "async_tensor_parallel"),
                get(table, "enable_async_tensor_parallel") is True,
                at=at(table, "enable_async_tensor_parallel"),
                origin=f"{table}.enable_async_tensor_parallel",
            )
            break
    # Expert exchange: `[parallelism] expert_parallel_comm_backend` (TOML era, after 0.2; "standard" is
    # all_to_all_single, one copy of a token per routed expert; "deepep" and "hybridep" send a token once
    # per destination rank in a node and once per destination node: training.expert_dispatcher flex).
    backend = get("parallelism", "expert_parallel_comm_backend")
    if backend is not None:
        if backend in ("deepep", "hybridep", "standard"):
            b.set(
                ("training", "expert_dispatcher"),
                "all_to_all" if backend == "standard" else "flex",
                at=at("parallelism", "expert_parallel_comm_backend"),
                origin="parallelism.expert_parallel_comm_backend",
            )
        else:
            b.refuse(
                f"parallelism.expert_parallel_comm_backend = {backend!r} is not a backend the spec models",
                at("parallelism", "expert_parallel_comm_backend"),
                'write "standard", "deepep" or "hybridep"',
            )
    optimizer = str(get("optimizer", "name", "AdamW"))
    b.set(
        ("training", "optimizer"),
        {"adamw": "adamw", "adam": "adam"}.get(optimizer.lower(), "adamw"),
        at=at("optimizer", "name"),
        origin="optimizer.name",
    )
    if optimizer.lower() not in ("adamw", "adam"):
        b.unmodelled(f"optimizer.name = {optimizer!r}", at("optimizer", "name"), "priced as AdamW")
    lr = get("optimizer", "lr")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0:
        b.set(("training", "learning_rate"), float(lr), at=at("optimizer", "lr"), origin="optimizer.lr")
    # The seed: [debug] seed (JobConfig.Debug), [training] seed before that.
    seed_table = "debug" if get("debug", "seed") is not None else "training"
    seed = get(seed_table, "seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
        b.set(("training", "seed"), seed, at=at(seed_table, "seed"), origin=f"{seed_table}.seed")
    steps = get("training", "steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
        b.set(("training", "steps"), steps, at=at("training", "steps"), origin="training.steps")
    _multi_token_prediction(b, get, at, python=python, pp=pp, cp=cp)
    b.set(
        ("backend",),
        {"name": "torchtitan", "version": version},
        origin="a torchtitan job TOML (the 0.2-era format)" if version == "0.2" else "a torchtitan Trainer.Config",
    )
    return b.result()


def _multi_token_prediction(b: SpecBuilder, get, at, *, python: bool, pp: int, cp: int) -> None:
    """Multi-token prediction (model.mtp_num_layers, training.mtp_loss_scaling_factor).

    torchtitan's job TOML (JobConfig at 238fa99, the 0.2 era) has none, nor does any model of that
    torchtitan: MTP came after, for deepseek_v3 only (f59c215, "[MTP] Add MTP module for deepseek_v3
    model"). An HF config that sized the model may name MTP layers (DeepSeek-V3's
    num_nextn_predict_layers), which torchtitan does not build: they are left out, and said so.

    torchtitan 0.3.0: ``model_registry(flavor, num_mtp_layers=N)`` (torchtitan/models/deepseek_v3/
    __init__.py, ``_build_mtp_layers``) puts N MTPTransformerBlock configs in the model config's
    ``mtp_layers``, each the last layer's attention and feed-forward (or MoE) with enorm, hnorm, a
    [2 dim -> dim] eh_proj and mtp_norm (models/deepseek_v3/mtp.py). ``MTPLoss`` adds ``mtp_scale``
    (default 0.3) times the mean of the depths' losses to the main loss. MTPDecoder.Config.
    update_from_config raises NotImplementedError under pipeline or context parallelism, and
    MTPDecoder.forward returns the main prediction and one per depth (and raises where the lm_head is
    left to ChunkedLossWrapper), which MTPLoss takes."""
    layers = get("model", "num_mtp_layers", 0) if python else 0
    read = b.get(("model", "mtp_num_layers"), 0)
    if not python:
        if read:
            b.unmodelled(
                f"the HF config's {read} multi-token prediction layers (num_nextn_predict_layers)",
                at("model", "flavor") or at("model", "name"),
                "torchtitan's job TOML (0.2) builds no multi-token prediction layers; the model is read without them",
            )
            b.set(("model", "mtp_num_layers"), 0, origin="a torchtitan job TOML (no multi-token prediction)")
        return
    where = at("model", "num_mtp_layers") or at("model", "flavor")
    origin = "Trainer.Config.model_spec.model.mtp_layers (model_registry(flavor, num_mtp_layers=N))"
    if read and read != layers:
        b.unmodelled(
            f"the HF config's {read} multi-token prediction layers (num_nextn_predict_layers)",
            where,
            f"the Trainer.Config's model builds {layers or 'none'}; the model is read with those",
        )
    if layers or read:
        b.set(("model", "mtp_num_layers"), layers, at=where, origin=origin)
    scale = get("loss", "mtp_scale")
    if not layers:
        if scale is not None:
            b.diagnostic(
                codes.ENGINE_REFUSES.code,
                "the loss is MTPLoss, and the model has no multi-token prediction layers: MTPLoss.__call__ raises "
                "without a list of the main prediction and one per depth (torchtitan/models/deepseek_v3/mtp.py)",
                at("loss", "mtp_scale") or where,
                hint="build the model with model_registry(flavor, num_mtp_layers=N), or use the model's own loss",
            )
        return
    for degree, key in ((pp, "pipeline_parallel_degree"), (cp, "context_parallel_degree")):
        if degree > 1:
            b.diagnostic(
                codes.ENGINE_REFUSES.code,
                f"torchtitan 0.3 refuses multi-token prediction with parallelism.{key} {degree} (MTPDecoder.Config."
                "update_from_config raises NotImplementedError)",
                at("parallelism", key) or where,
                hint=f"set {key} to 1, or build the model without num_mtp_layers",
            )
    if scale is None:
        b.diagnostic(
            codes.ENGINE_REFUSES.code,
            f"the model has {layers} multi-token prediction layers, and the loss is not MTPLoss: MTPDecoder.forward "
            "returns one prediction per depth (torchtitan/models/deepseek_v3/mtp.py), which only MTPLoss takes",
            where,
            hint="set loss=MTPLoss.Config(global_vocab_size=...), as torchtitan's deepseek_v3_debugmodel_mtp does",
        )
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale <= 1e6):
        b.refuse(
            f"`loss.mtp_scale` = {scale!r} is not a weight the spec takes for the multi-token prediction loss (a "
            "number above 0, at most 1e6)",
            at("loss", "mtp_scale") or where,
            "give MTPLoss.Config a positive mtp_scale (its default is 0.3)",
        )
        return
    b.set(
        ("training", "mtp_loss_scaling_factor"),
        scale,
        at=at("loss", "mtp_scale") or where,
        origin="Trainer.Config.loss (MTPLoss.Config.mtp_scale, default 0.3)",
    )


#: The tensor-parallel degree's key in torchtitan's first configs (March 2024, [training]).
OLD_TP_KEY = "sequence_parallel_degree"


def _parallel_table(data: dict, key: str) -> str:
    for table in ("parallelism", "training", "experimental"):
        section = data.get(table)
        if isinstance(section, dict) and key in section:
            return table
    return "parallelism"


_LAYER_FQN = re.compile(r"layers\.(\d+)")


def _listed_split(b: SpecBuilder, pp: int, get, at) -> bool:
    """A split the config lists: ``module_fqns_per_model_part`` (torchtitan 0.2 and later: the modules
    of each model chunk, stage ``i`` built from list ``i``: distributed/pipeline_parallel.py,
    pipeline_module_split, which asserts the chunks divide by pp) or ``pipeline_parallel_split_points``
    (the first configs: stage ``i`` holds the layers from split ``i - 1`` up to split ``i``,
    models/llama3/infra/pipeline.py at v0.1.0). Sets the listed split and the virtual stages; False
    where it is refused (reported)."""
    fqns = get("parallelism", "module_fqns_per_model_part")
    points = get("parallelism", "pipeline_parallel_split_points")
    layers = b.get(("model", "num_layers"))
    if (fqns is None and not points) or not isinstance(layers, int):
        return True
    key = "module_fqns_per_model_part" if fqns is not None else "pipeline_parallel_split_points"
    where = at("parallelism", key)

    def refuse(why: str, hint: str) -> bool:
        b.refuse(f"`parallelism.{key}`: {why}", where, hint)
        return False

    if fqns is not None:
        if not isinstance(fqns, list) or not fqns or not all(isinstance(part, list) for part in fqns):
            return refuse(f"{fqns!r} is not a list of lists of module names", "write one list of names per stage")
        order: list[int] = []
        counts = []
        for i, part in enumerate(fqns):
            found = 0
            for name in part:
                match = _LAYER_FQN.fullmatch(name) if isinstance(name, str) else None
                if match is not None:
                    order.append(int(match.group(1)))
                    found += 1
                elif name == "tok_embeddings" and i != 0 or name in ("norm", "output") and i != len(fqns) - 1:
                    return refuse(
                        f"{name!r} is in stage {i}: the model's forward embeds tokens on the first stage and "
                        "normalises and projects to the vocabulary on the last",
                        "put tok_embeddings in the first list and norm and output in the last",
                    )
                elif name not in ("tok_embeddings", "norm", "output"):
                    return refuse(
                        f"{name!r} is not a module the reader knows", "name layers.N, tok_embeddings, norm, output"
                    )
            counts.append(found)
        if order != list(range(layers)):
            return refuse(
                f"the stages do not hold layers 0 to {layers - 1} once each, in order (they list {order[:12]}"
                + ("..." if len(order) > 12 else "")
                + ")",
                "list every layer once, each stage the next run of layers",
            )
        names = {n for part in fqns for n in part}
        if not {"tok_embeddings", "norm", "output"} <= names:
            return refuse(
                "a stage list leaves out tok_embeddings, norm or output, which no stage would then build",
                "put tok_embeddings in the first list and norm and output in the last",
            )
    else:
        if not isinstance(points, list) or not all(isinstance(p, str) and _LAYER_FQN.fullmatch(p) for p in points):
            return refuse(f"{points!r} is not a list of layer names (layers.N)", "write the first layer of each stage")
        cuts = [int(_LAYER_FQN.fullmatch(p).group(1)) for p in points]
        if cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] >= layers:
            return refuse(
                f"{points} are not increasing layers between 1 and {layers - 1}",
                "name the first layer of every stage after the first, in order",
            )
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, layers], strict=True)]
    if len(counts) % pp:
        return refuse(
            f"{len(counts)} stages do not divide over pipeline_parallel_degree {pp}",
            "torchtitan asserts the stages divide evenly over the pipeline ranks",
        )
    b.set(("training", "virtual_pipeline_stages"), len(counts) // pp, at=where, origin=f"parallelism.{key}")
    b.set(("training", "pipeline_layers"), counts, at=where, origin=f"parallelism.{key} (the layers of each stage)")
    return True


def _schedule(b: SpecBuilder, schedule: str, pp: int, get, at) -> None:
    if schedule not in SCHEDULES:
        b.refuse(
            f"pipeline_parallel_schedule {schedule!r} is not modelled",
            at("parallelism", "pipeline_parallel_schedule"),
            f"the spec models {', '.join(SCHEDULES)}",
        )
        return
    b.set(
        ("training", "pipeline_schedule"),
        SCHEDULES[schedule],
        at=at("parallelism", "pipeline_parallel_schedule"),
        origin="parallelism.pipeline_parallel_schedule",
    )
    single = schedule in SINGLE_STAGE
    per_stage = get("parallelism", "pipeline_parallel_layers_per_stage")
    layers = b.get(("model", "num_layers"))
    if per_stage is not None and isinstance(layers, int):
        first = get("parallelism", "pipeline_parallel_first_stage_less_layers", 1)
        last = get("parallelism", "pipeline_parallel_last_stage_less_layers", 1)
        stages = math.ceil((layers + first + last) / per_stage)
        if stages % pp:
            b.refuse(
                f"{stages} pipeline stages ({layers} layers + {first} + {last} over {per_stage} per "
                "stage) do not divide "
                f"over pipeline_parallel_degree {pp}",
                at("parallelism", "pipeline_parallel_layers_per_stage"),
                "torchtitan requires the virtual stages to divide by pp",
            )
            return
        per_rank, where = stages // pp, at("parallelism", "pipeline_parallel_layers_per_stage")
    else:
        per_rank, where = (1 if single else 2), at("parallelism", "pipeline_parallel_schedule")
    if single and per_rank != 1:
        b.refuse(
            f"{schedule} runs one stage per rank, but the layers per stage give {per_rank}",
            at("parallelism", "pipeline_parallel_layers_per_stage"),
            "raise pipeline_parallel_layers_per_stage",
        )
        return
    b.set(
        ("training", "virtual_pipeline_stages"),
        per_rank,
        at=where,
        origin="stages per rank (2 for a multi-stage schedule unless pipeline_parallel_layers_per_stage sets them)",
    )
    _listed_split(b, pp, get, at)  # a listed split replaces the generated one (and sets the stages per rank)


def _preset(
    text: str, options: ImportOptions, b: SpecBuilder
) -> tuple[int | None, Position | None, str | None, str | None]:
    """torchtitan's presets say what they are for: '# NOTE: this toml config is a preset for 64 A100 GPUs.'
    Returns the device count, its position, where it came from and the memory of that GPU (80GiB for an
    A100 or H100: the larger of their models)."""
    if options.devices is not None:
        return None, None, None, None
    for number, line in enumerate(text.splitlines(), start=1):
        m = _PRESET.search(line) if line.lstrip().startswith("#") else None
        if m:
            memory = m.group(3).replace(" ", "") if m.group(3) else GPU_MEMORY.get((m.group(2) or "").lower())
            if memory is not None and memory.isdigit():
                memory = int(memory)
            origin = f"the config's comment: {m.group(0)}"
            if m.group(2):
                b.set(("resources", "kind"), m.group(2).lower(), at=Position(number, m.start() + 1), origin=origin)
            return int(m.group(1)), Position(number, m.start() + 1), origin, memory
    return None, None, None, None


def _model(b: SpecBuilder, data: dict, base: Path, options: ImportOptions, at, get) -> None:
    name, flavor_name = get("model", "name"), get("model", "flavor")
    hf_path = options.model
    if hf_path is None and isinstance(get("model", "hf_assets_path"), str):
        candidate = base / get("model", "hf_assets_path") / "config.json"
        if candidate.is_file():
            hf_path = str(candidate)
    if hf_path is not None:
        from mixle_compile.importers.hf import hf_model, read_hf_document

        hf = hf_model(read_hf_document(hf_path, hf_path))
        for message, hint, pos in hf.problems:
            b.refuse(f"{hf_path}:{pos.line}:{pos.column}: {message}", at("model", "name"), hint, ("model",))
        for field_name, v in hf.model.items():
            b.set(
                ("model", field_name),
                v,
                at=at("model", "flavor"),
                origin=f"{hf_path}: {hf.keys.get(field_name, 'architecture')}",
            )
        return
    # An experiment's model keeps the architecture's name as its last part (graph_trainer/deepseek_v3).
    refused = flavors.REFUSED.get(str(name).rsplit("/", 1)[-1])
    if refused is not None:
        b.refuse(
            f"model {name!r}: {refused}",
            at("model", "name"),
            "check a covered architecture, or give an approximating HF config with `--model config.json`",
        )
        return
    entry = flavors.flavor(str(name), str(flavor_name))
    if entry is None:
        known = flavors.FLAVORS.get(flavors.ALIASES.get(str(name), str(name)))
        listed = (
            f"the flavors of {name}: {', '.join(known)}"
            if known
            else f"models in the table: {', '.join(flavors.FLAVORS)}"
        )
        b.refuse(
            f"model {name!r} flavor {flavor_name!r} is not in the table of torchtitan's published flavors",
            at("model", "flavor") if known else at("model", "name"),
            f"{listed}; or give its HF config with `--model config.json`",
        )
        return
    for field_name, v in entry.model.items():
        b.set(
            ("model", field_name),
            v,
            at=at("model", "flavor"),
            origin=f"model.name/flavor = {name}/{flavor_name} (torchtitan "
            f"models/{flavors.ALIASES.get(name, name)}/__init__.py)",
        )
    for text in entry.approximations:
        b.unmodelled(f"model {name}/{flavor_name}", at("model", "flavor"), f"not modelled: {text}")


def _unmodelled(b: SpecBuilder, data: dict, at, extra: dict) -> None:
    for table, section in data.items():
        if table in QUIET_TABLES:
            continue
        read = READ.get(table, set()) | extra.get(table, set())
        if not isinstance(section, dict) or not read:
            b.unmodelled(f"[{table}]", at(table))
            continue
        for key in section:
            if key not in read and key not in QUIET_KEYS.get(table, set()):
                b.unmodelled(f"{table}.{key}", at(table, key))
