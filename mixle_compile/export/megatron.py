"""A spec as a Megatron-LM launch script: ``torchrun ... pretrain_gpt.py`` with its arguments.

The flags and their meanings are those :mod:`mixle_compile.importers.megatron` reads back (see that
module for the engine sources). Without ``dp_shard``, ``dp_replicate`` is Megatron's data
parallelism, with ``--use-distributed-optimizer`` (ZeRO-1: the optimizer state sharded) where the
spec sets ``training.distributed_optimizer``; ``dp_shard`` is Megatron-FSDP with the strategy
``optim_grads_params`` (weights, gradients and optimizer state sharded), and ``dp_replicate`` over
``dp_shard`` its hybrid sharding (``--num-distributed-optimizer-instances``). Megatron has no
gradient-accumulation setting of its own (its micro-batches per step are ``global / (micro * dp)``).
"""

from __future__ import annotations

import shlex

from mixle_compile.engines import engine_profile
from mixle_compile.export import Exported, ExportRefused, memory_text
from mixle_compile.layer_split import megatron_accounting, megatron_layout_text, megatron_uneven_of
from mixle_compile.spec.models import Spec, parallel_plan

# megatron/core/parallel_state.py initialize_model_parallel: order "tp-cp-ep-dp-pp", or "tp-cp-ep-pp-dp"
# with use_tp_pp_dp_mapping (Megatron-LM's --use-tp-pp-dp-mapping).
DEFAULT_ORDER, TP_PP_DP_ORDER = "tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"


def moe_pattern_text(layers: int, first: int, frequency: int) -> str:
    """``--moe-layer-freq`` as the per-layer pattern Megatron-LM's ``_eval_pattern`` reads (lists of 0
    and 1 with ``+`` and ``*``): ``first`` dense layers, then an MoE layer every ``frequency`` layers."""
    parts = [f"[0]*{first}"] if first else []
    rest = layers - first
    if frequency == 1:
        parts.append(f"[1]*{rest}")
    else:
        period = f"([1]+[0]*{frequency - 1})"
        whole, left = divmod(rest, frequency)
        if whole:
            parts.append(f"{period}*{whole}")
        if left:
            parts.append("[1]" + (f"+[0]*{left - 1}" if left > 1 else ""))
    return "(" + "+".join(parts) + ")"


def megatron_arguments(spec: Spec) -> list[str]:
    m, t, mesh = spec.model, spec.training, spec.mesh
    plan = parallel_plan(spec)
    reasons: list[tuple[str, str]] = []
    if mesh.gradient_accumulation_steps != 1:
        reasons.append(
            (
                "mesh.gradient_accumulation_steps",
                "Megatron accumulates through its micro-batches: fold the accumulation steps into mesh.microbatches",
            )
        )
    if m.activation == "relu":
        reasons.append(("model.activation", "relu: Megatron-LM's MLP is gelu or swiglu (or squared relu)"))
    if t.optimizer == "adam":
        reasons.append(("training.optimizer", "adam: Megatron-LM's adam applies decoupled weight decay (adamw)"))
    if t.pipeline_schedule == "gpipe":
        reasons.append(("training.pipeline_schedule", "Megatron-Core has no GPipe schedule"))
    uneven = accounted = layout = None
    if isinstance(t.pipeline_layers, list):
        split = t.pipeline_layers
        # --account-for-embedding/loss-in-pipeline-split (megatron/training/arguments.py), else
        # --decoder-first/last-pipeline-num-layers, else any split as --pipeline-model-parallel-layout
        # (Megatron-LM 0.13 and later; the export writes the newest supported Megatron-LM's launch)
        accounted = megatron_accounting(split, m.num_layers, mesh.pp, t.virtual_pipeline_stages)
        if accounted is None:
            uneven = megatron_uneven_of(split, m.num_layers, mesh.pp, t.virtual_pipeline_stages)
        if accounted is None and uneven is None:
            layout = megatron_layout_text(split, mesh.pp, m.mtp_num_layers)
    if t.attention is not None:
        reasons.append(("training.attention", "not written by this exporter; remove it to export"))
    if t.compile:
        reasons.append(("training.compile", "Megatron-LM's launch has no torch.compile setting; remove it to export"))
    if mesh.order not in (None, DEFAULT_ORDER, TP_PP_DP_ORDER):
        reasons.append(
            (
                "mesh.order",
                f"{mesh.order}: Megatron-LM's arguments give the order {DEFAULT_ORDER} or, with "
                f"--use-tp-pp-dp-mapping, {TP_PP_DP_ORDER}",
            )
        )
    if m.mtp_num_layers and m.position_embedding != "rope":
        # validate_args (megatron/training/arguments.py): MTP with position_embedding_type rope or none only
        reasons.append(
            (
                "model.mtp_num_layers",
                "Megatron-LM refuses multi-token prediction with learned positions (validate_args asserts "
                "--position-embedding-type rope or none): use rope positions, or no MTP layers",
            )
        )
    if t.mtp_loss_scaling_factor is not None and not m.mtp_num_layers:
        reasons.append(
            (
                "training.mtp_loss_scaling_factor",
                "weighs the multi-token prediction loss, and the model has no MTP layers (model.mtp_num_layers 0): "
                "remove it",
            )
        )
    if m.vocab_size % mesh.tp:
        reasons.append(("model.vocab_size", f"{m.vocab_size} is not a multiple of tp {mesh.tp}: Megatron pads it"))
    if m.num_experts and m.moe_layer_frequency != 1:
        pass  # written as --moe-layer-freq N
    per_stage = None
    if t.virtual_pipeline_stages > 1 and accounted is None and uneven is None and layout is None:
        if m.num_layers % (mesh.pp * t.virtual_pipeline_stages):
            reasons.append(
                ("training.virtual_pipeline_stages", "Megatron splits the layers evenly into virtual stages")
            )
        else:
            per_stage = m.num_layers // (mesh.pp * t.virtual_pipeline_stages)
    if reasons:
        raise ExportRefused("megatron", reasons)
    a = [
        "--num-layers",
        m.num_layers,
        "--hidden-size",
        m.hidden_size,
        "--num-attention-heads",
        m.num_heads,
        "--ffn-hidden-size",
        m.ffn_hidden_size,
    ]
    if m.latent_attention:
        # megatron/training/arguments.py _add_mla_args; --qk-layernorm builds the latents' norms
        # (megatron/core/models/gpt/gpt_layer_specs.py), which the spec's MLA has
        a += ["--multi-latent-attention", "--kv-lora-rank", m.kv_lora_rank, "--qk-head-dim", m.qk_nope_head_dim]
        a += ["--qk-pos-emb-head-dim", m.qk_rope_head_dim, "--v-head-dim", m.v_head_dim, "--qk-layernorm"]
        if m.q_lora_rank is not None:
            a += ["--q-lora-rank", m.q_lora_rank]
    else:
        if m.num_kv_heads is not None:
            a += ["--group-query-attention", "--num-query-groups", m.num_kv_heads]
        if m.head_dim is not None:
            a += ["--kv-channels", m.head_dim]
    if m.activation == "swiglu":
        a += ["--swiglu"]
    a += [
        "--normalization",
        "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm",
        "--position-embedding-type",
        "rope" if m.position_embedding == "rope" else "learned_absolute",
    ]
    if not m.tie_embeddings:
        a += ["--untie-embeddings-and-output-weights"]
    a += ["--tokenizer-type", "NullTokenizer", "--vocab-size", m.vocab_size]
    if m.vocab_size % (128 * mesh.tp):
        a += ["--make-vocab-size-divisible-by", 1]
    if m.num_experts:
        a += ["--num-experts", m.num_experts, "--moe-router-topk", m.experts_per_token]
        # the grouped experts (TEGroupedMLP) whose saved tensors the memory model prices, and which
        # recompute_modules' moe_act needs (transformer_config.py)
        a += ["--moe-grouped-gemm"]
        # the plan's exchange (lower/updates.py, training.expert_dispatcher); Megatron's default is allgather
        a += ["--moe-token-dispatcher-type", "flex" if t.expert_dispatcher == "flex" else "alltoall"]
        if m.moe_ffn_hidden_size is not None:
            a += ["--moe-ffn-hidden-size", m.moe_ffn_hidden_size]
        if m.moe_first_layer:
            a += ["--moe-layer-freq", moe_pattern_text(m.num_layers, m.moe_first_layer, m.moe_layer_frequency)]
        elif m.moe_layer_frequency != 1:
            a += ["--moe-layer-freq", m.moe_layer_frequency]
        if m.expert_capacity_factor is not None:
            a += ["--moe-expert-capacity-factor", m.expert_capacity_factor]
        if m.moe_shared_expert_hidden_size:
            a += ["--moe-shared-expert-intermediate-size", m.moe_shared_expert_hidden_size]
            if m.moe_shared_expert_gate:
                a += ["--moe-shared-expert-gate"]
    if m.mtp_num_layers:
        # TransformerConfig.mtp_num_layers and mtp_loss_scaling_factor (Megatron-Core's default 0.1, written
        # only where the spec sets it), flags through ArgumentGroupFactory(TransformerConfig)
        a += ["--mtp-num-layers", m.mtp_num_layers]
        if t.mtp_loss_scaling_factor is not None:
            a += ["--mtp-loss-scaling-factor", repr(t.mtp_loss_scaling_factor)]
    a += [
        "--seq-length",
        t.seq_len,
        "--max-position-embeddings",
        m.positions(t.seq_len),
        "--micro-batch-size",
        t.micro_batch_size,
        "--global-batch-size",
        t.global_batch_size,
        "--tensor-model-parallel-size",
        mesh.tp,
        "--pipeline-model-parallel-size",
        mesh.pp,
        "--context-parallel-size",
        mesh.cp,
        "--expert-model-parallel-size",
        mesh.ep,
        "--expert-tensor-parallel-size",
        mesh.etp,
    ]
    if per_stage is not None:
        a += ["--num-layers-per-virtual-pipeline-stage", per_stage]
    if (accounted is not None or uneven is not None) and t.virtual_pipeline_stages > 1:
        # the virtual stages by count: layers per virtual stage would be read against num_layers alone
        a += ["--num-virtual-stages-per-pipeline-rank", t.virtual_pipeline_stages]
    if accounted is not None:
        embedding, loss = accounted
        a += ["--account-for-embedding-in-pipeline-split"] * embedding
        a += ["--account-for-loss-in-pipeline-split"] * loss
    if uneven is not None:
        a += ["--decoder-first-pipeline-num-layers", uneven[0], "--decoder-last-pipeline-num-layers", uneven[1]]
    if layout is not None:  # the layout sets the virtual stages too (validate_args)
        a += ["--pipeline-model-parallel-layout", layout]
    if t.microbatch_group_size is not None:  # ModelParallelConfig.microbatch_group_size_per_vp_stage
        a += ["--microbatch-group-size-per-virtual-pipeline-stage", t.microbatch_group_size]
    if mesh.order == TP_PP_DP_ORDER:
        a += ["--use-tp-pp-dp-mapping"]
    if t.sequence_parallel:
        a += ["--sequence-parallel"]
    profile, schedule, virtual = engine_profile(spec.backend), t.pipeline_schedule, t.virtual_pipeline_stages
    if profile.overlaps_pipeline_transfers(schedule, virtual) and not profile.overlaps_pipeline_transfers(
        schedule, virtual, t.overlap_pipeline_transfers
    ):
        # Megatron-LM overlaps pipeline transfers under the interleaved schedule unless told not to; the
        # plan priced them exposed (the spec's false, or Megatron-Core's default for entry: core)
        a += ["--no-overlap-p2p-communication"]
    if t.async_tensor_parallel:
        a += ["--tp-comm-overlap"]
    if plan.dp_shard > 1:
        # Megatron-FSDP (megatron/training/arguments.py validate_args, use_megatron_fsdp): it asserts
        # the checkpoint format fsdp_dtensor and turns the distributed optimizer on itself (a warning
        # when the launch leaves it off; the sharded optimizer state is priced either way).
        a += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
        a += ["--ckpt-format", "fsdp_dtensor"]
        if plan.dp_replicate > 1:
            # Hybrid sharding: the data ranks in dp_replicate contiguous blocks, sharded within a block
            # and replicated across (parallel_state.py intra_partial_data_parallel_size; the
            # adapter's enable_hsdp), the shard ranks inner as in the plan's grid.
            a += ["--num-distributed-optimizer-instances", plan.dp_replicate]
    if t.distributed_optimizer:
        a += ["--use-distributed-optimizer"]
    if t.precision == "fp8":
        a += ["--bf16", "--fp8-format", "hybrid"]
    elif t.precision in ("bf16", "fp16"):
        a += [f"--{t.precision}"]
    if t.activation_checkpointing == "selective":
        a += ["--recompute-granularity", "selective"]
        if t.recompute_modules:
            a += ["--recompute-modules", *t.recompute_modules]
    elif t.activation_checkpointing == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    if t.optimizer == "sgd":
        a += ["--optimizer", "sgd"]
    a += ["--lr", repr(t.learning_rate), "--train-iters", t.steps, "--seed", t.seed]
    return [str(x) for x in a]


def megatron_files(spec: Spec, stem: str) -> Exported:
    args = megatron_arguments(spec)
    devices = spec.resources.devices
    per_node, nodes = (8, devices // 8) if devices > 8 and devices % 8 == 0 else (devices, 1)
    lines = [
        "#!/bin/bash",
        "# Megatron-LM launch written by mixle-compile export --to megatron.",
        f"# devices: {devices}{' ' + spec.resources.kind.upper() if spec.resources.kind else ''}, "
        f"each with {memory_text(spec.resources.memory)}",
        "",
        f"torchrun --nproc_per_node {per_node} --nnodes {nodes} pretrain_gpt.py \\",
    ]
    flags = []
    for word in args:
        if word.startswith("--"):
            flags.append([word])
        else:
            flags[-1].append(shlex.quote(word))
    lines += [f"    {' '.join(f)} \\" for f in flags[:-1]] + [f"    {' '.join(flags[-1])}", ""]
    main = f"{stem}.sh"
    return Exported("megatron", {main: "\n".join(lines)}, main)
