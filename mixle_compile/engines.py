"""Engine profiles: which engine a spec targets, at which version, and how that engine runs it.

``backend: torch`` or ``backend: {name: megatron, version: "0.16", entry: arguments}``. A bare
name means the newest version supported here. A profile holds the facts about an engine that
more than one pass reads (the verifier's rules, the lowering, the memory model), each with the
engine source it comes from:

* ``torch``: the in-tree runtime (``mixle_compile.runtime``). It executes plans; its pipeline
  schedules are torch 2.13's ``torch.distributed.pipelining`` classes' orders; it shards FSDP
  over ``dp_shard`` only.
* ``torchtitan`` (0.3): verification. Pipeline schedules are torch's; FSDP is applied over
  ``dp_shard * cp`` whenever either is above 1 (``ParallelDims.fsdp_enabled``: ``dp_shard_enabled
  or cp_enabled``, torchtitan/distributed/parallel_dims.py).
* ``megatron`` (Megatron-Core 0.12-0.16): verification. Its own schedules
  (megatron/core/pipeline_parallel/schedules.py); ``entry`` says which front end builds the
  config: ``arguments`` (Megatron-LM's ``pretrain_gpt.py`` arguments, whose ``validate_args``
  turns a setting off with a warning where Megatron-Core's config classes raise) or ``core``
  (``TransformerConfig`` built directly, as Megatron-Bridge and NeMo do).

A backend registered by a plugin gets the common profile: torch's schedules, no engine-specific
rules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from mixle_compile.memory_model import MoESaved
from mixle_compile.schedules import ScheduleFamily
from mixle_compile.spec.kinds import Engine

#: Versions supported per engine, oldest first; the last is what a bare name means.
VERSIONS: dict[str, tuple[str, ...]] = {
    Engine.TORCH: ("2.13",),
    Engine.TORCHTITAN: ("0.2", "0.3"),
    Engine.MEGATRON: ("0.12", "0.13", "0.14", "0.15", "0.16"),
}
#: Front ends per engine, the default first.
ENTRIES: dict[str, tuple[str, ...]] = {Engine.MEGATRON: ("arguments", "core")}


@dataclass(frozen=True)
class EngineProfile:
    name: str  # torch, torchtitan, megatron, or a plugin's name
    version: str | None  # None for a plugin backend
    entry: str | None = None
    known: bool = True  # False: a plugin backend checked with the common rules

    @property
    def schedules(self) -> ScheduleFamily:
        return ScheduleFamily.MEGATRON if self.name == Engine.MEGATRON else ScheduleFamily.TORCH

    @property
    def buffered_sends(self) -> bool:
        """torch's pipelining runtime awaits its sends at the end of the step."""
        return self.schedules is ScheduleFamily.TORCH

    def sends_buffered(self, pp: int, group: int | None) -> bool:
        """Whether a stage's sends complete before their receive is posted: torch's (awaited at the end
        of the step), and Megatron's under an interleaved micro-batch group above pp, whose first and
        last pipeline stages post ``group - pp + 1`` receives ahead (megatron/core/pipeline_parallel/
        schedules.py, fwd_recv_buffer_size and bwd_recv_buffer_size) so that the wrap-around sends of
        the stages before them complete early; with the default group (pp) Megatron's sends meet their
        receive in turn."""
        return self.buffered_sends or (self.schedules is ScheduleFamily.MEGATRON and (group or pp) > pp)

    @property
    def fsdp_over_cp(self) -> bool:
        """FSDP shards over dp_shard * cp whenever that product is above 1 (torchtitan)."""
        return self.name == Engine.TORCHTITAN

    @property
    def default_attention(self) -> str:
        """Every engine here runs a fused attention kernel that never stores the score matrix:
        the in-tree runtime and torchtitan ``F.scaled_dot_product_attention`` (flash or
        memory-efficient on GPUs), Megatron-Core Transformer Engine's fused attention or
        FlashAttention (``attention_backend`` auto)."""
        return "flash"

    @property
    def fsdp_keeps_stage_under_pp(self) -> bool:
        """Under a pipeline, FSDP keeps a stage's parameters gathered and their gradients unsharded
        for the whole step (torchtitan: ``fsdp_reshard_after_forward`` "default" = not pp; torch's
        ``PipelineStage`` backward without resharding or gradient sync until the last)."""
        return self.name == Engine.TORCHTITAN

    @property
    def pipeline_receive_buffers(self) -> bool:
        """The engine runs torch's pipelining runtime, whose stages allocate a receive buffer per
        micro-batch for activations and for gradients (torch/distributed/pipelining/stage.py;
        torchtitan builds its schedules from it). Megatron-Core and the in-tree runtime allocate a
        receive tensor per transfer, which the stage's first layer then keeps as its input."""
        return self.name == Engine.TORCHTITAN

    @property
    def fsdp_reduce_scatter_copy(self) -> bool:
        """FSDP2 reduces each unit's gradients through a flat fp32 copy of them (torchtitan applies
        ``fully_shard`` with ``reduce_dtype`` float32; torch's ``foreach_reduce``)."""
        return self.name == Engine.TORCHTITAN

    def overlaps_pipeline_transfers(
        self, schedule: str | None, virtual_stages: int | None, asked: bool | None = None
    ) -> bool:
        """A stage's sends and receives to its pipeline neighbours run beside its compute. Megatron runs
        them so only under its interleaved schedule (``overlap_p2p_comm``; megatron/training/arguments.py
        turns it off without virtual stages), and by default from its arguments (on unless
        ``--no-overlap-p2p-communication``), not from Megatron-Core's ``ModelParallelConfig`` (off;
        Megatron-Bridge sets it whenever vp > 1, training/comm_overlap.py). ``asked``: the spec's
        ``training.overlap_pipeline_transfers`` (None: that default). torch's pipelining has no such switch
        (P012): its transfers are priced exposed."""
        if self.name != Engine.MEGATRON or schedule != "interleaved_1f1b" or (virtual_stages or 1) <= 1:
            return False
        return (self.entry != "core") if asked is None else asked

    @property
    def ring_attention(self) -> bool:
        """Context parallelism runs torch's ring attention over SDPA, all-gathering keys and values
        (torchtitan's ``context_parallel`` / ``_ContextParallel`` plan; memory_model.ring_attention_bytes).
        Megatron-Core's runs Transformer Engine's attention with its own point-to-point ring."""
        return self.name == Engine.TORCHTITAN

    @property
    def context_parallel_ring(self) -> str | None:
        """Whose ring attention context parallelism runs (step_time.RING_MERGE_BYTES prices its merges):
        ``torch`` (torchtitan: torch's ``_templated_ring_attention`` over SDPA) or
        ``transformer_engine`` (Megatron-Core's ``TEDotProductAttention``: Transformer Engine's
        ``AttnFuncWithCPAndKVP2P``); None on the in-tree runtime and a plugin backend."""
        if self.name == Engine.TORCHTITAN:
            return "torch"
        if self.name == Engine.MEGATRON:
            return "transformer_engine"
        return None

    @property
    def repeats_key_heads(self) -> bool:
        """The model repeats its key and value heads to the query heads before attention, so the
        kernel (and ring attention's exchange) sees as many key heads as query heads: torchtitan's
        ``repeat_kv``, which 0.2.2 replaced with ``enable_gqa`` (pytorch/torchtitan#2259, "GQA
        without kv repeats"). The profile keeps minor versions, so 0.2 is priced with the repeat
        (its earlier releases, and the larger of the two)."""
        return self.name == Engine.TORCHTITAN and not self.at_least("0.3")

    @property
    def latent_projections_on_shards(self) -> bool:
        """Multi-head Latent Attention's down projections run on the tp rank's sequence shard and the
        latents cross the tensor-parallel boundary (Megatron-Core's ``TELinear`` with
        ``parallel_mode="duplicated"``, multi_latent_attention.py; the in-tree runtime does the same).
        torchtitan gathers the hidden state first and runs ``NoParallel`` wq_a and wkv_a on every
        token of every tp rank (torchtitan/models/deepseek_v3/infra/parallelize.py)."""
        return self.name != Engine.TORCHTITAN

    @property
    def mtp_projection_split(self) -> bool:
        """A multi-token prediction depth's ``eh_proj`` ([embedding, hidden] -> hidden) is split over tp
        by its outputs, its input gathered over the sequence under sequence parallelism and its output
        gathered over the features (Megatron-Core: a ColumnParallelLinear, then
        ``gather_from_tensor_model_parallel_region`` and, with sequence parallelism,
        ``scatter_to_sequence_parallel_region``, multi_token_prediction.py ``_concat_embeddings``; the
        in-tree runtime the same). torchtitan 0.3 keeps it whole on every tp rank and runs it on the
        rank's own tokens (models/deepseek_v3/sharding.py ``_set_deepseek_v3_mtp_sharding``: weight
        replicated, input and output in the activation's placement)."""
        return self.name != Engine.TORCHTITAN

    @property
    def pads_values_to_key_heads(self) -> bool:
        """Context parallelism exchanges MLA's keys and values padded to the larger head size, as one
        tensor: the in-tree runtime. Transformer Engine's ring (``AttnFuncWithCPAndKVP2P``, which
        handles ``k.shape[-1] != v.shape[-1]``) and torch's send each at its own size."""
        return self.name not in (Engine.TORCHTITAN, Engine.MEGATRON)

    @property
    def fp8_saves_quantized_inputs(self) -> bool:
        """Under fp8 the linear layers keep the fp8 copy of their input for the weight gradient:
        Megatron-Core's Transformer Engine modules (transformer_engine/pytorch/module/linear.py saves
        the quantized ``inputmat``). torchtitan's float8 linears (torchao's ``Float8Linear``) keep the
        high-precision input and cast it again in the backward (memory_model.activation_bytes_per_layer)."""
        return self.name == Engine.MEGATRON

    @property
    def op_level_selective(self) -> bool:
        """Selective checkpointing saves chosen ops' outputs (torchtitan's ``SelectiveAC``, op mode);
        elsewhere it recomputes attention's core (Korthikanti et al., Megatron's selective)."""
        return self.name == Engine.TORCHTITAN

    def selective_modules(self, recompute_modules: list[str] | None) -> frozenset[str]:
        """What selective checkpointing recomputes, by Megatron-Core's names (transformer_config.py
        ``recompute_modules``, default ``["core_attn"]``): Megatron-Core reads the spec's list; every
        other engine recomputes the attention core at most (torchtitan's op-level policy is priced
        apart, ``op_level_selective``)."""
        if self.name == Engine.MEGATRON and recompute_modules:
            return frozenset(recompute_modules)
        return frozenset({"core_attn"})

    def recomputes(
        self, checkpointing: str, collective: str, module: str, modules: frozenset[str] = frozenset({"core_attn"})
    ) -> bool:
        """Whether activation checkpointing issues a block's forward collective (``collective``, a
        CollectiveKind value) again in the backward, where the recomputed forward runs:

        - ``full``: torchtitan wraps each transformer block in ``checkpoint_wrapper`` and Megatron-Core
          checkpoints whole layers (``TransformerBlock._checkpointed_forward``): the block's forward,
          with every collective in it, runs again.
        - ``selective``, torchtitan (op-level SAC, ``torchtitan/distributed/activation_checkpoint.py``):
          the recomputed forward re-runs every op outside the save list; the list keeps
          ``reduce_scatter_tensor`` and, from 0.3, ``all_to_all_single`` (the TOML-era 0.2 list has
          no all-to-all), never ``all_gather_into_tensor`` or ``all_reduce``.
        - ``selective``, Megatron-Core: the submodules of ``modules`` (``recompute_modules``, default
          ``["core_attn"]``) that are checkpointed whole run again with their collectives: ``module``
          names the one a collective belongs to: ``core_attn`` (``Attention._checkpointed_attention_forward``:
          its context-parallel exchange), ``mlp`` (a dense layer's MLP: its sequence-parallel gather and
          reduce-scatter) and ``moe`` (an MoE layer: its dispatch and combine and its sequence-parallel
          gather and reduce-scatter), ``TransformerLayer._forward_mlp``; the output-discarding ones
          (``layernorm``, ``mla_up_proj``, ``moe_act``) hold no collective, and no attention projection's
          tensor-parallel collective runs again.

        The in-tree runtime keeps every activation (it does not apply checkpointing) and a plugin
        backend states no policy: nothing is issued again."""
        if checkpointing == "none" or self.name not in (Engine.TORCHTITAN, Engine.MEGATRON):
            return False
        if checkpointing == "full":
            return True
        if self.name == Engine.TORCHTITAN:
            saved = {"reduce_scatter", "all_to_all"} if self.at_least("0.3") else {"reduce_scatter"}
            return collective not in saved
        return module in modules

    def moe_saved(self, activation: str) -> MoESaved:
        """What the engine's mixture-of-experts block saves for its backward
        (memory_model.moe_layer_extra_bytes), at 16-bit activations, for experts of this activation:

        - torchtitan (0.3: models/common/moe.py ``GroupedExperts.forward``, token_dispatcher.py
          ``combine``, ``TokenChoiceTopKRouter.forward``): per routed token, its input (2 bytes a
          hidden feature) and its output cast to fp32 for the product with its score (4), the
          SwiGLU experts' w1 and w3 outputs, the silu output and their product (8 bytes an expert
          feature), its fp32 score (4); per token, the router's input cast to fp32 under its
          fp32 autocast (4 a feature) and its scores before and after the sigmoid or softmax (8
          an expert). 0.2's ``score_before_experts`` saves the same bytes in another order (the
          routed input in fp32 for the score product, then in bf16 for the grouped matmul).
        - Megatron-Core (transformer/moe/experts.py ``TEGroupedMLP.forward``, router.py): per
          routed token, fc1's input (2), fc1's output (SwiGLU: gate and up, 4 bytes an expert
          feature; else 2) and the weighted activation's output (2), its fp32 probability (4);
          per token, the router's logits (2 an expert) and their fp32 softmax (4).
        - The in-tree runtime (runtime/experts.py): per routed token, the repeated input, the
          rows each expert selects and the experts' outputs kept for the weighted sum (6), the
          expert's up and gate outputs with the activation and product (SwiGLU 8; else 4), its
          weight (4); per token, the router's fp32 input (4 a feature) and its logits and
          probabilities (8 an expert)."""
        swiglu = activation == "swiglu"
        if self.name == Engine.TORCHTITAN:
            return MoESaved(routed_hidden=6, routed_ffn=8, routed_fixed=4, token_hidden=4, token_experts=8)
        if self.name == Engine.MEGATRON:
            return MoESaved(
                routed_hidden=2, routed_ffn=6 if swiglu else 4, routed_fixed=4, token_hidden=0, token_experts=6
            )
        return MoESaved(routed_hidden=6, routed_ffn=8 if swiglu else 4, routed_fixed=4, token_hidden=4, token_experts=8)

    def loss_implementation(self, *, compiled: bool, tensor_parallel: bool) -> str:
        """How the engine's cross-entropy holds the logits (memory_model.loss_bytes_per_logit):
        Megatron-Core's vocab-parallel one in place; torchtitan's compiled one when its compile
        components include the loss, else under tensor parallelism torch's ``loss_parallel``
        (torchtitan ``ParallelDims.loss_parallel_enabled``), else eager ``F.cross_entropy``; the
        in-tree runtime's vocab-parallel one over fp32 logits."""
        if self.name == Engine.MEGATRON:
            return "vocab_parallel"
        if self.name == Engine.TORCHTITAN:
            return "compiled" if compiled else "loss_parallel" if tensor_parallel else "materialized"
        return "materialized"

    @property
    def compiles(self) -> bool:
        """The engine applies ``torch.compile`` as ``training.compile`` asks (torchtitan's
        ``compile.enable`` and ``compile.components``); the in-tree runtime and Megatron do not."""
        return self.name == Engine.TORCHTITAN

    def schedule_microbatches(self, microbatches: Any, accumulation: Any) -> Any:
        """Micro-batches one run of the pipeline schedule takes. torchtitan runs its schedule once
        per accumulation step on ``local_batch_size / microbatch_size`` micro-batches
        (torchtitan/trainer.py ``train_step`` -> ``forward_backward_step`` -> ``pp_schedule.step``);
        Megatron counts every micro-batch of the step (``get_num_microbatches``), and the in-tree
        runtime runs one schedule over the step's micro-batches and accumulation steps."""
        return microbatches if self.name == Engine.TORCHTITAN else microbatches * accumulation

    def at_least(self, version: str) -> bool:
        return self.version is not None and version_key(self.version) >= version_key(version)


@functools.lru_cache(maxsize=256)
def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def backend_name(backend: Any) -> str:
    """The backend's name, normalised, whether the spec wrote a name or a mapping."""
    from mixle_compile.contracts import normalize_backend_name

    return normalize_backend_name(backend if isinstance(backend, str) else backend.name)


class UnknownVersion(ValueError):
    def __init__(self, field: str, message: str, hint: str):
        super().__init__(message)
        self.field, self.hint = field, hint


def engine_profile(backend: Any) -> EngineProfile:
    """The profile a spec's ``backend`` names. Raises :class:`UnknownVersion` for a version or
    entry the engine does not have here (the loader reports it at that field)."""
    name = backend_name(backend)
    version = None if isinstance(backend, str) else backend.version
    entry = None if isinstance(backend, str) else backend.entry
    if name not in VERSIONS:
        if version is not None or entry is not None:
            raise UnknownVersion(
                "version" if version is not None else "entry",
                f"backend {name!r} is a plugin backend: it has no versions or entries here",
                "write `backend: NAME` for a plugin backend",
            )
        return EngineProfile(name, None, known=False)
    versions = VERSIONS[name]
    if version is None:
        version = versions[-1]
    else:
        match = [v for v in versions if version == v or version.startswith(v + ".")]
        if not match:
            raise UnknownVersion(
                "version",
                f"{name} version {version!r} is not one this verifier models",
                f"use one of {', '.join(versions)} (a bare `backend: {name}` means {versions[-1]})",
            )
        version = match[0]
    entries = ENTRIES.get(name, ())
    if entry is not None and entry not in entries:
        supported = f"one of {', '.join(entries)}" if entries else "none (only megatron has entries)"
        raise UnknownVersion("entry", f"{name} has no entry {entry!r}", f"entry: {supported}")
    if entry is None and entries:
        entry = entries[0]
    return EngineProfile(name, version, entry)
