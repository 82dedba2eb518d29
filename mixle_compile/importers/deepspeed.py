"""A DeepSpeed JSON config (``ds_config.json``), with the model from an HF config.json.

DeepSpeed's batch identity (deepspeed/runtime/config.py, ``DeepSpeedConfig._batch_assertion`` and
``_set_batch_related_parameters``): ``train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * dp_world_size``; of the three, the ones missing are derived from the
others (gradient accumulation defaults to 1 when only one batch size is given). ZeRO stage 3
partitions parameters, gradients and optimizer state over the data-parallel ranks (FSDP:
``dp_shard``); stages 1 and 2 partition the optimizer state (and stage 2 the gradients) of
replicated parameters (``dp_replicate`` with ``distributed_optimizer``). The config names no
tensor or pipeline degree (DeepSpeed's pipeline and MoE degrees are set in the model's code), so
every device is a data-parallel rank, except under DeepSpeed-Ulysses (``sequence_parallel_size``),
whose data-parallel ranks are the devices over it: the identity is checked on those, and the
config is then refused by name, the spec having no Ulysses axis.
"""

from __future__ import annotations

from typing import Any

from mixle_compile.importers.builder import ImportOptions, SpecBuilder, resources, unreadable
from mixle_compile.spec.source import Position, SourceDocument, SourceError, parse_source

# Keys with no bearing on the plan's sizes, memory or communication: read and ignored quietly.
IRRELEVANT = {
    "steps_per_print",
    "wall_clock_breakdown",
    "prescale_gradients",
    "gradient_predivide_factor",
    "gradient_clipping",
    "scheduler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "flops_profiler",
    "dump_state",
    "zero_allow_untested_optimizer",
    "memory_breakdown",
    "sparse_gradients",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "checkpoint",
    "data_types",
    "elasticity",
    "aio",
    "autotuning",
    "compile",
}
ZERO_IRRELEVANT = {
    "stage",
    "contiguous_gradients",
    "overlap_comm",
    "reduce_scatter",
    "reduce_bucket_size",
    "allgather_partitions",
    "allgather_bucket_size",
    "round_robin_gradients",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "sub_group_size",
    "elastic_checkpoint",
    "load_from_fp32_weights",
    "ignore_unused_parameters",
    "legacy_stage1",
    "cpu_offload",
    "stage3_gather_fp16_weights_on_model_save",
}
# Loss scaling and autocast settings: no effect on sizes or memory.
PRECISION_QUIET = {
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "auto_cast",
    "immediate_grad_update",
}
OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "fusedadam": "adam", "cpuadam": "adam"}
# Optimizers that keep Adam's two moments per parameter (priced as adam, with a warning).
ADAM_LIKE = {"onebitadam", "zerooneadam", "onebitlamb", "lamb", "adagrad", "muadam", "muadamw", "adafactor"}


def read_deepspeed(raw: bytes, name: str, options: ImportOptions) -> tuple[SourceDocument, list]:
    src, diags = parse_source(raw, name, json_syntax=True)
    if diags:
        raise SourceError(diags, unreadable=True)
    data = src.data
    if options.model is None:
        raise unreadable(
            name,
            f"{name} is a DeepSpeed config; it does not describe the model",
            "give the model's HF config with `--model config.json` (e.g. `mixle-compile check "
            "ds_config.json --model config.json`)",
        )
    b = SpecBuilder(name, "deepspeed")
    for path in (*src.keys, *src.values):
        if path and all(isinstance(p, str) for p in path):
            b.doc.engine_keys[".".join(path)] = src.values.get(path) or src.keys[path]

    def at(*path: Any) -> Position | None:
        return src.keys.get(tuple(path)) or src.values.get(tuple(path))

    def value(*path: Any) -> Any:
        cur = data
        for part in path:
            if not isinstance(cur, dict) or part not in cur:
                return None
            cur = cur[part]
        return cur

    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if value(key) == "auto":
            b.refuse(
                f'`{key}` is "auto": the HF Trainer fills it in from its own arguments at launch',
                at(key),
                f"write the number the run uses for `{key}`",
            )
    if b.failed:
        return b.result()
    _model(b, options, name)
    tbs, mbs, gas = (
        value("train_batch_size"),
        value("train_micro_batch_size_per_gpu"),
        value("gradient_accumulation_steps"),
    )
    for key, v in (
        ("train_batch_size", tbs),
        ("train_micro_batch_size_per_gpu", mbs),
        ("gradient_accumulation_steps", gas),
    ):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            b.refuse(f"`{key}` must be a positive integer, got {v!r}", at(key), "write a whole number")
    if b.failed:
        return b.result()
    # DeepSpeed-Ulysses: DeepSpeedConfig.__init__ (deepspeed/runtime/config.py, deepspeed 0.19.8) takes the
    # data-parallel world as dist.get_world_size() / config["sequence_parallel_size"] when no mpu is given
    # (and world / mpu.get_sequence_parallel_world_size() with one), and _batch_assertion checks
    # train = micro * accumulation * that world: the batch identity counts data-parallel ranks,
    # devices / sequence_parallel_size, and the devices the batch sizes give are those ranks times it.
    sp = value("sequence_parallel_size")
    if sp is not None and (isinstance(sp, bool) or not isinstance(sp, int) or sp < 1):
        b.refuse(
            f"`sequence_parallel_size` must be a positive integer, got {sp!r}",
            at("sequence_parallel_size"),
            "write the number of ranks each sequence is split over (1 for none)",
        )
        return b.result()
    sp = sp or 1
    devices = options.devices
    devices_at, devices_origin = None, None
    if devices is None and tbs is not None and mbs is not None and gas is not None:
        if tbs % (mbs * gas):
            b.refuse(
                f"train_batch_size {tbs} is not train_micro_batch_size_per_gpu {mbs} * "
                f"gradient_accumulation_steps {gas} "
                "* a number of data-parallel ranks",
                at("train_batch_size"),
                "DeepSpeed asserts train = micro * accumulation * dp",
            )
            return b.result()
        devices, devices_at = tbs // (mbs * gas) * sp, at("train_batch_size")
        devices_origin = "train_batch_size / (train_micro_batch_size_per_gpu * gradient_accumulation_steps)" + (
            f" data-parallel ranks * sequence_parallel_size {sp}" if sp > 1 else ""
        )
    # DeepSpeed derives a missing accumulation as train // (micro * dp) and asserts it whole and
    # positive: a world size the batch sizes do not divide is not one the config runs on.
    admits, admits_why = None, ""
    if tbs is not None and gas is None:
        admits = lambda n: n % sp == 0 and tbs % ((mbs or 1) * (n // sp)) == 0  # noqa: E731
        admits_why = (
            f"train_batch_size {tbs} / train_micro_batch_size_per_gpu {mbs}" if mbs else f"train_batch_size {tbs}"
        )
    world = resources(
        b,
        options,
        devices,
        devices_at,
        devices_origin,
        what="a DeepSpeed config",
        divisor=sp,
        admits=admits,
        admits_why=admits_why,
    )
    if world % sp:
        b.refuse(
            f"`sequence_parallel_size` {sp} does not divide the {world} devices: DeepSpeed splits the world into "
            "sequence-parallel groups of that size, and the data-parallel ranks are world / sequence_parallel_size",
            at("sequence_parallel_size"),
            f"pass a device count that is a multiple of {sp} with --devices",
        )
        return b.result()
    dp = world // sp
    # DeepSpeedConfig._set_batch_related_parameters: derive what is missing.
    if tbs is not None and mbs is not None and gas is None:
        gas = tbs // (mbs * dp) if tbs % (mbs * dp) == 0 else None
    elif tbs is not None and gas is not None and mbs is None:
        mbs = tbs // (gas * dp) if tbs % (gas * dp) == 0 else None
    elif tbs is None and mbs is not None:
        gas = gas or 1
        tbs = mbs * gas * dp
    elif tbs is not None and mbs is None and gas is None:
        gas, mbs = 1, tbs // dp if tbs % dp == 0 else None
    if tbs is None and mbs is None:
        b.refuse(
            "the config gives neither train_batch_size nor train_micro_batch_size_per_gpu",
            None,
            "DeepSpeed needs at least one of them",
        )
        return b.result()
    if mbs is None or gas is None or tbs != mbs * gas * dp:
        b.refuse(
            f"the batch sizes do not satisfy DeepSpeed's identity train_batch_size = micro * accumulation * dp "
            f"on {dp} data-parallel ranks"
            + (f" ({world} devices / sequence_parallel_size {sp})" if sp > 1 else "")
            + f" (train {tbs}, micro {mbs}, accumulation {gas})",
            at("train_batch_size"),
            "fix the batch sizes, or pass the real world size with --devices",
        )
        return b.result()
    if sp > 1:
        # The spec has no axis for Ulysses. Its cp is ring-attention context parallelism: keys and values
        # passed around the ring, rule Q001's 2 * cp load-balanced chunks, ZeRO/FSDP sharding over dp_shard
        # only; DeepSpeed-Ulysses (deepspeed/sequence/layer.py DistributedAttention) exchanges the heads
        # all-to-all, needs seq_len and the heads divisible by sp only, and ZeRO partitions over the
        # sequence-and-data ranks, dp * sp (deepspeed/runtime/engine.py: the ZeRO optimizers'
        # dp_process_group is seq_data_parallel_group). Writing it as cp would price and refuse another run.
        b.refuse(
            f"`sequence_parallel_size` {sp} is DeepSpeed-Ulysses sequence parallelism (each sequence split over "
            f"{sp} ranks, attention's heads exchanged all-to-all; here {dp} data-parallel "
            f"rank{'s' if dp > 1 else ''} of {world} devices): the spec has no Ulysses axis, and its context "
            "parallelism (cp, ring attention) is priced and checked differently",
            at("sequence_parallel_size"),
            f"to check the rest of the config, drop `sequence_parallel_size` and pass `--devices {dp}` (the "
            "sequence is then priced whole on each rank, an upper bound on the activations)",
            ("mesh", "cp"),
        )
        return b.result()
    b.set(("training", "global_batch_size"), tbs, at=at("train_batch_size"), origin="train_batch_size")
    b.set(
        ("training", "micro_batch_size"),
        mbs,
        at=at("train_micro_batch_size_per_gpu"),
        origin="train_micro_batch_size_per_gpu",
    )
    b.set(
        ("mesh", "gradient_accumulation_steps"),
        gas,
        at=at("gradient_accumulation_steps"),
        origin="gradient_accumulation_steps",
    )
    stage = value("zero_optimization", "stage") or 0
    zero_at = at("zero_optimization", "stage")
    if stage not in (0, 1, 2, 3):
        b.refuse(f"`zero_optimization.stage` must be 0, 1, 2 or 3, got {stage!r}", zero_at)
        return b.result()
    if stage == 3:
        b.set(("mesh", "dp_shard"), dp, at=zero_at, origin="zero_optimization.stage = 3 (parameters partitioned)")
    else:
        b.set(("mesh", "dp_replicate"), dp, at=zero_at, origin=f"zero_optimization.stage = {stage}")
        if stage >= 1:
            b.set(
                ("training", "distributed_optimizer"),
                True,
                at=zero_at,
                origin=f"zero_optimization.stage = {stage} (optimizer state partitioned)",
            )
        if stage == 2:
            b.unmodelled(
                "zero_optimization.stage = 2",
                zero_at,
                "gradient partitioning is not modelled; gradients are priced whole (an upper bound)",
            )
    zero = value("zero_optimization")
    if isinstance(zero, dict):
        for key in zero:
            if key not in ZERO_IRRELEVANT:
                b.unmodelled(
                    f"zero_optimization.{key}",
                    at("zero_optimization", key),
                    "offloading and other ZeRO options are not modelled (memory is priced on the device)",
                )
    for section in ("bf16", "fp16"):
        if isinstance(data.get(section), dict):
            for key in data[section]:
                if key not in PRECISION_QUIET:
                    b.unmodelled(
                        f"{section}.{key}",
                        at(section, key),
                        "the spec prices master weights, gradients and "
                        "optimizer state in fp32 with bf16/fp16 compute (an upper bound)",
                    )
    _precision(b, data, at)
    _optimizer(b, data, at)
    b.set(("backend",), "deepspeed", origin="a DeepSpeed config")
    known = IRRELEVANT | {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization",
        "fp16",
        "bf16",
        "amp",
        "optimizer",
        "sequence_parallel_size",
    }
    for key in data:
        if key not in known:
            b.unmodelled(key, at(key))
    return b.result()


def _model(b: SpecBuilder, options: ImportOptions, name: str) -> None:
    from mixle_compile.importers.hf import hf_model, read_hf_document

    doc = read_hf_document(options.model, options.model)
    hf = hf_model(doc)
    for message, hint, pos in hf.problems:
        b.refuse(f"{options.model}:{pos.line}:{pos.column}: {message}", None, hint, ("model",))
    for key, _pos in hf.ignored:
        b.unmodelled(f"{options.model}: {key}", None)
    for field_name, v in hf.model.items():
        origin = f"{options.model}: {hf.keys[field_name]}" if field_name in hf.keys else None
        b.set(("model", field_name), v, origin=origin)
    if options.seq_len is not None:
        b.set(("training", "seq_len"), options.seq_len, origin="--seq-len")
        return
    seq = doc.data.get("max_position_embeddings") or doc.data.get("n_positions") if isinstance(doc.data, dict) else None
    if isinstance(seq, int) and seq > 0:
        b.set(("training", "seq_len"), seq, origin=f"{options.model}: max_position_embeddings")
        b.assumed(
            f"the sequence length is not in a DeepSpeed config; assumed the model's max_position_embeddings ({seq})",
            None,
            "pass `--seq-len N` with the length the run trains on",
            ("training", "seq_len"),
        )


def _precision(b: SpecBuilder, data: dict, at) -> None:
    def enabled(key: str) -> bool:
        section = data.get(key)
        return isinstance(section, dict) and section.get("enabled") in (True, "true")

    if enabled("bf16"):
        b.set(("training", "precision"), "bf16", at=at("bf16", "enabled"), origin="bf16.enabled")
    elif enabled("fp16"):
        b.set(("training", "precision"), "fp16", at=at("fp16", "enabled"), origin="fp16.enabled")
    elif enabled("amp"):
        b.set(("training", "precision"), "fp16", at=at("amp", "enabled"), origin="amp.enabled")
    else:
        b.set(("training", "precision"), "fp32", origin="neither bf16 nor fp16 enabled")


def _optimizer(b: SpecBuilder, data: dict, at) -> None:
    opt = data.get("optimizer")
    if not isinstance(opt, dict):
        return
    kind = str(opt.get("type", "")).lower()
    if kind in OPTIMIZERS:
        b.set(("training", "optimizer"), OPTIMIZERS[kind], at=at("optimizer", "type"), origin="optimizer.type")
    else:
        b.set(("training", "optimizer"), "adam", at=at("optimizer", "type"), origin="optimizer.type")
        b.unmodelled(
            f"optimizer.type = {opt.get('type')!r}",
            at("optimizer", "type"),
            "priced as adam (two moments per parameter)" if kind in ADAM_LIKE else "priced as adam",
        )
    params = opt.get("params")
    lr = params.get("lr") if isinstance(params, dict) else None
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0:
        b.set(
            ("training", "learning_rate"), float(lr), at=at("optimizer", "params", "lr"), origin="optimizer.params.lr"
        )
